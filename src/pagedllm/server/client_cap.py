"""At most N requests in flight per client address, counted at the application: the
replicas' ingress, where Ray Serve's HTTP proxy (not ours) holds the connections, so the
single server's per-connection cap (connections.py) cannot apply. A request counts from its
arrival until its response, streams included, has been sent; the one past the cap gets a
429 with the connection cap's body (code too_many_connections) and Retry-After, before
its body is read. The proxy passes each request's client address in the ASGI scope.
"""
from __future__ import annotations

import json
from collections import Counter


class InFlightPerClient:
    """Pure ASGI middleware; `limit` 0: no cap."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit
        self.in_flight: Counter[str] = Counter()  # only the event loop's thread touches it

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.limit:
            return await self.app(scope, receive, send)
        host = (scope.get("client") or ("",))[0]
        if self.in_flight[host] >= self.limit:
            return await _refuse(send, f"too many requests in flight from {host} (this "
                                       f"server's limit is {self.limit} per client)")
        self.in_flight[host] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[host] -= 1
            if self.in_flight[host] <= 0:
                del self.in_flight[host]


async def _refuse(send, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "rate_limit_error", "param": None,
                                 "code": "too_many_connections"}}).encode()
    await send({"type": "http.response.start", "status": 429,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

"""uvicorn's HTTP/1.1 protocol with the connection limits it lacks: a request's headers must
arrive within `header_timeout` seconds (of the connection, or of the previous response on a
kept-alive one), so a client trickling them (slow loris) is cut off (408); they may take at
most MAX_HEADER_BYTES (431; h11 bounds only headers that arrive in pieces); and one client
address holds at most `max_per_client` open connections (the one past it gets 429). Each
refusal closes the connection. Bodies are bounded in time and size by middleware.BodyGuard."""
from __future__ import annotations

import json
from collections import Counter

from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEADER_BYTES = 32 << 10


def guarded_protocol(header_timeout: float, max_per_client: int) -> type[H11Protocol]:
    """A protocol class for uvicorn.Config(http=...); max_per_client 0: no per-client cap.
    Its connections share one count of open connections by client."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"header_timeout": header_timeout, "max_per_client": max_per_client,
                 "open_by_client": Counter()})


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a per-client cap on open connections, a deadline for
    each request's headers and a bound on their size (guarded_protocol sets the limits)."""

    header_timeout: float = 30.0
    max_per_client: int = 0
    open_by_client: Counter[str]
    _header_timer = None
    _host = None
    _header_bytes = b""  # what came since the last request, until its headers end
    _in_headers = True

    def connection_made(self, transport):
        super().connection_made(transport)
        self._host = self.client[0] if self.client else ""
        self.open_by_client[self._host] += 1
        if self.max_per_client and self.open_by_client[self._host] > self.max_per_client:
            _refuse(transport, f"too many open connections from {self._host} (this "
                               f"server's limit is {self.max_per_client} per client)")
            return
        self._arm()

    def connection_lost(self, exc):
        if self._host is not None:
            self.open_by_client[self._host] -= 1
            if self.open_by_client[self._host] <= 0:
                del self.open_by_client[self._host]
            self._host = None
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data):
        if self._in_headers:
            self._header_bytes += data[:MAX_HEADER_BYTES + 4 - len(self._header_bytes)]
            if b"\r\n\r\n" in self._header_bytes:
                self._in_headers, self._header_bytes = False, b""
            elif len(self._header_bytes) > MAX_HEADER_BYTES:
                self._disarm()
                _refuse(self.transport, f"the request headers are over {MAX_HEADER_BYTES} "
                                        f"bytes", 431)
                return
        super().data_received(data)

    def handle_events(self):
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._disarm()  # the headers are in: the request runs

    def on_response_complete(self):
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def _arm(self):
        self._disarm()
        self._in_headers, self._header_bytes = True, b""
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self):
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self):
        self._header_timer = None
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            _refuse(self.transport, f"the request headers did not arrive within "
                                    f"{self.header_timeout:g} s", 408)


def _refuse(transport, message: str, status: int = 429) -> None:
    reason, code = {408: ("Request Timeout", "request_timeout"),
                    429: ("Too Many Requests", "too_many_connections"),
                    431: ("Request Header Fields Too Large", "headers_too_large")}[status]
    body = json.dumps({"error": {"message": message, "type": "rate_limit_error" if status == 429
                                 else "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: %d\r\n\r\n%s" % (status, reason.encode(), len(body), body))
    transport.close()

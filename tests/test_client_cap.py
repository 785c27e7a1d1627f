"""The per-client cap at the application (server/client_cap.py, what the replicas' ingress
applies where Ray's proxy holds the connections): the request past the cap from one address
gets a 429 at once, another address is not affected, and a finished request frees its
place, streams counted until their last byte."""
import asyncio

import httpx

from pagedllm.server.client_cap import InFlightPerClient


def test_requests_in_flight_are_capped_per_client_address():
    release = asyncio.Event()
    started = []

    async def app(scope, receive, send):  # a streamed answer held open until released
        started.append(scope["client"][0])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await release.wait()
        await send({"type": "http.response.body", "body": b" last"})

    capped = InFlightPerClient(app, limit=2)

    def client(host):
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=capped, client=(host, 1234)),
                                 base_url="http://test")

    async def main():
        a, b = client("10.0.0.1"), client("10.0.0.2")
        held = [asyncio.create_task(a.get("/x")) for _ in range(2)]
        while len(started) < 2:
            await asyncio.sleep(0.01)
        refused = await a.get("/x")
        other = asyncio.create_task(b.get("/x"))
        while len(started) < 3:
            await asyncio.sleep(0.01)
        assert capped.in_flight == {"10.0.0.1": 2, "10.0.0.2": 1}
        release.set()
        done = await asyncio.gather(*held, other)
        again = await a.get("/x")
        return refused, done, again

    refused, done, again = asyncio.run(main())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["code"] == "too_many_connections" and "10.0.0.1" in error["message"]
    assert "limit is 2 per client" in error["message"]
    assert [r.status_code for r in done] == [200, 200, 200] and done[0].text == "first last"
    assert again.status_code == 200 and capped.in_flight == {}


def test_a_cap_of_zero_is_no_cap():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    capped = InFlightPerClient(app, limit=0)
    transport = httpx.ASGITransport(app=capped, client=("10.0.0.1", 1))

    async def main():
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return [r.status_code for r in await asyncio.gather(*(c.get("/") for _ in range(5)))]

    assert asyncio.run(main()) == [204] * 5

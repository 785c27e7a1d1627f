"""CORS (server/cors.py) over a bare app: `localhost` means any port on a loopback host, a
listed origin is allowed, and a refused preflight is an ordinary refusal (no
Access-Control-Allow-Origin), not an error body."""
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pagedllm.server.cors import add_cors


def preflight(client: TestClient, origin: str):
    return client.options("/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})


@pytest.fixture()
def client():
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat():
        return {"ok": True}

    add_cors(app, ("localhost", "https://app.example"))
    return TestClient(app)


@pytest.mark.parametrize("origin", ["http://localhost:5173", "http://127.0.0.1:3000",
                                    "http://localhost", "https://[::1]:8443",
                                    "https://app.example"])
def test_allowed_origins_pass_preflight(client, origin):
    r = preflight(client, origin)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == origin
    simple = client.post("/v1/chat/completions", headers={"Origin": origin})
    assert simple.headers["access-control-allow-origin"] == origin


@pytest.mark.parametrize("origin", ["http://evil.example", "http://localhost.evil.example",
                                    "http://127.0.0.1.evil.example:80", "http://app.example",
                                    "null"])
def test_other_origins_are_refused_quietly(client, origin):
    r = preflight(client, origin)
    assert r.status_code == 204 and r.content == b""
    assert not any(h.startswith("access-control-") for h in r.headers)
    simple = client.post("/v1/chat/completions", headers={"Origin": origin})
    assert "access-control-allow-origin" not in simple.headers


def test_by_default_loopback_origins_pass_and_none_turns_it_off():
    """As llama.cpp's server: a web UI on this machine (any port) may call it; nothing else,
    and `--allowed-origins none` turns CORS off."""
    from pagedllm.cli.main import build_parser
    from pagedllm.cli.serve import server_config

    default = server_config(build_parser().parse_args(["serve"]))
    assert default.allowed_origins == ("localhost",)
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat():
        return {"ok": True}

    add_cors(app, default.allowed_origins)
    client = TestClient(app)
    assert preflight(client, "http://localhost:3000").headers[
        "access-control-allow-origin"] == "http://localhost:3000"
    assert "access-control-allow-origin" not in preflight(client, "http://a.example").headers
    off = server_config(build_parser().parse_args(["serve", "--allowed-origins", "none"]))
    assert off.allowed_origins == ()


def test_no_origins_means_no_cors():
    app = FastAPI()
    add_cors(app, ())
    assert not app.user_middleware

"""The several-machines recipe on one machine: a two-node Ray cluster (Ray's own
cluster_utils: a head with 2 CPUs and a worker with 1, each its own raylet, sharing a token
made for the test), `pagedllm serve --replicas 2 --ray-address` joining it. Each replica
reserves its thread as a Ray CPU, so they land on different nodes; stopping the worker node
replaces its replica on the head while requests keep being answered, and a stream that was
running ends (completed or with an error chunk), never hangs."""
from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is the optional extra pagedllm[ray]")

from server_process import ServerProcess  # noqa: E402

from probes import wait_for

pytestmark = pytest.mark.slow


def replica_nodes(server) -> list[str]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return re.findall(r'pagedllm:replica_info\{[^}]*node="([0-9a-f]+)"', text)


def compiled_kernels() -> dict:
    """TORCH_EXTENSIONS_DIR at the folder of this host's compiled kernels (`make test`
    builds them under the machine's HOME). A node given a HOME of its own would otherwise
    compile them again in every replica, minutes on two cores, past the start timeouts
    (why the test of docs/replicas.md's recipe failed in CI on an AVX2 host)."""
    import os

    from pagedllm.kernels import capabilities
    from pagedllm.kernels.build import build_folder

    return {"TORCH_EXTENSIONS_DIR": os.path.dirname(build_folder(capabilities().best))}

@pytest.fixture
def two_nodes(tmp_path, monkeypatch):
    from ray.cluster_utils import Cluster

    from pagedllm.replicas.launch import SERVE_PATIENCE

    for name, value in SERVE_PATIENCE.items():  # the raylets started here pass it on
        monkeypatch.setenv(name, value)
    # A cluster with a token of its own (serve refuses one without), in a HOME of its own:
    # nothing read from or left in the machine's ~/.ray.
    import secrets

    for name, value in compiled_kernels().items():  # (before HOME moves)
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    from ray._raylet import Config

    Config.initialize("")  # Ray reads the mode once per process: this one checks the GCS

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    worker = cluster.add_node(num_cpus=1)
    try:
        yield cluster, worker
    finally:
        cluster.shutdown()
        monkeypatch.undo()
        Config.initialize("")


def test_replicas_spread_over_nodes_and_survive_losing_one(two_nodes, tmp_path):
    cluster, worker = two_nodes
    server = ServerProcess("--replicas", "2", "--ray-address", cluster.address,
                           "--threads-per-replica", "1", "--kv-cache-memory", "64MiB",
                           log_path=str(tmp_path / "serve.log"), wait_ready=False)
    try:
        server.wait_ready(timeout=240)
        nodes = wait_for(lambda: (n := replica_nodes(server)) and len(n) == 2 and n, 60)
        assert len(set(nodes)) == 2 and worker.node_id in nodes  # one replica a node

        ended = threading.Event()

        def stream():  # a long stream, running while the node goes
            body = {"prompt": "Once", "max_tokens": 300, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    pass
            ended.set()

        streaming = threading.Thread(target=stream, daemon=True)
        streaming.start()
        time.sleep(0.5)
        cluster.remove_node(worker)
        answers = []

        def replaced():
            answer = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4},
                                timeout=60)
            answers.append(answer.status_code)
            now = replica_nodes(server)
            return len(now) == 2 and worker.node_id not in now

        wait_for(replaced, 300)  # its replica started again on the head (slow on a busy host)
        assert answers and all(code == 200 for code in answers), answers
        streaming.join(120)
        assert ended.is_set(), "the stream hung"
    finally:
        server.stop()


def _ray_cli(home, **env_extra):
    """Runs Ray's CLI as a machine whose HOME is `home` (nothing left by other tests: no
    ~/.ray/auth_token), with no RAY_AUTH_* from the environment."""
    import os
    import shutil
    import subprocess
    import sys

    from pagedllm.replicas.launch import SERVE_PATIENCE

    ray_cli = shutil.which("ray", path=os.path.dirname(sys.executable))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")},
           **SERVE_PATIENCE, **compiled_kernels(), "HOME": str(home)}

    def ray(*args, **extra):
        return subprocess.run([ray_cli, *args], capture_output=True, text=True, timeout=180,
                              env={**env, **env_extra, **extra})
    return ray


def test_the_docs_recipe_with_ray_start(tmp_path):
    """docs/replicas.md's "Several machines" on a fresh machine, as an admin runs it (both
    nodes here, each with a HOME of its own): the head makes its token and starts with it; a node that
    joins without the token is refused, one that joins with it is taken; `pagedllm serve
    --replicas 2 --ray-address` on the head finds the token itself."""
    from server_process import free_port

    from pagedllm.replicas.cluster_auth import probe_cluster

    head_home, node_home = tmp_path / "head", tmp_path / "node"
    head_home.mkdir()
    node_home.mkdir()
    port = free_port()
    head = f"127.0.0.1:{port}"
    ray, node_ray = _ray_cli(head_home), _ray_cli(node_home)
    try:
        made = ray("get-auth-token", "--generate")  # docs/replicas.md step 1
        token = made.stdout.strip()
        assert made.returncode == 0 and len(token) >= 32, made.stderr[-2000:]
        assert (head_home / ".ray" / "auth_token").read_text().strip() == token
        started = ray("start", "--head", "--port", str(port), "--num-cpus", "1",
                      "--include-dashboard=false", "--disable-usage-stats")
        assert started.returncode == 0, started.stderr[-2000:]
        assert probe_cluster(head).kind == "token"
        # no token (a short connection timeout: Ray retries a refused join for ~20 s)
        refused = node_ray("start", "--address", head, "--num-cpus", "1",
                           RAY_py_gcs_connect_timeout_s="3")
        assert refused.returncode != 0 and "InvalidAuthToken" in refused.stdout + refused.stderr
        joined = node_ray("start", "--address", head, "--num-cpus", "1", RAY_AUTH_MODE="token",
                          RAY_AUTH_TOKEN=token)  # docs/replicas.md step 2
        assert joined.returncode == 0, joined.stderr[-2000:]
        server = ServerProcess("--replicas", "2", "--ray-address", head, "--kv-cache-memory",
                               "64MiB", log_path=str(tmp_path / "serve.log"), wait_ready=False,
                               env={"RAY_AUTH_MODE": "", "HOME": str(head_home),
                                    **compiled_kernels()})
        try:
            server.wait_ready(timeout=240)
            nodes = wait_for(lambda: (n := replica_nodes(server)) and len(n) == 2 and n, 60)
            assert len(set(nodes)) == 2  # one replica on each node
            answer = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4},
                                timeout=60)
            assert answer.status_code == 200
        finally:
            server.stop()
    finally:
        node_ray("stop", "--force")
        ray("stop", "--force")
        assert not (node_home / ".ray" / "auth_token").exists()  # the token came by variable


def test_a_cluster_without_authentication_is_refused(tmp_path):
    """A fresh head's `ray start --head` with no token runs without authentication: serve
    refuses to join it, saying how to fix it, and starts nothing; so does a serve that runs
    in token mode itself (a process in token mode joins an open cluster too)."""
    from server_process import free_port

    from pagedllm.replicas.cluster_auth import probe_cluster

    home = tmp_path / "home"
    home.mkdir()
    port = free_port()
    ray = _ray_cli(home)
    try:
        started = ray("start", "--head", "--port", str(port), "--num-cpus", "1",
                      "--include-dashboard=false", "--disable-usage-stats")
        assert started.returncode == 0, started.stderr[-2000:]
        assert not (home / ".ray" / "auth_token").exists()
        assert probe_cluster(f"127.0.0.1:{port}").kind == "open"
        for mode in ({"RAY_AUTH_MODE": ""},
                     {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "ab" * 32}):
            server = ServerProcess("--replicas", "1", "--ray-address", f"127.0.0.1:{port}",
                                   "--kv-cache-memory", "64MiB",
                                   log_path=str(tmp_path / "serve.log"), wait_ready=False,
                                   env={**mode, "HOME": str(home), **compiled_kernels()})
            assert server.proc.wait(240) == 2, mode
            output = server.output()
            assert "runs without token authentication" in output, mode
            assert "ray get-auth-token --generate" in output and "--insecure-ray-cluster" in output
            server.stop()
    finally:
        ray("stop", "--force")


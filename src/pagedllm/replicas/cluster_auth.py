"""Whether a --ray-address cluster asks for a token, asked before this process joins it.

Ray cannot tell a process how the cluster it joined authenticates: a process in token mode
joins a cluster without authentication as readily as one with it (the token is sent and
ignored), so the process's own mode says nothing about the cluster. So a child process in
Ray's `disabled` mode, holding no token, asks the cluster's GCS one question: answered, the
cluster runs without authentication; refused with Ray's AuthenticationError, it asks for a
token; anything else, it could not be reached. The answer decides, before `import ray` here
(Ray reads RAY_AUTH_MODE once per process), whether this process joins in token mode, and
whether an open cluster is refused. It also saves the ~20 s Ray spends retrying a join
refused for want of a token.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

PROBE_TIMEOUT_S = 30.0
# Run in a child: resolves the address as ray.init would, then one GCS call without a token.
_PROBE = r"""
import sys
from ray._private.services import canonicalize_bootstrap_address_or_die
from ray._raylet import GcsClient
from ray.exceptions import AuthenticationError

try:
    client = GcsClient(address=canonicalize_bootstrap_address_or_die(sys.argv[1]))
    client.internal_kv_get(b"pagedllm-auth-probe", None, timeout=10)
except AuthenticationError:
    print("token")
except BaseException as exc:
    print("unreachable", f"{type(exc).__name__}: {exc}"[:500])
else:
    print("open")
"""


class ClusterJoinError(RuntimeError):
    """A --ray-address cluster this process will not join; the message says why and what to do."""


class OpenClusterError(ClusterJoinError):
    """A --ray-address cluster without token authentication (the message says how to fix it)."""


@dataclass(frozen=True)
class ProbeAnswer:
    kind: str  # "token", "open" or "unreachable"
    detail: str = ""


def probe_cluster(address: str, timeout: float = PROBE_TIMEOUT_S) -> ProbeAnswer:
    """Ask the cluster at `address` one question from a child that holds no token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["RAY_AUTH_MODE"] = "disabled"
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, address], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return ProbeAnswer("unreachable", f"no answer within {timeout:.0f} s")
    words = done.stdout.strip().splitlines()[-1:] or [""]
    kind, _, detail = words[0].partition(" ")
    if kind not in ("token", "open", "unreachable"):
        return ProbeAnswer("unreachable", (done.stderr.strip() or done.stdout.strip())[-500:])
    return ProbeAnswer(kind, detail)


def open_cluster_refusal(ray_address: str) -> str:
    """Why an open cluster is refused. A cluster started with `ray start` listens on its
    node's network address: without a token anyone who reaches that port can run code on
    every node (Ray's own warning), so it is refused unless the admin says otherwise."""
    return (f"the Ray cluster at {ray_address} runs without token authentication: anyone who "
            f"can reach its port can run any code on its nodes. Start it with a token (docs/replicas.md, "
            f"\"Several machines\"): on the head `ray get-auth-token --generate`, then `ray "
            f"start --head ...`; on each other node `RAY_AUTH_MODE=token RAY_AUTH_TOKEN=<that "
            f"token> ray start --address ...`. On a private network you trust, "
            f"--insecure-ray-cluster joins it as it is.")


def ray_token_available() -> bool:
    """Whether this machine holds a Ray auth token (where `ray get-auth-token --generate`
    writes it, or where Ray's environment variables point)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    return os.path.isfile(path)


def join_mode(ray_address: str, answer: ProbeAnswer, token_here: bool, insecure: bool) -> str:
    """The RAY_AUTH_MODE this process joins with ("token" or "" for Ray's default), or a
    ClusterJoinError saying why it must not join."""
    if ray_address.startswith("ray://"):
        raise ClusterJoinError(f"{ray_address} is a Ray Client address: give the head's own "
                               f"address (HOST:6379, what `ray start --head` prints)")
    if answer.kind == "unreachable":
        raise ClusterJoinError(f"cannot reach the Ray cluster at {ray_address} ({answer.detail})")
    if answer.kind == "open":
        if not insecure:
            raise OpenClusterError(open_cluster_refusal(ray_address))
        return ""
    if not token_here:
        raise ClusterJoinError(
            f"the Ray cluster at {ray_address} asks for its token and this machine has none: "
            f"copy the head's ~/.ray/auth_token here, or set RAY_AUTH_TOKEN (or "
            f"RAY_AUTH_TOKEN_PATH)")
    return "token"


def prepare_to_join(ray_address: str, insecure: bool) -> bool:
    """Probe the cluster and set this process's RAY_AUTH_MODE for it; True when the cluster
    asks for a token. Must run before Ray is imported here (Ray reads the mode once)."""
    mode = join_mode(ray_address, probe_cluster(ray_address), ray_token_available(), insecure)
    if mode and os.environ.get("RAY_AUTH_MODE") != mode:
        if "ray._raylet" in sys.modules:
            raise ClusterJoinError(f"the Ray cluster at {ray_address} asks for its token, and Ray "
                                   f"was imported here before RAY_AUTH_MODE could be set: set "
                                   f"RAY_AUTH_MODE=token before starting")
        os.environ["RAY_AUTH_MODE"] = mode
    return mode == "token"

"""Where replicas can go (replicas/placement.py): each reserves its compute threads as Ray
CPUs, at most --replicas-per-node share a node, and a cluster too small for what was asked
is refused before anything deploys, with what it holds said; and that refusal end to end."""
import subprocess
import sys

import pytest

from pagedllm.replicas.placement import Node, PlacementError, check_placement, replicas_per_node

TWO_NODES = [Node("a" * 16, "head", 4), Node("b" * 16, "worker", 2)]


def test_replicas_fit_by_cpus_and_the_per_node_cap():
    assert replicas_per_node(TWO_NODES[0], 2, None) == 2
    assert replicas_per_node(TWO_NODES[0], 2, 1) == 1
    assert replicas_per_node(TWO_NODES[1], 3, None) == 0
    check_placement(TWO_NODES, 3, 2)  # 2 on the head, 1 on the worker
    check_placement(TWO_NODES, 2, 2, per_node=1)  # one a node


@pytest.mark.parametrize("replicas,threads,per_node,holds", [
    (4, 2, None, 3), (3, 2, 1, 2), (1, 8, None, 0), (7, 1, None, 6)])
def test_too_many_replicas_are_refused_saying_what_fits(replicas, threads, per_node, holds):
    with pytest.raises(PlacementError) as refused:
        check_placement(TWO_NODES, replicas, threads, per_node)
    message = str(refused.value)
    assert f"holds {holds} replica(s) of {threads} thread(s)" in message
    assert "head 4 CPU, worker 2 CPU" in message and f"{replicas} were asked for" in message
    assert ("--replicas-per-node" in message) == (per_node is not None)


def test_no_nodes_is_said():
    with pytest.raises(PlacementError, match="no nodes"):
        check_placement([], 1, 1)


def test_serve_refuses_a_cluster_too_small_before_deploying(tmp_path):
    """On a local Ray (this machine's CPUs), 3 replicas of 64 threads cannot fit: one line,
    exit 2, no replica started."""
    pytest.importorskip("ray")
    done = subprocess.run([sys.executable, "-m", "pagedllm.cli", "serve", "--replicas", "3",
                           "--threads-per-replica", "64", "--port", "0"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "holds 0 replica(s) of 64 thread(s)" in done.stderr
    assert "3 were asked for" in done.stderr and "Traceback" not in done.stderr

"""Where engine replicas can go: each reserves as many of Ray's CPUs as it runs compute
threads, so Ray places them by capacity instead of packing them on one node, and at most
--replicas-per-node share a node. Checked before anything deploys: a cluster that cannot
hold what was asked is an error that says what it holds, not replicas pending forever.
No Ray here (the nodes come in as plain records), so it is tested without a cluster.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Node:
    node_id: str
    host: str
    cpus: float


class PlacementError(ValueError):
    """The cluster cannot hold the replicas asked for; the message says what it can."""


def replicas_per_node(node: Node, threads: int, per_node: int | None) -> int:
    fit = int(node.cpus // threads)
    return fit if per_node is None else min(fit, per_node)


def check_placement(nodes: list[Node], replicas: int, threads: int,
                    per_node: int | None = None) -> None:
    """Raise PlacementError unless `replicas` replicas of `threads` CPUs each (at most
    `per_node` on a node) fit on these nodes."""
    room = sum(replicas_per_node(n, threads, per_node) for n in nodes)
    if room >= replicas:
        return
    listed = ", ".join(f"{n.host or n.node_id[:8]} {n.cpus:g} CPU" for n in nodes) or "no nodes"
    cap = f", at most {per_node} a node (--replicas-per-node)" if per_node is not None else ""
    raise PlacementError(
        f"the Ray cluster holds {room} replica(s) of {threads} thread(s) each{cap} "
        f"({listed}); {replicas} were asked for: add nodes, or lower --replicas or "
        f"--threads-per-replica")


def ray_nodes() -> list[Node]:
    """The cluster's live nodes as Ray reports them (call after ray.init)."""
    import ray

    return [Node(n["NodeID"], n.get("NodeManagerHostname", ""), float(n["Resources"].get("CPU", 0)))
            for n in ray.nodes() if n.get("Alive")]

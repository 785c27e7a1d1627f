"""How `serve --ray-address` decides to join a cluster (replicas/cluster_auth.py), without a
cluster: the decision from the probe's answer, the mode it sets before Ray is imported, and
the probe's answer for an address where nothing listens. The probe against real clusters
(one with a token, one without) is in test_replica_nodes.py."""
from __future__ import annotations

import sys

import pytest

from pagedllm.replicas import cluster_auth
from pagedllm.replicas.cluster_auth import (ClusterJoinError, OpenClusterError, ProbeAnswer,
                                            join_mode, prepare_to_join)

ADDRESS = "10.0.0.1:6379"


def test_a_token_cluster_is_joined_in_token_mode_when_this_machine_holds_the_token():
    assert join_mode(ADDRESS, ProbeAnswer("token"), token_here=True, insecure=False) == "token"


def test_a_token_cluster_without_the_token_here_says_where_to_put_it():
    with pytest.raises(ClusterJoinError, match="asks for its token and this machine has none") as e:
        join_mode(ADDRESS, ProbeAnswer("token"), token_here=False, insecure=False)
    assert "RAY_AUTH_TOKEN" in str(e.value) and "~/.ray/auth_token" in str(e.value)


@pytest.mark.parametrize("token_here", [False, True])
def test_an_open_cluster_is_refused_even_by_a_process_that_holds_a_token(token_here):
    # The hole this probe closes: a process in token mode joins an open cluster too, so the
    # process's own mode cannot be what decides.
    with pytest.raises(OpenClusterError, match="runs without token authentication") as e:
        join_mode(ADDRESS, ProbeAnswer("open"), token_here=token_here, insecure=False)
    assert "ray get-auth-token --generate" in str(e.value)
    assert "--insecure-ray-cluster" in str(e.value)


def test_insecure_ray_cluster_joins_an_open_cluster_as_it_is():
    assert join_mode(ADDRESS, ProbeAnswer("open"), token_here=False, insecure=True) == ""


def test_an_unreachable_cluster_is_an_error_naming_the_address_and_why():
    with pytest.raises(ClusterJoinError, match="cannot reach the Ray cluster at 10.0.0.1:6379") as e:
        join_mode(ADDRESS, ProbeAnswer("unreachable", "no answer within 30 s"), True, True)
    assert "no answer within 30 s" in str(e.value)


def test_a_ray_client_address_is_refused_with_the_address_to_give():
    with pytest.raises(ClusterJoinError, match="Ray Client address"):
        join_mode("ray://10.0.0.1:10001", ProbeAnswer("token"), True, False)


def _probe_says(monkeypatch, kind):
    monkeypatch.setattr(cluster_auth, "probe_cluster", lambda address: ProbeAnswer(kind))


def test_prepare_sets_token_mode_for_a_token_cluster(monkeypatch):
    _probe_says(monkeypatch, "token")
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "a" * 64)
    monkeypatch.delitem(sys.modules, "ray._raylet", raising=False)
    assert prepare_to_join(ADDRESS, insecure=False) is True
    import os

    assert os.environ["RAY_AUTH_MODE"] == "token"


def test_prepare_leaves_the_mode_alone_for_an_open_cluster_joined_on_purpose(monkeypatch):
    _probe_says(monkeypatch, "open")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # the admin's habit: still reported as open
    assert prepare_to_join(ADDRESS, insecure=True) is False
    with pytest.raises(OpenClusterError):
        prepare_to_join(ADDRESS, insecure=False)


def test_prepare_refuses_when_ray_was_imported_before_the_mode_could_be_set(monkeypatch):
    _probe_says(monkeypatch, "token")
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "a" * 64)
    monkeypatch.setitem(sys.modules, "ray._raylet", object())
    with pytest.raises(ClusterJoinError, match="set RAY_AUTH_MODE=token before starting"):
        prepare_to_join(ADDRESS, insecure=False)


def test_the_probe_of_an_address_where_nothing_answers_says_unreachable():
    pytest.importorskip("ray", reason="Ray is the optional extra pagedllm[ray]")
    from server_process import free_port

    answer = cluster_auth.probe_cluster(f"127.0.0.1:{free_port()}", timeout=5)
    assert answer.kind == "unreachable" and answer.detail

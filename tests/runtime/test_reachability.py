"""Checking that ranks on other hosts can reach each rank's gloo address."""

from __future__ import annotations

import os

import pytest

from pipetrain.runtime.host_address import is_loopback, route_address
from pipetrain.runtime.reachability import address_problems, local_place, settle_address
from pipetrain.runtime.roster import RankPlace

A = RankPlace(0, "node-a", "net-a", "127.0.1.1", "hostname 'node-a'", "127.0.0.1")
B = RankPlace(1, "node-b", "net-b", "10.0.0.2", "hostname 'node-b'", "10.0.0.2")


def test_one_host_may_use_loopback() -> None:
    same_host = {0: A, 1: A.with_changes(rank=1)}
    assert address_problems(same_host) == []
    assert settle_address(A, same_host) is A


def test_a_loopback_address_in_a_job_across_hosts_is_named_with_the_fix() -> None:
    (problem,) = address_problems({0: A, 1: B})
    assert problem.startswith("rank 0 (on host node-a) would advertise a loopback address to gloo, "
                              "which the ranks on other hosts cannot reach: "
                              "rank 0 on node-a: 127.0.1.1 from hostname 'node-a'")
    assert "set GLOO_SOCKET_IFNAME to the network interface" in problem
    assert "map each host's name to its network address in /etc/hosts" in problem


def test_the_users_interface_is_kept_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    mine = A.with_changes(address="127.0.0.1", source="GLOO_SOCKET_IFNAME=lo")
    settled = settle_address(mine, {0: mine, 1: B})
    assert settled.address == "127.0.0.1" and "user's choice" in settled.problem
    (problem,) = address_problems({0: settled, 1: B})
    assert "127.0.0.1 from GLOO_SOCKET_IFNAME=lo (kept: GLOO_SOCKET_IFNAME is the user's choice)" in problem
    assert "/etc/hosts" not in problem


def test_without_a_route_to_the_other_hosts_the_address_stays_and_is_reported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    lonely = A.with_changes(route=None)
    unreachable = B.with_changes(address="127.0.0.1", route=None)  # nothing to route to
    settled = settle_address(lonely, {0: lonely, 1: unreachable})
    assert settled.address == "127.0.1.1"
    assert settled.problem == "no other local address routes to the other hosts"
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # nothing was changed


def test_the_same_address_on_two_hosts_is_named() -> None:
    bridge = "172.17.0.2"
    (problem,) = address_problems({0: A.with_changes(address=bridge), 1: B.with_changes(address=bridge)})
    assert problem.startswith("ranks 0, 1 (on hosts node-a, node-b) all advertise 172.17.0.2 to gloo "
                              "but run on different hosts")


def test_an_interface_without_address_is_named() -> None:
    (problem,) = address_problems({0: A.with_changes(address=None, source="GLOO_SOCKET_IFNAME=eth9")})
    assert problem.startswith("rank 0 (on host node-a) has no address for gloo "
                              "(rank 0 on node-a: GLOO_SOCKET_IFNAME=eth9)")


def test_this_process_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    place = local_place(3, master_addr="127.0.0.1", master_port=29500)
    assert place.rank == 3 and place.source == "GLOO_SOCKET_IFNAME=lo"
    assert place.address in ("127.0.0.1", None)  # None off Linux
    assert place.route == route_address("127.0.0.1", 29500) and is_loopback(place.route)

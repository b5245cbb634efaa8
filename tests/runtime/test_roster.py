"""The roster: publishing places, naming the ranks that never arrive, naming peers in errors."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from pipetrain.runtime.errors import StartupError, StartupTimeout
from pipetrain.runtime.roster import (
    RankPlace,
    describe_rank,
    exchange_places,
    name_addresses,
    rank_of_error,
    read_roster,
)

A0 = RankPlace(0, "node-a", "net-a", "10.0.0.1", "hostname 'node-a'", "10.0.0.1")
A1 = A0.with_changes(rank=1)
B2 = RankPlace(2, "node-b", "net-b", "10.0.0.2", "hostname 'node-b'", "10.0.0.2")
B3 = B2.with_changes(rank=3)
ROSTER = {p.rank: p for p in (A0, A1, B2, B3)}


def test_a_place_survives_the_store() -> None:
    assert RankPlace.from_json(B2.to_json()) == B2


def test_ranks_get_their_host_only_in_a_job_that_spans_hosts() -> None:
    assert describe_rank(2, ROSTER) == "rank 2 (on host node-b)"
    assert describe_rank(1, {0: A0, 1: A1}) == "rank 1"
    assert describe_rank(7, ROSTER) == "rank 7"  # not in the roster


def test_a_raw_gloo_address_is_traced_back_to_its_rank() -> None:
    one_per_host = {0: A0, 2: B2}
    error = RuntimeError("[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:4711")
    assert rank_of_error(error, one_per_host) == 2
    assert rank_of_error("Read error [::ffff:10.0.0.2]:4711: Connection reset by peer", one_per_host) == 2
    # two ranks on that host: only the candidates can tell which
    assert rank_of_error(error, ROSTER) is None
    assert rank_of_error(error, ROSTER, candidates=[0, 3]) == 3
    assert rank_of_error("Connection closed by peer [10.9.9.9]:1", ROSTER) is None
    assert name_addresses("Read error [10.0.0.2]:4711: reset", one_per_host) == "Read error rank 2 (on host node-b): reset"
    assert name_addresses("Read error [10.0.0.2]:4711: reset", ROSTER) == \
        "Read error one of ranks 2, 3 (on host node-b): reset"


def test_exchange_returns_every_place_and_read_roster_finds_the_final_round() -> None:
    store = dist.HashStore()
    for place in (A0, B2.with_changes(rank=1)):
        store.set(f"pipetrain/roster/ready/{place.rank}", place.to_json())
    store.add("pipetrain/roster/ready/count", 1)
    places = exchange_places(store, A0, world_size=2, round_name="ready",
                             deadline=time.monotonic() + 5, timeout=5, where="node-a:29500")
    assert places == {0: A0, 1: B2.with_changes(rank=1)}
    assert read_roster(store, 2) == places
    assert read_roster(store, 3) == {}  # rank 2 never published: no roster, no wait


def test_a_rank_that_never_arrives_is_named_after_the_timeout() -> None:
    store = dist.HashStore()
    store.set("pipetrain/roster/join/2", B2.to_json())
    store.add("pipetrain/roster/join/count", 1)
    started = time.monotonic()
    with pytest.raises(StartupTimeout) as caught:
        exchange_places(store, A0, world_size=4, round_name="join",
                        deadline=time.monotonic() + 0.5, timeout=0.5, where="node-a:29500")
    assert time.monotonic() - started < 5
    message = str(caught.value)
    assert "rank 0 (on host node-a) waited 0.5 s (the timeout) for ranks 1, 3 of 4 to join" in message
    assert "at the store node-a:29500 (arrived: rank 0 on node-a; rank 2 on node-b)" in message
    assert "--timeout" in message


def test_a_store_that_goes_away_is_a_startup_error() -> None:
    class Gone(dist.HashStore):  # type: ignore[misc]
        def add(self, key: str, value: int) -> int:
            raise dist.DistNetworkError("Connection was likely closed")

    with pytest.raises(StartupError, match=r"lost the job's store at node-a:29500 .*has exited"):
        exchange_places(Gone(), A0, world_size=2, round_name="join",
                        deadline=time.monotonic() + 1, timeout=1, where="node-a:29500")

"""The peer monitor names a dead peer by rank (and host, across hosts), never by ip:port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

from pipetrain.runtime.errors import PeerFailure
from pipetrain.runtime.monitor import PeerMonitor, is_communication_error
from pipetrain.runtime.roster import RankPlace

A = RankPlace(0, "node-a", "net-a", "10.0.0.1", "hostname 'node-a'", "10.0.0.1")
B = RankPlace(1, "node-b", "net-b", "10.0.0.2", "hostname 'node-b'", "10.0.0.2")
CLOSED = RuntimeError("[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:4711. "
                      "This is typically caused by a remote worker crashing.")


@pytest.fixture
def monitor() -> Iterator[PeerMonitor]:
    store = dist.HashStore()
    for place in (A, B):
        store.set(f"pipetrain/roster/ready/{place.rank}", place.to_json())
    made = PeerMonitor(store, rank=0, world_size=2, namespace="t", interval=0.05, dead_after=60, grace=60)
    made.start()
    yield made
    made.stop()


def test_a_send_to_an_unknown_peer_names_the_rank_behind_the_address(monitor: PeerMonitor) -> None:
    failure = monitor.explain(CLOSED, -1)
    assert failure.dead_ranks == (1,)
    assert str(failure).startswith("rank 0 (on host node-a): pipeline stopped because "
                                   "rank 1 (on host node-b) died (its connection closed: "
                                   "Connection closed by peer rank 1 (on host node-b))")
    assert "10.0.0.2" not in str(failure)


def test_guard_turns_a_collectives_broken_connection_into_the_named_failure(monitor: PeerMonitor) -> None:
    with pytest.raises(PeerFailure, match=r"rank 1 \(on host node-b\) died") as caught:
        with monitor.guard():
            raise RuntimeError("[/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:62639: "
                               "Connection reset by peer")
    assert caught.value.dead_ranks == (1,)
    with pytest.raises(ValueError, match="not communication"), monitor.guard():
        raise ValueError("not communication")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"), monitor.guard():
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")


def test_on_one_host_ranks_are_named_as_before() -> None:
    store = dist.HashStore()
    made = PeerMonitor(store, rank=0, world_size=2, namespace="t", interval=0.05, dead_after=60, grace=60)
    made.start()
    try:
        failure = made.explain(RuntimeError("Connection closed by peer [127.0.0.1]:4711"), 1)
        assert "pipeline stopped because rank 1 died (its connection closed" in str(failure)
        assert str(failure).startswith("rank 0: ")
    finally:
        made.stop()


def test_communication_errors_are_told_apart() -> None:
    assert is_communication_error(CLOSED)
    assert is_communication_error(dist.DistNetworkError("gone"))
    assert not is_communication_error(RuntimeError("CUDA out of memory"))


def test_a_broken_connection_is_recorded_as_the_peers_failure_not_this_ranks(monitor: PeerMonitor) -> None:
    monitor.report_error(RuntimeError("Read error [10.0.0.2]:62639: Connection reset by peer"))
    failure = monitor.explain(RuntimeError("timed out"), 0)  # what any other rank would then read
    assert failure.dead_ranks == (1,) and "rank 1 (on host node-b) died" in str(failure)


_STUCK = """
import sys, time
import torch.distributed as dist
from pipetrain.runtime.monitor import PeerMonitor
grace = None if sys.argv[1] == "none" else float(sys.argv[1])
monitor = PeerMonitor(dist.HashStore(), rank=0, world_size=2, namespace="t", interval=0.05,
                      dead_after=60, grace=grace)
monitor.start()
monitor.explain(RuntimeError("Connection closed by peer [127.0.0.1]:4711"), 1)  # a failure found
time.sleep(2.5)  # the main thread never looks: stuck in a call that cannot see the failure
print("main thread went on")
"""


@pytest.mark.parametrize("grace", ["none", "0.5"])
def test_the_forced_exit_is_opt_in(grace: str) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _STUCK, grace], capture_output=True, text=True,
                          timeout=60)
    if grace == "none":  # the default never ends the caller's process
        assert done.returncode == 0 and "main thread went on" in done.stdout, done.stderr
    else:
        assert done.returncode == -9 and "main thread went on" not in done.stdout
        assert "forced exit: the main thread did not stop in 0.5 s" in done.stderr
        assert "rank 1 died" in done.stderr


_LAST_WORDS = """
import sys, time
import torch.distributed as dist
from pipetrain.runtime.monitor import PeerMonitor
monitor = PeerMonitor(dist.HashStore(), rank=0, world_size=2, namespace="t", interval=0.05,
                      dead_after=60, grace=0.5)
monitor.last_words.append(lambda failure: print("last words:", failure.dead_ranks, flush=True))
monitor.last_words.append(lambda failure: 1 / 0)  # a failing callback does not stop the exit
monitor.start()
monitor.explain(RuntimeError("Connection closed by peer [127.0.0.1]:4711"), 1)
time.sleep(5)
print("main thread went on")
"""


def test_a_forced_exit_says_its_last_words_first() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _LAST_WORDS], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == -9, done.stderr
    assert "last words: (1,)" in done.stdout and "main thread went on" not in done.stdout
    assert "ZeroDivisionError" in done.stderr  # logged, and the exit went ahead

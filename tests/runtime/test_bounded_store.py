"""Store calls that never return (a partitioned or powered-off store host) fail in time."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from pipetrain.runtime.bounded_store import BoundedStore, StoreUnreachable
from pipetrain.runtime.monitor import PeerMonitor


class _HangingStore:
    """A store whose calls block once ``hang`` is set, as a TCPStore client does when its
    host stops answering."""

    def __init__(self) -> None:
        self.inner = dist.HashStore()
        self.hang = threading.Event()
        self.release = threading.Event()

    def _maybe_hang(self) -> None:
        if self.hang.is_set():
            self.release.wait(60)

    def add(self, key: str, amount: int) -> int:
        self._maybe_hang()
        return int(self.inner.add(key, amount))

    def set(self, key: str, value: str) -> None:
        self._maybe_hang()
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._maybe_hang()
        return bytes(self.inner.get(key))

    def check(self, keys: list[str]) -> bool:
        self._maybe_hang()
        return bool(self.inner.check(keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._maybe_hang()
        return list(self.inner.multi_get(keys))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._maybe_hang()
        return bytes(self.inner.compare_set(key, expected, desired))


def test_calls_pass_through_while_the_store_answers() -> None:
    store = BoundedStore(dist.HashStore(), timeout=5.0)
    try:
        assert store.add("k", 2) == 2 and store.add("k", 3) == 5
        store.set("s", "v")
        assert store.check(["s"]) and not store.check(["missing"])
        assert store.get("s") == b"v" and store.multi_get(["s", "k"]) == [b"v", b"5"]
        assert store.compare_set("s", "v", "w") == b"w"
        assert store.broken is None
    finally:
        store.close()


def test_a_call_that_never_returns_fails_within_the_bound_and_so_does_every_later_one() -> None:
    hanging = _HangingStore()
    store = BoundedStore(hanging, timeout=0.5)  # type: ignore[arg-type]
    try:
        assert store.add("k", 1) == 1
        hanging.hang.set()
        began = time.monotonic()
        with pytest.raises(StoreUnreachable, match=r"it did not answer for 0 s|it did not answer for 1 s"):
            store.add("k", 1)
        assert time.monotonic() - began < 3.0
        began = time.monotonic()
        with pytest.raises(StoreUnreachable):
            store.get("k")  # at once: the store is taken to be gone
        assert time.monotonic() - began < 0.2
        assert store.broken is not None
    finally:
        hanging.release.set()
        store.close()


def test_an_error_of_the_store_reaches_the_caller_unchanged() -> None:
    store = BoundedStore(dist.HashStore(), timeout=5.0)
    try:
        with pytest.raises(ValueError, match="boom"):
            store.call("test", lambda: (_ for _ in ()).throw(ValueError("boom")))
        assert store.broken is None and store.add("k", 1) == 1
    finally:
        store.close()


def test_the_monitor_reports_a_store_that_stops_answering_instead_of_hanging() -> None:
    """The heartbeat thread used to block for good inside ``store.add``; now the store's
    silence is a failure, named, within about ``dead_after``."""
    hanging = _HangingStore()
    found = threading.Event()
    monitor = PeerMonitor(hanging, rank=1, world_size=2, namespace="t", interval=0.05,  # type: ignore[arg-type]
                          dead_after=0.6, store_host_rank=0, on_failure=lambda _: found.set())
    monitor.start()
    try:
        hanging.hang.set()
        began = time.monotonic()
        assert found.wait(10), "the monitor never noticed the silent store"
        assert time.monotonic() - began < 5.0
        failure = monitor.failure
        assert failure is not None and failure.dead_ranks == (0,)
        assert "rank 0, which hosts the job's store, is unreachable (it did not answer for" in str(failure)
        began = time.monotonic()
        monitor.stop()  # its farewell to the store does not hang either
        assert time.monotonic() - began < 3.0
    finally:
        hanging.release.set()

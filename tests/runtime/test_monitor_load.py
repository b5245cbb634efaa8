"""The failure detector at many ranks: each rank watches its two neighbours on a ring, so
its store calls per interval do not grow with the job, and a silent rank is still named by
every rank within a bounded time (64 monitors in one process, one in-memory store)."""

from __future__ import annotations

import time

import torch.distributed as dist

from pipetrain.runtime.monitor import PeerMonitor

INTERVAL = 0.02


def _monitors(world_size: int, *, dead_after: float = 60.0) -> list[PeerMonitor]:
    store = dist.HashStore()
    monitors = [PeerMonitor(store, rank=r, world_size=world_size, namespace=f"load{world_size}",
                            interval=INTERVAL, dead_after=dead_after) for r in range(world_size)]
    for monitor in monitors:
        monitor.start()
    return monitors


def _calls_per_interval(world_size: int, seconds: float = 1.0) -> float:
    monitors = _monitors(world_size)
    began = [m.bounded.calls for m in monitors]
    time.sleep(seconds)
    calls = [m.bounded.calls - b for m, b in zip(monitors, began)]
    rates = sorted(m.calls_per_second() or 0.0 for m in monitors)
    for monitor in monitors:
        monitor.stop()
    per_interval = sorted(calls)[len(calls) // 2] / (seconds / INTERVAL)
    # the rate a job records (metrics.json's monitor) counts per beat: on a busy machine
    # the beats come later than every interval, and the calls of a second fall with them
    recorded = rates[len(rates) // 2] * INTERVAL
    assert 0.7 * per_interval < recorded <= 6, (rates[:3], per_interval)
    return recorded


def test_a_ranks_store_calls_do_not_grow_with_the_number_of_ranks() -> None:
    few, many = _calls_per_interval(4), _calls_per_interval(64)
    assert 0 < few <= 6 and many <= 6, (few, many)  # a heartbeat, two neighbours, the cause
    assert many < 1.5 * few, f"{many:.1f} store calls per beat at 64 ranks, {few:.1f} at 4"


def test_a_silent_rank_of_64_is_named_by_every_rank_in_time() -> None:
    monitors = _monitors(64, dead_after=0.5)
    try:
        monitors[37]._stopped.set()  # rank 37 stops beating, as a frozen process does
        began = time.monotonic()
        while time.monotonic() - began < 10 and any(
                m.failure is None for r, m in enumerate(monitors) if r != 37):
            time.sleep(0.05)
        took = time.monotonic() - began
        failures = [m.failure for r, m in enumerate(monitors) if r != 37]
        assert all(f is not None and f.dead_ranks == (37,) for f in failures), failures[:3]
        assert all("rank 37 stopped answering" in str(f) for f in failures)
        assert took < 0.5 + 2.0, f"named after {took:.1f} s"
    finally:
        for monitor in monitors:
            monitor.stop()

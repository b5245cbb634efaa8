"""Peer monitoring: find a dead rank within a bounded time and name it, never hang.

Every rank runs a heartbeat thread that bumps a counter in the job's c10d store and
watches its two neighbours' on a ring of the ranks (rank ``r`` watches ``r - 1`` and
``r + 1``, so every rank is watched twice and the store calls of a rank per interval do
not grow with the job: the load on the store is O(N), not O(N²)). A rank whose counter
stops moving for ``dead_after`` seconds is declared dead; the watcher records it as the
job's root cause in the store, which every rank reads each interval. When a rank sees a broken connection it asks the store for the root cause
first, so the ranks that exit *because* a neighbour died do not get blamed: every rank
reports the rank that died first.

A failure found by the heartbeats reaches the main thread through ``on_failure`` (the
pipeline fails its transport's mailbox, waking a receive that waits there) and
:meth:`PeerMonitor.check`. A call that cannot see it (a collective, or a gloo wait on a
peer that froze without closing its connections) ends at its own timeout: every wait of
the runtime is bounded. A process that would rather end sooner opts in with ``grace``:
if the main thread has not seen the failure ``grace`` seconds after it was found, the
monitor writes it to stderr and ends the process with ``SIGKILL`` (``os.kill``; the
launcher sees a worker killed by a signal). The default never ends the caller's process.

Every store call of the monitor is bounded (:class:`~.bounded_store.BoundedStore`, by
``store_timeout``, default ``dead_after``): a c10d store client otherwise blocks without end
when the store's host stops answering (a network partition, a host that lost power), and
a rank cut off from the store would never notice. A store call that does not return in
time is a failure of the store's host, found and reported like a dead peer. Before a
forced exit the monitor runs the ``last_words`` callbacks (bounded too), so a process that
is ended still writes what it has.

In a job that spans hosts, peers are named with their host (``rank 1 (on host node-b)``),
and a raw gloo error that quotes a peer's ``[ip]:port`` is traced back to its rank through
the roster that start-up left in the store (see :mod:`.roster`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from pipetrain.runtime.bounded_store import BoundedStore, StoreUnreachable
from pipetrain.runtime.errors import PeerFailure, PipelineError, brief
from pipetrain.runtime.roster import (
    RankPlace,
    describe_rank,
    name_addresses,
    rank_of_error,
    read_roster,
)

__all__ = ["PeerMonitor", "is_communication_error"]

logger = logging.getLogger(__name__)

_LAST_WORDS = 10.0
"""Seconds the ``last_words`` callbacks get before a forced exit goes ahead anyway."""


def is_communication_error(error: BaseException) -> bool:
    """Whether ``error`` comes from c10d / gloo communication (not from the user's code).

    Example:
        >>> is_communication_error(RuntimeError("[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:4711"))
        True
        >>> is_communication_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
        False
    """
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return "gloo/" in text or "Connection closed by peer" in text or "Connection reset by peer" in text


class PeerMonitor:
    """Heartbeats through the c10d store, and the root cause of a failure.

    Example (inside a torch.distributed job)::

        monitor = PeerMonitor(store, rank=rank, world_size=world, namespace="run-1")
        monitor.start()
        ...
        monitor.check()    # raises PeerFailure naming the dead rank, if any
        with monitor.guard():
            dist.all_reduce(loss)   # a broken connection raises PeerFailure naming the rank
        monitor.stop()     # at a clean exit
    """

    def __init__(
        self,
        store: Store,
        *,
        rank: int,
        world_size: int,
        namespace: str,
        interval: float = 0.5,
        dead_after: float = 10.0,
        grace: float | None = None,
        store_host_rank: int | None = None,
        on_failure: Callable[[PeerFailure], None] | None = None,
        store_timeout: float | None = None,
    ) -> None:
        self.store = store
        self.bounded = BoundedStore(store, timeout=dead_after if store_timeout is None else store_timeout)
        """The store, every call bounded (the monitor's own calls go through it)."""
        self.rank = rank
        self.world_size = world_size
        self.prefix = f"pipetrain/{namespace}"
        self.interval = interval
        self.dead_after = dead_after
        self.grace = grace
        self.store_host_rank = store_host_rank
        self.on_failure = on_failure
        self.last_words: list[Callable[[PeerFailure], None]] = []
        """Called (from the monitor's thread, at most ``_LAST_WORDS`` seconds in all) just
        before a forced exit, e.g. to write the records of the run."""
        self._roster: dict[int, RankPlace] = {}
        self._failure: PeerFailure | None = None
        self._acknowledged = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipetrain-monitor", daemon=True)
        self._load = (0, 0)
        """The heartbeat loop's store calls, and its beats (one per interval)."""

    def calls_per_second(self) -> float | None:
        """The heartbeat loop's calls to the store per second of heartbeat interval (its
        load on the store: a constant, whatever the job's size; None before the first
        beat, which comes as soon as the monitor starts)."""
        calls, beats = self._load
        return calls / (beats * self.interval) if beats else None

    # -- keys -------------------------------------------------------------------------
    def _key(self, *parts: object) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def start(self) -> None:
        """Start the heartbeat thread."""
        self._roster = read_roster(self.store, self.world_size)
        self.bounded.set(self._key("exit", self.rank), "")
        self._thread.start()

    def stop(self, *, reason: str = "finished") -> None:
        """Stop heartbeating; ``reason`` tells the peers why this rank leaves."""
        try:
            self.bounded.set(self._key("exit", self.rank), reason)
        except Exception:  # the store may be gone already
            pass
        self._acknowledged.set()
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval + 1)
        self.bounded.close()

    # -- failure ----------------------------------------------------------------------
    @property
    def failure(self) -> PeerFailure | None:
        """The failure found so far, if any."""
        return self._failure

    def check(self) -> None:
        """Raise the failure found so far (and stop the forced exit: the caller handles it)."""
        if self._failure is not None:
            self._acknowledged.set()
            raise self._failure

    def name(self, rank: int) -> str:
        """``"rank 1"``, or ``"rank 1 (on host node-b)"`` in a job that spans hosts."""
        return describe_rank(rank, self._roster)

    def explain(self, error: BaseException, peer: int) -> PeerFailure:
        """The failure to report after ``error`` in communication with rank ``peer``.

        Prefers the root cause recorded by whichever rank saw it first. ``peer`` may be
        ``-1`` (unknown): then the rank whose address the error quotes is taken.
        """
        others = self._others()
        if peer < 0:
            found = rank_of_error(error, self._roster, candidates=others)
            peer = -1 if found is None else found
        detail = name_addresses(brief(error), self._roster, candidates=others)
        cause = self._root_cause(wait=2.0)
        if cause is None and peer >= 0 and not self._has_exited(peer):
            guess = (peer, f"{self.name(peer)} died (its connection closed: {detail})")
            self._record(*guess)
            cause = self._root_cause(wait=0.0) or guess
        if cause is None:
            who = self.name(peer) if peer >= 0 else "another rank"
            cause = (peer, f"communication with {who} failed: {detail}")
        failure = PeerFailure(self._message(cause[1]), dead_ranks=(cause[0],) if cause[0] >= 0 else ())
        self._fail(failure)
        return failure

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Turn a communication error raised inside (a collective, a wait) into the
        :class:`PeerFailure` that names the rank that failed first; other errors pass."""
        try:
            yield
        except PipelineError:
            raise
        except RuntimeError as error:
            if not is_communication_error(error):
                raise
            raise self.explain(error, -1) from error

    def report_error(self, error: BaseException) -> None:
        """Record that this rank fails with ``error`` (the root cause, unless one is known).

        A broken connection is recorded as the failure of the peer it names, if any.
        """
        if isinstance(error, PeerFailure):
            return
        if is_communication_error(error):  # a broken connection is the peer's failure, not ours
            peer = rank_of_error(error, self._roster, candidates=self._others())
            if peer is not None and not self._has_exited(peer):
                detail = name_addresses(brief(error), self._roster, candidates=self._others())
                self._record(peer, f"{self.name(peer)} died (its connection closed: {detail})")
            return
        text = f"{type(error).__name__}: {name_addresses(brief(error), self._roster)}"
        self._record(self.rank, f"{self.name(self.rank)} failed with {text}")

    def watched(self) -> list[int]:
        """The ranks whose heartbeats this rank watches: its neighbours on the ring.

        Example:
            >>> import torch.distributed as dist
            >>> PeerMonitor(dist.HashStore(), rank=0, world_size=64, namespace="x").watched()
            [1, 63]
        """
        ring = {(self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size}
        return sorted(ring - {self.rank})

    def _others(self) -> list[int]:
        """The ranks a broken connection of this rank's can lead to."""
        return [r for r in range(self.world_size) if r != self.rank]

    def _message(self, cause: str) -> str:
        return (
            f"{self.name(self.rank)}: pipeline stopped because {cause}. The other ranks stop too; "
            "restart the job (with --resume to continue from the last checkpoint)."
        )

    def _record(self, dead_rank: int, text: str) -> None:
        try:
            self.bounded.compare_set(self._key("cause"), "", f"{dead_rank}|{text}")
        except Exception:
            pass

    def _root_cause(self, *, wait: float) -> tuple[int, str] | None:
        deadline = time.monotonic() + wait
        while True:
            try:
                if self.bounded.check([self._key("cause")]):
                    raw = self.bounded.get(self._key("cause")).decode()
                    if raw:
                        dead, _, text = raw.partition("|")
                        return int(dead), text
            except Exception:
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def _has_exited(self, rank: int) -> bool:
        try:
            key = self._key("exit", rank)
            return bool(self.bounded.check([key]) and self.bounded.get(key))
        except Exception:
            return False

    def _fail(self, failure: PeerFailure) -> None:
        if self._failure is not None:
            return
        self._failure = failure
        logger.error("%s", failure)
        if self.on_failure is not None:
            self.on_failure(failure)
        if self.grace is not None:
            threading.Thread(target=self._force_exit, args=(self.grace,), name="pipetrain-exit",
                             daemon=True).start()

    def _force_exit(self, grace: float) -> None:
        if self._acknowledged.wait(grace):
            return
        message = f"{self._failure} (forced exit: the main thread did not stop in {grace:g} s)"
        logger.critical("%s", message)
        self._say_last_words()
        sys.stderr.write(f"pipetrain: error: {message}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def _say_last_words(self) -> None:
        failure = self._failure
        if failure is None or not self.last_words:
            return

        def say() -> None:
            for callback in self.last_words:
                try:
                    callback(failure)
                except Exception:
                    logger.exception("a last-words callback failed")

        speaker = threading.Thread(target=say, name="pipetrain-last-words", daemon=True)
        speaker.start()
        speaker.join(timeout=_LAST_WORDS)

    def _store_failure(self, error: BaseException) -> PeerFailure:
        host = self.store_host_rank
        if host is not None:
            who = f"{self.name(host)}, which hosts the job's store,"
        elif os.environ.get("MASTER_ADDR"):
            who = f"the job's store at {os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '?')}"
        else:
            who = "the job's store"
        why = str(error) if isinstance(error, StoreUnreachable) else brief(error)
        return PeerFailure(self._message(f"{who} is unreachable ({why})"),
                           dead_ranks=(host,) if host is not None else ())

    # -- heartbeat --------------------------------------------------------------------
    def _run(self) -> None:
        beat_key = self._key("beat", self.rank)
        others = self.watched()
        last_value: dict[int, bytes | None] = {r: None for r in others}
        last_change = {r: time.monotonic() for r in others}
        calls_before, beats = self.bounded.calls, 0
        while beats == 0 or not self._stopped.wait(self.interval):  # the first beat at once
            try:
                self.bounded.add(beat_key, 1)
                keys = [self._key("beat", r) for r in others]
                present = [r for r, k in zip(others, keys) if self.bounded.check([k])]
                values = self.bounded.multi_get([self._key("beat", r) for r in present]) if present else []
            except Exception as error:
                if self._stopped.is_set():
                    return
                self._fail(self._store_failure(error))
                return
            now = time.monotonic()
            beats += 1
            self._load = (self.bounded.calls - calls_before, beats)
            for r, value in zip(present, values):
                if value != last_value[r]:
                    last_value[r] = value
                    last_change[r] = now
            for r in others:
                if now - last_change[r] > self.dead_after and not self._has_exited(r):
                    text = f"{self.name(r)} stopped answering (no heartbeat for {self.dead_after:.0f} s)"
                    self._record(r, text)
                    dead, why = self._root_cause(wait=0.0) or (r, text)
                    self._fail(PeerFailure(self._message(why), dead_ranks=(dead,)))
                    return
            if self._failure is None:
                recorded = self._root_cause(wait=0.0)
                if recorded is not None:
                    self._fail(PeerFailure(self._message(recorded[1]), dead_ranks=(recorded[0],)))
                    return

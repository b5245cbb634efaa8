"""Sends in flight: each message's buffers kept alive until its peer has taken it.

A posted send owns its buffers (the encoded header, the tensors sent apart) until the
operation completes. Gloo completes a send only when it is waited, and it completes
only once the receiver has posted the matching receive, which the receiver does when
its schedule reaches the message: waiting on the main thread could wait for a peer
that is itself waiting for this rank. So each destination gets a thread that waits its
sends in the order they were posted and drops their buffers at once: a sent activation
or gradient is freed when the peer takes it, not at the end of the step (over a step of
M micro-batches the old way held M messages per link). A failed wait is handed to
``fail`` (the transport's mailbox: the main thread raises it at its next operation).

Works without a host deadline (NCCL: their ``wait()`` only orders CUDA streams) are kept
as before, waited on the calling thread by :meth:`SendsInFlight.drain`.
"""

from __future__ import annotations

import collections
import datetime
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipetrain.runtime.links import wait_work

__all__ = ["SendsInFlight"]

Timed = tuple[Any, "datetime.timedelta | None"]
"""A posted work and the timeout of its wait (``None``: NCCL)."""


class SendsInFlight:
    """The posted sends of one transport, released as each completes.

    ``wait(work, timeout, dst)`` waits for one work on the calling thread (raising the
    error the user sees); ``fail(error, dst)`` records a failure seen by a waiting
    thread. ``limit`` bounds the messages in flight: :meth:`add` waits below it.

    Example::

        sends = SendsInFlight(wait=transport_wait, fail=record_failure)
        sends.add(1, [(work, timeout)], [header])   # freed once rank 1 has taken it
        sends.drain(check=raise_failure)           # every send done (end of a step)
    """

    def __init__(self, *, wait: Callable[[Any, datetime.timedelta | None, int], None],
                 fail: Callable[[BaseException, int], object], limit: int = 256) -> None:
        self._wait = wait
        self._fail = fail
        self._limit = limit
        self._lock = threading.Condition()
        self._queues: dict[int, collections.deque[tuple[list[Timed], list[torch.Tensor]]]] = {}
        self._threads: dict[int, threading.Thread] = {}
        self._count = 0
        """Messages posted and not yet completed (threaded ones)."""
        self._failed = False
        self._closed = False
        self._held: collections.deque[tuple[list[Timed], list[torch.Tensor], int]] = (
            collections.deque())
        """Messages with a work that has no host deadline: waited by :meth:`drain`."""

    def add(self, dst: int, works: Sequence[Timed], tensors: list[torch.Tensor]) -> None:
        """Keep ``tensors`` alive until every one of ``works`` (sends to ``dst``) is done."""
        if any(timeout is None for _, timeout in works):
            self._held.append((list(works), tensors, dst))
            while len(self._held) > self._limit:
                self._finish_held()
            return
        with self._lock:
            while self._count >= self._limit and not self._failed:
                self._lock.wait(timeout=0.5)
            self._count += 1
            self._queues.setdefault(dst, collections.deque()).append((list(works), tensors))
            if dst not in self._threads:
                thread = threading.Thread(target=self._run, args=(dst,), daemon=True,
                                          name=f"pipetrain-send-{dst}")
                self._threads[dst] = thread
                thread.start()
            self._lock.notify_all()

    def _run(self, dst: int) -> None:
        queue = self._queues[dst]
        while True:
            with self._lock:
                while not queue and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                works, _ = queue[0]
            try:
                for work, timeout in works:
                    wait_work(work, timeout=timeout)
            except Exception as error:  # the peer failed: the main thread raises it
                if self._closed:  # the transport was closed under a wait: nothing to report
                    return
                self._fail(error, dst)  # recorded before drain() can see _failed
                with self._lock:
                    self._failed = True
                    self._lock.notify_all()
                return
            with self._lock:
                queue.popleft()  # the buffers go with it
                self._count -= 1
                self._lock.notify_all()

    def _finish_held(self) -> None:
        works, _, dst = self._held.popleft()
        for work, timeout in works:
            self._wait(work, timeout, dst)

    def drain(self, *, check: Callable[[], None]) -> None:
        """Wait until every posted send is done. ``check()`` runs while waiting and
        raises the failure a waiting thread (or the peer monitor) found."""
        while self._held:
            self._finish_held()
        while True:
            with self._lock:
                if not self._count or self._failed:
                    break
                self._lock.wait(timeout=0.5)
            check()
        check()

    def close(self) -> None:
        """Stop the waiting threads (one blocked in a wait ends with that wait)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        for thread in self._threads.values():
            thread.join(timeout=1.0)
        self._threads.clear()
        self._queues.clear()
        self._held.clear()
        self._count = 0

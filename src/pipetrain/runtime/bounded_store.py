"""A c10d store whose every call returns within a bound, or fails.

A c10d ``TCPStore`` client blocks without end when the store's host stops answering
(a network partition, a host that lost power, a frozen store process): its own timeout
covers waiting for a key, not a request whose reply never comes. :class:`BoundedStore`
runs each call on one helper thread and waits for it at most ``timeout`` seconds; a call
that takes longer raises :class:`StoreUnreachable`, and so does every later call at once
(the store is taken to be gone: the stuck call is left to its daemon thread). Callers
that must never hang (the peer monitor's heartbeats, the root cause of a failure, a
rank's farewell) go through it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from torch.distributed.distributed_c10d import Store

from pipetrain.runtime.errors import PipelineError

__all__ = ["BoundedStore", "StoreUnreachable"]

T = TypeVar("T")

logger = logging.getLogger(__name__)


class StoreUnreachable(PipelineError):
    """A store call did not return within its bound (or an earlier one did not)."""


class BoundedStore:
    """The calls of a c10d store that the runtime makes, each bounded by ``timeout``.

    Example:
        >>> import torch.distributed as dist
        >>> store = BoundedStore(dist.HashStore(), timeout=5.0)
        >>> store.add("beats", 1)
        1
        >>> store.get("beats")
        b'1'
        >>> store.close()

    A call that does not return within ``timeout``::

        store.add("beats", 1)   # StoreUnreachable: it did not answer for 10 s (add)
    """

    def __init__(self, store: Store, *, timeout: float) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout={timeout!r} must be positive seconds")
        self.store = store
        self.timeout = timeout
        self.calls = 0
        """Store calls made so far (the load this client puts on the store)."""
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._broken: str | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="pipetrain-store", daemon=True)
        self._thread.start()

    @property
    def broken(self) -> str | None:
        """Why the store is taken to be gone (``None`` while it answers)."""
        return self._broken

    def _serve(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            future, call = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as error:  # handed to the caller
                future.set_exception(error)

    def call(self, what: str, function: Callable[[], T]) -> T:
        """Run ``function`` (a call on :attr:`store`) within the bound; ``what`` names it
        in the error.

        Raises:
            StoreUnreachable: it did not return within ``timeout`` seconds, or an earlier
                call did not.
        """
        if self._broken is not None:
            raise StoreUnreachable(self._broken)
        self.calls += 1
        future: Future[T] = Future()
        began = time.monotonic()
        self._calls.put((future, function))
        try:
            return future.result(timeout=self.timeout)
        except TimeoutError:
            future.cancel()
            with self._lock:
                if self._broken is None:
                    waited = time.monotonic() - began
                    self._broken = f"it did not answer for {waited:.0f} s"
                    logger.debug("store call %s did not return in %.0f s", what, waited)
                reason = self._broken
            raise StoreUnreachable(reason) from None

    # -- the calls the runtime makes ---------------------------------------------------------
    def add(self, key: str, amount: int) -> int:
        """``store.add``, bounded."""
        return int(self.call("add", lambda: self.store.add(key, amount)))

    def set(self, key: str, value: str) -> None:
        """``store.set``, bounded."""
        self.call("set", lambda: self.store.set(key, value))

    def get(self, key: str) -> bytes:
        """``store.get``, bounded (the key must exist: see :meth:`check`)."""
        return bytes(self.call("get", lambda: self.store.get(key)))

    def check(self, keys: list[str]) -> bool:
        """``store.check``, bounded."""
        return bool(self.call("check", lambda: self.store.check(keys)))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """``store.multi_get``, bounded."""
        return [bytes(v) for v in self.call("multi_get", lambda: self.store.multi_get(keys))]

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """``store.compare_set``, bounded."""
        return bytes(self.call("compare_set",
                               lambda: self.store.compare_set(key, expected, desired)))

    def close(self) -> None:
        """Stop the helper thread once the calls queued before are done (a stuck call's
        thread is a daemon and is left behind)."""
        self._calls.put(None)

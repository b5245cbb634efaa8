"""Stopping a training run cleanly on Ctrl-C (SIGINT) or SIGTERM.

The signal only sets a flag: the step in progress finishes, then every rank agrees (one
all-reduce, so a signal seen by one rank stops them all at the same step boundary), and
the run saves its checkpoint and records before it exits. The launcher forwards the
signal it receives to its workers and gives them time to do so.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

__all__ = ["StopRequest"]


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """A stop asked for by a signal, taken at the next step boundary.

    Example::

        stop = StopRequest()
        stop.install()                 # main thread
        for step in ...:
            train_step(...)
            if stop.agreed(device):    # every rank calls it
                break                  # save, write, exit
        stop.uninstall()
    """

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        """The first signal received, if any."""
        self._previous: dict[signal.Signals, object] = {}

    def install(self) -> None:
        """Catch SIGINT and SIGTERM (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in _SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """Give the signals their previous handlers back; once a stop was received they stay
        ignored instead (the process is ending: a second Ctrl-C during its exit must not turn
        the clean stop into a traceback)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if self.signal is None else signal.SIG_IGN)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.signal is None:  # a second signal changes nothing: the first one's stop stands
            self.signal = signal.Signals(number)

    def agreed(self, device: torch.device) -> signal.Signals | None:
        """The signal that stops every rank now, or None (every rank of the job calls it)."""
        mine = 0 if self.signal is None else int(self.signal)
        flag = torch.tensor([mine], dtype=torch.int64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        number = int(flag.item())
        return signal.Signals(number) if number else None

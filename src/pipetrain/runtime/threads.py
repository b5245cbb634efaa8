"""The thread transport: stages that are threads of one process hand values over directly."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pipetrain.runtime.transport import Channel, Mailbox, handoff

__all__ = ["ThreadTransport"]


class ThreadTransport:
    """Transport between stages that run in threads of this process.

    One instance is shared by all the stage threads. Tensors are not copied: the receiver
    gets a detached view (a new autograd leaf), moved to its device by the stage.

    Example:
        >>> import torch
        >>> from pipetrain.runtime.transport import ACTIVATION
        >>> t = ThreadTransport(timeout=5.0)
        >>> c = Channel(ACTIVATION, 0, 1)
        >>> t.send(c, 0, torch.ones(2, requires_grad=True))
        >>> x = t.recv(c, 0)
        >>> x.is_leaf and x.requires_grad
        True
    """

    def __init__(self, *, timeout: float) -> None:
        self.mailbox = Mailbox()
        self.timeout = timeout
        self.idle: Callable[[], bool] | None = None
        """Work a receiver may do while its message is not there yet (see
        :meth:`Mailbox.get`); set by a pipeline that shares recomputation."""

    def send(self, channel: Channel, microbatch: int, value: Any) -> None:
        self.mailbox.put(channel, microbatch, handoff(value))

    def recv(self, channel: Channel, microbatch: int) -> Any:
        return self.mailbox.get(channel, microbatch, timeout=self.timeout, idle=self.idle)

    def expect(self, channel: Channel, microbatches: Sequence[int]) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        self.mailbox.clear()

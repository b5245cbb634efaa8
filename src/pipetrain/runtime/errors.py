"""Errors the pipeline runtime raises: dead peers, communication timeouts, start-up."""

from __future__ import annotations

import re

__all__ = [
    "CommunicationTimeout",
    "HostAddressError",
    "PeerFailure",
    "PipelineError",
    "StartupError",
    "StartupTimeout",
    "brief",
]


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*/[^\]]*\]\s*")  # gloo's "[/path/pair.cc:537] "


def brief(error: BaseException | str) -> str:
    """The useful part of a c10d / gloo error: its first line, without the boilerplate.

    Example:
        >>> brief("[/src/gloo/pair.cc:553] Connection closed by peer [10.0.0.2]:4711. This is typically caused by ...")
        'Connection closed by peer [10.0.0.2]:4711'
    """
    text = str(error).strip()
    if not text:
        return type(error).__name__
    text = _SOURCE_PREFIX.sub("", text.splitlines()[0])
    for cut in (". This is typically", " Exception raised from"):
        text = text.split(cut)[0]
    return text[:240]


class PipelineError(RuntimeError):
    """Base class of the runtime's errors."""


class PeerFailure(PipelineError):
    """Another rank of the pipeline died or stopped answering.

    ``dead_ranks`` names the ranks that failed first (the root cause), not the
    neighbours that exited because of them.
    """

    def __init__(self, message: str, *, dead_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.dead_ranks = dead_ranks


class CommunicationTimeout(PipelineError):
    """A receive waited longer than the configured timeout."""


class StartupError(PipelineError):
    """Joining the job failed: the store, the other ranks or their connections.

    Raised by :func:`pipetrain.init_distributed`; the message says what it waited for
    and how to fix it.
    """


class StartupTimeout(StartupError):
    """Start-up waited longer than its timeout for the store or for other ranks."""


class HostAddressError(StartupError, ValueError):
    """A rank advertises an address that ranks on other hosts cannot reach (a loopback
    address, or one that another host uses too); the message says what to set."""

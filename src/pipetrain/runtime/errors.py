"""Errors the pipeline runtime raises: dead peers and communication timeouts."""

from __future__ import annotations

__all__ = ["CommunicationTimeout", "PeerFailure", "PipelineError"]


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


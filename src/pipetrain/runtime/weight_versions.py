"""Weight versions of one stage: its live weights and the older versions it still needs.

Asynchronous schedules update a stage's weights while micro-batches that used the old
ones are still in flight, and (vertical sync, 2BW) run forwards with an older version
than the live one. :class:`StageVersions` keeps what they need and nothing more:

- a forward with the live version runs on the parameters as they are; with an older
  version, the parameters' ``data`` points to that version's tensors during the forward;
- while a forward runs, the tensors autograd saves from the parameters are detached
  views of the version's tensors (``saved_tensors_hooks``), so the backward computes
  with exactly the weights of the forward (weight stashing), whatever the optimizer did
  to the parameters in between;
- an update (:meth:`StageVersions.update`) steps the optimizer on the parameters in
  place; when the live tensors are still needed (by a micro-batch in flight, or by a
  later forward) they become a stashed version first and the parameters get a copy;
- a stashed version is dropped once no micro-batch in flight uses it and no later
  forward will (the versions of the coming forwards are planned per window,
  :meth:`StageVersions.plan`).

Gradients always land in the parameters' ``.grad``, so optimizers, clipping of ``.grad``
and checkpoints see ordinary parameters. A recorder (tests) notes the version and a
checksum of the weights every forward and backward used.
"""

from __future__ import annotations

import contextlib
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from pipetrain.schedule import Op

__all__ = ["StageVersions", "VersionUse"]


class VersionUse(NamedTuple):
    """One forward or backward of a micro-batch and the weights it used (recorded)."""

    stage: int
    op: str
    """``"F"`` or ``"B"``."""
    microbatch: int
    version: int
    checksum: float
    """Sum of every element of the stage's weights in that version (float64)."""


def _checksum(tensors: Sequence[torch.Tensor]) -> float:
    return float(sum(t.detach().double().sum() for t in tensors))


class StageVersions:
    """The weight versions of one stage's parameters.

    Example (a forward with version 0, an update, and the backward still uses version 0):
        >>> layer = nn.Linear(2, 2, bias=False)
        >>> versions = StageVersions(list(layer.parameters()), stage_index=0)
        >>> versions.plan([0], after=1)
        >>> x = torch.ones(1, 2, requires_grad=True)
        >>> with versions.computing(Op.FORWARD, 0, 0):
        ...     y = layer(x)
        >>> before = layer.weight.detach().clone()
        >>> versions.update(lambda: layer.weight.data.add_(1.0))
        >>> versions.version, versions.num_stashed
        (1, 1)
        >>> with versions.computing(Op.BACKWARD, 0, 0):
        ...     y.sum().backward()
        >>> torch.equal(x.grad, before.sum(0, keepdim=True)), versions.num_stashed
        (True, 0)
    """

    def __init__(self, params: Sequence[nn.Parameter], *, stage_index: int,
                 record: list[VersionUse] | None = None) -> None:
        self.params = list(params)
        self.stage_index = stage_index
        self.version = 0
        """Version of the live weights (the updates applied so far)."""
        self.record = record
        """When a list, every forward and backward appends its :class:`VersionUse`."""
        self.peak_versions = 1
        """Most versions held at once (live included)."""
        self.peak_stashed_bytes = 0
        """Most bytes of stashed (not live) versions held at once."""
        self._stash: dict[int, list[torch.Tensor]] = {}
        self._users: Counter[int] = Counter()
        self._of: dict[int, int] = {}
        self._upcoming: deque[int] = deque()
        self._after: int | None = None

    # -- what is kept -------------------------------------------------------------------
    @property
    def floor(self) -> int:
        """The version the next forward uses (no later forward uses an older one)."""
        if self._upcoming:
            return self._upcoming[0]
        return self.version + 1 if self._after is None else self._after

    @property
    def num_stashed(self) -> int:
        """Versions held besides the live weights."""
        return len(self._stash)

    @property
    def stashed_bytes(self) -> int:
        """Bytes of the versions held besides the live weights."""
        return sum(t.numel() * t.element_size() for ts in self._stash.values() for t in ts)

    def plan(self, versions: Sequence[int], *, after: int | None) -> None:
        """The versions of this stage's coming forwards, in order, and of the first one
        after them (``None``: none known)."""
        self._upcoming = deque(versions)
        self._after = after
        self._prune()

    def _prune(self) -> None:
        floor = self.floor
        for v in [v for v in self._stash if self._users[v] <= 0 and v < floor]:
            del self._stash[v]
        self.peak_versions = max(self.peak_versions, 1 + len(self._stash))
        self.peak_stashed_bytes = max(self.peak_stashed_bytes, self.stashed_bytes)

    def _weights(self, version: int) -> list[torch.Tensor] | None:
        """The tensors of ``version`` (``None``: the live ones)."""
        if version == self.version:
            return None
        if version not in self._stash:
            raise RuntimeError(
                f"stage {self.stage_index}: weight version {version} is not kept (live: "
                f"{self.version}, stashed: {sorted(self._stash)}); the schedule and the "
                "planned versions disagree"
            )
        return self._stash[version]

    # -- computing ----------------------------------------------------------------------
    @staticmethod
    def _pack(tensor: torch.Tensor) -> Any:
        # a detached alias: a parameter's pins the version's tensors, whatever the
        # parameter's data becomes; any other's keeps no link back to the graph (an
        # output returned as is would make a cycle through its grad_fn that is never freed)
        return tensor.detach()

    @contextlib.contextmanager
    def computing(self, op: Op, microbatch: int, version: int | None) -> Iterator[None]:
        """Run a forward (``F``), a recomputation (``RB``) or a backward (``B``) of
        ``microbatch`` with its weight version: the action's (forwards), its forward's
        (the others); an unversioned forward (evaluation) uses the next forward's."""
        forward = op is Op.FORWARD
        if forward:
            if version is None:
                version = self.floor if self.floor <= self.version else self.version
            elif self._upcoming and self._upcoming[0] == version:
                self._upcoming.popleft()
        else:
            used = self._of.get(microbatch)
            if used is None or (version is not None and version != used):
                raise RuntimeError(f"stage {self.stage_index}: {op.value} of micro-batch "
                                   f"{microbatch} with version {version}, but its forward used "
                                   f"{used}")
            version = used
        tensors = self._weights(version)
        live = [p.data for p in self.params] if tensors is not None else []
        if tensors is not None:
            for p, t in zip(self.params, tensors):
                p.data = t
        if self.record is not None and op is not Op.RECV_BACKWARD:
            used_weights = tensors if tensors is not None else [p.data for p in self.params]
            self.record.append(VersionUse(self.stage_index, op.value, microbatch, version,
                                          _checksum(used_weights)))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved):
                yield
        finally:
            for p, t in zip(self.params, live):
                p.data = t
        if forward and torch.is_grad_enabled():
            self._of[microbatch] = version
            self._users[version] += 1
        elif op is Op.BACKWARD:
            del self._of[microbatch]
            self._users[version] -= 1
        self._prune()

    # -- updating -----------------------------------------------------------------------
    def update(self, apply: Callable[[], object]) -> None:
        """Apply an update to the live weights in place (``apply``: the optimizer step),
        stashing them first if a micro-batch in flight or a later forward needs them."""
        if self._users[self.version] > 0 or self.floor <= self.version:
            self._stash[self.version] = [p.data for p in self.params]
            for p in self.params:
                p.data = p.data.clone()
        apply()
        self.version += 1
        self._prune()

    # -- state --------------------------------------------------------------------------
    def stashed(self) -> dict[int, list[torch.Tensor]]:
        """The stashed versions (for a checkpoint taken with nothing in flight)."""
        return dict(self._stash)

    def restore(self, version: int, stashed: Mapping[int, Sequence[torch.Tensor]]) -> None:
        """Set the live version number and the stashed versions (after a checkpoint)."""
        self.reset()
        self.version = version
        self._stash = {v: [t.detach() for t in ts] for v, ts in stashed.items()}

    def reset(self) -> None:
        """Forget the micro-batches in flight (after a failed step) and the plan."""
        self._users.clear()
        self._of.clear()
        self._upcoming.clear()
        self._after = None
        self._stash.clear()

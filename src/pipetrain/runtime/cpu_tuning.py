"""CPU-only tunings of a single-process pipeline, applied only where partitions run on the CPU.

When ``GPipe``'s partitions share the CPU, their worker threads compete with each other
and with the caller for a few cores, and memory comes from the C allocator, not from a
caching allocator. These tunings help there and nowhere else; :class:`CpuTuning` holds
them, ``GPipe`` builds one from its keywords, and nothing of it runs on a GPU pipeline:

| tuning | ``GPipe`` keyword | default | costs |
|---|---|---|---|
| the caller's thread runs the backward, last partition first (as autograd runs a plain model's: one thread team, one malloc arena, each checkpointed partition recomputed right before its backward), the last partition's forward too, and every partition of a single micro-batch | — | on | partitions do not overlap in the backward |
| idle workers rebuild the checkpointed micro-batches that the backward will need next (:mod:`.shared_recompute`) | ``recompute_ahead`` | off (``0``) | up to ``recompute_ahead`` more micro-batches' activations per partition |
| GNU OpenMP counts the workers among its threads, so idle OpenMP threads sleep (:func:`join_openmp_count`) | ``throttle_openmp_spin`` | off | process-wide: the caller's own parallel ops wake their threads from sleep |
| a step's weight gradients written into the memory of the last step's, once ``zero_grad()`` dropped them (:class:`ReusingGradientPool`) | ``reuse_gradient_buffers`` | off | the gradients' size held between steps |

All of them use public torch APIs only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipetrain.backward.gradient_pool import GradientPool
from pipetrain.runtime.shared_recompute import RecomputeSharing, SharedStage

__all__ = ["CpuTuning", "ReusingGradientPool", "join_openmp_count"]


@dataclass(frozen=True, kw_only=True)
class CpuTuning:
    """The CPU tunings a single-process pipeline asked for (see the module's table).

    Example:
        >>> tuning = CpuTuning(throttle_openmp_spin=True)
        >>> tuning.worker_setup() is join_openmp_count, type(tuning.gradient_pool()).__name__
        (True, 'GradientPool')
        >>> CpuTuning(recompute_ahead=-1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: recompute_ahead must be a non-negative integer, got -1; ...
    """

    recompute_ahead: int = 0
    """micro-batches a partition may hold rebuilt beyond the one its backward needs (``0``:
    none; each partition is recomputed right before its backward)"""
    reuse_gradient_buffers: bool = False
    throttle_openmp_spin: bool = False

    def __post_init__(self) -> None:
        ahead = self.recompute_ahead
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
            raise ValueError(
                f"recompute_ahead must be a non-negative integer, got {ahead!r}; "
                "fix: recompute_ahead=0 (the default) adds no memory, recompute_ahead=1 "
                "lets idle workers rebuild one micro-batch ahead per partition"
            )

    def worker_setup(self) -> Callable[[], None] | None:
        """What each CPU stage worker runs on its thread when it starts (or ``None``)."""
        return join_openmp_count if self.throttle_openmp_spin else None

    def gradient_pool(self) -> GradientPool:
        """The gradient pool of a partition on the CPU."""
        return ReusingGradientPool() if self.reuse_gradient_buffers else GradientPool()

    def share_recomputation(self, stages: Sequence[SharedStage], *, helpers: Sequence[int],
                            transport: Any) -> RecomputeSharing | None:
        """Let the CPU workers ``helpers`` (thread identifiers) rebuild the checkpointed
        micro-batches of ``stages`` (the CPU stages) when idle; ``transport`` is their
        :class:`~pipetrain.runtime.threads.ThreadTransport`, whose receivers help while
        they wait. ``None`` (nothing shared) with ``recompute_ahead=0`` or fewer than two
        CPU workers."""
        if self.recompute_ahead == 0 or len(helpers) < 2:
            return None
        sharing = RecomputeSharing(stages, transport.mailbox.condition, helpers=helpers,
                                   limit=1 + self.recompute_ahead, timeout=transport.timeout)
        for stage in stages:
            stage.sharing = sharing  # type: ignore[attr-defined]
        transport.idle = sharing.help
        return sharing


def join_openmp_count() -> None:
    """Make the OpenMP runtime count the calling thread (a stage worker) among the
    process's threads.

    GNU OpenMP keeps the threads of a finished parallel region spinning for a while
    (about 8 ms here) in case another region follows, unless the process has more
    OpenMP threads than CPUs: then it spins briefly and sleeps. Stage workers compute
    outside OpenMP's view (one intra-op thread each), so after the caller's 2-thread
    loss a spinning OpenMP thread would take a core from the stages for milliseconds.
    Running one 2-thread region here leaves one sleeping OpenMP thread per worker, so the
    count includes the workers and the runtime spins only as it does on a machine with
    more threads than cores. That holds for the whole process: the caller's own parallel
    regions then wake their threads from sleep (slower for many short regions), hence
    opt-in. The worker sets its own thread count afterwards.

    Example:
        >>> before = torch.get_num_threads()
        >>> join_openmp_count()
        >>> torch.set_num_threads(before)
    """
    torch.set_num_threads(2)
    torch.ones(1 << 17).add_(1)  # large enough for an intra-op parallel region


class ReusingGradientPool(GradientPool):
    """A gradient pool that also reuses the buffers the user dropped (CPU only).

    A CPU has no caching allocator: a fresh gradient buffer comes from the operating
    system, and its first write page-faults through every byte of it (about a third of a
    millisecond per MiB here, on the critical path of the first backward of each step).
    :meth:`lend` remembers the buffer the first accumulation of a step put in ``.grad``;
    once the user's ``zero_grad()`` (``set_to_none=True``, torch's default) has dropped
    that tensor, the next step writes into its memory again.

    Whether the user still holds a dropped gradient is told by a weak reference to the
    tensor handed out: it dies only when no Python variable, no ``.grad`` and no view of
    it is left. A tensor that shares the memory without referring to the tensor
    (``.detach()``, ``.data``, ``.numpy()``, ``untyped_storage()``) is not seen: do not
    keep such aliases of a gradient across ``zero_grad()`` (copy it, ``.clone()``,
    instead). Keeping the buffers costs memory between steps (the gradients' size, held
    while the next forward runs).

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2, 2))
        >>> pool = ReusingGradientPool()
        >>> w.grad = torch.ones(2, 2)
        >>> pool.lend(w, w.grad)   # the first accumulation of a step made this buffer
        >>> w.grad = None          # zero_grad(): nothing refers to that tensor now
        >>> pool.take(w) is not None
        True
    """

    def __init__(self) -> None:
        super().__init__()
        self._lent: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}

    def release(self, params: Iterable[torch.Tensor]) -> None:
        params = list(params)
        for param in params:
            if param.grad is not None:
                self._lent.pop(id(param), None)
        super().release(params)

    def lend(self, param: torch.Tensor, buffer: torch.Tensor) -> None:
        """``buffer`` became ``param.grad``: take its memory back once nobody refers to
        ``buffer`` (CPU buffers only: CUDA's caching allocator reuses memory itself)."""
        super().lend(param, buffer)
        if buffer.device.type == "cpu":
            # the pool's own tensor over the memory; it does not keep ``buffer`` alive
            self._lent[id(param)] = (weakref.ref(buffer), buffer.detach())

    def take(self, param: torch.Tensor) -> torch.Tensor | None:
        kept = super().take(param)
        if kept is not None:
            return kept
        lent = self._lent.pop(id(param), None)
        if lent is None or lent[0]() is not None:
            return None  # nothing lent, or the user still holds it: theirs now
        buffer = lent[1]
        if buffer.shape != param.shape or buffer.dtype != param.dtype:
            return None
        return buffer

    def __len__(self) -> int:
        return super().__len__() + len(self._lent)

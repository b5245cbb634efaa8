"""Re-materialization: run a function keeping only its inputs, recompute it in backward.

:func:`checkpoint` is non-reentrant (built on ``torch.utils.checkpoint`` with
``use_reentrant=False``): the recomputation happens inside the autograd engine when a
dropped activation is first needed, so it composes with DDP, with
``torch.autograd.grad(..., inputs=...)`` and with backward split into an input-gradient
pass and a weight-gradient pass. The CPU random generator, and that of every CUDA
device holding an input tensor, are restored for the recomputation, so dropout draws
the same masks.

:func:`is_checkpointing` and :func:`is_recomputing` are per thread and true in the
thread that runs the function: the first (activation-dropping) forward, and the
recomputation, which runs in whichever thread executes that part of the backward.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from pipetrain.nested import map_tensors
from pipetrain.schedule.memory import STAGE_CHECKPOINT_MODES, stage_modes

__all__ = [
    "CHECKPOINT_MODES",
    "STAGE_CHECKPOINT_MODES",
    "checkpoint",
    "checkpoint_stop",
    "enable_checkpointing",
    "enable_recomputing",
    "is_checkpointing",
    "is_recomputing",
    "stage_modes",
]

CHECKPOINT_MODES = ("always", "except_last", "never")
"""Which micro-batches are checkpointed, as torchgpipe's ``GPipe(checkpoint=...)``."""


class _Flags(threading.local):
    def __init__(self) -> None:
        self.checkpointing = False
        self.recomputing = False


_flags = _Flags()


class _SetFlag:
    """Set one of the current thread's flags while inside; may be entered many times.

    ``torch.utils.checkpoint`` creates the recomputation context once per call, but a
    graph kept with ``retain_graph=True`` recomputes once per backward, possibly in
    different threads: the previous value is kept per thread, as a stack.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._previous = threading.local()

    def __enter__(self) -> None:
        stack: list[bool] = self._previous.__dict__.setdefault("stack", [])
        stack.append(getattr(_flags, self._name))
        setattr(_flags, self._name, True)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        setattr(_flags, self._name, self._previous.stack.pop())


def enable_checkpointing() -> _SetFlag:
    """Context manager: :func:`is_checkpointing` is true inside (this thread only).

    For runtimes that drop activations themselves (the pipeline stages run their
    checkpointed forward under ``torch.no_grad()`` inside it).

    Example:
        >>> with enable_checkpointing():
        ...     is_checkpointing()
        True
    """
    return _SetFlag("checkpointing")


def enable_recomputing() -> _SetFlag:
    """Context manager: :func:`is_recomputing` is true inside (this thread only).

    Example:
        >>> with enable_recomputing():
        ...     is_recomputing()
        True
    """
    return _SetFlag("recomputing")


def is_checkpointing() -> bool:
    """Whether this thread is running the first forward of a checkpointed function.

    In that pass activations are dropped; they are recomputed in backward (see
    :func:`is_recomputing`). Same meaning as ``torchgpipe.is_checkpointing``.

    Example:
        >>> import torch
        >>> seen = []
        >>> def f(x):
        ...     seen.append(is_checkpointing())
        ...     return x * 2
        >>> _ = checkpoint(f, torch.ones(2, requires_grad=True))
        >>> seen, is_checkpointing()
        ([True], False)
    """
    return _flags.checkpointing


def is_recomputing() -> bool:
    """Whether this thread is recomputing a checkpointed function during backward.

    Use it to skip side effects that must happen once per forward (counters, running
    statistics). Same meaning as ``torchgpipe.is_recomputing``.

    Example:
        >>> import torch
        >>> seen = []
        >>> def f(x):
        ...     seen.append(is_recomputing())
        ...     return (x * x).sum()
        >>> checkpoint(f, torch.ones(2, requires_grad=True)).backward()
        >>> seen
        [False, True]
    """
    return _flags.recomputing


def checkpoint_stop(mode: str, num_microbatches: int, *, training: bool = True) -> int:
    """How many leading micro-batches are checkpointed: micro-batch ``i`` is iff ``i < stop``.

    ``"always"`` -> all of them, ``"except_last"`` -> all but the last (its backward
    comes first, so recomputing it saves no memory), ``"never"`` -> none, and none
    when not training (nothing to recompute without a backward).

    Raises:
        ValueError: an unknown mode (the message lists the modes), or
            ``num_microbatches < 0``.

    Example:
        >>> [checkpoint_stop(m, 4) for m in CHECKPOINT_MODES]
        [4, 3, 0]
        >>> checkpoint_stop("always", 4, training=False)
        0
    """
    if mode not in CHECKPOINT_MODES:
        modes = ", ".join(repr(m) for m in CHECKPOINT_MODES)
        raise ValueError(
            f"checkpoint mode must be one of {modes}, got {mode!r}; fix: "
            f"checkpoint='except_last' (the default of torchgpipe's GPipe)"
        )
    if num_microbatches < 0:
        raise ValueError(
            f"num_microbatches must be >= 0, got {num_microbatches}; fix: pass the "
            f"number of micro-batches of this step, e.g. len(split_batch(batch, chunks))"
        )
    if not training or mode == "never":
        return 0
    if mode == "except_last":
        return max(num_microbatches - 1, 0)
    return num_microbatches


def checkpoint(
    function: Callable[..., Any], *args: Any, preserve_rng_state: bool = True
) -> Any:
    """Run ``function(*args)`` keeping only ``args``; recompute it when backward needs it.

    ``args`` may nest tensors in tuples, lists and dicts and hold non-tensor values;
    the output may be any structure. Gradients flow to every tensor in ``args`` that
    requires them and to the parameters ``function`` uses. The function runs with
    :func:`is_checkpointing` true, and again during backward with
    :func:`is_recomputing` true, with the random generators restored (CPU, and the
    CUDA devices of the input tensors) so that dropout repeats its masks. The
    recomputation may stop early, once every dropped activation is rebuilt, so code
    after the last saved activation may not run again.

    Each backward that needs dropped activations recomputes them again: an
    input-gradient pass (``torch.autograd.grad(..., inputs=..., retain_graph=True)``)
    followed by a weight-gradient pass recomputes twice. (Torch's ``GraphExecGroup``,
    which recomputes once per group, refuses such passes: both unpack the same saved
    activations.)

    ``preserve_rng_state=False`` leaves the random generators alone: for a function that
    seeds its own random streams (the runtime does this for stages that share a process),
    so that restoring the global generator cannot disturb another thread.

    With gradients disabled (``torch.no_grad()``) there is nothing to recompute:
    ``function(*args)`` runs plainly, with both flags false.

    Example:
        >>> import torch
        >>> layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> out = checkpoint(lambda inputs: layer(inputs["x"]), {"x": x})
        >>> out.sum().backward()
        >>> x.grad.shape
        torch.Size([2, 4])
    """
    if not torch.is_grad_enabled():
        return function(*args)

    # torch.utils.checkpoint only sees top-level tensors (for the devices whose random
    # state it saves, and for the inputs it keeps): pass the tensor leaves flat.
    leaves: list[Tensor] = []
    map_tensors(leaves.append, args)

    def run(*tensors: Tensor) -> Any:
        refill = iter(tensors)
        rebuilt = map_tensors(lambda _: next(refill), args)
        return function(*rebuilt)

    def contexts() -> tuple[_SetFlag, _SetFlag]:
        return _SetFlag("checkpointing"), _SetFlag("recomputing")

    return torch_checkpoint(
        run, *leaves, use_reentrant=False, context_fn=contexts,
        preserve_rng_state=preserve_rng_state,
    )

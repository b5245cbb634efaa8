"""Skip trackers: where stashed skip tensors wait for their pop, one current per thread.

A :class:`SkipTracker` is a plain store keyed by ``(namespace, name)``. Skippable
layers stash into and pop from the *current* tracker of the thread running them: the
one installed by :func:`use_skip_tracker`, or else a per-thread default, so that a
model runs as a plain ``nn.Sequential`` with no pipeline.

A pipeline stage runs its partition as a pure function of ``(input, skips_in)`` with
:func:`run_with_skips`: a fresh tracker holds ``skips_in``, and what is left in it
afterwards (received and not popped, plus stashed and not popped) is ``skips_out``.
Popped tensors are the stashed tensors themselves, so gradients flow through them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from pipetrain.skip.namespace import SkipKey, _format_key

__all__ = ["SkipTracker", "current_skip_tracker", "run_with_skips", "use_skip_tracker"]


class SkipTracker:
    """A store of skip tensors keyed by ``(namespace, name)``.

    ``stash`` overwrites an existing entry (a forward that failed midway may leave one
    in a thread's default tracker); ``pop`` removes and returns it.

    Example:
        >>> import torch
        >>> tracker = SkipTracker({(None, "a"): torch.ones(1)})
        >>> tracker.stash((None, "b"), torch.zeros(1))
        >>> tracker.pop((None, "a")).tolist(), sorted(name for _, name in tracker.remaining())
        ([1.0], ['b'])
    """

    def __init__(self, skips: Mapping[SkipKey, Tensor | None] | None = None) -> None:
        self._skips: dict[SkipKey, Tensor | None] = dict(skips or {})

    def stash(self, key: SkipKey, tensor: Tensor | None) -> None:
        """Store ``tensor`` under ``key`` (replacing any earlier entry)."""
        self._skips[key] = tensor

    def pop(self, key: SkipKey) -> Tensor | None:
        """Remove and return the tensor stored under ``key``.

        Raises:
            KeyError: nothing is stored under ``key`` (the message names what is).
        """
        try:
            return self._skips.pop(key)
        except KeyError:
            held = ", ".join(_format_key(k) for k in self._skips) or "nothing"
            raise KeyError(
                f"no skip {_format_key(key)} is stashed (the tracker holds {held})"
            ) from None

    def remaining(self) -> dict[SkipKey, Tensor | None]:
        """The entries not popped yet, in stash order (a new dict; tensors not copied)."""
        return dict(self._skips)

    def copy(self) -> SkipTracker:
        """A new tracker with the same entries (tensors not copied)."""
        return SkipTracker(self._skips)

    def __contains__(self, key: object) -> bool:
        return key in self._skips

    def __len__(self) -> int:
        return len(self._skips)

    def __repr__(self) -> str:
        return f"SkipTracker([{', '.join(_format_key(k) for k in self._skips)}])"


class _Current(threading.local):
    def __init__(self) -> None:
        self.installed: SkipTracker | None = None
        self.default: SkipTracker | None = None


_current = _Current()


@contextmanager
def use_skip_tracker(tracker: SkipTracker) -> Iterator[SkipTracker]:
    """Make ``tracker`` the current thread's tracker inside the ``with`` block.

    Nests (the previous one is restored on exit) and affects only this thread.

    Example:
        >>> import torch
        >>> tracker = SkipTracker()
        >>> with use_skip_tracker(tracker):
        ...     current_skip_tracker().stash((None, "x"), torch.ones(1))
        >>> len(tracker), current_skip_tracker() is tracker
        (1, False)
    """
    previous = _current.installed
    _current.installed = tracker
    try:
        yield tracker
    finally:
        _current.installed = previous


def current_skip_tracker() -> SkipTracker:
    """The tracker skippable layers use in this thread (installed, else the default).

    Example:
        >>> current_skip_tracker() is current_skip_tracker()
        True
    """
    if _current.installed is not None:
        return _current.installed
    if _current.default is None:
        _current.default = SkipTracker()
    return _current.default


def run_with_skips(
    module: nn.Module, input: Any, skips: Mapping[SkipKey, Tensor | None]
) -> tuple[Any, dict[SkipKey, Tensor | None]]:
    """Run ``module(input)`` with a fresh tracker holding ``skips``: ``(output, skips_out)``.

    ``skips_out`` is what is left in the tracker: the received skips not popped here
    (the same tensor objects) and the skips stashed here and not popped. A pure
    function of its arguments, so it can be checkpointed:
    ``checkpoint(run_with_skips, partition, input, skips_in)``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from pipetrain.skip import pop, skippable, stash
        >>> @skippable(stash=["s"])
        ... class Save(nn.Module):
        ...     def forward(self, x):
        ...         yield stash("s", x)
        ...         return x + 1
        >>> out, skips = run_with_skips(nn.Sequential(Save()), torch.zeros(1), {})
        >>> out.tolist(), [(name, t.tolist()) for (_, name), t in skips.items()]
        ([1.0], [('s', [0.0])])
    """
    tracker = SkipTracker(skips)
    with use_skip_tracker(tracker):
        output = module(input)
    return output, tracker.remaining()

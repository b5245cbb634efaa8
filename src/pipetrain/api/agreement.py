"""Agreement between ranks: values every rank of a job must hold alike, compared once.

Every process of a job builds its own copy of the configuration, so two hosts launched
with different settings would each run their own idea of the job: a layer on no rank, a
micro-batch count one rank splits by and another does not. :func:`refuse_disagreement`
gathers every rank's values with one small collective and refuses any difference on
every rank at once, with one line per differing value naming the ranks and what each
holds, e.g.::

    ranks disagree on PipelineConfig.balance: rank 0 has [1, 3], rank 1 has [2, 2];
    fix: give every rank the same PipelineConfig

The gather sends a short digest of each value; only when some differ does a second
gather bring the values themselves (the differing ones), so a model's description costs
nothing when the ranks agree. A value that is a mapping (a model's parameter shapes by
name) is shown by the entries that differ only.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DisagreementError", "describe_disagreement", "refuse_disagreement", "shown"]

logger = logging.getLogger(__name__)

_ABSENT = "(not given)"
"""How a value one rank gave and another did not is shown."""
_WIDTH = 160
"""Characters of a value shown, at most."""
_ENTRIES = 3
"""Differing entries of a mapping shown per rank, at most."""
_GROUPS = 4
"""Distinct values shown per differing key, at most."""

Shown = str | dict[str, str]
"""A value as ranks compare it: its text, or a mapping's entries as texts."""


class DisagreementError(ValueError):
    """Ranks of a job were given different values where every rank must hold the same.

    Raised on every rank alike. ``differences`` maps each differing key to the value
    each rank holds, as shown in the message (``{"PipelineConfig.balance": {0: "[1, 3]",
    1: "[2, 2]"}}``).
    """

    def __init__(self, message: str, *, differences: dict[str, dict[int, str]]) -> None:
        super().__init__(message)
        self.differences = differences


def _text(value: Any) -> str:
    if isinstance(value, (str, bytes)):
        return repr(value)
    if isinstance(value, os.PathLike):
        return repr(os.fspath(value))
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_text(k)}: {_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):  # a tuple and a list of the same items agree
        return "[" + ", ".join(_text(v) for v in value) + "]"
    return repr(value)


def shown(value: Any) -> Shown:
    """``value`` as the ranks compare it: a mapping's entries as texts, anything else
    as one text (sequences as lists, so ``(1, 3)`` and ``[1, 3]`` agree).

    Example:
        >>> shown((1, 3)), shown("1f1b"), shown({"w": (8, 4)})
        ('[1, 3]', "'1f1b'", {'w': '[8, 4]'})
    """
    if isinstance(value, Mapping):
        return {str(k): _text(v) for k, v in value.items()}
    return _text(value)


def _digest(value: Shown) -> str:
    key = repr(sorted(value.items())) if isinstance(value, dict) else value
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _clip(text: str) -> str:
    return text if len(text) <= _WIDTH else text[: _WIDTH - 3] + "..."


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 3``, ``ranks 0-2, 5``."""
    parts: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _per_rank(values: Sequence[Shown | None]) -> list[str]:
    """What each rank's message shows of its value: a mapping's differing entries only."""
    if all(isinstance(v, dict) for v in values if v is not None) and any(values):
        maps = [v if isinstance(v, dict) else {} for v in values]
        keys = list(dict.fromkeys(k for m in maps for k in m))
        differ = [k for k in keys if len({m.get(k, "absent") for m in maps}) > 1]
        more = f", and {len(differ) - _ENTRIES} more" if len(differ) > _ENTRIES else ""
        return [_ABSENT if v is None else
                "{" + ", ".join(f"{k!r}: {m.get(k, 'absent')}" for k in differ[:_ENTRIES]) + more + "}"
                for v, m in zip(values, maps)]
    return [_ABSENT if v is None else _clip(v if isinstance(v, str) else _text(v)) for v in values]


def describe_disagreement(gathered: Sequence[Mapping[str, Shown]], *, what: str, fix: str,
                          ranks: Sequence[int] | None = None) -> DisagreementError | None:
    """The error for the ranks' values ``gathered`` (one mapping per rank, each value as
    :func:`shown` gives it; ``ranks``: their ranks in the job, default ``0, 1, ...``), or
    ``None`` when they agree. Every differing key is reported, each on one line.

    Example:
        >>> error = describe_disagreement(
        ...     [{"PipelineConfig.balance": "[1, 3]"}, {"PipelineConfig.balance": "[2, 2]"}],
        ...     what="the Pipeline's set-up", fix="give every rank the same PipelineConfig")
        >>> print(error)
        ranks disagree on PipelineConfig.balance: rank 0 has [1, 3], rank 1 has [2, 2]; fix: give every rank the same PipelineConfig
        >>> describe_disagreement([{"a": "1"}, {"a": "1"}], what="a", fix="b") is None
        True
    """
    ranks = list(range(len(gathered))) if ranks is None else list(ranks)
    keys = list(dict.fromkeys(k for values in gathered for k in values))
    lines: list[str] = []
    differences: dict[str, dict[int, str]] = {}
    for key in keys:
        values = [values.get(key) for values in gathered]
        if len({_digest(v) if v is not None else "" for v in values}) == 1:
            continue
        texts = _per_rank(values)
        differences[key] = dict(zip(ranks, texts))
        groups: dict[str, list[int]] = {}
        for r, text in zip(ranks, texts):
            groups.setdefault(text, []).append(r)
        said = [f"{_ranks(rs)} {'has' if len(rs) == 1 else 'have'} {text}"
                for text, rs in list(groups.items())[:_GROUPS]]
        if len(groups) > _GROUPS:
            said.append(f"and {len(groups) - _GROUPS} other values")
        lines.append(f"{key}: {', '.join(said)}")
    if not lines:
        return None
    if len(lines) == 1:
        message = f"ranks disagree on {lines[0]}; fix: {fix}"
    else:
        message = (f"ranks disagree on {len(lines)} values of {what}:\n"
                   + "".join(f"  * {line}\n" for line in lines) + f"fix: {fix}")
    return DisagreementError(message, differences=differences)


def _gather(value: Any, *, group: Any, what: str) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(out, value, group=group)
    except RuntimeError as error:  # a peer that failed before it, or the group's timeout
        raise RuntimeError(
            f"rank {dist.get_rank()} could not compare {what} with the other ranks: {error}; "
            "another rank probably failed before the comparison (see its error), or did not "
            "reach it within the job's timeout"
        ) from error
    return out


def refuse_disagreement(values: Mapping[str, Any], *, what: str, fix: str,
                        group: Any = None) -> None:
    """Refuse, on every rank, any value that is not the same on every rank of ``group``.

    Every rank of ``group`` (default: the job's) calls it with its own ``values``, keyed
    by how the user spells them (``"PipelineConfig.balance"``, ``"--balance"``); values
    are compared as :func:`shown` gives them (a mapping entry by entry). One gather of
    short digests (a second, of the differing values, only when some differ), bounded by
    the group's timeout. Outside a job, or in a job of one process, it does nothing.

    Raises:
        DisagreementError: some value differs between ranks; every differing key named
            with each rank's value, then ``fix`` (the same error on every rank).
        RuntimeError: the gather failed (a peer died before it, or a timeout).

    Example (in every process of a job, e.g. with a command line's resolved options)::

        refuse_disagreement({"--balance": "1,3", "--microbatches": 8},
                            what="the options of `pipetrain train`",
                            fix="launch every host with the same options")
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    mine = {key: shown(value) for key, value in values.items()}
    digests = _gather({key: _digest(v) for key, v in mine.items()}, group=group, what=what)
    keys = list(dict.fromkeys(k for d in digests for k in d))
    differ = [k for k in keys if len({d.get(k) for d in digests}) > 1]
    if not differ:
        logger.debug("every rank agrees on %s (%d values)", what, len(mine))
        return
    gathered = _gather({k: mine[k] for k in differ if k in mine}, group=group, what=what)
    ranks = (list(range(len(gathered))) if group is None
             else list(dist.get_process_group_ranks(group)))
    error = describe_disagreement(gathered, what=what, fix=fix, ranks=ranks)
    assert error is not None  # the digests differ, so do the values
    raise error

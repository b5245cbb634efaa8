"""Activation memory of a schedule: the bytes each stage and each rank holds at its peak,
under each stage's re-materialization mode and offload budget.

A micro-batch of stage ``j`` holds, from its forward ``F`` to the end of its backward
(``B``, or ``W`` when split): its input and its saved activations (``never``), its saved
activations as the selective mode keeps them (``selective``), the inputs of its layers
(``per_layer``: its backward then rebuilds one layer at a time, holding the largest
layer's saved activations while it runs), or its input alone when it is re-materialized
(``always``; ``except_last``: all but the stage's last micro-batch on the rank), whose
saved activations come back at its first backward action. With an
offload budget ``b`` a stage keeps at most ``b`` bytes on its device, plus the
micro-batch whose backward is running (brought back one action ahead). A rank's peak
is the most its stages hold together, walking its actions in order, with the temporary
memory of the backward that runs (:attr:`StageBytes.workspace`, from the profiler).

Example:
    >>> from pipetrain.schedule.one_f_one_b import one_f_one_b
    >>> peaks = activation_peaks(one_f_one_b(2, 4), [StageBytes(saved=10, input=1)] * 2)
    >>> peaks.per_rank, peaks.per_stage  # 1F1B: rank 0 keeps 2 micro-batches, rank 1 one
    ((22.0, 11.0), (22.0, 11.0))
    >>> activation_peaks(one_f_one_b(2, 4), [StageBytes(saved=10, input=1)] * 2,
    ...                  modes=("always", "never")).per_rank  # 2 inputs + one rebuilt
    (12.0, 11.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipetrain.schedule.actions import Op
from pipetrain.schedule.program import Schedule

__all__ = ["STAGE_CHECKPOINT_MODES", "ActivationPeaks", "StageBytes", "activation_peaks",
           "offload_budgets", "stage_budgets", "stage_modes"]

STAGE_CHECKPOINT_MODES = ("always", "except_last", "never", "selective", "per_layer")
"""What a pipeline stage may do with its activations: re-materialize all, all but the last,
or none of its micro-batches, keep only its matrix products' outputs and recompute the
rest (``selective``, :mod:`pipetrain.runtime.selective`), or re-materialize each layer on
its own, keeping every layer's input (``per_layer``)."""


def stage_modes(checkpoint: str | Sequence[str], num_stages: int) -> tuple[str, ...]:
    """One re-materialization mode per stage: ``checkpoint`` for every stage, or its own
    entry for each (``num_stages`` entries of :data:`STAGE_CHECKPOINT_MODES`).

    Example:
        >>> stage_modes("always", 3)
        ('always', 'always', 'always')
        >>> stage_modes("always,selective", 2)
        ('always', 'selective')
        >>> stage_modes(["never", "sometimes"], 2)
        Traceback (most recent call last):
        ...
        ValueError: checkpoint ['never', 'sometimes']: stage 1's mode 'sometimes' is not one of always, except_last, never, selective, per_layer; fix: e.g. checkpoint=('always', 'never')

    Raises:
        ValueError: an unknown mode, or not one mode per stage.
    """
    modes = tuple(m.strip() for m in checkpoint.split(",")) if isinstance(checkpoint, str) \
        else tuple(checkpoint)
    if len(modes) == 1:
        modes = modes * num_stages
    example = ("always",) + ("never",) * (num_stages - 1)
    for j, mode in enumerate(modes):
        if mode not in STAGE_CHECKPOINT_MODES:
            raise ValueError(
                f"checkpoint {checkpoint!r}: stage {j}'s mode {mode!r} is not one of "
                f"{', '.join(STAGE_CHECKPOINT_MODES)}; fix: e.g. checkpoint={example}"
            )
    if len(modes) != num_stages:
        raise ValueError(
            f"checkpoint {checkpoint!r}: {len(modes)} modes for {num_stages} stages; fix: "
            f"one mode for all stages or one per stage, e.g. checkpoint={example}"
        )
    return modes


def offload_budgets(text: str | None) -> Any:
    """``--offload``'s text as :attr:`~pipetrain.api.config.PipelineConfig.offload`: MiB
    for all stages, or per stage (``none``: that stage keeps all); a word that is not a
    number is passed on for the configuration to name.

    Example:
        >>> offload_budgets("0"), offload_budgets("512,none"), offload_budgets(None)
        (0.0, (512.0, None), None)
    """
    if text is None:
        return None

    def budget(word: str) -> Any:
        word = word.strip()
        if word.lower() in ("none", "-"):
            return None
        try:
            return float(word)
        except ValueError:
            return word

    budgets = tuple(budget(word) for word in text.split(","))
    return budgets[0] if len(budgets) == 1 else budgets


def stage_budgets(offload: float | Sequence[float | None] | None,
                  num_stages: int, *, unit: int = 1 << 20) -> tuple[int | None, ...]:
    """Per stage, the bytes of saved activations kept on the device (``None``: no offload):
    ``offload`` units (default MiB) for every stage, or its own entry for each.

    Example:
        >>> stage_budgets(1, 2), stage_budgets([None, 0], 2), stage_budgets(None, 2)
        ((1048576, 1048576), (None, 0), (None, None))

    Raises:
        ValueError: a budget is not a finite number of MiB at least 0, or not one per stage.
    """
    if offload is None or isinstance(offload, (int, float)):
        budgets: tuple[Any, ...] = (offload,) * num_stages
    else:
        budgets = tuple(offload)
    for j, budget in enumerate(budgets):
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                                   or not math.isfinite(budget) or budget < 0):
            raise ValueError(f"offload {offload!r}: stage {j}'s budget {budget!r} is not a number "
                             f"of {'MiB' if unit == 1 << 20 else 'bytes'} >= 0; fix: e.g. offload=0 (every saved activation to host "
                             "memory) or offload=512")
    if len(budgets) != num_stages:
        raise ValueError(f"offload {offload!r}: {len(budgets)} budgets for {num_stages} "
                         f"stages; fix: one budget for all stages or one per stage (None: "
                         f"that stage keeps its activations)")
    return tuple(None if b is None else int(b * unit) for b in budgets)


_FIRST_BACKWARD = (Op.BACKWARD, Op.BACKWARD_INPUT)
_LAST_BACKWARD = (Op.BACKWARD, Op.BACKWARD_WEIGHT)


@dataclass(frozen=True)
class StageBytes:
    """What one micro-batch of a stage holds for its backward.

    Example:
        >>> StageBytes(saved=10.0, input=1.0, selective=4.0).kept("selective")
        5.0
        >>> StageBytes(saved=10.0, input=1.0, layer_inputs=3.0).kept("per_layer")
        3.0
    """

    saved: float
    """Its saved activations, kept whole (``never``)."""
    input: float = 0.0
    """Its input (all a re-materialized micro-batch keeps)."""
    selective: float | None = None
    """Its saved activations under ``selective`` (None: as :attr:`saved`)."""
    layer_inputs: float | None = None
    """The inputs of all its layers, its own included (``per_layer``; None: as
    :attr:`input`, one layer)."""
    layer_saved: float | None = None
    """The largest of its layers' saved activations, rebuilt by a ``per_layer`` backward
    (None: as :attr:`saved`)."""
    workspace: float = 0.0
    """What its whole backward (``B``) needs above that while it runs (temporaries)."""
    input_workspace: float | None = None
    """Likewise for the input-gradient pass ``I`` of a split backward (None: as
    :attr:`workspace`)."""

    def transient(self, op: Op) -> float:
        """Bytes a running ``op`` needs above what the stage holds.

        Example:
            >>> StageBytes(saved=10.0, workspace=2.0, input_workspace=3.0).transient(Op.BACKWARD_INPUT)
            3.0
        """
        if op is Op.BACKWARD:
            return self.workspace
        if op is Op.BACKWARD_INPUT:
            return self.workspace if self.input_workspace is None else self.input_workspace
        return 0.0

    def kept(self, mode: str) -> float:
        """Bytes held from the forward to the backward under ``mode`` (a micro-batch that
        is not re-materialized)."""
        if mode == "selective" and self.selective is not None:
            return self.selective + self.input
        if mode == "per_layer":
            return self.input if self.layer_inputs is None else self.layer_inputs
        return self.saved + self.input

    def rebuilt(self, mode: str, op: Op) -> float:
        """Bytes a ``per_layer`` backward rebuilds while ``op`` runs (its largest layer's
        saved activations at the first backward action; 0 otherwise).

        Example:
            >>> StageBytes(saved=10.0, layer_saved=4.0).rebuilt("per_layer", Op.BACKWARD)
            4.0
        """
        if mode != "per_layer" or op not in _FIRST_BACKWARD:
            return 0.0
        return self.saved if self.layer_saved is None else self.layer_saved


@dataclass(frozen=True)
class ActivationPeaks:
    """Peak activation bytes, per rank and per stage."""

    per_rank: tuple[float, ...]
    per_stage: tuple[float, ...]


def _rematerialized(schedule: Schedule, modes: Sequence[str]) -> set[tuple[int, int]]:
    """(stage, micro-batch) pairs that keep only their input."""
    last: dict[tuple[int, int], int] = {}  # (rank, stage) -> its last forward's micro-batch
    chosen = set()
    for rank, actions in enumerate(schedule.actions):
        for a in actions:
            if a.op is Op.FORWARD and a.microbatch is not None:
                last[(rank, a.stage)] = max(last.get((rank, a.stage), -1), a.microbatch)
                if modes[a.stage] in ("always", "except_last"):
                    chosen.add((a.stage, a.microbatch))
    for (_, stage), microbatch in last.items():
        if modes[stage] == "except_last":
            chosen.discard((stage, microbatch))
    return chosen


def activation_peaks(
    schedule: Schedule,
    stages: Sequence[StageBytes],
    *,
    modes: Sequence[str] | None = None,
    offload: Sequence[float | None] | None = None,
) -> ActivationPeaks:
    """The peak activation bytes of every rank and stage of ``schedule`` (see the module
    docstring), ``stages[j]`` giving stage ``j``'s bytes per micro-batch, ``modes[j]`` its
    mode (default ``never``) and ``offload[j]`` its budget (None: no offload).

    Raises:
        ValueError: not one entry per stage in ``stages``, ``modes`` or ``offload``.
    """
    count = schedule.num_stages
    modes = tuple(modes) if modes is not None else ("never",) * count
    budgets = tuple(offload) if offload is not None else (None,) * count
    if not len(stages) == len(modes) == len(budgets) == count:
        raise ValueError(f"activation_peaks: the schedule has {count} stages, got "
                         f"{len(stages)} stage sizes, {len(modes)} modes and "
                         f"{len(budgets)} offload budgets")
    inputs_only = _rematerialized(schedule, modes)
    stage_peak = [0.0] * count
    rank_peaks = []
    for actions in schedule.actions:
        held: dict[int, float] = {}  # stage -> bytes its micro-batches hold (offload aside)
        running: dict[int, float] = {}  # stage -> bytes of the micro-batch in backward
        peak = 0.0
        for a in actions:
            j, i = a.stage, a.microbatch
            if i is None or not a.op.is_compute:
                continue
            whole = stages[j].kept(modes[j])
            thin = (j, i) in inputs_only
            if a.op is Op.FORWARD:
                held[j] = held.get(j, 0.0) + (stages[j].input if thin else whole)
            elif a.op in _FIRST_BACKWARD:
                if thin:  # rebuilt: its saved activations are back
                    held[j] = held.get(j, 0.0) + whole - stages[j].input
                running[j] = whole
            resident = {s: _resident(h, budgets[s], running.get(s, 0.0))
                        for s, h in held.items()}
            resident[j] = (resident.get(j, 0.0) + stages[j].transient(a.op)
                           + stages[j].rebuilt(modes[j], a.op))
            for s, value in resident.items():
                stage_peak[s] = max(stage_peak[s], value)
            peak = max(peak, sum(resident.values()))
            if a.op in _LAST_BACKWARD:
                held[j] -= whole
                running.pop(j, None)
        rank_peaks.append(peak)
    return ActivationPeaks(per_rank=tuple(rank_peaks), per_stage=tuple(stage_peak))


def _resident(held: float, budget: float | None, running: float) -> float:
    """A stage's bytes on its device: all it holds, or its budget and the micro-batch
    whose backward runs."""
    if budget is None:
        return held
    return min(held, budget + running)

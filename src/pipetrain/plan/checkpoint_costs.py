"""What re-materialization costs a stage, per mode: the forwards it runs twice and the
activation bytes a replica holds (for :mod:`pipetrain.plan.costs_pipetrain`).
"""

from __future__ import annotations

from pipetrain.plan.costs import StageLoad

__all__ = ["CHECKPOINT_MODES", "PER_STAGE", "PLANNED_CHECKPOINTS", "SEARCHED_CHECKPOINTS",
           "activation_bytes", "layer_inputs", "recomputed_forwards"]

CHECKPOINT_MODES = ("never", "except_last", "always", "per_layer")
"""Re-materialization modes, as :mod:`pipetrain.checkpoint` and
:data:`pipetrain.schedule.memory.STAGE_CHECKPOINT_MODES` name them, fastest first
(``per_layer`` recomputes as much as ``always`` without fusing weight gradients)."""
PER_STAGE = "per-stage"
"""The planner's mode that gives each stage its own: the fastest of
:data:`CHECKPOINT_MODES` whose memory fits the limit (:func:`stage_modes`). While cuts are
searched, a stage is timed as ``never`` (the fastest it can get) and its memory counted
as the least of ``always`` and ``per_layer``; the plan found is then resolved stage by
stage."""
PLANNED_CHECKPOINTS = (*CHECKPOINT_MODES, PER_STAGE)
"""The checkpoint choices of a :class:`Candidate`."""
SEARCHED_CHECKPOINTS = ("never", "except_last", "always", PER_STAGE)
"""What the planner tries under a memory limit when not told (``per_layer`` for every
stage only when asked: ``per-stage`` resolves a stage to it where it alone fits)."""


def recomputed_forwards(checkpoint: str, per_replica: int) -> int:
    """Forwards a replica runs twice: all of them (``always``, ``per_layer``), all but its
    last (``except_last``), none (``never``, and ``per-stage`` before its stages are
    resolved).

    Example:
        >>> [recomputed_forwards(mode, 4) for mode in CHECKPOINT_MODES]
        [0, 3, 4, 4]
    """
    if checkpoint in ("always", "per_layer"):
        return per_replica
    if checkpoint == "except_last":
        return per_replica - 1
    return 0


def activation_bytes(schedule: str, checkpoint: str, *, kept: int, saved_bytes: float,
                     input_bytes: float, layer_input_bytes: float | None = None,
                     layer_saved_bytes: float | None = None) -> float:
    """Peak activation bytes of a replica keeping ``kept`` micro-batches, each its input
    and, unless re-materialized, its saved activations; re-materializing one brings its
    saved activations back until its backward ends. ``except_last`` keeps the last
    micro-batch whole; under GPipe its backward runs first, otherwise one other micro-batch
    may be recomputed meanwhile. ``per_layer``: each keeps its layers' inputs
    (``layer_input_bytes``, None: its input) and a backward rebuilds the largest layer's
    saved activations (``layer_saved_bytes``, None: all of them). ``per-stage`` before its
    stages are resolved: the least of ``always`` and ``per_layer``.

    Example:
        >>> [activation_bytes("1f1b", mode, kept=3, saved_bytes=10.0, input_bytes=1.0,
        ...                   layer_input_bytes=2.0, layer_saved_bytes=4.0)
        ...  for mode in CHECKPOINT_MODES]
        [33.0, 23.0, 13.0, 10.0]
    """
    if kept <= 0:
        return 0.0
    whole = saved_bytes + input_bytes
    if checkpoint == "never":
        return kept * whole
    layered = (kept * (input_bytes if layer_input_bytes is None else layer_input_bytes)
               + (saved_bytes if layer_saved_bytes is None else layer_saved_bytes))
    if checkpoint == "per_layer":
        return layered
    if checkpoint == PER_STAGE:
        return min(kept * input_bytes + saved_bytes, layered)
    if checkpoint == "always":
        return kept * input_bytes + saved_bytes
    rest = (kept - 1) * input_bytes
    return whole + rest + (saved_bytes if kept > 1 and schedule != "gpipe" else 0.0)


def layer_inputs(load: StageLoad) -> float:
    """The inputs of a stage's layers, what a ``per_layer`` micro-batch keeps: its input and
    its nodes' outputs but the one that leaves it (of a chain; the last stage counts its
    last node's output too, an upper bound).

    Example:
        >>> layer_inputs(StageLoad(compute_s=1.0, parameter_bytes=0.0, activation_bytes=6.0,
        ...                        input_bytes=2.0, output_bytes=3.0, is_first=False,
        ...                        is_last=False))
        5.0
    """
    return load.input_bytes + max(0.0, load.activation_bytes - load.output_bytes)

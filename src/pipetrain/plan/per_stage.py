"""The planner's ``per-stage`` checkpoint choice, resolved: each stage of a plan takes the
fastest re-materialization mode whose memory fits the limit (AdaPipe's idea, Sun et al.,
ASPLOS 2024: the first stages of a 1F1B pipeline keep the most micro-batches, so they
are the ones worth recomputing; the others keep everything and stay fast).

For a fixed cut, schedule and micro-batch count this choice is the best there is: a
stage's mode changes only its own memory, and each step of recomputation only adds time
to its own actions, so the stage-by-stage fastest fitting mode gives the shortest
simulated step. The cut itself is searched with each stage timed as ``never`` and its
memory counted as ``always`` (:data:`~pipetrain.plan.costs_pipetrain.PER_STAGE`), then
every plan found is resolved here and simulated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pipetrain.plan.costs import StageLoad
from pipetrain.plan.costs_pipetrain import (
    CHECKPOINT_MODES,
    PER_STAGE,
    Candidate,
    PipetrainCostModel,
    stage_mode,
)

__all__ = ["resolve_stage_modes", "stage_models"]


def stage_models(candidate: Candidate, count: int, *,
                 num_workers: int) -> list[PipetrainCostModel]:
    """One cost model per stage, each with that stage's own mode.

    Example:
        >>> c = Candidate(checkpoint="per-stage", stage_checkpoints=("always", "never"))
        >>> [m.candidate.checkpoint for m in stage_models(c, 2, num_workers=2)]
        ['always', 'never']
    """
    return [PipetrainCostModel(dataclasses.replace(candidate, checkpoint=stage_mode(candidate, j),
                                                   stage_checkpoints=None),
                               num_workers=num_workers)
            for j in range(count)]


def resolve_stage_modes(loads: Sequence[StageLoad], replicas: Sequence[int],
                        candidate: Candidate, *, memory_limit: float | None,
                        num_workers: int) -> Candidate | None:
    """``candidate`` with each stage's fastest mode that fits ``memory_limit`` (``never``
    when there is none), or None when some stage fits under none. A candidate that is not
    ``per-stage`` is returned as it is.

    Example:
        >>> load = StageLoad(compute_s=3.0, forward_s=1.0, parameter_bytes=0.0,
        ...                  activation_bytes=0.0, input_bytes=1.0, output_bytes=0.0,
        ...                  is_first=False, is_last=False, saved_bytes=10.0)
        >>> c = Candidate(schedule="1f1b", num_microbatches=4, checkpoint="per-stage")
        >>> [resolve_stage_modes([load] * 3, [1] * 3, c, memory_limit=limit,
        ...                      num_workers=3).stage_checkpoints  # 3, 2, 1 in flight
        ...  for limit in (23.0, 20.0)]
        [('except_last', 'never', 'never'), ('always', 'always', 'never')]
    """
    if candidate.checkpoint != PER_STAGE:
        return candidate
    after, modes = sum(replicas), []
    for load, r in zip(loads, replicas):
        for mode in CHECKPOINT_MODES:  # fastest first: never, except_last, always, per_layer
            model = PipetrainCostModel(dataclasses.replace(candidate, checkpoint=mode),
                                       num_workers=num_workers)
            if memory_limit is None or model.stage_memory(
                    load, replicas=r, workers_from_stage=after) <= memory_limit:
                modes.append(mode)
                break
        else:
            return None
        after -= r
    return dataclasses.replace(candidate, stage_checkpoints=tuple(modes))

"""What a pipeline does with its activations, checked: re-materialization modes and
offload budgets, one for every stage or one per model stage."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pipetrain.schedule import ASYNC_SCHEDULES
from pipetrain.schedule.memory import stage_budgets, stage_modes

__all__ = ["memory_problems", "stage_budgets"]



def _reason(error: ValueError) -> str:
    """The message of :func:`stage_modes` or :func:`stage_budgets` without its value and fix."""
    return str(error).split(": ", 1)[-1].split("; fix")[0]


def memory_problems(v: Mapping[str, Any], name: str,
                    say: Callable[[str, Any], str]) -> list[str]:
    """What is wrong with ``checkpoint`` and ``offload`` of the :class:`PipelineConfig`
    values ``v`` (schedule ``name``): an unknown mode or bad budget, not one per model
    stage, a per-stage, selective or per-layer mode or an offload on an asynchronous
    schedule, or an offload on a per-layer stage.

    Example:
        >>> say = lambda name, value: f"{name}={value!r}"
        >>> memory_problems({"checkpoint": "sometimes", "offload": None, "num_stages": 2,
        ...                  "stages_per_rank": 1}, "1f1b", say)
        ["checkpoint='sometimes': stage 0's mode 'sometimes' is not one of always, except_last, never, selective, per_layer; fix: e.g. checkpoint='never'"]
    """
    counts = (v["num_stages"], v["stages_per_rank"])
    stages = counts[0] * counts[1] if all(isinstance(c, int) and c > 0 for c in counts) else None
    found = []
    checkpoint, offload = v["checkpoint"], v["offload"]
    try:
        modes = stage_modes(checkpoint, stages or 1)
    except (ValueError, TypeError, AttributeError) as error:
        modes = ()
        if stages is not None or "modes for" not in str(error):  # else: counts told apart
            detail = (_reason(error) if isinstance(error, ValueError)
                      else f"not a mode or a sequence of modes ({type(checkpoint).__name__})")
            found.append(f"{say('checkpoint', checkpoint)}: {detail}; fix: e.g. "
                         f"{say('checkpoint', 'never')}")
    try:
        stage_budgets(offload, stages or 1)
    except (ValueError, TypeError) as error:
        if stages is not None or "budgets for" not in str(error):
            detail = (_reason(error) if isinstance(error, ValueError)
                      else f"not a number or a sequence of numbers ({type(offload).__name__})")
            found.append(f"{say('offload', offload)}: {detail}; fix: e.g. {say('offload', 0)} "
                         f"(every saved activation to host memory) or {say('offload', 512)}")
    budgets = offload if isinstance(offload, (list, tuple)) else (offload,) * len(modes)
    layered = [j for j, (mode, budget) in enumerate(zip(modes, budgets))
               if mode == "per_layer" and budget is not None]
    if layered:
        found.append(f"{say('offload', offload)} with checkpoint 'per_layer' on stage "
                     f"{layered[0]}: a per-layer stage keeps only its layers' inputs, which "
                     f"are not offloaded; fix: no budget for that stage (none), or another "
                     f"checkpoint mode")
    if name in ASYNC_SCHEDULES:
        if modes and (not isinstance(checkpoint, str) or len(set(modes)) > 1
                      or modes[0] in ("selective", "per_layer")):
            found.append(f"{say('checkpoint', checkpoint)}: asynchronous schedules take one mode "
                         f"for all stages, always or never; fix: {say('checkpoint', 'always')}")
        if offload is not None:
            found.append(f"{say('offload', offload)} is not available with asynchronous schedules "
                         f"(their weight versions change under the saved tensors); fix: "
                         f"{say('offload', None)}")
    return found

"""What an asynchronous schedule cannot do, as :class:`~pipetrain.api.config.PipelineConfig`
problems (each naming the setting, why, and the fix)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pipetrain.schedule import ASYNC_SCHEDULES

__all__ = ["async_problems"]


def async_problems(values: Mapping[str, Any], name: str, say: Callable[[str, Any], str]) -> list[str]:
    """The problems of the configuration ``values`` for schedule ``name`` (canonical;
    ``""`` when unknown) that concern the asynchronous schedules.

    Example:
        >>> async_problems({"vertical_sync": True, "clip_grad_norm": None, "nonfinite": "ignore",
        ...                 "checkpoint": "never", "deferred_batch_norm": False}, "1f1b",
        ...                lambda n, v: f"{n}={v!r}")
        ["vertical_sync=True is an option of schedule 'pipedream'; fix: schedule='pipedream' or vertical_sync=False"]
    """
    found: list[str] = []
    vertical_sync = values["vertical_sync"]
    if not isinstance(vertical_sync, bool):
        found.append(f"{say('vertical_sync', vertical_sync)} must be True or False")
    elif vertical_sync and name not in ("pipedream", ""):
        found.append(f"{say('vertical_sync', True)} is an option of schedule 'pipedream'; fix: "
                     f"{say('schedule', 'pipedream')} or {say('vertical_sync', False)}")
    if name not in ASYNC_SCHEDULES:
        return found
    clip = values["clip_grad_norm"]
    if clip is not None:
        found.append(
            f"{say('clip_grad_norm', clip)}: schedule {name!r} updates each stage on its own, at "
            "its own time, so no update has a gradient norm over all stages to clip by; fix: "
            f"{say('clip_grad_norm', None)}")
    if values["nonfinite"] != "ignore":
        found.append(
            f"{say('nonfinite', values['nonfinite'])}: schedule {name!r} cannot refuse or skip a "
            "step whole, because its stages apply their updates at different times, before the "
            "step's loss is known everywhere; fix: "
            f"{say('nonfinite', 'ignore')} (and watch the losses train_step returns)")
    if values["checkpoint"] == "except_last":
        found.append(
            f"{say('checkpoint', 'except_last')} spares the micro-batch whose backward comes first "
            f"after a flush, and schedule {name!r} has no flush; fix: "
            f"{say('checkpoint', 'always')} or {say('checkpoint', 'never')}")
    if values["deferred_batch_norm"] is True:
        found.append(
            f"{say('deferred_batch_norm', True)} commits batch-norm statistics once per step, "
            f"after a flush, and schedule {name!r} has none; fix: "
            f"{say('deferred_batch_norm', False)} (batch norms then track each micro-batch)")
    if values.get("mixed_precision") == "fp16":
        found.append(
            f"{say('mixed_precision', 'fp16')} scales the loss and skips a step on every stage "
            f"when any stage overflows, and schedule {name!r} applies each stage's updates on "
            f"their own, before every stage's gradients are known; fix: "
            f"{say('mixed_precision', 'bf16')} (no loss scale) or a synchronous schedule")
    counts = values.get("stage_replicas")
    if vertical_sync is True and counts is not None and len(set(counts)) > 1:
        found.append(
            f"{say('vertical_sync', True)} needs the same replica count on every stage, got "
            f"{say('stage_replicas', tuple(counts))}: a version counts the updates of a round "
            "of replicas, and rounds of different sizes do not line up; fix: "
            f"{say('vertical_sync', False)}")
    return found

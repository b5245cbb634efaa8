"""What a worker of a stage holds of its weights: FSDP's policies, and weight versions.

Pure Python, for the ``pipetrain`` cost model (:mod:`pipetrain.plan.costs_pipetrain`):
the bytes of parameters, gradients and optimizer state a worker holds at its step's peak
under each way of holding a stage over its replicas, and the extra parameter versions of
the asynchronous schedules.
"""

from __future__ import annotations

from pipetrain.plan.costs import StageLoad

__all__ = ["FSDP_POLICIES", "weight_versions", "weights_held"]

FSDP_POLICIES: dict[str, tuple[bool, bool]] = {
    "gathered": (False, False),
    "reduce-each": (False, True),
    "reshard": (True, False),
    "lean": (True, True),
}
"""When a sharded stage gathers and reduces, by name: ``(reshard_after_forward,
reduce_each_microbatch)`` (:class:`~pipetrain.api.config.PipelineConfig`'s options;
``pipetrain train --fsdp-reshard`` / ``--fsdp-reduce-each-microbatch``), fewest
collectives first."""


def weights_held(load: StageLoad, replicas: int, data_parallel: str, *,
                 reshard_after_forward: bool = False,
                 reduce_each_microbatch: bool = False) -> float:
    """Bytes of parameters, gradients and optimizer state a worker of the stage holds at
    its step's peak. Replicated: all of them. Under FSDP: a ``1 / replicas`` shard of
    them, plus by default the gathered parameters (kept across the step's micro-batches)
    and the whole gradients they accumulate into (reduce-scattered once, after the last
    backward); ``reshard_after_forward`` drops the first, ``reduce_each_microbatch`` the
    second (a layer's gathered copy while it runs is not counted).

    Example:
        >>> from pipetrain.plan.costs import StageLoad
        >>> load = StageLoad(compute_s=1.0, parameter_bytes=4.0, activation_bytes=0.0,
        ...                  input_bytes=0.0, output_bytes=0.0, is_first=True, is_last=True,
        ...                  weight_memory_bytes=16.0, gradient_bytes=4.0)
        >>> weights_held(load, 4, "replicate"), weights_held(load, 4, "fsdp")
        (16.0, 12.0)
        >>> weights_held(load, 4, "fsdp", reshard_after_forward=True,
        ...              reduce_each_microbatch=True)  # the formula: 16 / 4
        4.0
    """
    if data_parallel != "fsdp" or replicas <= 1:
        return load.weight_memory_bytes
    gathered = (0.0 if reshard_after_forward else load.parameter_bytes) + (
        0.0 if reduce_each_microbatch else (load.gradient_bytes or load.parameter_bytes))
    return load.weight_memory_bytes / replicas + gathered


def weight_versions(schedule: str, kept: int) -> int:
    """Copies of the parameters beyond the live ones: PipeDream's stashed versions (one per
    micro-batch in flight but the newest), 2BW's second version.

    Example:
        >>> weight_versions("pipedream", 4), weight_versions("2bw", 4), weight_versions("1f1b", 4)
        (3, 1, 0)
    """
    if schedule == "pipedream":
        return max(0, kept - 1)
    if schedule == "2bw":
        return 1
    return 0

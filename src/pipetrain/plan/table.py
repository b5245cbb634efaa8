"""A plan as the text table ``pipetrain plan`` prints.

Example:
    >>> from pipetrain.plan.plan_file import Plan, PlanStage
    >>> plan = Plan(stages=(PlanStage(nodes=(0, 1, 2), replicas=3, time=0.1,
    ...                               memory_per_worker=2e9),
    ...                     PlanStage(nodes=(3,), replicas=1, time=0.2, memory_per_worker=1e9)),
    ...             cost_model="pipedream", time_per_step=0.2, num_workers=4,
    ...             single_worker_time=0.5, data_parallel_time=0.25)
    >>> print(render_plan(plan))  # doctest: +NORMALIZE_WHITESPACE
    stage  nodes                 replicas  time/step  memory/worker
        0  layers 0-2 (3)               3   100.0 ms         2.0 GB
        1  layer 3                      1   200.0 ms         1.0 GB
    predicted time per step: 200.0 ms (cost model pipedream; slowest stage: 1)
    speedup: 2.50x over one worker, 1.25x over data parallelism on 4 workers
    workers used: 4 of 4; 2 stages
    memory per worker: 2.0 GB at most
    schedule: not chosen by the plan (the pipedream cost model predicts PipeDream's 1F1B with weight stashing, 2 minibatches in flight at the input stage)
"""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.counts import count_of
from pipetrain.plan.plan_file import Plan, PlanStage

__all__ = ["describe_nodes", "render_plan"]


def describe_nodes(nodes: Sequence[str | int]) -> str:
    """A short description of a stage's nodes: ``layers 0-16 (17)`` for layer indices
    that run consecutively, the ids for a few nodes, ``first .. last (N nodes)`` else.

    Example:
        >>> describe_nodes([3, 4, 5]), describe_nodes(["a", "c"]), describe_nodes(list("abcde"))
        ('layers 3-5 (3)', 'a, c', 'a .. e (5 nodes)')
    """
    if all(isinstance(node, int) for node in nodes):
        ints = [int(node) for node in nodes]
        if len(ints) == 1:
            return f"layer {ints[0]}"
        if ints == list(range(ints[0], ints[0] + len(ints))):
            return f"layers {ints[0]}-{ints[-1]} ({len(ints)})"
    if len(nodes) <= 3:
        return ", ".join(str(node) for node in nodes)
    return f"{nodes[0]} .. {nodes[-1]} ({len(nodes)} nodes)"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.1f} ms" if value < 10 else f"{value:.2f} s"


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def _replicas(stage: PlanStage) -> str:
    if len(stage.replicas_per_level) > 1:
        return f"{stage.replicas} ({'x'.join(map(str, stage.replicas_per_level))})"
    return str(stage.replicas)


def render_plan(plan: Plan) -> str:
    """The table and summary lines (no trailing newline)."""
    modes = (plan.checkpoint or "").split(",")
    per_stage = len(modes) == plan.num_stages > 1
    rows = [
        (str(j), describe_nodes(stage.nodes), _replicas(stage), _seconds(stage.time),
         _bytes(stage.memory_per_worker)) + ((modes[j],) if per_stage else ())
        for j, stage in enumerate(plan.stages)
    ]
    header = ("stage", "nodes", "replicas", "time/step", "memory/worker") + (
        ("checkpoint",) if per_stage else ())
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    widths[1] = max(widths[1], 20)
    lines = [
        "  ".join(
            cell.ljust(widths[c]) if c == 1 else cell.rjust(widths[c])
            for c, cell in enumerate(row)
        ).rstrip()
        for row in [header, *rows]
    ]
    times = [(s.time, j) for j, s in enumerate(plan.stages) if s.time is not None]
    slowest = f"; slowest stage: {max(times)[1]}" if times else ""
    how = ": the simulated step" if plan.cost_model == "pipetrain" else ""
    lines.append(
        f"predicted time per step: {_seconds(plan.time_per_step)} "
        f"(cost model {plan.cost_model}{how}{slowest})"
    )
    speedups = []
    one, data = plan.speedup_over_one_worker(), plan.speedup_over_data_parallel()
    if one is not None:
        speedups.append(f"{one:.2f}x over one worker")
    if data is not None:
        speedups.append(f"{data:.2f}x over data parallelism on {count_of(plan.num_workers, 'worker')}")
    if speedups:
        lines.append("speedup: " + ", ".join(speedups))
    lines.append(
        f"workers used: {plan.workers_used} of {plan.num_workers}; {plan.num_stages} "
        f"stage{'s' * (plan.num_stages != 1)}"
    )
    memory = [s.memory_per_worker for s in plan.stages if s.memory_per_worker is not None]
    if memory:
        limit = f" (limit {_bytes(plan.memory_limit)})" if plan.memory_limit else ""
        lines.append(f"memory per worker: {_bytes(max(memory))} at most{limit}")
    if plan.data_parallel == "fsdp":
        replicated = plan.replicated_memory
        whole = (f"; with whole copies on every replica the same stages need "
                 f"{_bytes(replicated)} per worker"
                 + (", over the limit" if plan.memory_limit and replicated > plan.memory_limit
                    else "") if replicated is not None else "")
        flags = " --fsdp-reshard" * plan.reshard_after_forward + (
            " --fsdp-reduce-each-microbatch" * plan.reduce_each_microbatch)
        gathered = ("gathered for every forward and backward" if plan.reshard_after_forward
                    else "gathered once per step")
        reduced = ("reduce-scattered after every backward" if plan.reduce_each_microbatch
                   else "reduce-scattered once per step")
        lines.append(f"data parallel: FSDP, each stage's parameters, gradients and optimizer "
                     f"state sharded over its {plan.stages[0].replicas} replicas, the "
                     f"parameters {gathered}, the gradients {reduced} (pipetrain train "
                     f"--fsdp{flags}){whole}")
    if plan.schedule is not None:
        per = " per replica of stage 0" if plan.stages[0].replicas > 1 else ""
        lines.append(
            f"schedule: {plan.schedule}, {plan.num_microbatches} "
            f"micro-batch{'es' * (plan.num_microbatches != 1)}{per}"
            + (f", checkpoint {plan.checkpoint}" if plan.checkpoint else "")
            + f" (chosen by the {plan.cost_model} cost model)"
        )
    if per_stage:
        lines.append("checkpoint per stage: each stage takes the fastest mode whose memory fits "
                     "the limit (never, except_last, always); the stages that keep more "
                     "micro-batches in flight re-materialize, the others keep their activations")
    elif plan.cost_model == "pipedream":
        in_flight = -(-plan.workers_used // plan.stages[0].replicas)
        lines.append(
            "schedule: not chosen by the plan (the pipedream cost model predicts PipeDream's "
            f"1F1B with weight stashing, {in_flight} minibatch{'es' * (in_flight != 1)} in flight "
            "at the input stage)"
        )
    return "\n".join(lines)

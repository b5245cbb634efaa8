"""A two-stage pipeline against data parallelism over a bandwidth-limited link, measured here
and predicted by the planner's two cost models.

Two network namespaces joined by a veth pair shaped to ``rate_mbit`` each way
(:mod:`pipetrain.bench.netns`), one gloo worker in each
(:mod:`.pipedream_link_worker`). The model is an MLP whose weights are much larger than
the activations between its layers (PipeDream's favourable case: a pipeline sends only
activations and gradients across its cut, data parallelism all-reduces every weight).
The same worker profiles the MLP (rank 0, one intra-op thread, as the runners train).

Example::

    raw = run_link(LinkOptions(), progress=print)     # as root, iproute2 installed
    rows = link_rows(raw, LinkOptions())
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pipetrain
from pipetrain.bench.harness import median
from pipetrain.bench.netns import ShapedLink, shaped_link
from pipetrain.plan import PlannerConfig, Profile, Topology, get_cost_model, make_plan
from pipetrain.plan.costs import LevelContext
from pipetrain.plan.graph import CutGraph
from pipetrain.plan.schedule_choice import plan_for_layout

__all__ = ["LinkOptions", "link_rows", "pipedream_predictions", "pipetrain_predictions", "run_link"]

_JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "GLOO_SOCKET_IFNAME")


@dataclass(frozen=True, kw_only=True)
class LinkOptions:
    """The shaped-link run's settings (the worker reads them as JSON)."""

    rate_mbit: float = 100.0
    width: int = 1024
    depth: int = 4
    batch: int = 64
    microbatches: int = 8
    repetitions: int = 12
    warmup: int = 2
    lr: float = 0.01
    schedules: tuple[str, ...] = ("1f1b", "pipedream")
    profile_repetitions: int = 5
    timeout: float = 240.0
    extra: dict[str, Any] = field(default_factory=dict)


def _env(link: ShapedLink, rank: int, opts: LinkOptions) -> dict[str, str]:
    from pipetrain.bench.cases.pipedream_link_worker import OPTIONS_ENV

    env = {k: v for k, v in os.environ.items()
           if k not in _JOB_VARIABLES and not k.startswith("TORCHELASTIC_")}
    source = str(Path(pipetrain.__file__).resolve().parents[1])
    env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR=link.a.name, MASTER_PORT="29500",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p))
    env[OPTIONS_ENV] = json.dumps(asdict(opts))
    return env


def _result(output: str) -> dict[str, Any] | None:
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT "):]) if lines else None


def run_link(opts: LinkOptions, *, progress: Callable[[str], None]) -> dict[str, Any]:
    """Run the two workers on a shaped link; rank 0's result (see the worker).

    Raises:
        LinkUnavailable: the namespaces or the shaping cannot be made here.
        RuntimeError: a worker failed or overstayed ``opts.timeout`` (its output's end quoted).
    """
    module = "pipetrain.bench.cases.pipedream_link_worker"
    with shaped_link(rate_mbit=opts.rate_mbit) as link:
        progress(f"link: two namespaces, veth shaped to {opts.rate_mbit:g} Mbit/s each way; "
                 f"2 workers, MLP {opts.depth} x {opts.width}, batch {opts.batch}")
        started = time.monotonic()
        processes = [link.popen(host, [sys.executable, "-m", module], env=_env(link, rank, opts))
                     for rank, host in enumerate((link.a, link.b))]
        outputs = []
        for rank, process in enumerate(processes):
            left = max(1.0, opts.timeout - (time.monotonic() - started))
            try:
                output, _ = process.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                process.kill()
                output, _ = process.communicate(timeout=20)
                raise RuntimeError(f"link worker {rank} took more than {opts.timeout:g} s: "
                                   f"...{output[-1500:]}") from None
            outputs.append(output)
        for rank, output in enumerate(outputs):
            result = _result(output)
            if result is None or not result.get("ok", False):
                detail = result.get("traceback", "") if result else output[-1500:]
                raise RuntimeError(f"link worker {rank} failed: {detail}")
        raw = _result(outputs[0])
        assert raw is not None
        raw["seconds"] = time.monotonic() - started
        return raw


def pipedream_predictions(profile: Profile, *, bandwidth: float) -> dict[str, float]:
    """PipeDream's model, per step of the profile's batch: the two-stage even split (its
    steady state, no flush) and data parallelism on 2 workers.

    Example:
        >>> from pipetrain.plan import LayerProfile
        >>> layers = tuple(LayerProfile(name=str(k), forward_s=1.0, backward_s=1.0,
        ...                             output_bytes=10, parameter_bytes=100) for k in range(2))
        >>> pipedream_predictions(Profile(layers=layers), bandwidth=10.0)
        {'two_stage_s': 2.0, 'data_parallel_s': 22.0}
    """
    model = get_cost_model("pipedream")
    graph = CutGraph(profile)
    level = LevelContext(bandwidth=bandwidth)
    half = profile.num_layers // 2
    stages = [(0, half), (half, graph.full)]
    two = max(model.stage_time(graph.load(a, b), replicas=1, level=level) for a, b in stages)
    dp = model.stage_time(graph.load(0, graph.full), replicas=2, level=level)
    return {"two_stage_s": two, "data_parallel_s": dp}


def pipetrain_predictions(profile: Profile, *, bandwidth: float, num_microbatches: int,
                          schedules: tuple[str, ...]) -> dict[str, float]:
    """pipetrain's model (the simulated step): the two-stage even split under each of
    ``schedules`` with ``num_microbatches``, and data parallelism (one stage on 2
    replicas, one micro-batch each)."""
    topology = Topology.flat(2, bandwidth)
    half = profile.num_layers // 2
    out = {}
    for schedule in schedules:
        try:
            config = PlannerConfig(topology=topology, schedules=(schedule,),
                                   num_microbatches=(num_microbatches,))
        except ValueError:
            continue  # a schedule the model does not plan (the asynchronous ones)
        plan = plan_for_layout(profile, [half, profile.num_layers - half], [1, 1], config)
        out[f"two_stage_{schedule}_s"] = plan.time_per_step
    dp = PlannerConfig(topology=topology, schedules=("1f1b",), num_microbatches=(1,))
    out["data_parallel_s"] = plan_for_layout(profile, [profile.num_layers], [2], dp).time_per_step
    return out


def link_rows(raw: dict[str, Any], opts: LinkOptions) -> tuple[list[list[Any]], dict[str, Any]]:
    """The table rows of a run (measured beside predicted, ms per step), and its data."""
    profile = Profile.from_dict(raw["profile"])
    shaped = opts.rate_mbit * 1e6 / 8
    dream = pipedream_predictions(profile, bandwidth=shaped)
    ours = pipetrain_predictions(profile, bandwidth=shaped, num_microbatches=opts.microbatches,
                                 schedules=opts.schedules)
    choice = make_plan(profile, PlannerConfig(topology=Topology.flat(2, shaped), cost_model="pipedream"))
    measured = {label: median(times) for label, times in raw["steps"].items()}
    ddp = measured["ddp"]
    rows: list[list[Any]] = []
    for schedule in opts.schedules:
        label = f"pipeline-{schedule}"
        if label not in measured:
            continue
        rows.append([f"Pipeline, 2 stages, {schedule}", _ms(measured[label]), f"{ddp / measured[label]:.2f}x",
                     _ms(ours.get(f"two_stage_{schedule}_s")), _ms(dream["two_stage_s"])])
    rows.append(["torch DDP, 2 replicas", _ms(ddp), "1.00x", _ms(ours["data_parallel_s"]),
                 _ms(dream["data_parallel_s"])])
    data = {"measured_s": measured, "steps_s": raw["steps"], "predicted_pipetrain_s": ours,
            "predicted_pipedream_s": dream, "shaped_bandwidth": shaped,
            "measured_bandwidth": raw["bandwidth"], "seconds": raw.get("seconds"),
            "planner_choice": {"config": "-".join(str(s.replicas) for s in choice.stages),
                               "speedup_over_data_parallel": choice.speedup_over_data_parallel()},
            "options": asdict(opts)}
    return rows, data


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"

"""Item ``planner``: the planner on a profile taken on the device, its predicted step
next to the measured step of its layout run in one process.

1. ``pipetrain.plan.profile_model`` profiles a GPT (untied embeddings) on the device
   (AdamW; the micro-batch costs at ``batch / 8`` samples);
2. ``pipetrain.plan.make_plan`` plans 2 workers, one stage each (``straight``), with the
   ``pipetrain`` cost model and the ``gpipe`` schedule (the one a ``GPipe`` runs), at the
   device's measured copy bandwidth; it chooses the cut, the micro-batches and the
   checkpoint mode and predicts the step;
3. the plan runs as ``GPipe(model, balance, devices=[device, device], chunks=...,
   checkpoint=...)`` with AdamW, and the plain model as one process (the plan's
   single-worker prediction), timed in interleaved repetitions.

Both stages share the one device, where the plan assumes a device each: the measured
step can only match the prediction where the two stages' work overlaps on the device;
the item reports the ratio either way.
"""

from __future__ import annotations

import time
from typing import Any

from gpu.common import ItemContext, interleaved_times, synchronize

__all__ = ["SIZES", "copy_bandwidth", "run"]

SIZES = {
    "cuda": {"num_layers": 8, "width": 1024, "num_heads": 16, "context": 256, "batch": 32,
             "repetitions": 5, "warmup": 3, "rounds": 4, "block": 3},
    "cpu": {"num_layers": 4, "width": 128, "num_heads": 4, "context": 64, "batch": 16,
            "repetitions": 5, "warmup": 2, "rounds": 3, "block": 2},
    "quick": {"num_layers": 2, "width": 32, "num_heads": 2, "context": 16, "batch": 8,
              "repetitions": 5, "warmup": 1, "rounds": 2, "block": 2},
}


def copy_bandwidth(device: Any, num_bytes: int = 64 * 2**20) -> float:
    """Bytes per second of a copy within ``device`` (median of 5)."""
    import statistics

    import torch

    source = torch.ones(num_bytes // 4, device=device)
    target = torch.empty_like(source)
    times = []
    for k in range(6):
        synchronize(device)
        began = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        if k:
            times.append(time.perf_counter() - began)
    return num_bytes / statistics.median(times)


def run(ctx: ItemContext) -> dict[str, Any]:
    import torch

    import pipetrain
    from pipetrain.bench.harness import summary
    from pipetrain.models import GPTConfig, build_gpt, gpt_layer_factories, gpt_loss
    from pipetrain.plan import PlannerConfig, Topology, make_plan, profile_model

    sizes = ctx.pick(SIZES)
    device = ctx.torch_device()
    config = GPTConfig(num_layers=sizes["num_layers"], width=sizes["width"],
                       num_heads=sizes["num_heads"], context=sizes["context"],
                       tie_embeddings=False)
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (sizes["batch"], sizes["context"] + 1), generator=generator)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    began = time.monotonic()
    profile = profile_model(gpt_layer_factories(config, seed=0), x, loss_fn=gpt_loss, target=y,
                            microbatch_size=max(1, sizes["batch"] // 8), device=device,
                            optimizer="adamw", repetitions=sizes["repetitions"])
    profile_s = time.monotonic() - began
    bandwidth = copy_bandwidth(device)
    planner = PlannerConfig(topology=Topology.flat(2, bandwidth), straight=True,
                            schedules=("gpipe",))
    plan = make_plan(profile, planner)
    balance = [len(stage.nodes) for stage in plan.stages]
    chunks = plan.num_microbatches or 1
    checkpoint = plan.checkpoint or "never"

    x, y = x.to(device), y.to(device)

    def trainer(model: torch.nn.Module) -> Any:
        optimizer = torch.optim.AdamW(model.parameters())

        def step() -> None:
            gpt_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(device)

        return step

    staged = pipetrain.GPipe(build_gpt(config, seed=0), balance, devices=[device, device],
                             chunks=chunks, checkpoint=checkpoint)
    plain = build_gpt(config, seed=0).to(device)
    times = interleaved_times({"plan_2_stages_one_process": trainer(staged),
                               "one_process_plain": trainer(plain)},
                              warmup=sizes["warmup"], rounds=sizes["rounds"],
                              block=sizes["block"])
    stats = {name: summary(values) for name, values in times.items()}
    measured = stats["plan_2_stages_one_process"]["median_s"]
    single = stats["one_process_plain"]["median_s"]
    predicted = plan.time_per_step
    result: dict[str, Any] = {
        "status": "ok", "sizes": sizes, "profile_seconds": round(profile_s, 2),
        "profile_device": profile.device, "bandwidth_bytes_per_s": bandwidth,
        "plan": {"balance": balance, "schedule": plan.schedule, "num_microbatches": chunks,
                 "checkpoint": checkpoint, "predicted_step_s": predicted,
                 "predicted_single_worker_s": plan.single_worker_time},
        "measured_step_s": stats,
        "measured_over_predicted": measured / predicted if predicted else None,
        "single_worker_measured_over_predicted": (single / plan.single_worker_time
                                                  if plan.single_worker_time else None),
        "note": "both stages share one device; the plan assumes one device per stage",
    }
    return result

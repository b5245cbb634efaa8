"""Item ``pipeline_one_process``: ``Pipeline`` with several stages in one process.

A job of one rank (``pipetrain.launch.run_processes(..., 1)``: NCCL with CUDA, gloo on
the CPU) trains a GPT (untied embeddings) as ``PipelineConfig(num_stages=1,
stages_per_rank=V)``: every stage on the one rank, on its device, under the
interleaved 1F1B (V = 2 and 3) and ZB-V (V = 2) schedules, and as one stage (1F1B,
V = 1) for comparison; each in fp32, bf16 and fp16 (dynamic loss scaling). The same
process trains the same model with plain PyTorch on the same device and the same
batches: the same micro-batches under the same autocast, each micro-batch's loss
weighted by its share of the batch, fp16 through ``torch.amp.GradScaler`` with the same
scale settings, the same optimizer.

Reported per case: the losses of both, their largest absolute and relative
differences, the largest absolute difference of the final weights, and the largest
difference of the weights' updates relative to the update's norm, layer by layer;
pass / fail against tolerances. The two runs do the same operations on the same
shapes; only the order in which float32 gradients are summed differs (a few units in
the last place), which reduced precision can amplify through rounding: hence looser
tolerances for bf16 and fp16 than for fp32.
"""

from __future__ import annotations

import time
from typing import Any

from gpu.common import ItemContext, case_status, error_text

__all__ = ["CASES", "TOLERANCES", "job", "run"]

SIZES = {
    "cuda": {"num_layers": 6, "width": 512, "num_heads": 8, "context": 128, "batch": 16,
             "microbatches": 4, "steps": 4},
    "cpu": {"num_layers": 4, "width": 64, "num_heads": 4, "context": 32, "batch": 8,
            "microbatches": 4, "steps": 3},
    "quick": {"num_layers": 4, "width": 32, "num_heads": 2, "context": 16, "batch": 8,
              "microbatches": 4, "steps": 3},
}
CASES = (("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zb-v", 2))
PRECISIONS = ("fp32", "bf16", "fp16")
TOLERANCES = {"fp32": {"loss_rel": 1e-5, "update_rel": 1e-5},
              "bf16": {"loss_rel": 1e-4, "update_rel": 5e-4},
              "fp16": {"loss_rel": 1e-4, "update_rel": 1e-4}}
"""Losses: relative difference per step; updates: ``|w - w_ref| / |w_ref - w_0|`` per
parameter. fp32 as the test suite's correctness tests; bf16 / fp16 over ten times below
what autocast itself changes in the quick sizes (reported per case as
``precision_effect_rel_update``: a pipeline that ignored autocast would be that far off)."""
LR = 0.05
INIT_SCALE = 2.0**10
GROWTH_INTERVAL = 2


def _config(sizes: dict[str, Any]) -> Any:
    from pipetrain.models import GPTConfig

    return GPTConfig(num_layers=sizes["num_layers"], width=sizes["width"],
                     num_heads=sizes["num_heads"], context=sizes["context"],
                     tie_embeddings=False)


def _batches(sizes: dict[str, Any]) -> list[tuple[Any, Any]]:
    import torch

    generator = torch.Generator().manual_seed(7)
    out = []
    for _ in range(sizes["steps"]):
        tokens = torch.randint(0, 256, (sizes["batch"], sizes["context"] + 1), generator=generator)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _reference(sizes: dict[str, Any], precision: str, device: Any) -> dict[str, Any]:
    """Plain PyTorch: the model in one piece, the same micro-batches and autocast."""
    import torch

    from pipetrain.microbatch import split_batch
    from pipetrain.models import build_gpt, gpt_loss

    model = build_gpt(_config(sizes), seed=0).to(device)
    initial = {f"layers.{k}": p.detach().clone() for k, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    scaler = (torch.amp.GradScaler(device.type, init_scale=INIT_SCALE,
                                   growth_interval=GROWTH_INTERVAL)
              if precision == "fp16" else None)
    losses, scales = [], []
    for x, y in _batches(sizes):
        x, y = x.to(device), y.to(device)
        total = 0.0
        for xs, ys in zip(split_batch(x, sizes["microbatches"]),
                          split_batch(y, sizes["microbatches"])):
            with torch.autocast(device.type, dtype=dtype or torch.bfloat16,
                                enabled=dtype is not None):
                loss = gpt_loss(model(xs), ys) * (len(xs) / len(x))
            total += loss.item()
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return {"losses": losses, "scales": scales, "initial": initial,
            "final": {f"layers.{k}": p.detach().clone() for k, p in model.named_parameters()}}


def _pipeline(ctx: Any, sizes: dict[str, Any], schedule: str, stages_per_rank: int,
              precision: str) -> dict[str, Any]:
    import torch

    from pipetrain import Pipeline, PipelineConfig
    from pipetrain.models import gpt_layer_factories, gpt_loss
    from pipetrain.runtime.precision import LossScaling

    config = PipelineConfig(
        schedule=schedule, num_stages=1, stages_per_rank=stages_per_rank,
        num_microbatches=sizes["microbatches"],
        mixed_precision=None if precision == "fp32" else precision,
        loss_scaling=(LossScaling(init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
                      if precision == "fp16" else None))
    pipe = Pipeline(gpt_layer_factories(_config(sizes), seed=0), loss_fn=gpt_loss,
                    optimizer=lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9),
                    config=config, context=ctx)
    try:
        losses, scales = [], []
        for x, y in _batches(sizes):
            losses.append(float(pipe.train_step(x, y)))
            scaler = pipe.optimizers.scaler
            scales.append(scaler.scale if scaler is not None else None)
        named = pipe.named_parameters()
        return {"losses": losses, "scales": scales,
                "weights": {k: v.detach().clone() for k, v in named.items()},
                "num_model_stages": config.num_model_stages}
    finally:
        pipe.close()


def _update_difference(weights: dict[str, Any], expected: dict[str, Any]) -> float:
    """Largest ``|w - w_ref| / |w_ref - w_0|`` over the parameters."""
    return float(max(((weights[k].float() - r.float()).norm()
                      / max((r.float() - expected["initial"][k].float()).norm().item(), 1e-30)).item()
                     for k, r in expected["final"].items()))


def _compare(got: dict[str, Any], expected: dict[str, Any], precision: str) -> dict[str, Any]:
    if sorted(got["weights"]) != sorted(expected["final"]):
        raise AssertionError(f"the pipeline's parameters {sorted(got['weights'])} are not the "
                             f"reference's {sorted(expected['final'])}")
    loss_abs = [abs(a - b) for a, b in zip(got["losses"], expected["losses"])]
    loss_rel = [d / max(abs(b), 1e-12) for d, b in zip(loss_abs, expected["losses"])]
    weight_abs = max((got["weights"][k].float() - r.float()).abs().max().item()
                     for k, r in expected["final"].items())
    update_rel = _update_difference(got["weights"], expected)
    tolerance = TOLERANCES[precision]
    passed = max(loss_rel) <= tolerance["loss_rel"] and update_rel <= tolerance["update_rel"]
    result: dict[str, Any] = {
        "losses": got["losses"], "reference_losses": expected["losses"],
        "max_abs_loss_difference": max(loss_abs), "max_rel_loss_difference": max(loss_rel),
        "max_abs_weight_difference": weight_abs, "max_rel_update_difference": update_rel,
        "tolerance": tolerance, "passed": passed,
    }
    if precision == "fp16":
        result.update(scales=got["scales"], reference_scales=expected["scales"],
                      scales_equal=got["scales"] == expected["scales"])
        result["passed"] = passed and result["scales_equal"]
    return result


def job(ctx: Any, sizes: dict[str, Any], deadline_s: float) -> dict[str, Any]:
    """On the one rank: every case and the references, within ``deadline_s`` seconds."""
    import torch

    began = time.monotonic()
    device = ctx.device
    out: dict[str, Any] = {"backend": ctx.backend, "rank_device": str(device), "cases": []}
    references: dict[str, Any] = {}
    for precision in PRECISIONS:
        for schedule, stages_per_rank in CASES:
            name = f"{schedule}-V{stages_per_rank}-{precision}"
            record: dict[str, Any] = {"case": name, "schedule": schedule,
                                      "stages_per_rank": stages_per_rank, "precision": precision}
            if time.monotonic() - began > deadline_s:
                record.update(status="skipped", reason="time budget spent before this case")
                out["cases"].append(record)
                continue
            t0 = time.monotonic()
            try:
                if precision not in references:
                    references[precision] = _reference(sizes, precision, device)
                got = _pipeline(ctx, sizes, schedule, stages_per_rank, precision)
                record["num_model_stages"] = got["num_model_stages"]
                record.update(_compare(got, references[precision], precision))
                if precision != "fp32" and "fp32" in references:
                    # how far autocast moves plain PyTorch's weights: a pipeline that
                    # ignored autocast would be this far from the reference
                    record["precision_effect_rel_update"] = _update_difference(
                        references["fp32"]["final"], references[precision])
                record["status"] = "ok" if record["passed"] else "failed"
                if not record["passed"]:
                    record["reason"] = (f"differs from plain PyTorch beyond the {precision} "
                                        f"tolerance {record['tolerance']}")
            except Exception as error:
                import traceback

                record.update(status="failed", reason=error_text(error),
                              traceback=traceback.format_exc()[-3000:])
            record["seconds"] = round(time.monotonic() - t0, 3)
            out["cases"].append(record)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


def run(ctx: ItemContext) -> dict[str, Any]:
    from pipetrain.launch import run_processes

    sizes = ctx.pick(SIZES)
    [result] = run_processes(job, 1, sizes, max(5.0, ctx.left() - 25),
                             timeout=max(10.0, ctx.left() - 5))
    cases = result.pop("cases")
    status, reason = case_status(cases)
    supported = [c["case"] for c in cases if c.get("stages_per_rank", 1) > 1
                 and c.get("status") == "ok"]
    return {"status": status, "reason": reason, "sizes": sizes, **result,
            "several_stages_in_one_process": bool(supported),
            "summary": {c["case"]: {"status": c["status"],
                                    "max_rel_loss_difference": c.get("max_rel_loss_difference"),
                                    "max_rel_update_difference": c.get("max_rel_update_difference")}
                        for c in cases},
            "cases": cases}

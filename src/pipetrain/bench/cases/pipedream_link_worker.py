"""One rank of the shaped-link run of ``pipedream_claims``: ``python -m pipetrain.bench.cases.pipedream_link_worker``.

It joins the job (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` in the
environment; its settings as JSON in ``PIPEDREAM_LINK_OPTIONS``), measures the link (a
gloo all-reduce), profiles the MLP on rank 0, then times, interleaved, a two-stage
``Pipeline`` (``1f1b``, and ``pipedream`` where it runs) and torch's
``DistributedDataParallel`` on the same global batch and optimizer. Rank 0 prints one
line ``RESULT {json}`` (the step times of every runner per repetition, the profile, the
bandwidth), rank 1 ``RESULT {"ok": true}``; a rank that fails prints ``RESULT {"ok": false, ...}``.

Example (what :mod:`.pipedream_link` starts in each namespace)::

    PIPEDREAM_LINK_OPTIONS='{"width": 1024, ...}' RANK=0 WORLD_SIZE=2 ... \\
        python -m pipetrain.bench.cases.pipedream_link_worker
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

__all__ = ["OPTIONS_ENV", "main"]

OPTIONS_ENV = "PIPEDREAM_LINK_OPTIONS"
_PROBE_BYTES = 2 * 2**20


def _report(**fields: Any) -> None:
    sys.stdout.write("RESULT " + json.dumps(fields) + "\n")
    sys.stdout.flush()


class _Pipe:
    """A ``Pipeline`` as a runner of the harness's interleaved loop."""

    def __init__(self, label: str, pipe: Any) -> None:
        self.label, self.pipe = label, pipe

    def step(self, x: Any, y: Any) -> None:
        self.pipe.train_step(x, y)


class _DDP:
    """torch's DistributedDataParallel: each rank its half of the global batch."""

    label = "ddp"

    def __init__(self, opts: dict[str, Any], rank: int, world_size: int) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel

        from pipetrain.models import build_mlp

        self.model = DistributedDataParallel(build_mlp(width=opts["width"], depth=opts["depth"], seed=0))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=opts["lr"])
        self.rank, self.world_size = rank, world_size

    def step(self, x: Any, y: Any) -> None:
        import torch
        from torch.nn import functional as F

        rows = x.shape[0] // self.world_size
        part = slice(self.rank * rows, (self.rank + 1) * rows)
        self.optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(F.mse_loss(self.model(x[part]), y[part]))
        self.optimizer.step()


def _profile(opts: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.nn import functional as F

    from pipetrain.models import mlp_layer_factories
    from pipetrain.plan import profile_model

    generator = torch.Generator().manual_seed(7)
    x = torch.randn(opts["batch"], opts["width"], generator=generator)
    profile = profile_model(mlp_layer_factories(width=opts["width"], depth=opts["depth"], seed=0),
                            x, loss_fn=F.mse_loss, target=x.clone(), optimizer="sgd",
                            microbatch_size=opts["batch"] // opts["microbatches"], device="cpu",
                            repetitions=opts["profile_repetitions"])
    return dict(profile.to_dict())


def run(opts: dict[str, Any]) -> dict[str, Any] | None:
    """The timed comparison on this rank; rank 0's result (None on the others)."""
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F

    from pipetrain.api.config import PipelineConfig
    from pipetrain.api.pipeline import Pipeline
    from pipetrain.bench.harness import gather_objects, interleave, ring_bandwidth, step_times
    from pipetrain.models import mlp_layer_factories
    from pipetrain.runtime.process_group import init_distributed

    context = init_distributed(timeout=opts["timeout"])
    rank, world_size = context.rank, context.world_size
    bandwidth = ring_bandwidth(_PROBE_BYTES, timed=3)
    box: list[Any] = [_profile(opts) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)

    def sgd(params: Any) -> Any:
        return torch.optim.SGD(params, lr=opts["lr"])

    runners: list[Any] = []
    for schedule in opts["schedules"]:
        asynchronous = schedule in ("pipedream", "2bw")  # no flush: no per-step norm check
        config = PipelineConfig(schedule=schedule, num_stages=world_size,
                                num_microbatches=opts["microbatches"], timeout=opts["timeout"],
                                nonfinite="ignore" if asynchronous else "error")
        factories = mlp_layer_factories(width=opts["width"], depth=opts["depth"], seed=0)
        pipe = Pipeline(factories, loss_fn=F.mse_loss, optimizer=sgd, config=config, context=context)
        runners.append(_Pipe(f"pipeline-{schedule}", pipe))
    runners.append(_DDP(opts, rank, world_size))
    generator = torch.Generator().manual_seed(11)
    pool = [torch.randn(opts["batch"], opts["width"], generator=generator) for _ in range(4)]
    samples, _ = interleave(runners, lambda k: (pool[k % 4], pool[(k + 1) % 4]),
                            reps=opts["repetitions"], warmup=opts["warmup"], rotate=True)
    for runner in runners:
        if isinstance(runner, _Pipe):
            runner.pipe.close()
    gathered = gather_objects(samples)
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    return {"ok": True, "bandwidth": bandwidth, "profile": box[0],
            "steps": {r.label: step_times(gathered, r.label) for r in runners}}


def main() -> int:
    opts = json.loads(os.environ[OPTIONS_ENV])
    try:
        result = run(opts)
    except Exception as error:  # reported to the parent, which names the rank
        _report(ok=False, rank=os.environ.get("RANK"), error=f"{type(error).__name__}: {error}",
                traceback=traceback.format_exc()[-3000:])
        return 3
    _report(**(result if result is not None else {"ok": True}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

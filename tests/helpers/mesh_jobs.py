"""Worker functions of the mesh tests: a GPT trained with FSDP2 over the replicas."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from helpers.pipeline_jobs import GPT, GPT_CLIP, gpt_batches, sgd
from pipetrain.api.config import PipelineConfig
from pipetrain.models import gpt_layer_factories, gpt_loss, gpt_ties

Params = dict[str, torch.Tensor]


def full_parameters(pipe: Any) -> Params:
    """This rank's parameters as whole tensors (a DTensor gathered over its replicas: a
    collective of the replicas, called in the same order by each)."""
    out = {}
    for name, p in pipe.named_parameters().items():
        value = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = value.detach().clone()
    return out


def make_pipeline(ctx: Any, config: dict[str, Any], mesh: Any = None) -> Any:
    from pipetrain.api.pipeline import Pipeline
    from pipetrain.models.gpt_tp import gpt_plan

    config = dict(config)
    sequence = config.pop("sequence_parallel", False)  # a test's choice of plan
    plan = gpt_plan(sequence) if config.get("tensor_parallel", 1) > 1 else None
    return Pipeline(gpt_layer_factories(GPT, seed=3), loss_fn=gpt_loss, optimizer=sgd,
                    ties=gpt_ties(GPT), config=PipelineConfig(clip_grad_norm=GPT_CLIP, **config),
                    context=ctx, mesh=mesh, tensor_parallel_plan=plan)


def fsdp_job(ctx: Any, configs: list[dict[str, Any]], steps: int,
             path: str | None = None) -> list[tuple[Params, list[float]]]:
    """Train each configuration ``steps`` steps; its whole parameters and losses. The
    last configuration saves to ``path`` (if given)."""
    results = []
    for c, config in enumerate(configs):
        pipe = make_pipeline(ctx, config)
        seen = _norm_lengths(pipe)
        losses = [pipe.train_step(x, y) for x, y in gpt_batches(steps)]
        results.append((full_parameters(pipe), losses, sorted(set(seen))))
        if path is not None and c == len(configs) - 1:
            pipe.save(path, extra={"data_step": steps})
        pipe.close()
    return results


def _norm_lengths(pipe: Any) -> list[int]:
    """The sequence lengths the blocks' first LayerNorm sees on this rank (this rank's
    positions under sequence parallelism), filled in as the pipeline runs."""
    seen: list[int] = []

    def record(module: Any, args: Any, output: Any) -> None:
        local = output.to_local() if isinstance(output, DTensor) else output
        seen.append(int(local.shape[1]))

    for layer in pipe.layers.values():
        for name, module in layer.named_modules():
            if name.endswith("ln_1"):
                module.register_forward_hook(record)
    return seen


class CollectiveCounts:
    """Counts FSDP's collectives (``torch.distributed.all_gather_single`` and
    ``reduce_scatter_single``) while a block runs, by wrapping them."""

    def __init__(self) -> None:
        self.gathers = 0
        self.reductions = 0

    def __enter__(self) -> CollectiveCounts:
        import torch.distributed as dist

        self._saved = (dist.all_gather_single, dist.reduce_scatter_single)
        gather, reduce = self._saved

        def counted_gather(*args: Any, **kwargs: Any) -> Any:
            self.gathers += 1
            return gather(*args, **kwargs)

        def counted_reduce(*args: Any, **kwargs: Any) -> Any:
            self.reductions += 1
            return reduce(*args, **kwargs)

        dist.all_gather_single, dist.reduce_scatter_single = counted_gather, counted_reduce
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        dist.all_gather_single, dist.reduce_scatter_single = self._saved


def _unsharded_gradients(pipe: Any) -> int:
    """Elements of whole (unsharded) gradients FSDP holds on this rank now (FSDP2's
    internals: each unit's parameters, gathered or not, and what they accumulated)."""
    held = 0
    for unit in pipe.sharded.units:
        state = unit._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
        for param in (p for group in groups if group is not None for p in group.fsdp_params):
            unsharded = getattr(param, "_unsharded_param", None)
            if unsharded is not None and unsharded.grad is not None:
                held += unsharded.grad.numel()
            accumulated = getattr(param, "unsharded_accumulated_grad", None)
            held += accumulated.numel() if accumulated is not None else 0
    return held


def _state_bytes(pipe: Any) -> int:
    """Bytes of parameters, gradients and optimizer state this rank holds now: the shards
    (their storage, FSDP's padding included), and whatever FSDP holds gathered (whole
    parameters, whole gradients); each storage counted once."""
    counted: set[int] = set()

    def size(tensor: Any) -> int:
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            return 0
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in counted:
            return 0
        counted.add(storage.data_ptr())
        return int(storage.nbytes())

    held = 0
    for optimizer in pipe.optimizers.optimizers.values():
        held += sum(size(value) for state in optimizer.state.values() for value in state.values())
    # FSDP's own record of each parameter: the module holds the whole one while gathered
    for unit in pipe.sharded.units:
        state = unit._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
        for param in (p for group in groups if group is not None for p in group.fsdp_params):
            shard, whole = param.sharded_param, getattr(param, "_unsharded_param", None)
            held += size(shard) + size(shard.grad)
            held += size(whole) + (size(whole.grad) if whole is not None else 0)
            held += size(getattr(param, "unsharded_accumulated_grad", None))
    return held


def _watch_gradients(pipe: Any) -> tuple[list[int], list[int]]:
    """Before every backward of the pipeline's stages, how many whole-gradient elements
    FSDP holds, and the bytes of parameters, gradients and optimizer state the rank holds
    (appended to the lists returned)."""
    seen: list[int] = []
    held: list[int] = []
    for stage in pipe.stages.values():
        before = stage.before_backward

        def watched(j: int, key: int, before: Any = before) -> None:
            seen.append(_unsharded_gradients(pipe))
            held.append(_state_bytes(pipe))
            before(j, key)

        stage.before_backward = watched
    return seen, held


def fsdp_checks_job(ctx: Any, configs: list[dict[str, Any]], steps: int,
                    path: str) -> list[dict[str, Any]]:
    """Train each configuration ``steps`` steps and report, per configuration: whole
    parameters, losses, FSDP collectives per step, whether every parameter is a DTensor
    sharded over the replicas, the mesh; then, for the first one, an evaluation of one
    sequence (one replica has no micro-batch), a smaller batch that the replicas split
    unevenly, and a save to ``path``. The second configuration runs on a mesh built here
    (the others build their own); a mesh of another shape is refused (``mesh_error``)."""
    from torch.distributed.device_mesh import init_device_mesh

    results = []
    for c, config in enumerate(configs):
        mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "tp")) if c == 1 else None
        pipe = make_pipeline(ctx, config, mesh)
        losses, counts = [], []
        held, state_bytes = _watch_gradients(pipe)
        for x, y in gpt_batches(steps):
            with CollectiveCounts() as count:
                losses.append(pipe.train_step(x, y))
            counts.append((count.gathers, count.reductions))
        fsdp_ops = ("UNSHARD", "REDUCE", "RESHARD")
        step_collectives = [str(t.action) for t in pipe.last_timeline
                            if t.action.op.value in fsdp_ops]
        mesh = pipe.mesh
        result: dict[str, Any] = {
            "params": full_parameters(pipe), "losses": losses, "counts": counts,
            "collectives": step_collectives, "held_whole_gradients": max(held),
            "state_bytes": max(state_bytes),
            "shard_bytes": sum(p.to_local().numel() * p.element_size() for p in pipe.parameters()),
            "stage_bytes": sum(p.numel() * p.element_size() for p in pipe.parameters()),
            "units": len(pipe.sharded.units) if pipe.sharded is not None else 0,
            "sharded": all(isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("dp",)
                           for p in pipe.parameters()),
            "mesh": (mesh.mesh_dim_names, tuple(mesh.mesh.shape),
                     tuple(mesh["dp"].mesh.tolist())),
            "dp_ranks": pipe.layout.groups[pipe.pipeline_rank],
        }
        if c == 0:
            x, y = gpt_batches(1, batch=1, first=steps)[0]
            result["eval"] = pipe.eval_step(x, y)
            x, y = gpt_batches(1, batch=3, first=steps)[0]  # 3 micro-batches over 2 replicas
            result["uneven"] = pipe.train_step(x, y)
            result["after_uneven"] = full_parameters(pipe)
            result["full_state_dict"] = pipe.full_state_dict()
            pipe.save(path, extra={"data_step": steps + 1})
        if c == 1:
            result["same_mesh"] = pipe.mesh is mesh
        results.append(result)
        pipe.close()
    try:
        make_pipeline(ctx, configs[0], init_device_mesh("cpu", (4, 1, 1),
                                                        mesh_dim_names=("pp", "dp", "tp")))
    except ValueError as error:
        results[0]["mesh_error"] = str(error)
    return results


def resume_job(ctx: Any, config: dict[str, Any], path: str, steps: int) -> tuple[list[float], int]:
    """Load ``path`` into a pipeline of ``config``, train ``steps`` more steps (the batches
    after the saved ones); the losses and the restored step."""
    pipe = make_pipeline(ctx, config)
    extra = pipe.load(path)
    assert extra is not None
    first = extra["data_step"]
    step = pipe.step
    losses = [pipe.train_step(x, y) for x, y in gpt_batches(steps, first=first)]
    pipe.close()
    return losses, step


def link_groups_job(ctx: Any) -> list[tuple[int, int]]:
    """The links (src, dst) this rank gets groups for at (P, D, T) = (2, 1, 2)."""
    import torch.distributed as dist

    from pipetrain.api.layout import Layout
    from pipetrain.api.pipeline_setup import layout_link_groups

    rank = dist.get_rank()
    config = PipelineConfig(num_stages=2, tensor_parallel=2)
    layout = Layout.create(config, num_layers=2, tp_index=rank % 2)
    return sorted(layout_link_groups(layout, rank=rank))


def saved_bytes_job(ctx: Any, batch: int, length: int) -> dict[str, int]:
    """Bytes a GPT block saves for its backward on this rank (each storage once, its
    parameters left out), split by the tensor-parallel plan with and without sequence
    parallelism over the 2 ranks of the job."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipetrain.models.gpt import Block, GPTConfig
    from pipetrain.models.gpt_tp import gpt_sequence_parallel_plan, gpt_tensor_parallel_plan

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    config = GPTConfig(num_layers=1, width=64, num_heads=4, context=length)
    out = {}
    for name, plan in (("tp", gpt_tensor_parallel_plan), ("sp", gpt_sequence_parallel_plan)):
        torch.manual_seed(0)
        block = Block(config)
        plan(1, block, mesh)
        params = {(p.to_local() if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
                  for p in block.parameters()}
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor, params: set[int] = params,
                 storages: dict[int, int] = storages) -> torch.Tensor:
            local = t.to_local() if isinstance(t, DTensor) else t
            storage = local.untyped_storage()
            if storage.data_ptr() not in params:
                storages[storage.data_ptr()] = storage.nbytes()
            return t

        x = torch.randn(batch, length, config.width, generator=torch.Generator().manual_seed(1),
                        requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = block(x)
        torch.autograd.backward(y, torch.ones_like(y))
        out[name] = sum(storages.values())
    return out

"""``Pipeline``: pipeline-parallel training across processes with torch.distributed.

Every process of the job creates the same ``Pipeline``; each builds only the layers of
its own stages, runs its rank's action list of the schedule, and exchanges activations
and gradients with its neighbours through torch.distributed point to point. With
``replicas = D`` every stage has D data-parallel copies whose gradients are summed.
The math does not depend on the layout: for any number of stages, replicas, schedule and
checkpoint mode the losses and weights equal single-process training on the same batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pipetrain.api.async_training import AsyncTraining, attach_async, refuse_ties
from pipetrain.api.checkpointing import KEEP, Loaded, load_pipeline, save_pipeline
from pipetrain.api.config import PipelineConfig
from pipetrain.api.fsdp import ShardedStages, whole_tensors
from pipetrain.api.grad_check import NonFiniteError, loss_sum
from pipetrain.api.layout import LayerSource, Layout, Tie
from pipetrain.api.optimizer_step import OptimizerFactory, SchedulerFactory, StageOptimizers
from pipetrain.api.pipeline_outputs import gather_outputs, mean_loss
from pipetrain.api.pipeline_setup import (
    build_layers,
    build_transport,
    check_world,
    refuse_batch_disagreement,
    refuse_setup_disagreement,
    start_monitor,
)
from pipetrain.api.pipeline_stages import (
    build_stages,
    convert_batch_norms,
    model_skip_layout,
    stage_parameters,
)
from pipetrain.api.placement import place_layers
from pipetrain.api.step_batches import StepBatches, StepSplitter
from pipetrain.api.step_schedules import StepSchedules
from pipetrain.api.tensor_parallel import TensorParallelPlan
from pipetrain.frontend import CapturedModel
from pipetrain.frontend.names import gather_state_dict
from pipetrain.frontend.pipelines import pipeline_units, wants_capture
from pipetrain.runtime.batchnorm_sync import DeferredNorms
from pipetrain.runtime.errors import PeerFailure
from pipetrain.runtime.executor import RankExecutor, StepIO
from pipetrain.runtime.precision import LossScaler, autocast_dtype
from pipetrain.runtime.process_group import DistContext
from pipetrain.runtime.rng import RandomStreams, mix_seed
from pipetrain.runtime.stage import LossFn
from pipetrain.schedule import ASYNC_SCHEDULES, Action, Schedule, TimedAction

__all__ = ["Pipeline"]

logger = logging.getLogger(__name__)


class Pipeline:
    """A model trained as a pipeline of stages over the processes of a torch.distributed job.

    Args:
        layers: layer factories (each builds one layer; only this rank's are called), an
            ``nn.Sequential``, or any ``nn.Module`` (a Hugging Face model unmodified)
            with ``example_inputs``: captured into a graph and cut where
            ``split_points`` begin (module names, e.g. ``["transformer.h.6"]``), else by
            ``config.balance`` (a plan's, in units), else by the planner (rank 0
            profiles the units); a model on the meta device is materialized stage by
            stage, from ``weights`` (a safetensors file or Hugging Face folder) when
            given. See ``docs/frontend.md``.
        loss_fn: ``loss_fn(output, target)``, the MEAN loss of a micro-batch; the last
            stage applies it and weights each micro-batch by its share of the batch.
        optimizer: builds each stage's optimizer from its parameters.
        config: layout and schedule (:class:`PipelineConfig`).
        context: from :func:`pipetrain.init_distributed` (default: the initialized
            default process group).
        lr_scheduler: builds each stage's LR scheduler from its optimizer (stepped once
            per training step).
        ties: tied weights, e.g. ``[((0, "token.weight"), (5, "proj.weight"))]``: every
            copy starts equal and gets the sum of all their gradients.
        mesh: the job's ``DeviceMesh`` of shape ``(num_stages, replicas, tensor_parallel)``
            named ``("pp", "dp", "tp")`` (default: the Pipeline builds it, see
            :mod:`pipetrain.api.mesh`); ``None`` with different replica counts per stage.
        tensor_parallel_plan: with ``config.tensor_parallel > 1``, how each layer is split
            over the ``tp`` ranks (see :mod:`pipetrain.api.tensor_parallel`).

    Example (in each of 2 processes started by ``torchrun --nproc-per-node 2``)::

        ctx = pipetrain.init_distributed()
        pipe = Pipeline(mlp_layer_factories(width=64, depth=8, seed=0),
                        loss_fn=torch.nn.functional.mse_loss,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        config=PipelineConfig(schedule="1f1b", num_stages=2,
                                              num_microbatches=8),
                        context=ctx)
        loss = pipe.train_step(inputs, targets)   # the same mean loss on every rank
    """

    def __init__(
        self,
        layers: LayerSource | nn.Module,
        *,
        loss_fn: LossFn,
        optimizer: OptimizerFactory,
        config: PipelineConfig | None = None,
        context: DistContext | None = None,
        lr_scheduler: SchedulerFactory | None = None,
        ties: Sequence[Tie] = (),
        example_inputs: Any = None,
        example_kwargs: dict[str, Any] | None = None,
        split_points: Sequence[str] | None = None,
        weights: str | os.PathLike[str] | None = None,
        mesh: DeviceMesh | None = None,
        tensor_parallel_plan: TensorParallelPlan | None = None,
    ) -> None:
        config = PipelineConfig() if config is None else config
        capturing = wants_capture(layers, example_inputs, example_kwargs)  # any nn.Module
        # first: before anything one rank could refuse alone
        refuse_setup_disagreement(config, layers, capturing=capturing,
                                  split_points=split_points, ties=ties)
        check_world(config)
        self.context = context
        self.device = context.device if context is not None else torch.device("cpu")
        self.captured: CapturedModel | None = None
        """The captured model (``Pipeline(model, example_inputs=...)``), else ``None``."""
        if capturing:
            self.captured, balance = pipeline_units(
                layers, example_inputs=example_inputs, example_kwargs=example_kwargs,
                split_points=split_points, weights=weights, num_stages=config.num_model_stages,
                balance=config.balance, device=self.device)
            config, layers = dataclasses.replace(config, balance=balance), self.captured
            ties = [*ties, *self.captured.ties]
        else:
            layers = cast(LayerSource, layers)
        self.config = config
        self.rank = dist.get_rank()
        self.loss_fn = loss_fn
        self.schedule_name = config.schedule_name
        refuse_ties(self.schedule_name, ties)
        self.tp_index = self.rank % config.tensor_parallel
        """This rank's tensor-parallel index (its layout's ranks are those of that index)."""
        self._layout_rank = self.rank // config.tensor_parallel  # its rank in the schedules
        self.layout = Layout.create(config, num_layers=len(layers), tp_index=self.tp_index)
        self.pipeline_rank, self.replica = self.layout.position(self.rank)
        self.num_replicas = self.layout.replica_counts[self.pipeline_rank]
        """Replicas of this rank's stages (this rank included)."""
        self.local_stages = self.layout.stages_of(self.pipeline_rank)
        self._schedules = StepSchedules(config, self.layout)
        self._schedules.check(self.schedule_name, config.total_microbatches)

        # this rank's layers, named by global index; tied copies that meet here are shared
        self.layers = build_layers(layers, layout=self.layout, local_stages=self.local_stages,
                                   device=self.device)
        convert_batch_norms(self.layers, config)
        if self.captured is not None:  # the model's own names (checkpoints reshard)
            self.model = self.captured.container(self.layers)
        else:
            self.model = nn.Module()
            self.model.layers = nn.ModuleDict({str(i): layer for i, layer in self.layers.items()})
        placed = place_layers(self.model, self.layers, ties, config=config, layout=self.layout,
                              pipeline_rank=self.pipeline_rank, replica=self.replica,
                              device=self.device, mesh=mesh, plan=tensor_parallel_plan,
                              captured=capturing)
        self.mesh, self._replica_group, ties_here = placed.mesh, placed.replica_group, placed.tied
        self.sharded: ShardedStages | None = placed.sharded
        """This rank's FSDP2 units (``data_parallel='fsdp'``, :mod:`pipetrain.api.fsdp`)."""
        fsdp = self.sharded is not None
        if self.captured is not None and fsdp:
            self.model = self.captured.container(self.layers)  # it held the replaced parameters

        self._scalar_device = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        # every layer draws from streams keyed by (seed, step, layer, micro-batch of the batch)
        self._streams = RandomStreams()
        self.stages = build_stages(
            self.layers, layout=self.layout, local_stages=self.local_stages,
            skips=model_skip_layout(layers, self.layers, layout=self.layout,
                                    device=self._scalar_device),
            streams=self._streams, device=self.device, loss_fn=loss_fn,
            # FSDP gathers its gradients through autograd: nothing to fuse (see .fsdp)
            fuse_weight_gradients=(config.fuse_weight_gradients and self.sharded is None
                                   and config.tensor_parallel == 1),
            autocast=autocast_dtype(config.mixed_precision), compile=config.compile,
            modes=config.checkpoint_modes, offload=config.offload_bytes,
        )
        if self.sharded is not None:
            self.sharded.attach(self.stages.values())
        self._norms = DeferredNorms(self.layers.values(), group=self._replica_group,
                                    replicas=self.num_replicas)
        self.optimizers = StageOptimizers(
            stage_parameters(self.layers, layout=self.layout, local_stages=self.local_stages),
            optimizer=optimizer,
            scheduler=lr_scheduler,
            dp_group=self._replica_group,
            dp_size=self.num_replicas,
            ties=ties_here,
            clip_grad_norm=config.clip_grad_norm,
            nonfinite=config.nonfinite,
            release=lambda stage: self.stages[stage].release_gradients(),
            scaler=LossScaler(config.loss_scaling) if config.mixed_precision == "fp16" else None,
            sharded=self.sharded is not None,
            tensor_parallel=config.tensor_parallel,
        )
        self.optimizers.scalar_device = self._scalar_device
        self._monitor = start_monitor(context, rank=self.rank, dead_after=config.heartbeat_timeout,
                                      exit_after=config.exit_when_stuck)
        placement = self.layout.placement()
        self.transport = build_transport(
            self.layout, rank=self.rank, device=self.device, timeout=config.timeout,
            monitor=self._monitor, own_group=self.schedule_name in ASYNC_SCHEDULES)
        if self._monitor is not None:
            self._monitor.on_failure = self.transport.mailbox.fail
        self.executor = RankExecutor(
            rank=self.rank,
            placement=placement,
            stages=self.stages,
            transport=self.transport,
            hooks=self.optimizers,
            shards=self.sharded,
        )
        self.async_state: AsyncTraining | None = None
        """The stream, weight versions and updates of an asynchronous schedule (see
        :mod:`pipetrain.api.async_training`); ``None`` for the synchronous ones."""
        if self.schedule_name in ASYNC_SCHEDULES:
            self.async_state = attach_async(self.schedule_name, config=config, layout=self.layout,
                                            rank=self.rank, executor=self.executor,
                                            optimizers=self.optimizers)
        self.step = 0
        """Training steps taken (restored by :meth:`load`)."""
        self.loaded: Loaded | None = None
        """What the last :meth:`load` read (its folder, step, the damaged ones passed over)."""
        self.last_timeline: list[TimedAction] = []
        """This rank's measured actions of the last step (seconds since its start)."""
        self.last_step_start: float = 0.0
        """Wall-clock time (``time.time()``) at which the last step started on this rank."""
        self.last_step_skipped = False
        """Whether the last training step's update was skipped (``nonfinite='skip'``)."""
        self._splitter = StepSplitter(num_microbatches=config.total_microbatches,
                                      min_microbatches=max(self.layout.replica_counts),
                                      first_replicas=self.layout.replica_counts[0],
                                      per_token=config.loss_per == "token")
        self._last_stage = len(self.layout.stage_to_rank) - 1
        self._holds_last = self._last_stage in self.local_stages
        self._batch_agreed = False

    # -- construction -------------------------------------------------------------------
    def schedule(self, num_microbatches: int | None = None, *, training: bool = True) -> Schedule:
        """The validated schedule of a step of ``num_microbatches`` micro-batches (all
        replicas together; default: a full step's), every rank's action list. For an
        asynchronous schedule: a step in the steady state, as ``train_step`` runs it
        (:func:`~pipetrain.schedule.steady_state.step_window`)."""
        total = self.config.total_microbatches if num_microbatches is None else num_microbatches
        if self.async_state is not None and training:
            return self.async_state.step_schedule(total)
        return self._schedules.get(self.schedule_name if training else "forward", total)

    def guard(self) -> AbstractContextManager[None]:
        """A block in which a broken connection (a collective of the caller's, too) raises
        :class:`~pipetrain.runtime.errors.PeerFailure` naming the rank that died."""
        return self._monitor.guard() if self._monitor is not None else contextlib.nullcontext()

    @property
    def store_calls_per_second(self) -> float | None:
        """This rank's failure detector's calls to the c10d store per second so far (None:
        no detector runs, e.g. one process)."""
        return self._monitor.calls_per_second() if self._monitor is not None else None

    def at_forced_exit(self, callback: Callable[[PeerFailure], None]) -> None:
        """Call ``callback(failure)`` just before ``config.exit_when_stuck`` ends this
        process (from the monitor's thread, 10 s at most), e.g. to write what the run has.

        Example::

            pipe.at_forced_exit(lambda failure: records.write(stopped=str(failure)))
        """
        if self._monitor is not None:
            self._monitor.last_words.append(callback)

    # -- running ------------------------------------------------------------------------
    def _run(self, actions: Sequence[Action], io: StepIO) -> None:
        self.last_timeline = []
        self.last_step_start = time.time()
        # asynchronous: micro-batches are numbered across steps (the key of their streams)
        self._streams.seed = mix_seed(self.config.seed, self.step if self.async_state is None else -1)
        origin = time.perf_counter()
        try:
            with self.guard():
                self.executor.run(actions, io, record=self.last_timeline, origin=origin)
        except BaseException as error:
            if self._monitor is not None:
                self._monitor.report_error(error)
            self.executor.reset()
            if self.async_state is not None:
                self.async_state.fail(error)
            raise

    def _set_mode(self, *, training: bool) -> None:
        for module in self.layers.values():
            module.train(training)

    def _mean_loss(self, io: StepIO) -> float:
        with self.guard():
            return mean_loss(self._own_losses(io), device=self._scalar_device)

    def _own_losses(self, io: StepIO) -> Any:
        """The losses this rank counts: every ``tp`` rank computes them, index 0 counts them."""
        return io.losses.values() if self.tp_index == 0 else ()

    def train_step(self, inputs: Any, targets: Any) -> float:
        """One training step on a batch; returns its mean loss (the same on every rank).

        Every rank passes the same global batch (tensors of equal dim 0; nested values
        allowed); it is split into the step's micro-batches (``num_microbatches`` per
        replica of the first stage), dealt round-robin over each stage's replicas. The
        first batch must fill them all; a later, smaller batch (the last of an epoch)
        runs as fewer micro-batches, with the same math. The first step compares the
        ranks' batches (their size, the shapes and dtypes of inputs and targets) and
        refuses different ones on every rank; later steps are not compared (that would
        cost a collective per step).

        With ``mixed_precision="fp16"`` a step whose gradients overflow (its losses
        finite) is skipped on every stage and lowers the loss scale, without an error
        (:attr:`last_step_skipped` tells); :attr:`step` advances.

        With an asynchronous schedule (``pipedream``, ``2bw``) there is no flush: the step
        admits its micro-batches and runs the backwards and updates that interleave with
        them, leaving the last ones in flight until the next step (or :meth:`drain`); it
        returns its own batch's mean loss (see :mod:`pipetrain.api.async_training`).

        Raises:
            NonFiniteError: the loss or the global gradient norm is not finite (with
                ``nonfinite='error'``); no stage applied the update and :attr:`step`
                did not advance.
            DisagreementError: (the first step only) the ranks passed different
                batches (:class:`~pipetrain.api.agreement.DisagreementError`).
        """
        if not self._batch_agreed:
            with self.guard():
                refuse_batch_disagreement(inputs, targets)
            self._batch_agreed = True
        batches = self._splitter.train(inputs, targets)
        if self.async_state is not None:
            return self._train_async(self.async_state, batches)
        n = len(batches.inputs)
        scaler = self.optimizers.scaler
        loss_scale = 1.0 if scaler is None else scaler.scale  # fp16: backward of S x loss
        io = StepIO(
            inputs=batches.inputs if 0 in self.local_stages else None,
            targets=batches.targets if self._holds_last else None,
            loss_scales=[s * loss_scale for s in batches.scales],
            checkpointed=self._schedules.checkpointed(self.config.checkpoint_modes, self.schedule_name,
                                                      n, rank=self._layout_rank),
        )
        self.optimizers.begin_step()
        self.optimizers.losses_finite = lambda: all(
            bool(torch.isfinite(loss)) for loss in io.losses.values()
        )
        self.optimizers.loss_sum = lambda: loss_sum(self._own_losses(io), self._scalar_device)
        self._set_mode(training=True)
        actions = self._schedules.actions(self.schedule_name, n, rank=self._layout_rank)
        with (self.sharded.training(actions, each_microbatch=self._schedules.reduces_each_microbatch(n))
              if self.sharded is not None else contextlib.nullcontext()):
            self._run(actions, io)
        with self.guard():  # (also after a non-finite step, as nn.BatchNorm would)
            self._norms.commit()
        check = self.optimizers.last_check  # its all-reduce summed the losses too
        loss = (check.loss_sum if check is not None else self._mean_loss(io)) / loss_scale
        self.last_step_skipped = self.optimizers.skipped
        if self.last_step_skipped and self.config.nonfinite == "error" and not self.optimizers.overflowed:
            raise NonFiniteError.at_step(self.step + 1, loss=loss,
                                         grad_norm=self.optimizers.last_grad_norm)
        self.step += 1
        return loss

    def _train_async(self, state: AsyncTraining, batches: StepBatches) -> float:
        if state.needs_drain(len(batches.inputs)):
            self.drain()
        actions, io = state.window(batches)
        self._set_mode(training=True)
        self._run(actions, io)
        state.weigh(io)
        loss = self._mean_loss(io)
        self.step += 1
        return loss

    def drain(self) -> None:
        """Asynchronous schedules: run the backwards and updates of the micro-batches still
        in flight, a flush (every rank calls it; :meth:`save` does). Nothing otherwise."""
        if self.async_state is None or not self.async_state.in_flight:
            return
        actions, io = self.async_state.drain()
        self._set_mode(training=True)
        self._run(actions, io)

    def eval_step(self, inputs: Any, targets: Any = None, *, broadcast: bool = False) -> Any:
        """Forward only. With ``targets``: the mean loss (every rank). Without: the model's
        output for the whole batch, on the first rank of the last stage (every rank if
        ``broadcast``; else ``None`` elsewhere). A batch may be of any size, also smaller
        than the number of replicas (the replicas left without a sample then idle)."""
        batches = self._splitter.eval(inputs, targets)
        n = len(batches.inputs)
        io = StepIO(
            inputs=batches.inputs if 0 in self.local_stages else None,
            targets=batches.targets if self._holds_last and targets is not None else None,
            loss_scales=batches.scales,
        )
        self._set_mode(training=False)
        with torch.no_grad(), self.guard(), (
                self.sharded.evaluation() if self.sharded is not None else contextlib.nullcontext()):
            self._run(self._schedules.actions("forward", n, rank=self._layout_rank), io)
        if targets is not None:
            return self._mean_loss(io)
        with self.guard():
            return gather_outputs(io.outputs, num_microbatches=n,  # tp index 0's
                                  layout=dataclasses.replace(self.layout, tp_index=0),
                                  holds_last=self._holds_last and self.tp_index == 0,
                                  broadcast=broadcast)

    def save(self, path: str, *, extra: dict[str, Any] | None = None, keep: int = KEEP) -> None:
        """Save model, optimizer, step and ``extra`` with torch.distributed.checkpoint
        (every rank calls it), keeping the ``keep`` newest checkpoints at ``path`` (the
        one replaced stays as ``path.step-S``); see :mod:`pipetrain.api.checkpointing`.
        An asynchronous schedule drains first. A peer that dies during the save raises
        :class:`~pipetrain.runtime.errors.PeerFailure` naming it, as in a step."""
        self.drain()
        with self.guard():
            save_pipeline(self, path, extra=extra, keep=keep)

    def load(self, path: str, *, set_aside: bool = True) -> dict[str, Any] | None:
        """Load the newest intact checkpoint kept at ``path``, taken with any number of
        stages; returns its ``extra``. A damaged newer one is passed over with a warning
        and, with ``set_aside``, renamed ``PATH.damaged-step-S`` so that later saves never
        count it (``False`` where another job may be writing ``path``). :attr:`loaded`
        says what was read."""
        with self.guard():
            self.loaded = load_pipeline(self, path, set_aside=set_aside)
        return self.loaded.extra

    def close(self) -> None:
        """Stop the monitor and the transport's threads (the process group stays)."""
        self.transport.close()
        if self._monitor is not None:
            self._monitor.stop()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def grad_norm(self) -> float | None:
        """The global gradient norm of the last step (when clipping is on)."""
        return self.optimizers.last_grad_norm

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (shared copies once)."""
        return list(self.model.parameters())

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters by global name (``layers.5.weight``; a captured
        model's own names)."""
        return dict(self.model.named_parameters(remove_duplicate=False))

    def state_dict(self) -> dict[str, Any]:
        """This rank's stages' state (a captured model: under the model's own names)."""
        return dict(self.model.state_dict())

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict on rank 0 (CPU tensors; ``None`` elsewhere; every
        rank calls it). A captured model's has exactly ``model.state_dict()``'s keys."""
        order = self.captured.state_keys if self.captured is not None else None
        with self.guard():
            return gather_state_dict(whole_tensors(self.state_dict()), order=order)


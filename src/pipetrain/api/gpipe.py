"""``GPipe``: a torchgpipe-compatible pipeline of an ``nn.Sequential`` in one process.

A torchgpipe user changes only the import. Underneath, every partition is a stage of
pipetrain's runtime with its own persistent worker thread (also when partitions share a
device), the fill-drain schedule is the same action list the simulator draws, and
activations and gradients move through the thread transport. In the forward phase the
partitions overlap, micro-batch after micro-batch (the last partition runs on the
caller's thread, which would only wait). The backward runs where autograd runs it, on
the caller's thread, last partition first: on the CPU, as a plain model's backward
runs (one intra-op thread team, one malloc arena, each checkpointed partition
recomputed right before its backward: torchgpipe's peak memory); on a GPU, each
partition computes on its own CUDA stream and values cross devices on copy streams
(:mod:`pipetrain.runtime.streams`), the partitions' kernels overlapping on their
streams. With one micro-batch on the CPU there is nothing to overlap: the caller's
thread runs the forward too.
"""

from __future__ import annotations

import functools
import numbers
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn

from pipetrain.api.local_step import LocalPipeline
from pipetrain.api.random_streams import SessionRng
from pipetrain.batchnorm import DeferredBatchNorm
from pipetrain.checkpoint import CHECKPOINT_MODES, checkpoint_stop
from pipetrain.counts import whole_number
from pipetrain.frontend.pipelines import (
    CAPTURE_HINT,
    gpipe_units,
    partition_units,
    wants_capture,
)
from pipetrain.microbatch import split_batch
from pipetrain.nested import iter_tensors
from pipetrain.partition import split_module, verify_balance, verify_module
from pipetrain.runtime.cpu_tuning import CpuTuning
from pipetrain.runtime.executor import Placement, RankExecutor
from pipetrain.runtime.precision import autocast_dtype
from pipetrain.runtime.stage import StageCompute
from pipetrain.runtime.streams import PipelineStreams, StreamTransport
from pipetrain.runtime.threads import ThreadTransport
from pipetrain.runtime.workers import StageWorkers
from pipetrain.schedule import Schedule, add_communication, build_schedule, gpipe, validate
from pipetrain.skip import skip_layout, verify_skippables

__all__ = ["GPipe", "MovingModuleError"]

Device = torch.device | int | str


class MovingModuleError(TypeError):
    """``GPipe`` places its partitions itself; moving the wrapper is refused."""


def _moving_denied(call: str, devices: list[torch.device]) -> MovingModuleError:
    placed = [str(d) for d in devices]
    return MovingModuleError(
        f"GPipe.{call} would move every partition to one device: denied to move "
        f"parameters and buffers, because GPipe should manage device placement (each "
        f"partition stays on its own device, now {placed}); fix: choose the devices when "
        f"wrapping the model, GPipe(model, balance, devices={placed}) (one per partition, "
        "e.g. ['cuda:0', 'cuda:1']). Converting the dtype (gpipe.to(torch.float64), "
        "gpipe.double()) is allowed."
    )


def _call(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """``name(args, key=value)`` as the user wrote it (tensors shown by device)."""

    def show(value: Any) -> str:
        if torch.is_tensor(value):
            return f"<tensor on {value.device}>"
        return repr(value)

    parts = [show(a) for a in args] + [f"{k}={show(v)}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})"


@functools.lru_cache(maxsize=64)
def _forward_schedule(num_stages: int, num_microbatches: int) -> Schedule:
    return build_schedule("forward", num_ranks=num_stages, num_microbatches=num_microbatches)


@functools.lru_cache(maxsize=64)
def _gpipe_last_first(num_stages: int, num_microbatches: int) -> Schedule:
    schedule = add_communication(gpipe(num_stages, num_microbatches, last_first=True))
    validate(schedule)
    return schedule


def _resolve_devices(devices: Iterable[Device] | None, num_partitions: int) -> list[torch.device]:
    if devices is None:
        if torch.cuda.is_available():
            devices = range(torch.cuda.device_count())
        else:
            devices = ["cpu"] * num_partitions
    resolved = [torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in devices]
    # 'cuda' means the current GPU, as in torchgpipe (a worker sets its device by index)
    resolved = [torch.device("cuda", torch.cuda.current_device())
                if d.type == "cuda" and d.index is None else d for d in resolved]
    if len(resolved) < num_partitions:
        raise IndexError(
            f"too few devices to hold given partitions (devices: {len(resolved)}, "
            f"partitions: {num_partitions}): {len(resolved)} devices "
            f"({[str(d) for d in resolved]}) for {num_partitions} partitions; fix: pass one "
            f"device per partition, e.g. devices={['cpu'] * num_partitions}, or use fewer "
            "partitions (several partitions may share a device)"
        )
    return resolved[:num_partitions]


def _chunks(value: Any) -> int:
    """``chunks`` as an ``int``: whole numbers (``4``, ``4.0``) and ``'4'``, as torchgpipe's
    ``int(chunks)`` takes them; fractions, bools and non-numbers are refused."""
    fix = ("fix: chunks=4 splits each mini-batch into 4 micro-batches (use at least 4x the "
           "number of partitions to keep the pipeline bubble small)")
    if isinstance(value, str):
        number = int(value) if value.strip().lstrip("+-").isdigit() else None
    else:
        number = whole_number(value)
        if number is None and not isinstance(value, numbers.Real):  # bool is one
            raise TypeError(
                f"number of chunks must be positive integer, got {value!r} "
                f"({type(value).__name__}); {fix}"
            )
    if number is None or number < 1:
        raise ValueError(f"number of chunks must be positive integer, got {value!r}; {fix}")
    return number


def _check_tensors(value: Any) -> None:
    """torchgpipe's input check for an empty GPipe: a tensor or a tuple of tensors."""
    if isinstance(value, tuple):
        for item in value:
            _check_tensors(item)
    elif not isinstance(value, torch.Tensor):
        raise TypeError(
            f"expected Tensor, but got {type(value).__name__}: a GPipe of an empty "
            f"nn.Sequential passes on a tensor or a (nested) tuple of tensors unchanged; "
            f"fix: pass the batch as a tensor or a tuple of tensors"
        )


class GPipe(nn.Module):
    """Pipeline-parallel wrapper of an ``nn.Sequential`` (GPipe, torchgpipe's API).

    The module is cut into ``len(balance)`` partitions of ``balance[j]`` consecutive
    layers, partition ``j`` on ``devices[j]``. Each mini-batch is split into ``chunks``
    micro-batches that flow through the partitions concurrently; ``loss.backward()``
    runs the pipelined backward. Outputs and gradients equal those of the unpipelined
    module (transparency). As in torchgpipe, ``GPipe(nn.Sequential(), [])`` has no
    partition and returns its input (a tensor or a tuple of tensors) unchanged.

    Args:
        module: the ``nn.Sequential`` to pipeline.
        balance: layers per partition, e.g. ``[2, 2]``; see :mod:`pipetrain.balance`.
        devices: one device per partition (default: all CUDA devices, else the CPU for
            every partition). Several partitions may share a device.
        chunks: number of micro-batches (a smaller batch gives fewer). As in
            torchgpipe, a whole float (``4.0``) or a numeric string (``'4'``) is taken
            and stored as ``int``.
        checkpoint: ``'always'``, ``'except_last'`` or ``'never'`` (anything whose
            ``str()`` is one of them, stored as ``str``): which micro-batches
            are re-materialized in backward. ``'except_last'`` re-materializes all but
            the last micro-batch, whose backward runs first, as torchgpipe does (the
            backward runs last micro-batch first).
        deferred_batch_norm: track BatchNorm statistics over the whole mini-batch.
        timeout: seconds a stage waits for its neighbour before reporting it stuck.
        fuse_weight_gradients: accumulate linear layers' weight gradients in place
            (faster; see :mod:`pipetrain.backward.fused`). Turn it off when
            something must see autograd accumulate them (hooks registered on the
            gradient accumulators, e.g. by DDP wrapping this module).
        recompute_ahead: for partitions on the CPU, how many re-materialized
            micro-batches a partition may hold beyond the one its backward needs, so
            that idle workers can rebuild them ahead while the backward runs (see
            :mod:`pipetrain.runtime.shared_recompute`). The default, ``0``, adds no
            memory: each checkpointed partition is recomputed right before its backward,
            as in torchgpipe. ``1`` can be faster on the CPU (checkpointed modes) and
            holds up to one more micro-batch's activations per partition.
        reuse_gradient_buffers: on the CPU, write each step's weight gradients into the
            memory of the previous step's, once ``zero_grad()`` dropped them (saves the
            page faults of fresh memory on the first backward of a step, but holds the
            gradients' size between steps). Off by default; when on, do not keep
            ``.detach()`` / ``.data`` aliases of a gradient across ``zero_grad()`` (see
            :class:`pipetrain.runtime.cpu_tuning.ReusingGradientPool`).
        throttle_openmp_spin: with partitions on the CPU, make GNU OpenMP count the
            stage workers among its threads, so that the idle OpenMP threads of the
            caller's parallel ops (its loss) sleep after a short spin instead of taking a
            core from the stages for milliseconds (faster steps on a small CPU). Off by
            default: it changes how every OpenMP thread of the process waits, the
            caller's own parallel work included (see
            :func:`pipetrain.runtime.cpu_tuning.join_openmp_count`).
        mixed_precision: ``'bf16'`` or ``'fp16'``: every partition's forward (and the
            recomputation of its checkpointed micro-batches) runs under
            ``torch.autocast`` of its device with that dtype; parameters stay float32.
            With fp16, scale the loss with ``torch.amp.GradScaler`` as for any model
            (one process: its overflow check covers every partition). See
            :mod:`pipetrain.runtime.precision`.
        example_inputs, example_kwargs, split_points: any ``nn.Module`` (a Hugging Face
            model unmodified) instead of an ``nn.Sequential``: captured on the example
            inputs and cut where ``split_points`` (module names, e.g.
            ``["transformer.h.6"]``) begin, else by ``balance`` (units per partition)
            or by the planner (one partition per device); see
            :mod:`pipetrain.frontend` and ``docs/frontend.md``.

    Random layers (dropout, or any layer drawing from torch's generators) draw from
    streams seeded per (forward call, layer, micro-batch), so a recomputation repeats
    the masks exactly, ``torch.manual_seed`` reproduces a run, and the masks do not
    depend on the balance. A partition's random
    draws are watched during its first two training-mode calls (which run one partition
    at a time); partitions that drew nothing then run concurrently, without seeding.
    See :mod:`pipetrain.api.random_streams`.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> model = GPipe(model, balance=[2, 1], chunks=2)
        >>> out = model(torch.randn(6, 4))
        >>> out.sum().backward()
        >>> out.shape
        torch.Size([6, 2])
    """

    def __init__(
        self,
        module: nn.Sequential | nn.Module,
        balance: Iterable[int] | None = None,
        *,
        devices: Iterable[Device] | None = None,
        chunks: int = 1,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
        timeout: float = 300.0,
        fuse_weight_gradients: bool = True,
        recompute_ahead: int = 0,
        reuse_gradient_buffers: bool = False,
        throttle_openmp_spin: bool = False,
        mixed_precision: str | None = None,
        example_inputs: Any = None,
        example_kwargs: dict[str, Any] | None = None,
        split_points: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        # any nn.Module with example inputs; without, torchgpipe's checks and errors
        captured = wants_capture(module, example_inputs, example_kwargs, strict=False)
        if captured:
            module, balance, shared = gpipe_units(module, example_inputs=example_inputs,
                                                  example_kwargs=example_kwargs,
                                                  split_points=split_points, balance=balance,
                                                  devices=devices)
            # tied weights shared by partitions: autograd accumulates their gradients
            fuse_weight_gradients = fuse_weight_gradients and not shared
        elif not isinstance(module, nn.Sequential) or len(module) > 0:
            try:
                verify_module(module)  # an empty nn.Sequential is allowed, as in torchgpipe
            except TypeError as error:
                error.add_note(CAPTURE_HINT)
                raise
        module = cast(nn.Sequential, module)
        verify_skippables(module)
        CpuTuning(recompute_ahead=recompute_ahead, reuse_gradient_buffers=reuse_gradient_buffers,
                  throttle_openmp_spin=throttle_openmp_spin)  # refuses a bad value now
        autocast = autocast_dtype(mixed_precision)
        num_chunks = _chunks(chunks)
        mode = str(checkpoint)  # like torchgpipe: any value whose str() is a mode
        if mode not in CHECKPOINT_MODES:
            raise ValueError(
                f"checkpoint is not one of 'always', 'except_last', or 'never': got "
                f"{checkpoint!r}; fix: checkpoint='except_last' (the default)"
            )
        balance_list = verify_balance(None if balance is None else list(balance), len(module))
        device_list = _resolve_devices(devices, len(balance_list))
        if deferred_batch_norm:
            module = DeferredBatchNorm.convert_deferred_batch_norm(module, num_chunks)

        self.balance = balance_list
        self.devices = device_list
        self.chunks = num_chunks
        self.checkpoint = mode
        self.fuse_weight_gradients = fuse_weight_gradients
        self.recompute_ahead = recompute_ahead
        self.reuse_gradient_buffers = reuse_gradient_buffers
        self.throttle_openmp_spin = throttle_openmp_spin
        self.timeout = timeout
        self.mixed_precision = mixed_precision
        self._autocast = autocast
        split = partition_units if captured else split_module  # units may share tied weights
        partitions = split(module, balance_list) if len(module) > 0 else []
        for partition, device in zip(partitions, device_list):
            partition.to(device)
        self.partitions = nn.ModuleList(partitions)
        self._layout = skip_layout(partitions)
        self._local: LocalPipeline | None = None

    # -- torchgpipe's sequence behaviour ------------------------------------------------
    def _layers(self) -> list[nn.Module]:
        return [layer for partition in self.partitions for layer in cast(nn.Sequential, partition)]

    def __len__(self) -> int:
        return len(self._layers())

    def __getitem__(self, index: int) -> nn.Module:
        layers = self._layers()
        try:
            return layers[index]
        except IndexError:
            raise IndexError(f"layer index {index} out of range for {len(layers)} layers") from None

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._layers())

    # -- moving is refused (dtype conversions are fine) ---------------------------------
    def cuda(self, device: Any = None) -> GPipe:
        raise _moving_denied(_call("cuda", () if device is None else (device,), {}),
                             self.devices)

    def cpu(self) -> GPipe:
        raise _moving_denied("cpu()", self.devices)

    def to(self, *args: Any, **kwargs: Any) -> GPipe:
        moving = "device" in kwargs or "tensor" in kwargs or bool(
            args and (isinstance(args[0], (torch.device, int, str)) or torch.is_tensor(args[0]))
        )
        if moving:
            raise _moving_denied(_call("to", args, kwargs), self.devices)
        super().to(*args, **kwargs)
        return self

    # -- running ------------------------------------------------------------------------
    def _pipeline(self) -> LocalPipeline:
        if self._local is None:
            streams = PipelineStreams(self.devices) if PipelineStreams.needed(self.devices) \
                else None
            transport = ThreadTransport(timeout=self.timeout) if streams is None \
                else StreamTransport(streams, timeout=self.timeout)
            num = len(self.partitions)
            rng = SessionRng(list(self.partitions))
            # the CPU tunings, for partitions on the CPU only (pipetrain.runtime.cpu_tuning)
            cpu = CpuTuning(recompute_ahead=self.recompute_ahead,
                            reuse_gradient_buffers=self.reuse_gradient_buffers,
                            throttle_openmp_spin=self.throttle_openmp_spin) \
                if any(d.type == "cpu" for d in self.devices) else None
            executors = []
            for j, (partition, device) in enumerate(zip(self.partitions, self.devices)):
                stage = StageCompute(
                    partition,
                    stage_index=j,
                    device=device,
                    skips_in=self._layout.incoming(j),
                    skips_out=self._layout.crossing(j),
                    rng=rng,
                    first_layer=sum(self.balance[:j]),
                    fuse_weight_gradients=self.fuse_weight_gradients,
                    autocast=self._autocast,
                    module_hooks=True,  # hooks on a partition fire, as in torchgpipe
                )
                if cpu is not None and device.type == "cpu":
                    stage.gradient_pool = cpu.gradient_pool()
                executors.append(
                    RankExecutor(rank=j, placement=Placement.single(range(num)), stages={j: stage},
                                 transport=transport)
                )
            workers = StageWorkers(self.devices, on_error=transport.mailbox.fail,
                                   setup=None if cpu is None else cpu.worker_setup())
            self._local = LocalPipeline(executors, workers, transport, rng=rng,
                                        cpu_tuning=cpu, streams=streams)
            weakref.finalize(self, self._local.close)
        return self._local

    def forward(self, input: Any) -> Any:
        """Run the pipeline on a mini-batch (a tensor or a nested value of tensors).

        Raises:
            TypeError: ``input`` holds no tensor (torchgpipe's "expected Tensor"); for
                the GPipe of an empty ``nn.Sequential``, which returns ``input``
                itself, anything but a tensor or a tuple of tensors.
        """
        if not self.partitions:
            _check_tensors(input)
            return input
        if not any(True for _ in iter_tensors(input)):
            raise TypeError(
                f"expected Tensor, but got {type(input).__name__} ({input!r:.80}): the "
                f"mini-batch holds no tensor to split into micro-batches; fix: pass a "
                f"tensor, or a tuple / list / dict of tensors whose dim 0 is the batch"
            )
        batches = split_batch(input, self.chunks)
        pipeline = self._pipeline()
        num_microbatches = len(batches)
        num_stages = len(self.partitions)
        needs_grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in self.parameters())
            or any(t.requires_grad for t in iter_tensors(input))
        )
        if needs_grad:
            # as torchgpipe: the first `count` micro-batches are checkpointed and the
            # backward runs last micro-batch first, so the one left whole ('except_last')
            # frees its activations first, and no checkpointed forward runs beside them
            count = checkpoint_stop(self.checkpoint, num_microbatches, training=self.training)
            schedule = _gpipe_last_first(num_stages, num_microbatches)
            output = pipeline.forward(schedule, batches, input_value=input,
                                      checkpointed=range(count))
        else:
            schedule = _forward_schedule(num_stages, num_microbatches)
            output = pipeline.forward_only(schedule, batches)
        if self.training and num_microbatches < self.chunks:
            # a batch smaller than chunks: deferred batch norms wait for more micro-batches
            for module in self.modules():
                if isinstance(module, DeferredBatchNorm):
                    module.commit()
        return output

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_local"] = None
        return state

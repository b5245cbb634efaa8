"""One pipelined pass of a single-process pipeline, glued into the caller's autograd.

:class:`LocalPipeline` runs a schedule's forward phase on the stage workers and returns
the merged output through :class:`_PipelineFunction`; when the caller's ``backward()``
reaches that function, the schedule's backward phase runs on the workers and the
gradients of the caller's inputs come back. Parameter gradients accumulate into
``.grad`` in the workers, as with any backward.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pipetrain.api.local_grads import merge_grads, rows, split_grad
from pipetrain.api.random_streams import KEY_STRIDE, SessionRng
from pipetrain.microbatch import merge_batches
from pipetrain.nested import flatten, iter_tensors, unflatten
from pipetrain.runtime.cpu_tuning import CpuTuning
from pipetrain.runtime.executor import RankExecutor, StepIO
from pipetrain.runtime.shared_recompute import RecomputeSharing
from pipetrain.runtime.streams import PipelineStreams
from pipetrain.runtime.threads import ThreadTransport
from pipetrain.runtime.workers import StageWorkers
from pipetrain.schedule import Action, Op, Schedule

__all__ = ["LocalPipeline"]


def split_phases(actions: Sequence[Action]) -> tuple[list[Action], list[Action]]:
    """A fill-drain action list cut before its first backward action."""
    for index, action in enumerate(actions):
        if action.op in (Op.BACKWARD, Op.BACKWARD_INPUT, Op.RECV_BACKWARD):
            return list(actions[:index]), list(actions[index:])
    return list(actions), []


@dataclass
class _Session:
    """The state of one forward whose backward is pending."""

    io: list[StepIO]
    backward_actions: list[list[Action]]
    output_mask: list[bool] = field(default_factory=list)
    """per output tensor: whether any micro-batch's piece of it requires grad"""
    microbatch_masks: list[list[bool]] = field(default_factory=list)
    """per micro-batch and output tensor: whether that piece requires grad"""
    output_sizes: list[list[int]] = field(default_factory=list)
    input_sizes: list[list[int]] = field(default_factory=list)
    input_shapes: list[torch.Size] = field(default_factory=list)
    forward_actions: list[list[Action]] = field(default_factory=list)
    leaves: list[Any] = field(default_factory=list)
    structure: Any = None
    tensor_positions: list[int] = field(default_factory=list)
    done: bool = False


class LocalPipeline:
    """Executors of every stage of a single-process pipeline, on persistent workers."""

    def __init__(self, executors: Sequence[RankExecutor], workers: StageWorkers,
                 transport: ThreadTransport, *, rng: SessionRng | None = None,
                 cpu_tuning: CpuTuning | None = None,
                 streams: PipelineStreams | None = None) -> None:
        self.executors = list(executors)
        self.workers = workers
        self.transport = transport
        self.streams = streams if streams is not None else PipelineStreams([])
        """the stages' CUDA streams, if any stage is on a GPU (the transport then ships
        values between them: :class:`~pipetrain.runtime.streams.StreamTransport`)"""
        self.rng = rng
        """the stages' random streams (None: stages draw from torch's generators as is)"""
        self._sessions = itertools.count()
        self._on_cpu = [j for j, e in enumerate(self.executors)
                        if all(s.device.type == "cpu" for s in e.stages.values())]
        self.sharing: RecomputeSharing | None = None
        """idle CPU workers rebuild CPU stages' checkpointed micro-batches in backward
        (a CPU tuning: :meth:`~pipetrain.runtime.cpu_tuning.CpuTuning.share_recomputation`;
        None: each stage recomputes its own)"""
        if cpu_tuning is not None:
            self.sharing = cpu_tuning.share_recomputation(
                [s for j in self._on_cpu for s in self.executors[j].stages.values()],
                helpers=[workers.thread_ids[j] for j in self._on_cpu], transport=transport)

    def _run(self, actions: Sequence[Sequence[Action]], ios: Sequence[StepIO], *,
             grad: bool, then: dict[int, Callable[[], None]] | None = None,
             speculators: Sequence[int] = (), generation: int = 0,
             here: int | None = None) -> None:
        """Run each stage's actions on its worker; ``then[j]`` runs on worker ``j`` after
        them (glue such as merging micro-batches runs there, single-threaded, so that the
        caller's thread starts no intra-op thread team that would spin on the cores the
        stages are using). Workers ``speculators`` go on
        rebuilding checkpointed micro-batches after their task (without this call
        waiting for them) until speculation number ``generation`` ends (the backward
        begins, or another forward). Worker ``here``'s task runs on the calling thread
        (see :meth:`StageWorkers.run`)."""
        then = then or {}
        speculation = self.sharing if speculators else None

        def task(j: int, executor: RankExecutor, acts: Sequence[Action], io: StepIO) -> Any:
            if not acts and j not in then:
                return None

            def work() -> None:
                with self.streams.stage(j):
                    if acts:
                        _run_with_grad(executor, acts, io, grad)
                    if j in then:
                        then[j]()
                if speculation is not None:
                    for stage in executor.stages.values():
                        speculation.forward_done(stage)
                    if j in speculators:
                        self.workers.submit(
                            j, functools.partial(speculation.help_while_speculating, generation))
            return work

        tasks = [task(j, e, a, io)
                 for j, (e, a, io) in enumerate(zip(self.executors, actions, ios))]
        try:
            self.workers.run(tasks, here=here)
        except BaseException:
            for executor in self.executors:
                executor.reset()
            self.transport.mailbox.clear()
            raise

    def close(self) -> None:
        """End any recomputation in progress and stop the workers."""
        self._stop_sharing()
        self.workers.close()

    def _stop_sharing(self) -> None:
        """End the sharing of an earlier call, once its rebuilds in progress are done
        (none may run beside the stages' next forward)."""
        if self.sharing is not None:
            self.sharing.close()

    def forward_only(self, schedule: Schedule, batches: list[Any]) -> Any:
        """Run a forward-only schedule without autograd; the merged output."""
        self._stop_sharing()
        offset = self._next_offset()
        ios = self._ios(len(self.executors), batches, key_offset=offset, checkpointed=range(0))
        if self.rng is not None:
            self.rng.open(offset)
        try:
            with self.streams.edges():
                if self._serial(len(batches)):
                    self._run_in_order(schedule.actions, ios, then={}, grad=False)
                else:
                    self._run(schedule.actions, ios, grad=False, here=self._caller_stage())
        finally:
            if self.rng is not None:
                self.rng.forward_done(offset)
                self.rng.close(offset)
        last = ios[-1]
        return merge_batches([last.outputs[i] for i in range(len(batches))])

    def forward(self, schedule: Schedule, batches: list[Any], *, checkpointed: range,
                input_value: Any) -> Any:
        """Run the forward phase; returns the merged output wired into autograd.

        Micro-batches ``i in checkpointed`` (a range) are re-materialized in backward.
        """
        phases = [split_phases(acts) for acts in schedule.actions]
        self._stop_sharing()
        offset = self._next_offset()
        ios = self._ios(len(self.executors), batches, key_offset=offset,
                        checkpointed=checkpointed)
        if self.rng is not None:
            self.rng.open(offset)
        session = _Session(io=ios, backward_actions=[b for _, b in phases])
        session.forward_actions = [f for f, _ in phases]
        session.input_sizes = [
            [rows(t) for t in iter_tensors(b) if t.requires_grad] for b in batches
        ]
        inputs = [t for t in iter_tensors(input_value) if t.requires_grad]
        session.input_shapes = [t.shape for t in inputs]
        weakref.finalize(session, _drop, self.executors, ios[0].key_offset, self.rng)
        phony = torch.empty(0, requires_grad=True)
        results = _PipelineFunction.apply(self, session, phony, *inputs)  # type: ignore[no-untyped-call]
        leaves = list(session.leaves)
        for k, result in zip(session.tensor_positions, results):
            leaves[k] = result
        session.leaves = []
        return unflatten(leaves, session.structure)

    def run_forward(self, session: _Session) -> tuple[torch.Tensor, ...]:
        """The forward phase (inside the autograd function): the merged output tensors."""
        ios = session.io
        num_microbatches = len(ios[0].inputs or ())

        def merge() -> None:
            outputs = [ios[-1].outputs[i] for i in range(num_microbatches)]
            # a piece may need no gradient in one micro-batch and need one in another (a
            # checkpointed micro-batch announces its outputs before knowing)
            session.microbatch_masks = [[t.requires_grad for t in iter_tensors(o)] for o in outputs]
            session.output_mask = [any(column) for column in zip(*session.microbatch_masks)]
            session.output_sizes = [[rows(t) for t in iter_tensors(o)] for o in outputs]
            with torch.no_grad():
                leaves, session.structure = flatten(merge_batches(outputs))
            # merged: the pieces' data is not needed any more (the stages keep seeds of
            # their outputs, not the outputs: pipetrain.backward.roots)
            outputs.clear()
            ios[-1].outputs.clear()
            session.tensor_positions = [
                k for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)
            ]
            session.leaves = leaves

        serial = self._serial(num_microbatches)
        speculators = [] if serial else self._speculators(session)
        generation = 0
        if self.sharing is not None and speculators:
            low = ios[0].key_offset
            generation = self.sharing.speculate(low, low + KEY_STRIDE)
        try:
            with self.streams.edges():
                if serial:
                    self._run_in_order(session.forward_actions, ios, then={len(ios) - 1: merge},
                                       grad=True)
                else:
                    self._run(session.forward_actions, ios, grad=True,
                              then={len(ios) - 1: merge}, speculators=speculators,
                              generation=generation, here=self._caller_stage())
        finally:
            if self.rng is not None:
                self.rng.forward_done(ios[0].key_offset)
        leaves = session.leaves
        return tuple(leaves[k].detach() for k in session.tensor_positions)

    def backward(self, session: _Session, grads: Sequence[torch.Tensor | None]) -> list[Any]:
        """Run the backward phase with the gradients of the merged outputs."""
        if session.done:
            raise RuntimeError(
                "backward through a GPipe output twice: the pipeline frees each micro-batch's "
                "graph after its backward, so retain_graph=True is not supported; fix: run "
                "the forward again before each backward, or add up the losses and call "
                "backward() once"
            )
        session.done = True
        num_microbatches = len(session.output_sizes)
        # pieces of each output, per micro-batch (k: output tensor position)
        per_output = [
            split_grad(g, [session.output_sizes[i][k] for i in range(num_microbatches)])
            for k, g in enumerate(grads)
        ]
        ios = session.io
        ios[-1].output_grads = [
            [pieces[i] for pieces, keep in zip(per_output, session.microbatch_masks[i]) if keep]
            for i in range(num_microbatches)
        ]
        first_io = ios[0]
        merged: list[Any] = []

        def merge() -> None:
            for k, shape in enumerate(session.input_shapes):
                pieces = [first_io.input_grads.get(i, [None] * (k + 1))[k]
                          for i in range(num_microbatches)]
                sizes = [session.input_sizes[i][k] for i in range(num_microbatches)]
                merged.append(merge_grads(pieces, shape, sizes))

        try:
            with self.streams.edges():
                # this thread, which autograd runs the backward on, runs every stage's
                # part, last stage first, as autograd would run the whole model's
                if self.streams.active or self._serial(num_microbatches):
                    self._stop_sharing()  # no CPU stage's rebuild runs beside it
                    self._run_in_order(session.backward_actions, ios, then={0: merge},
                                       backward=True)
                else:
                    self._run_in_order(session.backward_actions, ios, then={0: merge},
                                       backward=True, sharing=self.sharing,
                                       low=ios[0].key_offset)
        finally:
            if self.rng is not None:
                self.rng.close(ios[0].key_offset)
        for io in ios:
            io.input_grads.clear()
            io.outputs.clear()
        return merged

    def _run_in_order(self, actions: Sequence[Sequence[Action]], ios: Sequence[StepIO], *,
                      then: dict[int, Callable[[], None]], grad: bool = True,
                      backward: bool = False, sharing: RecomputeSharing | None = None,
                      low: int = 0) -> None:
        """A phase on this thread, one stage after another (first stage first; last stage
        first for a ``backward`` phase), each on its CUDA stream if it has one. With
        ``sharing`` (an opt-in CPU tuning), the idle CPU workers meanwhile rebuild the
        checkpointed micro-batches (keys from ``low``) that later stages will need.

        This thread is autograd's (it runs :class:`_PipelineFunction`'s backward). With a
        stage on a GPU, a stage's backward called from another thread would wait for it
        forever, one called from here runs here; the GPU still overlaps the stages (their
        kernels queue on their own streams), and each stage's backward needs only what
        later stages sent (fill-drain order). With the stages on the CPU, running the
        backward here, as autograd runs a plain model's, keeps one thread team and one
        malloc arena for it, and each checkpointed partition is recomputed right before
        its backward (torchgpipe's peak memory); partitions that share the CPU overlap in
        the forward phase, where their outputs wait for nothing but their inputs.
        """
        order = reversed(range(len(self.executors))) if backward else range(len(self.executors))
        if sharing is not None:
            sharing.open(low, low + KEY_STRIDE, tasks=1)
            for j in self._on_cpu:
                self.workers.submit(j, functools.partial(
                    sharing.help_until_done, lambda: self.transport.mailbox.error))
        try:
            for j in order:
                with self.streams.stage(j):
                    if actions[j]:
                        _run_with_grad(self.executors[j], actions[j], ios[j], grad)
                    if j in then:
                        then[j]()
        except BaseException:
            if sharing is not None:
                sharing.task_done()
                sharing.close()
            for executor in self.executors:
                executor.reset()
            self.transport.mailbox.clear()
            raise
        if sharing is not None:
            sharing.task_done()
            sharing.close()

    def _serial(self, num_microbatches: int) -> bool:
        """Whether a call runs every stage on the caller's thread, in order: with every
        stage on the CPU and a single micro-batch there is nothing to overlap, and the
        caller's thread runs the partitions as plain PyTorch runs the model (its intra-op
        threads, one thread team in the process, each checkpointed partition recomputed
        right before its backward, as torchgpipe does)."""
        return (num_microbatches == 1 and not self.streams.active
                and len(self._on_cpu) == len(self.executors))

    def _caller_stage(self) -> int | None:
        """The stage whose forward the caller's thread runs (``None``: none): the last
        one, if it is on the CPU. The caller would only wait for the workers meanwhile;
        running the last stage there keeps its memory in the caller's malloc arena, where
        its backward runs, and, with a single partition, leaves one intra-op thread team
        in the process, as plain PyTorch has (a second team, spinning in a worker, would
        make GNU OpenMP put the idle threads of both to sleep after each parallel
        region)."""
        last = len(self.executors) - 1
        return last if last in self._on_cpu else None

    def _speculators(self, session: _Session) -> list[int]:
        """The CPU workers whose backward starts by waiting for a gradient: they rebuild
        checkpointed micro-batches from the end of their forward phase on."""
        if self.sharing is None:
            return []
        return [j for j in self._on_cpu if session.backward_actions[j]
                and session.backward_actions[j][0].op is Op.RECV_BACKWARD]

    def _next_offset(self) -> int:
        """The key offset of a new forward call (its micro-batches' keys start there)."""
        return next(self._sessions) * KEY_STRIDE

    @staticmethod
    def _ios(num: int, batches: list[Any], *, key_offset: int,
             checkpointed: range) -> list[StepIO]:
        assert checkpointed.step == 1, "checkpointed micro-batches are a contiguous range"
        ios = [StepIO(key_offset=key_offset, checkpoint_start=checkpointed.start,
                      checkpoint_stop=checkpointed.stop) for _ in range(num)]
        ios[0].inputs = batches
        return ios


def _run_with_grad(executor: RankExecutor, actions: Sequence[Action], io: StepIO, grad: bool) -> None:
    with torch.set_grad_enabled(grad):
        executor.run(actions, io)


def _drop(executors: list[RankExecutor], key_offset: int, rng: SessionRng | None) -> None:
    """A session whose output was freed without backward: free its micro-batches."""
    for executor in executors:
        for stage in executor.stages.values():
            stage.drop(key_offset, key_offset + KEY_STRIDE)
    if rng is not None:
        rng.close(key_offset)


class _PipelineFunction(torch.autograd.Function):
    """Autograd node standing for the whole pipeline of one forward call."""

    @staticmethod
    def forward(ctx: Any, pipeline: LocalPipeline, session: _Session, phony: torch.Tensor,
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = pipeline.run_forward(session)
        ctx.pipeline = pipeline
        ctx.session = session
        for tensor, keep in zip(outputs, session.output_mask):
            if not keep:
                ctx.mark_non_differentiable(tensor)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        if torch.is_grad_enabled():  # autograd runs backward in grad mode for create_graph
            raise RuntimeError(
                "GPipe does not support double backward: backward(create_graph=True) or "
                "torch.autograd.grad(..., create_graph=True) through a GPipe output would "
                "return gradients that are not differentiable; fix: compute the gradient "
                "penalty (or other higher-order term) on a plain nn.Sequential, or drop "
                "create_graph=True"
            )
        input_grads = ctx.pipeline.backward(ctx.session, grads)
        return (None, None, None, *input_grads)

"""The rank executor: runs one rank's action list, the same code for every transport.

The executor walks its actions in order. Compute actions go to the rank's
:class:`~pipetrain.runtime.stage.StageCompute` objects; communication actions go to the
transport; ``REDUCE`` and ``STEP`` go to the :class:`StepHooks` of the training API.
Hand-offs between two stages of the same rank stay local. A schedule without
communication actions works too: then each receive happens right before the compute
that needs it and each send right after the compute that produced it.

Every action is timed (:class:`~pipetrain.schedule.TimedAction`), which is what the
trace, the timeline picture and the measured bubble are made from.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pipetrain.nested import describe_value
from pipetrain.runtime.stage import LOSS_NOTE, StageCompute
from pipetrain.runtime.transport import ACTIVATION, GRADIENT, Channel, Placement, Transport, handoff
from pipetrain.schedule import Action, Op, TimedAction

__all__ = ["Placement", "RankExecutor", "ShardHooks", "StepHooks", "StepIO", "VersionHooks", "describe_value"]


_NOTE = "pipetrain: raised by rank"
_WEIGHTED = (Op.FORWARD, Op.BACKWARD, Op.RECV_BACKWARD)
"""Actions that compute with a stage's weights (a receive of gradients recomputes)."""


class VersionHooks(Protocol):
    """A stage's weight versions (:class:`~pipetrain.runtime.weight_versions.StageVersions`)."""

    def computing(self, op: Op, microbatch: int, version: int | None) -> AbstractContextManager[None]:
        """A block in which ``op`` of ``microbatch`` runs with its weight version."""


class StepHooks(Protocol):
    """What ``REDUCE`` and ``STEP`` actions do; provided by the training API."""

    def reduce(self, stage: int) -> None:
        """Start the gradient all-reduce of ``stage`` (asynchronously)."""

    def step(self, stage: int) -> None:
        """Finish the reduction of ``stage``, step its optimizer, zero its gradients."""


class ShardHooks(Protocol):
    """What FSDP's ``UNSHARD``, ``REDUCE`` and ``RESHARD`` actions do to a stage's
    sharded parameters; provided by the training API under ``data_parallel='fsdp'``."""

    def unshard(self, stage: int) -> None:
        """Start gathering the stage's parameters."""

    def reduce(self, stage: int) -> None:
        """Reduce-scatter the gradients the stage's backwards accumulated."""

    def reshard(self, stage: int) -> None:
        """Free the stage's gathered parameters."""


@dataclass
class StepIO:
    """What one run of actions consumes and produces on a rank.

    Inputs are indexed by micro-batch; only the ranks holding the first (inputs) or last
    (targets, output gradients) stage need them.
    """

    inputs: Sequence[Any] | None = None
    """Input of the first stage, per micro-batch."""
    targets: Sequence[Any] | None = None
    """Loss target per micro-batch (the last stage computes ``loss_fn(output, target)``)."""
    loss_scales: Sequence[float] | None = None
    """Weight of each micro-batch's loss (its share of the batch)."""
    output_grads: Sequence[Sequence[torch.Tensor | None]] | None = None
    """Gradients of the last stage's outputs per micro-batch, when no loss is computed."""
    outputs: dict[int, Any] = field(default_factory=dict)
    """Filled: the last stage's output per micro-batch (when no loss is computed)."""
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    """Filled: the (scaled, detached) loss per micro-batch."""
    input_grads: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)
    """Filled: gradients of the first stage's inputs that require grad, per micro-batch."""
    checkpoint_stop: int = 0
    """Micro-batches ``checkpoint_start <= i < checkpoint_stop`` are re-materialized in
    backward."""
    checkpoint_start: int = 0
    """See :attr:`checkpoint_stop`."""
    checkpointed: Collection[int] | Mapping[int, Collection[int]] | None = None
    """The micro-batches to re-materialize, when not a range (replicated stages: each
    replica decides for its own micro-batches), or, per stage, those of that stage;
    overrides the range."""
    key_offset: int = 0
    """Added to micro-batch indices in the stages and on the wire, so that several runs
    whose backward is still pending (several forwards before one ``backward()``) do not
    collide."""


class RankExecutor:
    """Executes the actions of one rank.

    ``placement`` tells which rank runs each micro-batch of each stage (as the
    :class:`~pipetrain.schedule.Schedule` does: one rank per stage, or replicated stages
    with micro-batches round-robin); ``stages`` holds this rank's stages.

    Example:
        >>> from pipetrain.runtime.threads import ThreadTransport
        >>> from pipetrain.schedule import parse_actions
        >>> stage = StageCompute(torch.nn.Linear(2, 2), stage_index=0, device=torch.device("cpu"))
        >>> ex = RankExecutor(rank=0, placement=Placement.single([0]), stages={0: stage},
        ...                   transport=ThreadTransport(timeout=5))
        >>> io = StepIO(inputs=[torch.ones(1, 2)], output_grads=[[torch.ones(1, 2)]])
        >>> ex.run(parse_actions("0F0 0B0"), io)
        >>> io.outputs[0].shape
        torch.Size([1, 2])
    """

    def __init__(
        self,
        *,
        rank: int,
        placement: Placement,
        stages: Mapping[int, StageCompute],
        transport: Transport,
        hooks: StepHooks | None = None,
        versions: Mapping[int, VersionHooks] | None = None,
        shards: ShardHooks | None = None,
    ) -> None:
        self.rank = rank
        self.placement = placement
        self.num_stages = placement.num_stages
        self.stages = dict(stages)
        self.transport = transport
        self.hooks = hooks
        self.shards = shards
        """FSDP's gathers and reduce-scatters (``None``: the parameters are whole, and
        ``UNSHARD`` / ``RESHARD`` do nothing)."""
        self.versions = dict(versions or {})
        """Per stage, its weight versions (asynchronous schedules; empty otherwise)."""
        self._inbox: dict[tuple[str, int, int], Any] = {}
        self._outbox: dict[tuple[str, int, int], Any] = {}
        self._explicit = True
        self._preposted: set[tuple[Channel, int]] = set()
        self._last_input: Any = None
        self._in_loss = False
        self.current: tuple[Action, float] | None = None
        """The action running now and when it began (``time.monotonic``); after a failure,
        the action that failed (see :func:`pipetrain.runtime.rank_report.rank_report`)."""
        self.recent: deque[Action] = deque(maxlen=8)
        """The last actions completed, oldest first (named only when reported)."""

    # -- helpers ----------------------------------------------------------------------
    def _local(self, stage: int, microbatch: int) -> bool:
        return 0 <= stage < self.num_stages and self.placement.rank(stage, microbatch) == self.rank

    def _announce(self, actions: Sequence[Action], key_offset: int) -> None:
        for channel, microbatches in self._expected(actions, key_offset).items():
            fresh = [i for i in microbatches if (channel, i) not in self._preposted]
            self._preposted.difference_update((channel, i) for i in microbatches)
            if fresh:
                self.transport.expect(channel, fresh)

    def expect_ahead(self, actions: Sequence[Action], *, key_offset: int = 0) -> None:
        """Post now the receives of ``actions`` of a later run whose messages are sent
        before it starts (an asynchronous schedule's next step); that run does not post
        them again."""
        for channel, microbatches in self._expected(actions, key_offset).items():
            self.transport.expect(channel, microbatches)
            self._preposted.update((channel, i) for i in microbatches)

    def _expected(self, actions: Sequence[Action], key_offset: int) -> dict[Channel, list[int]]:
        expected: dict[Channel, list[int]] = defaultdict(list)
        for a in actions:
            j, i = a.stage, a.microbatch
            if i is None:
                continue
            if a.op is Op.RECV_FORWARD or (not self._explicit and a.op is Op.FORWARD
                                           and j > 0 and not self._local(j - 1, i)):
                expected[Channel(ACTIVATION, j - 1, j)].append(i + key_offset)
            elif a.op is Op.RECV_BACKWARD or (
                not self._explicit
                and a.op in (Op.BACKWARD, Op.BACKWARD_INPUT)
                and j < self.num_stages - 1
                and not self._local(j + 1, i)
            ):
                expected[Channel(GRADIENT, j + 1, j)].append(i + key_offset)
        return expected

    def _receive(self, kind: str, stage: int, microbatch: int) -> Any:
        key = (kind, stage, microbatch)
        if key in self._inbox:
            return self._inbox.pop(key)
        src = stage - 1 if kind == ACTIVATION else stage + 1
        return self.transport.recv(Channel(kind, src, stage), microbatch)

    def _deliver(self, kind: str, stage: int, microbatch: int, value: Any, *, local: bool) -> None:
        """Route ``value`` produced by ``stage`` to the neighbour that consumes it
        (``local``: that neighbour runs on this rank)."""
        dst = stage + 1 if kind == ACTIVATION else stage - 1
        if local:
            self._inbox[(kind, dst, microbatch)] = handoff(value)
        elif self._explicit:
            self._outbox[(kind, stage, microbatch)] = value
        else:
            self.transport.send(Channel(kind, stage, dst), microbatch, value)

    # -- running ----------------------------------------------------------------------
    def run(
        self,
        actions: Sequence[Action],
        io: StepIO,
        *,
        record: list[TimedAction] | None = None,
        origin: float | None = None,
    ) -> None:
        """Run ``actions`` in order. Appends one :class:`TimedAction` per action to
        ``record`` (times in seconds since ``origin``, default: the start of this run)."""
        self._explicit = any(a.op.is_communication for a in actions)
        self._announce(actions, io.key_offset)
        clock = time.perf_counter
        origin = clock() if origin is None else origin
        prefetching = any(stage.offload is not None for stage in self.stages.values())
        for index, action in enumerate(actions):
            if prefetching:
                self._prefetch_next(actions, index, io.key_offset)
            start = clock()
            self.current = (action, time.monotonic())
            try:
                versions = self.versions.get(action.stage) if action.op in _WEIGHTED else None
                if versions is None or action.microbatch is None:
                    self._dispatch(action, io)
                else:
                    with versions.computing(action.op, action.microbatch + io.key_offset,
                                            action.version):
                        self._dispatch(action, io)
            except BaseException as error:
                # a neighbour's failure re-raised here (the thread transport wakes waiters
                # with the same object) already names where it was raised
                notes = getattr(error, "__notes__", ())
                self._in_loss = any(n.startswith(LOSS_NOTE) for n in notes)
                if hasattr(error, "add_note") and not any(n.startswith(_NOTE) for n in notes):
                    error.add_note(self._describe_failure(action))
                raise
            self.recent.append(action)
            if record is not None:
                record.append(TimedAction(self.rank, action, start - origin, clock() - origin))
        self.current = None
        self.transport.flush()

    def _prefetch_next(self, actions: Sequence[Action], index: int, key_offset: int) -> None:
        """If the compute action after ``actions[index]`` is a backward of a stage that
        offloads, start bringing its activations back now, to overlap this action."""
        for later in actions[index + 1:]:
            if later.op.is_compute:
                if later.op in (Op.BACKWARD, Op.BACKWARD_INPUT) and later.microbatch is not None \
                        and later.stage in self.stages:
                    self.stages[later.stage].prefetch(later.microbatch + key_offset)
                return

    def _describe_failure(self, action: Action) -> str:
        note = f"{_NOTE} {self.rank} running action {action}"
        if action.op is Op.FORWARD and action.stage > 0 and not self._in_loss:
            note += (
                f" (stage {action.stage} on the output of stage {action.stage - 1}: "
                f"{describe_value(self._last_input)}); check that stage {action.stage - 1}'s output is "
                f"what stage {action.stage}'s first layer takes"
            )
        return note

    def _dispatch(self, action: Action, io: StepIO) -> None:
        op, j, i = action.op, action.stage, action.microbatch
        if i is None:
            shards, hooks = self.shards, self.hooks
            if op is Op.REDUCE_GRAD:
                if shards is not None:
                    shards.reduce(j)
                if hooks is not None:
                    hooks.reduce(j)
            elif op is Op.OPTIMIZER_STEP and hooks is not None:
                hooks.step(j)
            elif op is Op.UNSHARD and shards is not None:
                shards.unshard(j)
            elif op is Op.RESHARD and shards is not None:
                shards.reshard(j)
            return
        key = i + io.key_offset
        if op is Op.FORWARD:
            self._forward(j, i, io)
        elif op is Op.BACKWARD or op is Op.BACKWARD_INPUT:
            self._backward(j, i, io, split=op is Op.BACKWARD_INPUT)
        elif op is Op.BACKWARD_WEIGHT:
            self.stages[j].backward_weight(key)
        elif op is Op.SEND_FORWARD:
            value = self._outbox.pop((ACTIVATION, j, key))
            self.transport.send(Channel(ACTIVATION, j, j + 1), key, value)
        elif op is Op.SEND_BACKWARD:
            value = self._outbox.pop((GRADIENT, j, key))
            self.transport.send(Channel(GRADIENT, j, j - 1), key, value)
        elif op is Op.RECV_FORWARD:
            channel = Channel(ACTIVATION, j - 1, j)
            self._inbox[(ACTIVATION, j, key)] = self.transport.recv(channel, key)
        elif op is Op.RECV_BACKWARD:
            # rebuild a checkpointed graph while the gradient is still on its way
            self.stages[j].recompute(key)
            channel = Channel(GRADIENT, j + 1, j)
            self._inbox[(GRADIENT, j, key)] = self.transport.recv(channel, key)
        else:  # pragma: no cover - every Op is handled above
            raise NotImplementedError(f"action {action} is not supported by this runtime")

    def _forward(self, j: int, i: int, io: StepIO) -> None:
        stage = self.stages[j]
        key = i + io.key_offset
        if j == 0:
            assert io.inputs is not None, "the first stage needs StepIO.inputs"
            message = handoff(io.inputs[i])
        else:
            message = self._receive(ACTIVATION, j, key)
            self._last_input = message
        last = j == self.num_stages - 1
        target = io.targets[i] if last and io.targets is not None else None
        scale = io.loss_scales[i] if last and io.loss_scales is not None else None
        if isinstance(io.checkpointed, Mapping):
            checkpointed = i in io.checkpointed.get(j, ())
        elif io.checkpointed is not None:
            checkpointed = i in io.checkpointed
        else:
            checkpointed = io.checkpoint_start <= i < io.checkpoint_stop
        output, loss = stage.forward(
            key, message, checkpointed=checkpointed,
            target=target, loss_scale=scale,
        )
        self._last_input = None  # kept for an error's note only: do not hold the data
        if last:
            if loss is not None:
                io.losses[i] = loss.detach()
            else:
                io.outputs[i] = output
        else:
            self._deliver(ACTIVATION, j, key, output, local=self._local(j + 1, i))

    def _backward(self, j: int, i: int, io: StepIO, *, split: bool) -> None:
        stage = self.stages[j]
        key = i + io.key_offset
        grads: Any = None
        if j < self.num_stages - 1:
            grads = self._receive(GRADIENT, j, key)
        elif io.output_grads is not None:
            grads = io.output_grads[i]
        input_grads = stage.backward_input(key, grads) if split else stage.backward(key, grads)
        if j == 0:
            io.input_grads[i] = input_grads
        else:
            self._deliver(GRADIENT, j, key, input_grads, local=self._local(j - 1, i))

    def reset(self) -> None:
        """Forget everything in flight (after a failed step)."""
        self._inbox.clear()
        self._outbox.clear()
        self._preposted.clear()
        for stage in self.stages.values():
            stage.reset()


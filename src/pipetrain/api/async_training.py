"""Training without a flush: how an asynchronous schedule maps onto ``Pipeline.train_step``.

The pipeline keeps micro-batches in flight *across* ``train_step`` calls. Micro-batches
are numbered from the start of training (a step of ``n`` admits the next ``n``), and
step ``t`` runs one window of the schedule's stream (:class:`~pipetrain.schedule.AsyncStream`):
the forwards of batch ``t``'s micro-batches and the backwards and updates that
interleave with them, on every rank. The last ``w_j`` micro-batches of the batch stay in
flight on stage ``j`` (their activations, and the weight versions they use) until the
next step's window runs their backwards, so there is no flush between steps.

``train_step`` returns the mean loss of its own batch (known at its end: the last stage
runs a micro-batch's backward right after its forward). A *drain* (:meth:`Pipeline.drain`,
a flush) runs the backwards still pending; the pipeline drains before a save and before
a step with another micro-batch count. A drain keeps 2BW's rule (the next step still
uses the version before the last update) but is a flush for PipeDream: micro-batches
after it start with fresh weights on every stage, as at the start of training.
Evaluation needs no drain: it runs on every stage with the version the next training
micro-batch would use there.

A failed step loses the micro-batches in flight: the pipeline then refuses to train
until a checkpoint is loaded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch

from pipetrain.api.async_updates import AsyncUpdates
from pipetrain.api.config import PipelineConfig
from pipetrain.api.layout import Layout
from pipetrain.api.optimizer_step import StageOptimizers
from pipetrain.api.step_batches import StepBatches
from pipetrain.runtime.executor import RankExecutor, StepIO
from pipetrain.runtime.weight_versions import StageVersions
from pipetrain.schedule import ASYNC_SCHEDULES, Action, AsyncStream, Op, Schedule, add_communication
from pipetrain.schedule.steady_state import step_window

__all__ = ["AsyncTraining", "Shifted", "attach_async", "refuse_ties"]

T = TypeVar("T")
_SENT = {Op.SEND_FORWARD: (Op.RECV_FORWARD, 1), Op.SEND_BACKWARD: (Op.RECV_BACKWARD, -1)}
"""A send's receive, and the stage offset of the receiving stage."""


class Shifted(Sequence[T]):
    """The values of micro-batches ``first, first + 1, ...``, indexed by global number.

    Example:
        >>> Shifted(["a", "b"], first=10)[11]
        'b'
    """

    def __init__(self, values: Sequence[T], *, first: int) -> None:
        self.values, self.first = values, first

    def __getitem__(self, index: Any) -> Any:
        return self.values[index - self.first]

    def __len__(self) -> int:
        return self.first + len(self.values)

    def __iter__(self) -> Iterator[T]:
        return iter(self.values)


class AsyncTraining:
    """The asynchronous state of one rank of a pipeline: the stream, the stages' weight
    versions and the updates (see the module doc).

    Example::

        state = AsyncTraining("pipedream", layout=layout, rank=0, versions=versions,
                              updates=updates, checkpoint="never")
        actions, io = state.window(batches)   # what this rank runs for the step
    """

    def __init__(self, kind: str, *, layout: Layout, rank: int, executor: RankExecutor,
                 versions: Mapping[int, StageVersions], updates: AsyncUpdates, checkpoint: str,
                 vertical_sync: bool = False,
                 microbatches_per_step: int = 1) -> None:
        self.kind = kind
        self.layout = layout
        self.rank = rank
        self.executor = executor
        self.versions = dict(versions)
        """This rank's stages' weight versions."""
        self.updates = updates
        self.checkpoint = checkpoint
        self.stream = AsyncStream(kind, layout.replica_counts, vertical_sync=vertical_sync)
        self.count: int | None = None
        """Micro-batches per step since the last drain."""
        self.microbatches_per_step = microbatches_per_step
        """A full step's micro-batches (to continue a synchronous run's checkpoint)."""
        self.broken: str | None = None
        self._shares: Shifted[float] = Shifted([], first=0)

    @property
    def in_flight(self) -> bool:
        """Whether micro-batches are in flight (the same on every rank)."""
        return self.stream.in_flight

    def needs_drain(self, count: int) -> bool:
        """Whether a step of ``count`` micro-batches must drain the pipeline first."""
        return self.stream.in_flight and count != self.count

    # -- windows ------------------------------------------------------------------------
    def _mine(self, per_rank: list[list[Action]]) -> list[Action]:
        """This rank's part of a window, with its messages; the receives of the messages
        sent to it in the window that a later window takes are posted now."""
        schedule = add_communication(Schedule(
            name=self.kind, num_microbatches=max(self.stream.admitted, 1),
            stage_to_rank=tuple(group[0] for group in self.stream.groups),
            actions=tuple(tuple(acts) for acts in per_rank),
            replicas=self.stream.groups if max(self.stream.replicas) > 1 else (),
        ))
        mine = list(schedule.actions[self.rank])
        received = {(a.op, a.stage, a.microbatch) for a in mine}
        later = []
        for r, actions in enumerate(schedule.actions):
            for a in actions:
                if r == self.rank or a.microbatch is None or a.op not in _SENT:
                    continue
                receive, peer = _SENT[a.op]
                j, i = a.stage + peer, a.microbatch
                if schedule.rank_of(j, i) == self.rank and (receive, j, i) not in received:
                    later.append(Action(j, receive, i))
        if later:
            self.executor.expect_ahead(later)
        return mine

    def _plan(self, actions: list[Action], count: int) -> None:
        after = self.stream.next_forward_versions(count)[self.rank]
        for j, versions in self.versions.items():
            versions.plan([a.version for a in actions if a.op is Op.FORWARD and a.stage == j
                           and a.version is not None], after=after)

    def _check(self) -> None:
        if self.broken is not None:
            raise RuntimeError(
                f"the pipeline lost the micro-batches in flight of its {self.kind!r} schedule "
                f"when a step failed ({self.broken}); fix: load a checkpoint (Pipeline.load) "
                "before training on"
            )

    def window(self, batches: StepBatches) -> tuple[list[Action], StepIO]:
        """What this rank runs for a step on ``batches`` (drain first if
        :meth:`needs_drain`), and its inputs.

        Raises:
            ValueError: the step's micro-batch count does not fit the schedule.
        """
        self._check()
        count = len(batches.inputs)
        problem = self.stream.count_problem(count)
        if problem:
            raise ValueError(f"a step of {count} micro-batches: {problem}")
        if count != self.count:
            self.count = count
            per_step = count // self.layout.replica_counts[self.layout.position(self.rank)[0]]
            self.updates.set_updates_per_step(per_step if self.kind == "pipedream" else 1)
        first = self.stream.admitted
        actions = self._mine(self.stream.window(count))
        self._plan(actions, count)
        own = {a.microbatch for a in actions if a.op is Op.FORWARD and a.microbatch is not None}
        # PipeDream: each update follows one micro-batch's own mean loss (weighed after)
        scales = [1.0] * count if self.kind == "pipedream" else batches.scales
        io = StepIO(
            inputs=Shifted(batches.inputs, first=first),
            targets=Shifted(batches.targets, first=first),
            loss_scales=Shifted(scales, first=first),
            checkpointed=own if self.checkpoint == "always" else frozenset(),
        )
        self._shares = Shifted(batches.scales, first=first)
        return actions, io

    def step_schedule(self, count: int) -> Schedule:
        """A training step of ``count`` micro-batches in the steady state (for the
        simulator: the messages of other steps left out)."""
        stream = AsyncStream(self.kind, self.stream.replicas, vertical_sync=self.stream.vertical_sync)
        return step_window(stream, count)

    def weigh(self, io: StepIO) -> None:
        """Weigh each micro-batch's loss by its share of the batch (PipeDream)."""
        if self.kind == "pipedream":
            for i, loss in io.losses.items():
                io.losses[i] = loss * self._shares[i]

    def drain(self) -> tuple[list[Action], StepIO]:
        """What this rank runs to drain the pipeline (every rank calls it)."""
        self._check()
        actions = self._mine(self.stream.drain())
        self._plan(actions, self.count or self.stream.minimum_count())
        return actions, StepIO()

    def fail(self, error: BaseException) -> None:
        """A step failed: the micro-batches in flight are lost."""
        self.broken = f"{type(error).__name__}: {error}".splitlines()[0][:200]
        for versions in self.versions.values():
            versions.reset()

    # -- checkpoints --------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        """What a checkpoint (taken drained) records of the stream."""
        assert not self.in_flight, "a checkpoint is taken drained"
        return {"kind": self.kind, "admitted": self.stream.admitted,
                "steps": self.stream.num_batches}

    def tensors(self, names: Mapping[int, str]) -> dict[str, torch.Tensor]:
        """The older version 2BW keeps across a drain (by global parameter name; the
        version before the live one), empty otherwise."""
        found: dict[str, torch.Tensor] = {}
        for versions in self.versions.values():
            for version, tensors in versions.stashed().items():
                assert version == versions.version - 1, "only 2BW's previous version is kept"
                found.update({names[id(p)]: t for p, t in zip(versions.params, tensors)})
        return found

    def restore(self, meta: Mapping[str, Any] | None, tensors: Mapping[str, torch.Tensor],
                names: Mapping[int, str], *, step: int) -> None:
        """Continue after a checkpoint: ``meta`` of :meth:`meta` (``None``: a synchronous
        run's, taken after ``step`` full steps); 2BW's previous version from ``tensors``
        (absent: the delay restarts, the previous version is the loaded one)."""
        if meta is None:
            meta = {"admitted": step * self.microbatches_per_step, "steps": step}
        self.stream = AsyncStream(self.kind, self.stream.replicas,
                                  vertical_sync=self.stream.vertical_sync)
        self.stream.restart(admitted=int(meta["admitted"]), num_batches=int(meta["steps"]))
        self.count, self.broken = None, None
        for j, versions in self.versions.items():
            version = self.stream.updates(j)
            stashed = {}
            if self.kind == "2bw" and version > 0:
                previous = [tensors[names[id(p)]] if names[id(p)] in tensors else p.detach().clone()
                            for p in versions.params]
                stashed = {version - 1: previous}
            versions.restore(version, stashed)
            versions.plan([], after=version - 1 if stashed else version)


def attach_async(kind: str, *, config: PipelineConfig, layout: Layout, rank: int,
                 executor: RankExecutor, optimizers: StageOptimizers) -> AsyncTraining:
    """Give ``executor`` the weight versions of its stages and the asynchronous updates;
    the state that drives them.

    Example::

        pipe.async_state = attach_async("2bw", config=config, layout=layout, rank=rank,
                                        executor=executor, optimizers=optimizers)
    """
    versions = {j: StageVersions(params, stage_index=j)
                for j, params in optimizers.stage_params.items()}
    replicas = layout.replica_counts[layout.position(rank)[0]]
    updates = AsyncUpdates(optimizers, versions, replicas=replicas, average=kind == "pipedream")
    executor.versions = dict(versions)
    executor.hooks = updates
    return AsyncTraining(kind, layout=layout, rank=rank, executor=executor, versions=versions,
                         updates=updates,
                         checkpoint=config.checkpoint_modes[0], vertical_sync=config.vertical_sync,
                         microbatches_per_step=config.total_microbatches)


def refuse_ties(name: str, ties: Sequence[Any]) -> None:
    """Refuse tied weights under an asynchronous schedule.

    Example:
        >>> refuse_ties("1f1b", [((0, "w"), (3, "w"))])   # synchronous: fine

    Raises:
        ValueError: ``name`` is asynchronous and ``ties`` is not empty.
    """
    if name in ASYNC_SCHEDULES and ties:
        raise ValueError(
            f"schedule {name!r} cannot train tied weights {list(ties)}: its stages update at "
            "different times, so the copies of a tied weight on two stages would be different "
            "versions; fix: untie them (e.g. GPTConfig(tie_embeddings=False)) or a synchronous "
            "schedule such as '1f1b'"
        )

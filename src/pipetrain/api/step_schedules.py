"""The schedules a multi-process pipeline runs, one per micro-batch count, and what each
rank's part of them re-materializes.

A step of ``n`` micro-batches (all replicas together, dealt round-robin over each
stage's replicas) runs the validated schedule of the pipeline's layout for ``n``; rank
``r`` runs its action list. Schedules are built once per count and kept. A user
schedule (:mod:`pipetrain.api.user_schedule`) runs as written, for its own micro-batch
count only; evaluation runs the forward-only schedule on the training placement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipetrain.api.config import PipelineConfig
from pipetrain.api.layout import Layout
from pipetrain.schedule import Action, Op, Schedule, add_fsdp_actions, build_schedule, validate

__all__ = ["StepSchedules"]


@dataclass
class StepSchedules:
    """The schedules of one pipeline, by name and micro-batch count.

    Example:
        >>> from pipetrain.api.config import PipelineConfig
        >>> config = PipelineConfig(num_stages=2, stage_replicas=(2, 1), num_microbatches=2)
        >>> schedules = StepSchedules(config, Layout.create(config, num_layers=2))
        >>> [str(a) for a in schedules.actions("1f1b", 4, rank=1) if a.op.is_compute]
        ['0F1', '0F3', '0B1', '0B3']
        >>> schedules.checkpointed(("except_last", "never"), "1f1b", 4, rank=1)
        {0: frozenset({1})}
    """

    config: PipelineConfig
    layout: Layout
    _built: dict[tuple[str, int], Schedule] = field(default_factory=dict, repr=False)

    def get(self, name: str, num_microbatches: int) -> Schedule:
        """The validated schedule of ``num_microbatches`` micro-batches (all replicas).

        Raises:
            ValueError: the user schedule runs another number of micro-batches.
        """
        user = self.config.user_schedule
        if user is not None and name != "forward":
            if num_microbatches != user.num_microbatches:
                raise ValueError(
                    f"schedule {user.name!r} runs exactly {user.num_microbatches} micro-batches "
                    f"a step, not {num_microbatches}; fix: batches of at least "
                    f"{user.num_microbatches} samples (drop a smaller last batch)"
                )
            return user
        key = (name, num_microbatches)
        if key not in self._built:
            training = name != "forward"
            counts = self.layout.replica_counts
            schedule = build_schedule(
                name,
                num_ranks=self.config.num_stages,
                num_microbatches=num_microbatches,
                stages_per_rank=self.config.stages_per_rank,
                optimizer_step=training,
                reduce=training,
                replicas=counts if max(counts) > 1 else None,
                placement=None if training else self.layout.stage_to_rank,
                vertical_sync=self.config.vertical_sync and name == "pipedream",
            )
            if training and self._gathers_once(num_microbatches):
                schedule = add_fsdp_actions(schedule)
                validate(schedule)
            self._built[key] = schedule
        return self._built[key]

    def _gathers_once(self, num_microbatches: int) -> bool:
        """Whether a training step of ``num_microbatches`` gathers each FSDP stage once
        (``UNSHARD`` ... ``RESHARD``): always, unless ``reshard_after_forward`` has FSDP
        gather each layer for each forward and backward, which needs every replica to
        run as many micro-batches (each gather is a collective of all of them)."""
        if self.config.data_parallel != "fsdp":
            return False
        return not self.config.reshard_after_forward or not self._replicas_even(num_microbatches)

    def _replicas_even(self, num_microbatches: int) -> bool:
        """Whether every replica of a stage runs as many of ``num_microbatches``."""
        return num_microbatches % max(self.layout.replica_counts) == 0

    def reduces_each_microbatch(self, num_microbatches: int) -> bool:
        """Whether a training step of ``num_microbatches`` reduce-scatters each FSDP
        stage's gradients after every backward (``reduce_each_microbatch``): only where
        every replica runs as many micro-batches (each reduce-scatter is a collective of
        all of them); otherwise its ``REDUCE`` does, once."""
        return (self.config.data_parallel == "fsdp" and self.config.reduce_each_microbatch
                and self._replicas_even(num_microbatches))

    def check(self, name: str, num_microbatches: int) -> None:
        """Build the schedule once, to refuse at construction one that cannot run.

        Raises:
            ValueError: the schedule cannot run ``num_microbatches`` on these ranks.
        """
        try:
            self.get(name, num_microbatches)
        except ValueError as error:
            raise ValueError(
                f"schedule {name!r} cannot run {num_microbatches} micro-batches "
                f"on {self.config.num_stages} ranks: {error}"
            ) from None

    def actions(self, name: str, num_microbatches: int, *, rank: int) -> tuple[Action, ...]:
        """What global rank ``rank`` runs in that schedule."""
        return self.get(name, num_microbatches).actions[rank]

    def checkpointed(self, modes: tuple[str, ...], name: str, num_microbatches: int, *,
                     rank: int) -> dict[int, frozenset[int]]:
        """Per stage of rank ``rank``, the micro-batches it re-materializes (``modes``: one
        per model stage): all of its own (``always``), all but its last (``except_last``:
        the last one's backward comes first), or none (``never``, ``selective``,
        ``per_layer``)."""
        mine: dict[int, list[int]] = {}
        for a in self.actions(name, num_microbatches, rank=rank):
            if a.op is Op.FORWARD and a.microbatch is not None:
                mine.setdefault(a.stage, []).append(a.microbatch)
        chosen = {}
        for stage, microbatches in mine.items():
            mode = modes[stage]
            ordered = sorted(set(microbatches))
            chosen[stage] = frozenset(ordered if mode == "always" else ordered[:-1]
                                      if mode == "except_last" else ())
        return chosen

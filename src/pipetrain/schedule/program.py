"""The schedule container: per-rank action lists plus where each stage lives."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pipetrain.schedule.actions import Action, Op, format_actions

__all__ = ["Schedule", "loop_placement", "v_placement"]


def loop_placement(num_ranks: int, stages_per_rank: int = 1) -> tuple[int, ...]:
    """Stage ``j`` on rank ``j % num_ranks`` (Megatron-LM's interleaving).

    Example:
        >>> loop_placement(2, 2)
        (0, 1, 0, 1)
    """
    return tuple(j % num_ranks for j in range(num_ranks * stages_per_rank))


def v_placement(num_ranks: int) -> tuple[int, ...]:
    """Two stages per rank folded into a V: rank ``r`` holds stages ``r`` and ``2R-1-r``.

    Example:
        >>> v_placement(3)
        (0, 1, 2, 2, 1, 0)
    """
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))


@dataclass(frozen=True)
class Schedule:
    """What every rank of a pipeline does for one training (or evaluation) step.

    ``actions[r]`` is rank ``r``'s ordered action list; ``stage_to_rank[j]`` is the rank
    that holds stage ``j``. Generators build it; :func:`pipetrain.schedule.validate`
    checks it; :func:`pipetrain.schedule.simulate` times it; the runtimes execute it.

    A stage may be *replicated* (data parallelism inside the pipeline, PipeDream's
    1F1B-RR): ``replicas[j]`` lists every rank holding stage ``j`` (``stage_to_rank[j]``
    is the first), and micro-batch ``i`` of stage ``j`` runs on
    ``replicas[j][i % len(replicas[j])]`` (:meth:`rank_of`). Without ``replicas`` every
    stage has one rank.

    Example:
        >>> from pipetrain.schedule.actions import parse_actions
        >>> s = Schedule(
        ...     name="toy", num_microbatches=1, stage_to_rank=(0, 1),
        ...     actions=(tuple(parse_actions("0F0 0SF0 0RB0 0B0")),
        ...              tuple(parse_actions("1RF0 1F0 1B0 1SB0"))))
        >>> s.num_stages, s.num_ranks
        (2, 2)
        >>> print(s)
        rank 0: 0F0 0SF0 0RB0 0B0
        rank 1: 1RF0 1F0 1B0 1SB0
    """

    name: str
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    replicas: tuple[tuple[int, ...], ...] = ()
    """Per stage, every rank that holds it (empty: one rank per stage, ``stage_to_rank``)."""
    _stages_of_rank: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        num_ranks = len(self.actions)
        if not self.stage_to_rank:
            raise ValueError("a schedule needs at least one stage (stage_to_rank is empty)")
        bad = [r for r in self.stage_to_rank if not 0 <= r < num_ranks]
        if bad:
            raise ValueError(
                f"stage_to_rank {self.stage_to_rank} names ranks {bad} but the schedule has "
                f"action lists for {num_ranks} ranks"
            )
        if self.replicas:
            self._check_replicas(num_ranks)
        holders = self.replicas or tuple((r,) for r in self.stage_to_rank)
        stages = tuple(
            tuple(j for j, group in enumerate(holders) if r in group) for r in range(num_ranks)
        )
        object.__setattr__(self, "_stages_of_rank", stages)

    def _check_replicas(self, num_ranks: int) -> None:
        problems = []
        if len(self.replicas) != len(self.stage_to_rank):
            problems.append(f"{len(self.replicas)} replica groups for {len(self.stage_to_rank)} stages")
        for j, group in enumerate(self.replicas):
            if not group or len(set(group)) != len(group):
                problems.append(f"stage {j}'s replicas {group} must be distinct ranks, at least one")
            elif any(not 0 <= r < num_ranks for r in group):
                problems.append(f"stage {j}'s replicas {group} name ranks outside 0..{num_ranks - 1}")
            elif j < len(self.stage_to_rank) and group[0] != self.stage_to_rank[j]:
                problems.append(f"stage {j}'s first replica {group[0]} is not stage_to_rank[{j}] "
                                f"= {self.stage_to_rank[j]}")
        if problems:
            raise ValueError("invalid replicas: " + "; ".join(problems))

    @property
    def num_stages(self) -> int:
        """Number of stages ``K`` (virtual stages count individually)."""
        return len(self.stage_to_rank)

    @property
    def num_ranks(self) -> int:
        """Number of ranks (action lists)."""
        return len(self.actions)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` holds, in increasing order."""
        return self._stages_of_rank[rank]

    def rank_of(self, stage: int, microbatch: int | None = None) -> int:
        """The rank that runs ``microbatch`` of ``stage`` (without a micro-batch, or
        without replicas: the stage's first rank).

        Example:
            >>> s = Schedule(name="toy", num_microbatches=2, stage_to_rank=(0, 1),
            ...              actions=((), (), ()), replicas=((0,), (1, 2)))
            >>> s.rank_of(1, 0), s.rank_of(1, 1), s.stages_of(2)
            (1, 2, (1,))
        """
        if not self.replicas or microbatch is None:
            return self.stage_to_rank[stage]
        group = self.replicas[stage]
        return group[microbatch % len(group)]

    def ranks_of(self, stage: int) -> tuple[int, ...]:
        """Every rank that holds ``stage`` (its replicas)."""
        return self.replicas[stage] if self.replicas else (self.stage_to_rank[stage],)

    @property
    def is_training(self) -> bool:
        """True when the schedule has backward work (not forward-only)."""
        return any(a.op is not Op.FORWARD and a.op.is_compute for acts in self.actions for a in acts)

    def replace_actions(self, actions: Sequence[Sequence[Action]], *, name: str | None = None) -> Schedule:
        """A copy with other action lists (same placement and micro-batch count)."""
        return Schedule(
            name=self.name if name is None else name,
            num_microbatches=self.num_microbatches,
            stage_to_rank=self.stage_to_rank,
            actions=tuple(tuple(acts) for acts in actions),
            replicas=self.replicas,
        )

    def compute_only(self) -> Schedule:
        """A copy without communication actions."""
        return self.replace_actions(
            [[a for a in acts if not a.op.is_communication] for acts in self.actions]
        )

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: {format_actions(acts)}" for r, acts in enumerate(self.actions))

"""``PlannerConfig``: what the planner plans for (cluster, cost model, limits, choices).

Example:
    >>> from pipetrain.plan.topology import Topology
    >>> config = PlannerConfig(topology=Topology.flat(4, 1e9), schedules=("PipeDream-Flush",))
    >>> config.cost_model, config.schedules
    ('pipetrain', ('1f1b',))
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.plan.cost_models import DEFAULT_COST_MODEL
from pipetrain.plan.costs_pipetrain import FSDP_POLICIES, PLANNED_CHECKPOINTS
from pipetrain.plan.effort import DEFAULT_MAX_WORK
from pipetrain.plan.graph import DEFAULT_MAX_CUTS
from pipetrain.plan.topology import Topology
from pipetrain.schedule import ASYNC_SCHEDULES, TRAINING_SCHEDULES, build_schedule, canonical_name

__all__ = ["PLANNED_SCHEDULES", "PlannerConfig"]



def _one_stage_per_rank(name: str) -> bool:
    """Whether the schedule runs with one stage per rank (a plan gives each worker one)."""
    try:
        build_schedule(name, num_ranks=2, num_microbatches=4, communication=False)
    except ValueError:
        return False
    return True


PLANNED_SCHEDULES = tuple(s for s in TRAINING_SCHEDULES
                          if s not in ASYNC_SCHEDULES and _one_stage_per_rank(s))
"""The schedules the ``pipetrain`` cost model chooses from: every synchronous training
schedule the registry knows that runs one stage per rank (not the interleaved ones: a plan
gives each worker one stage; not the asynchronous ``pipedream`` and ``2bw``, whose stages
update on their own: the cost model predicts a synchronized step, so they are refused in
``schedules``; ``pipetrain train --plan FILE --schedule pipedream`` runs a plan's cut with
them)."""


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """What to plan for.

    ``schedules``, ``num_microbatches`` and ``checkpoints`` narrow the choices of the
    ``pipetrain`` cost model (None: all of them); ``num_microbatches`` counts the
    micro-batches of each replica of the first stage, as
    :class:`~pipetrain.api.config.PipelineConfig`, plan files and ``pipetrain train
    --microbatches`` do: a step runs that many times the first stage's replicas.

    Example:
        >>> from pipetrain.plan.topology import Topology
        >>> PlannerConfig(topology=Topology.flat(8, 1e9), straight=True).cost_model
        'pipetrain'
    """

    topology: Topology
    cost_model: str = DEFAULT_COST_MODEL
    memory_limit: float | None = None
    """Bytes per worker (None: no limit); one-level topologies only for now."""
    straight: bool = False
    """No replication: one worker per stage, as many stages as workers."""
    fewer_workers: bool = False
    """Leave workers idle when that is faster (PipeDream's ``--use_fewer_machines``)."""
    max_cuts: int = DEFAULT_MAX_CUTS
    schedules: tuple[str, ...] | None = None
    """The schedules to choose from (None: :data:`PLANNED_SCHEDULES`)."""
    num_microbatches: tuple[int, ...] | None = None
    """Micro-batches per replica of the first stage to choose from (None: every count of
    micro-batches per step that divides the profile's batch size, up to 64)."""
    checkpoints: tuple[str, ...] | None = None
    """Checkpoint modes to choose from (None: ``never``, and under a memory limit also
    ``except_last``, ``always`` and ``per-stage``: each stage its own fastest fitting
    mode, ``per_layer`` included, :mod:`pipetrain.plan.per_stage`)."""
    fsdp_policies: tuple[str, ...] = ("gathered",)
    """Where FSDP plans (under a memory limit) gather and reduce, to choose from: names of
    :data:`~pipetrain.plan.costs_pipetrain.FSDP_POLICIES` (``gathered``: parameters
    gathered once per step and gradients reduced once, pipetrain's default;
    ``reduce-each``, ``reshard``, ``lean``: less memory for more collectives)."""
    max_work: int | None = DEFAULT_MAX_WORK
    """The most steps the planner's programs may take (None: no limit); a plan that
    needs more is refused at once with :class:`~pipetrain.plan.effort.PlanTooLarge`,
    naming the fix (:mod:`pipetrain.plan.effort`)."""

    def __post_init__(self) -> None:
        problems = []
        if self.memory_limit is not None and not (
            isinstance(self.memory_limit, (int, float)) and self.memory_limit > 0
        ):
            problems.append(
                f"memory_limit={self.memory_limit!r} must be a number of bytes > 0 "
                f"(e.g. 16e9), or None for no limit"
            )
        elif self.memory_limit is not None and self.topology.num_levels > 1:
            problems.append(
                f"a memory limit works with a one-level topology only for now, and the "
                f"topology has {self.topology.num_levels} levels; plan for the flat cluster "
                f"(--workers {self.topology.num_workers} --bandwidth "
                f"{self.topology.levels[-1].bandwidth:g}) or drop --memory"
            )
        work = self.max_work
        if work is not None and (isinstance(work, bool) or not isinstance(work, int) or work < 1):
            problems.append(f"max_work={work!r} must be a whole number of steps >= 1 "
                            f"(e.g. {DEFAULT_MAX_WORK}), or None for no limit")
        problems += self._choice_problems()
        if problems:
            raise ValueError("; ".join(problems))

    def _choice_problems(self) -> list[str]:
        problems = []
        given = [name for name in ("schedules", "num_microbatches", "checkpoints")
                 if getattr(self, name) is not None]
        if given and self.cost_model != "pipetrain":
            problems.append(
                f"{', '.join(given)} are choices of the pipetrain cost model, not of "
                f"{self.cost_model!r}; fix: cost_model='pipetrain' (--cost-model pipetrain)"
            )
        if self.schedules is not None:
            names = []
            for name in self.schedules:
                try:
                    key = canonical_name(name)
                except ValueError:
                    key = ""
                if key not in PLANNED_SCHEDULES:
                    why = ("its stages update on their own, without a step the cost model "
                           "predicts" if key in ASYNC_SCHEDULES else
                           "it runs several stages per worker and a plan runs one"
                           if key in TRAINING_SCHEDULES else "no such schedule")
                    problems.append(
                        f"schedule {name!r} cannot be planned ({why}); choose from "
                        f"{', '.join(PLANNED_SCHEDULES)}"
                    )
                names.append(key)
            if not self.schedules:
                problems.append(f"schedules=() is empty; give some of {', '.join(PLANNED_SCHEDULES)}")
            object.__setattr__(self, "schedules", tuple(names))
        counts = self.num_microbatches
        if counts is not None and (not counts or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts)):
            problems.append(f"num_microbatches={counts!r} must be whole numbers >= 1, e.g. (8,)")
        modes = self.checkpoints
        if modes is not None and (not modes or any(m not in PLANNED_CHECKPOINTS for m in modes)):
            problems.append(
                f"checkpoints={modes!r} must be some of {', '.join(PLANNED_CHECKPOINTS)}"
            )
        policies = self.fsdp_policies
        if not policies or any(p not in FSDP_POLICIES for p in policies):
            problems.append(f"fsdp_policies={policies!r} must be some of "
                            f"{', '.join(FSDP_POLICIES)}")
        elif policies != ("gathered",) and self.cost_model != "pipetrain":
            problems.append(f"fsdp_policies are choices of the pipetrain cost model, not of "
                            f"{self.cost_model!r}; fix: cost_model='pipetrain'")
        return problems

"""The schedule registry: names (and aliases) to generators, and the validated build."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipetrain.schedule._args import check_counts
from pipetrain.schedule.async_stream import ASYNC_SCHEDULES
from pipetrain.schedule.dualpipe_v import dualpipe_v
from pipetrain.schedule.forward_only import forward_only
from pipetrain.schedule.gpipe import gpipe
from pipetrain.schedule.interleaved import interleaved_1f1b
from pipetrain.schedule.looped_bfs import looped_bfs
from pipetrain.schedule.lowering import add_communication, add_optimizer_step
from pipetrain.schedule.one_f_one_b import one_f_one_b
from pipetrain.schedule.pipedream import pipedream
from pipetrain.schedule.program import Schedule, loop_placement, v_placement
from pipetrain.schedule.replicated import replicated_pipeline, uniform_replicas
from pipetrain.schedule.two_bw import two_bw
from pipetrain.schedule.v_memory import v_half, v_min
from pipetrain.schedule.validate import validate
from pipetrain.schedule.zb_h2 import zb_h2
from pipetrain.schedule.zb_v import zb_v
from pipetrain.schedule.zero_bubble import zb_h1

__all__ = [
    "ASYNC_SCHEDULES",
    "SCHEDULE_ALIASES",
    "SCHEDULE_NAMES",
    "TRAINING_SCHEDULES",
    "V_SCHEDULES",
    "build_schedule",
    "canonical_name",
    "default_stages_per_rank",
    "get_generator",
    "schedule_placement",
    "stages_per_rank_range",
]

SCHEDULE_NAMES = (
    "gpipe",
    "1f1b",
    "interleaved-1f1b",
    "looped-bfs",
    "zb-h1",
    "zb-h2",
    "zb-v",
    "v-half",
    "v-min",
    "dualpipe-v",
    "pipedream",
    "2bw",
    "forward",
)
"""The schedules :func:`build_schedule` knows, by their canonical name."""

TRAINING_SCHEDULES = tuple(name for name in SCHEDULE_NAMES if name != "forward")
"""The schedules that train (every one but the forward-only schedule of evaluation)."""

SCHEDULE_ALIASES = {
    "pipedream-flush": "1f1b",
    "interleaved": "interleaved-1f1b",
    "zero-bubble": "zb-h1",
    "bfs": "looped-bfs",
    "zbv": "zb-v",
    "vhalf": "v-half",
    "vmin": "v-min",
    "dualpipev": "dualpipe-v",
    "forward-only": "forward",
    "inference": "forward",
    "pipedream-2bw": "2bw",
}
"""Other names accepted for the schedules."""

_GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved-1f1b": interleaved_1f1b,
    "zb-h1": zb_h1,
    "looped-bfs": looped_bfs,
    "zb-h2": zb_h2,
    "zb-v": zb_v,
    "v-half": v_half,
    "v-min": v_min,
    "dualpipe-v": dualpipe_v,
    "forward": forward_only,
    "pipedream": pipedream,
    "2bw": two_bw,
}

V_SCHEDULES = ("zb-v", "v-half", "v-min", "dualpipe-v")
"""The schedules with two stages per rank folded into a V (rank ``r`` holds stages
``r`` and ``2K-1-r``)."""

# stages per rank a schedule takes: (least, most); None: no upper bound
_STAGES_PER_RANK: dict[str, tuple[int, int | None]] = {
    "interleaved-1f1b": (2, None),
    "looped-bfs": (2, None),
    "zb-v": (2, 2),
    "v-half": (2, 2),
    "v-min": (2, 2),
    "dualpipe-v": (2, 2),
    "forward": (1, None),
}


def canonical_name(name: str) -> str:
    """The canonical name of a schedule name or alias (any case, ``_`` for ``-``).

    Example:
        >>> canonical_name("PipeDream_Flush")
        '1f1b'

    Raises:
        ValueError: the name is unknown; the message lists the known names.
    """
    key = name.strip().lower().replace("_", "-")
    key = SCHEDULE_ALIASES.get(key, key)
    if key not in _GENERATORS:
        aliases = ", ".join(f"{a} ({c})" for a, c in SCHEDULE_ALIASES.items())
        raise ValueError(
            f"unknown schedule {name!r}; known schedules: {', '.join(SCHEDULE_NAMES)} "
            f"(aliases: {aliases})"
        )
    return key


def get_generator(name: str) -> Callable[..., Schedule]:
    """The generator function of a schedule name or alias.

    Example:
        >>> get_generator("zero-bubble").__name__
        'zb_h1'
    """
    return _GENERATORS[canonical_name(name)]


def stages_per_rank_range(name: str) -> tuple[int, int | None]:
    """The least and the most stages per rank a schedule takes (``None``: no bound).

    Example:
        >>> stages_per_rank_range("zb-v"), stages_per_rank_range("1f1b")
        ((2, 2), (1, 1))
    """
    return _STAGES_PER_RANK.get(canonical_name(name), (1, 1))


def default_stages_per_rank(name: str) -> int:
    """Stages per rank a schedule runs unless told otherwise: its least.

    Example:
        >>> default_stages_per_rank("looped-bfs"), default_stages_per_rank("forward")
        (2, 1)
    """
    return stages_per_rank_range(name)[0]


def schedule_placement(name: str, num_ranks: int, stages_per_rank: int) -> tuple[int, ...]:
    """Where a schedule puts its stages: the rank of each stage.

    Example:
        >>> schedule_placement("zb-v", 2, 2), schedule_placement("interleaved", 2, 2)
        ((0, 1, 1, 0), (0, 1, 0, 1))
    """
    if canonical_name(name) in V_SCHEDULES:
        return v_placement(num_ranks)
    return loop_placement(num_ranks, stages_per_rank)


def _generate(key: str, num_ranks: int, num_microbatches: int, stages_per_rank: int,
              placement: Sequence[int] | None) -> Schedule:
    """The compute-only schedule of a canonical name."""
    if key in ("interleaved-1f1b", "looped-bfs"):
        return _GENERATORS[key](num_ranks, num_microbatches, stages_per_rank=stages_per_rank)
    if key == "forward":
        return forward_only(num_ranks * stages_per_rank, num_microbatches,
                            stages_per_rank=stages_per_rank, stage_to_rank=placement)
    return _GENERATORS[key](num_ranks, num_microbatches)


def build_schedule(
    name: str,
    *,
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int = 1,
    communication: bool = True,
    optimizer_step: bool = False,
    reduce: bool = False,
    replicas: Sequence[int] | None = None,
    placement: Sequence[int] | None = None,
    vertical_sync: bool = False,
    num_steps: int = 1,
) -> Schedule:
    """Generate a schedule by name, lower it as asked, and validate it.

    ``stages_per_rank > 1`` is for ``interleaved-1f1b`` and ``looped-bfs`` (at least
    2), ``zb-v`` and ``dualpipe-v`` (exactly 2) and ``forward``; ``placement`` (the rank
    of each stage) is for ``forward`` only, to evaluate with a training schedule's
    placement (default: looped). ``communication`` adds the sends and receives, ``optimizer_step`` the
    ``STEP`` s, ``reduce`` (with ``optimizer_step``) the gradient ``REDUCE`` s.
    ``replicas[p]`` gives pipeline rank ``p`` that many data-parallel replicas (see
    :mod:`pipetrain.schedule.replicated`): the schedule then has ``sum(replicas)`` ranks,
    and ``num_microbatches`` counts the micro-batches of all replicas together, dealt
    round-robin. The same count for every rank works with every schedule; different
    counts with ``gpipe``, ``1f1b`` and ``forward``.

    The asynchronous schedules (:data:`ASYNC_SCHEDULES`: ``pipedream``, ``2bw``) run
    ``num_steps`` steps of ``num_microbatches`` without flushes, then drain; their
    ``STEP`` s (and ``REDUCE`` s, with replicas) are part of them, whatever
    ``optimizer_step`` says. ``vertical_sync`` is ``pipedream``'s option.

    Example:
        >>> s = build_schedule("1f1b", num_ranks=2, num_microbatches=2, optimizer_step=True)
        >>> print(s)
        rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1 0STEP
        rank 1: 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1 1STEP

    Raises:
        ValueError: an unknown name, a count out of range, or options that do not fit
            the schedule; the message names the value and the fix.
    """
    key = canonical_name(name)
    check_counts(
        {
            "num_ranks": (num_ranks, 1),
            "num_microbatches": (num_microbatches, 1),
            "stages_per_rank": (stages_per_rank, 1),
        },
        context=key,
    )
    least, most = stages_per_rank_range(key)
    if least == most == 2 and stages_per_rank != 2:
        raise ValueError(
            f"{key} places exactly 2 stages per rank (a V: rank r holds stages r and "
            f"2K-1-r), got stages_per_rank={stages_per_rank}; fix: stages_per_rank=2"
        )
    if stages_per_rank < least:
        raise ValueError(
            f"{key} needs stages_per_rank >= {least}, got {stages_per_rank}; "
            f"e.g. stages_per_rank={least} (or use '1f1b' for one stage per rank)"
        )
    if most is not None and stages_per_rank > most:
        raise ValueError(
            f"{key} has one stage per rank, got stages_per_rank={stages_per_rank}; use "
            f"stages_per_rank=1, or 'interleaved-1f1b' for several stages per rank"
        )
    if placement is not None and key != "forward":
        raise ValueError(f"placement={tuple(placement)} is for 'forward' only; {key} places "
                         "its stages itself")
    if key in ASYNC_SCHEDULES:
        return _asynchronous(key, num_ranks, num_microbatches, replicas=replicas,
                             vertical_sync=vertical_sync, num_steps=num_steps,
                             communication=communication)
    if vertical_sync or num_steps != 1:
        raise ValueError(f"vertical_sync and num_steps are options of the asynchronous schedules "
                         f"({', '.join(ASYNC_SCHEDULES)}), not of {key!r}")
    if reduce and not optimizer_step:
        raise ValueError("reduce=True needs optimizer_step=True (the STEP waits for the REDUCE)")
    uneven = replicas is not None and len(set(replicas)) > 1
    if replicas is not None and len(replicas) != num_ranks:
        raise ValueError(
            f"replicas {list(replicas)} has {len(replicas)} entries for {num_ranks} ranks; "
            "fix: one replica count per pipeline rank"
        )
    if uneven:
        assert replicas is not None
        if stages_per_rank != 1:
            raise ValueError(
                f"replica counts {list(replicas)} differ between ranks: that needs one stage "
                f"per rank, got stages_per_rank={stages_per_rank}"
            )
        schedule = replicated_pipeline(key, replicas, num_microbatches)
    elif replicas is not None and replicas[0] > 1:
        schedule = uniform_replicas(
            lambda n: _generate(key, num_ranks, n, stages_per_rank, placement),
            num_microbatches,
            replicas[0],
        )
    else:
        schedule = _generate(key, num_ranks, num_microbatches, stages_per_rank, placement)
    if communication:
        schedule = add_communication(schedule)
    if optimizer_step:
        schedule = add_optimizer_step(schedule, reduce=reduce)
    validate(schedule)
    return schedule


def _asynchronous(key: str, num_ranks: int, num_microbatches: int, *,
                  replicas: Sequence[int] | None, vertical_sync: bool, num_steps: int,
                  communication: bool) -> Schedule:
    """The validated schedule of an asynchronous schedule (its steps are its own)."""
    if replicas is not None and len(replicas) != num_ranks:
        raise ValueError(
            f"replicas {list(replicas)} has {len(replicas)} entries for {num_ranks} ranks; "
            "fix: one replica count per pipeline rank"
        )
    if key == "pipedream":
        schedule = pipedream(num_ranks, num_microbatches, vertical_sync=vertical_sync,
                             replicas=replicas, num_steps=num_steps)
    elif vertical_sync:
        raise ValueError(f"vertical_sync is an option of 'pipedream', not of {key!r}")
    else:
        schedule = two_bw(num_ranks, num_microbatches, replicas=replicas, num_steps=num_steps)
    if communication:
        schedule = add_communication(schedule)
    validate(schedule)
    return schedule

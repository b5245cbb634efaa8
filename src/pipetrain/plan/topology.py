"""The cluster a plan is for: levels of workers and the bandwidth between them.

A topology is a list of levels, innermost first, as PipeDream's hierarchical optimizer
takes them: ``Level(num_workers=8, bandwidth=300e9)`` is 8 GPUs inside one server
connected at 300 GB/s; a second ``Level(num_workers=4, bandwidth=25e9)`` puts 4 such
servers together at 25 GB/s, 32 workers in all. A one-level topology is a flat cluster.

Bandwidths are bytes per second; they are what PipeDream's cost model divides parameter
and activation bytes by.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipetrain.counts import count_of

__all__ = ["Level", "Topology"]


@dataclass(frozen=True, kw_only=True)
class Level:
    """One level of a topology: how many units it groups, and their bandwidth.

    Example:
        >>> Level(num_workers=8, bandwidth=300e9)
        Level(num_workers=8, bandwidth=300000000000.0)
    """

    num_workers: int
    """Units at this level (GPUs at the innermost level, servers above it)."""
    bandwidth: float
    """Bytes per second between the units of this level."""

    def __post_init__(self) -> None:
        problems = _level_problems(0, self.num_workers, self.bandwidth)
        if problems:
            raise ValueError("; ".join(problems))
        object.__setattr__(self, "bandwidth", float(self.bandwidth))


def _level_problems(index: int, num_workers: object, bandwidth: object) -> list[str]:
    problems = []
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        problems.append(
            f"level {index}: num_workers={num_workers!r} must be a whole number >= 1 "
            f"(e.g. 8 GPUs per server)"
        )
    if (
        isinstance(bandwidth, bool)
        or not isinstance(bandwidth, (int, float))
        or not math.isfinite(bandwidth)
        or bandwidth <= 0
    ):
        problems.append(
            f"level {index}: bandwidth={bandwidth!r} must be a finite number of bytes per "
            f"second > 0 (e.g. 25e9 for 25 GB/s)"
        )
    return problems


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Levels of workers, innermost first.

    Example:
        >>> t = Topology.from_lists([8, 4], [300e9, 25e9])
        >>> t.num_workers, t.num_levels, t.describe()
        (32, 2, '8 x 4 workers (8 at 3e+11 B/s, 4 at 2.5e+10 B/s)')
    """

    levels: tuple[Level, ...]

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError("a topology needs at least one level, e.g. Topology.flat(4, 1e9)")
        object.__setattr__(self, "levels", tuple(self.levels))

    @staticmethod
    def flat(num_workers: int, bandwidth: float) -> Topology:
        """A one-level topology: ``num_workers`` workers at ``bandwidth`` bytes/s."""
        return Topology(levels=(Level(num_workers=num_workers, bandwidth=bandwidth),))

    @staticmethod
    def from_lists(
        workers: Sequence[int], bandwidths: Sequence[float], *, spell: tuple[str, str] = ("workers", "bandwidths")
    ) -> Topology:
        """Levels from parallel lists (innermost first), as the CLI's ``--workers`` and
        ``--bandwidth`` give them; every problem is reported at once.

        ``spell`` names the two lists in messages (the CLI passes its flags).
        """
        problems = []
        if len(workers) != len(bandwidths):
            problems.append(
                f"{spell[0]} has {len(workers)} value(s) {list(workers)} but {spell[1]} has "
                f"{len(bandwidths)} {list(bandwidths)}: give one bandwidth per level, innermost "
                f"first (e.g. {spell[0]} 8 4 and {spell[1]} 300e9 25e9 for 4 servers of 8 GPUs)"
            )
        if not workers:
            problems.append(f"{spell[0]} is empty: give the number of workers, e.g. 4")
        for index, (n, b) in enumerate(zip(workers, bandwidths)):
            problems.extend(_level_problems(index, n, b))
        if problems:
            raise ValueError("; ".join(problems))
        return Topology(
            levels=tuple(Level(num_workers=n, bandwidth=b) for n, b in zip(workers, bandwidths))
        )

    @property
    def num_levels(self) -> int:
        return len(self.levels)

    @property
    def num_workers(self) -> int:
        """All workers: the product of the levels' counts."""
        return math.prod(level.num_workers for level in self.levels)

    def describe(self) -> str:
        """A one-line description (``'4 workers at 1e+09 B/s'``)."""
        if len(self.levels) == 1:
            level = self.levels[0]
            return f"{count_of(level.num_workers, 'worker')} at {level.bandwidth:.3g} B/s"
        counts = " x ".join(str(level.num_workers) for level in self.levels)
        parts = ", ".join(f"{lv.num_workers} at {lv.bandwidth:.3g} B/s" for lv in self.levels)
        return f"{counts} workers ({parts})"

    def to_dict(self) -> dict[str, Any]:
        """JSON form: ``{"levels": [{"num_workers": 8, "bandwidth": 3e11}, ...]}``."""
        return {
            "levels": [
                {"num_workers": lv.num_workers, "bandwidth": lv.bandwidth} for lv in self.levels
            ]
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Topology:
        """Read :meth:`to_dict`'s form."""
        levels = data.get("levels")
        if not isinstance(levels, list):
            raise ValueError(f"topology: 'levels' must be a list, got {levels!r}")
        return Topology.from_lists(
            [lv.get("num_workers") for lv in levels], [lv.get("bandwidth") for lv in levels]
        )

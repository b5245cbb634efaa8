"""How busy the machine was while we measured, and what machine it was.

On a shared machine anything else running shows up directly in the figures. Each rank
opens a :class:`CpuWindow` at the same barrier before a timed loop and closes it at the
same barrier after; :func:`foreign_load` then tells how many cores *other* processes
used on average in between (the machine's busy CPU time from ``/proc/stat`` minus every
rank's own CPU time).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["CpuWindow", "busy_seconds", "foreign_load", "load_line", "machine_info",
           "usable_cores"]


def busy_seconds() -> float | None:
    """CPU seconds all processes of the machine have used since boot (``/proc/stat``)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class CpuWindow:
    """Wall time, machine-wide busy CPU time and this process's CPU time over a window;
    every rank opens and closes it at the same barriers.

    Example:
        >>> window = CpuWindow()
        >>> sorted(window.close())
        ['machine_busy_s', 'own_cpu_s', 'wall_s']
    """

    def __init__(self) -> None:
        self.start = (time.perf_counter(), busy_seconds(), time.process_time())
        self.result: dict[str, float | None] = {}

    def close(self) -> dict[str, float | None]:
        """Close the window; its figures (also kept as :attr:`result`)."""
        wall0, busy0, own0 = self.start
        busy1 = busy_seconds()
        self.result = {"wall_s": time.perf_counter() - wall0,
                       "machine_busy_s": None if busy0 is None or busy1 is None else busy1 - busy0,
                       "own_cpu_s": time.process_time() - own0}
        return self.result


def foreign_load(windows: Sequence[dict[str, float | None]]) -> dict[str, float | None]:
    """Cores used by other processes on average during the window (rank 0's machine
    figures minus every rank's own CPU time), and ours.

    Example:
        >>> foreign_load([{"wall_s": 2.0, "machine_busy_s": 3.0, "own_cpu_s": 1.0},
        ...               {"wall_s": 2.0, "machine_busy_s": 3.0, "own_cpu_s": 1.0}])
        {'wall_s': 2.0, 'our_cores': 1.0, 'other_cores': 0.5}
    """
    wall = windows[0]["wall_s"]
    busy = windows[0]["machine_busy_s"]
    own = sum(w["own_cpu_s"] or 0.0 for w in windows)
    if busy is None or not wall:
        return {"wall_s": wall, "our_cores": own / wall if wall else None, "other_cores": None}
    return {"wall_s": wall, "our_cores": own / wall, "other_cores": max(0.0, busy - own) / wall}


def load_line(load: dict[str, Any]) -> str:
    """One line of the report about :func:`foreign_load`'s figures."""
    other = load.get("other_cores")
    ours = load.get("our_cores")
    text = "unknown (no /proc/stat)" if other is None else f"{other:.2f} cores"
    mine = "-" if ours is None else f"{ours:.2f}"
    return (f"machine load during the timed loop: other processes {text}, ours "
            f"{mine} cores, of {os.cpu_count()}")


def usable_cores() -> int | None:
    """The cores this process may run on (its CPU affinity; ``None`` where the system does
    not say).

    Example:
        >>> usable_cores() >= 1
        True
    """
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def machine_info() -> dict[str, Any]:
    """CPUs, torch and Python versions, and the load average now.

    Example:
        >>> "loadavg_start" in machine_info()
        True
    """
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpu_count": os.cpu_count(),
        "affinity_cpus": usable_cores(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_start": list(load) if load else None,
    }

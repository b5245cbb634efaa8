"""What a ``pipetrain bench`` run records about itself: the machine, the versions, the command, the date.

Every result file carries it, and every table generated into the docs states it, so
that a figure can be traced to the run that produced it. Versions are read from the
installed distributions (``importlib.metadata``): nothing optional is imported.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
from typing import Any

from pipetrain.bench.harness.machine import usable_cores

__all__ = ["PACKAGES", "load_average", "machine", "run_metadata", "versions"]

PACKAGES = ("torch", "pipetrain", "torchgpipe", "transformers")
"""The distributions whose versions a run records (besides Python's)."""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages now (``None`` where the system has none).

    Example:
        >>> value = load_average()
        >>> value is None or len(value) == 3
        True
    """
    if not hasattr(os, "getloadavg"):
        return None
    return [round(v, 2) for v in os.getloadavg()]


def machine() -> dict[str, Any]:
    """The CPU model, its cores (all, and those this process may use), the memory and
    the operating system.

    Example:
        >>> sorted(machine())
        ['cores', 'cpu_model', 'memory_bytes', 'platform', 'usable_cores']
    """
    return {"cpu_model": _cpu_model(), "cores": os.cpu_count(), "usable_cores": usable_cores(),
            "memory_bytes": _memory_bytes(), "platform": platform.platform()}


def versions() -> dict[str, str | None]:
    """Python's version and those of :data:`PACKAGES` (``None``: not installed).

    Example:
        >>> sorted(versions())
        ['pipetrain', 'python', 'torch', 'torchgpipe', 'transformers']
    """
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    if found["pipetrain"] is None:  # run from a source tree without installing it
        import pipetrain

        found["pipetrain"] = pipetrain.__version__
    return found


def run_metadata(command: str) -> dict[str, Any]:
    """The date (local time, with its offset), the command line, the machine (with the
    load average now) and the versions: what the suite writes beside each result.

    Example:
        >>> info = run_metadata("pipetrain bench transport --quick")
        >>> info["command"], sorted(info)
        ('pipetrain bench transport --quick', ['command', 'date', 'machine', 'versions'])
    """
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return {"date": date, "command": command,
            "machine": {**machine(), "load_average_before": load_average()},
            "versions": versions()}

"""Peak memory of a region of a benchmark process: RSS growth on the CPU, the CUDA
caching allocator's peak on a GPU.

On the CPU, the figure is the growth of the process's resident set (``VmHWM`` minus the
resident size at the start, from ``/proc/self/status``; the high-water mark is reset by
writing ``5`` to ``/proc/self/clear_refs``, Linux 4.0+). It is what the operating system
must give the process, so it includes what the C allocator keeps after a free (free
chunks in the arenas of the threads that allocated) and code pages loaded on first use;
the start is taken after ``malloc_trim(0)`` (glibc) so that memory freed before the
region does not hide growth in it. On a GPU, the figure is
``torch.cuda.max_memory_allocated()`` minus the memory allocated at the start (tensors
only; the caching allocator's reserve is not counted).

Example (in a benchmark's own process: the CPU figure is the whole process's)::

    meter = PeakMemory([torch.device("cpu")])
    meter.start()
    step()
    grown = meter.peak_mib()   # MiB above the start
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys

import torch

__all__ = ["PeakMemory", "memory_available"]

_MIB = float(1 << 20)


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def memory_available(devices: list[torch.device]) -> bool:
    """Whether peak memory can be measured for ``devices`` here.

    Example:
        >>> isinstance(memory_available([torch.device("cpu")]), bool)
        True
    """
    if all(d.type == "cuda" for d in devices) and devices:
        return torch.cuda.is_available()
    return sys.platform.startswith("linux") and _status_kib("VmHWM") is not None


def _trim() -> None:
    """Give the C allocator's free memory back to the system (glibc), if it can."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


class PeakMemory:
    """Measures the peak memory of the region from :meth:`start` to :meth:`peak_mib`:
    RSS growth if any of ``devices`` is the CPU, else the sum over the GPUs of each
    one's allocator peak.

    Example::

        meter = PeakMemory([torch.device("cpu")])
        meter.start()
        step()
        grown = meter.peak_mib()
    """

    def __init__(self, devices: list[torch.device]) -> None:
        self.cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
        self.on_cpu = any(d.type != "cuda" for d in devices) or not self.cuda
        self._start: dict[int, int] = {}

    def start(self) -> None:
        """Begin the region (resets the high-water mark)."""
        if self.on_cpu:
            _trim()
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # VmHWM := VmRSS
            self._start = {-1: (_status_kib("VmRSS") or 0) * 1024}
            return
        for index in self.cuda:
            torch.cuda.synchronize(index)
            torch.cuda.reset_peak_memory_stats(index)
            self._start[index] = torch.cuda.memory_allocated(index)

    def peak_mib(self) -> float:
        """MiB above the start at the region's peak so far."""
        if self.on_cpu:
            return ((_status_kib("VmHWM") or 0) * 1024 - self._start[-1]) / _MIB
        total = 0
        for index in self.cuda:
            torch.cuda.synchronize(index)
            total += torch.cuda.max_memory_allocated(index) - self._start[index]
        return total / _MIB

"""Host memory a CPU worker frees, kept for its next step (glibc's malloc thresholds).

A GPU worker's tensors come from torch's caching allocator, which keeps what a step
frees for the next. A CPU worker's come from the C library's ``malloc``, and glibc gives
large blocks back to the operating system when they are freed (blocks above its mmap
threshold, and the free top of its heap above its trim threshold): the next step's
activations then arrive as fresh pages, each zeroed by the kernel on first touch. On
the compute-bound GPT of the benchmarks (8 blocks of width 256, 1 thread per rank) the
first rank of a GPipe step page-faulted 164 MiB a step that way, about 5% of its step.

:func:`keep_freed_memory` raises both thresholds, as a caching allocator would keep the
memory: the resident memory of the process stays at its peak instead of following the
live tensors. ``pipetrain train`` does it in every worker on the CPU (``--host-memory
release`` leaves glibc's defaults); a program of its own calls it once at start-up.
"""

from __future__ import annotations

import ctypes
import platform
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["HOST_MEMORY", "KEEP_MMAP_THRESHOLD", "KEEP_TRIM_THRESHOLD", "host_memory_setting",
           "keep_freed_memory"]

KEEP_MMAP_THRESHOLD = 1 << 26
"""Blocks up to 64 MiB come from the heap (and go back to it when freed)."""
KEEP_TRIM_THRESHOLD = 1 << 30
"""The heap's free top is given back to the system only above 1 GiB."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
HOST_MEMORY = ("keep", "release")
"""The choices of ``pipetrain train --host-memory``."""


def keep_freed_memory(*, mmap_threshold: int = KEEP_MMAP_THRESHOLD,
                      trim_threshold: int = KEEP_TRIM_THRESHOLD) -> bool:
    """Keep the memory this process frees for its next allocations (see the module).

    Returns whether the C library took the settings: ``False`` where it is not glibc
    (nothing changes there). Process-wide and for the rest of the process; a fixed
    threshold also ends glibc's own raising of the mmap threshold after frees.

    Example::

        from pipetrain.runtime.host_memory import keep_freed_memory

        keep_freed_memory()          # once, before training on the CPU
    """
    for name, value in (("mmap_threshold", mmap_threshold), ("trim_threshold", trim_threshold)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 1 << 31:
            raise ValueError(f"{name}={value!r} must be a positive number of bytes below "
                             "2 GiB (glibc takes an int)")
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def host_memory_setting(choice: str, device: torch.device) -> str:
    """Apply ``choice`` (one of :data:`HOST_MEMORY`) in a worker whose stages run on
    ``device``; what its malloc does with freed memory, in words (a run's records).

    Example::

        host_memory_setting("keep", torch.device("cpu"))
        # "kept: glibc's mmap threshold 64 MiB, trim threshold 1024 MiB"
    """
    if choice not in HOST_MEMORY:
        raise ValueError(f"host memory {choice!r}: choose one of {', '.join(HOST_MEMORY)}")
    if device.type != "cpu":
        return "not applied: the stages run on a GPU"
    if choice == "release":
        return "released: glibc's defaults"
    if keep_freed_memory():
        return (f"kept: glibc's mmap threshold {KEEP_MMAP_THRESHOLD >> 20} MiB, trim threshold "
                f"{KEEP_TRIM_THRESHOLD >> 20} MiB")
    return "released: the C library is not glibc, its defaults apply"

"""This process's resident memory, as the memory tests read it."""

from __future__ import annotations


def anonymous_bytes() -> int:
    """This process's resident anonymous memory: what it allocated, not the file pages it
    maps (page cache the kernel may drop: the kernel maps a whole large folio of a file on
    one fault, so a few windows show tens of MiB of the file as resident)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))

"""Finding a local job's worker processes from its launcher's pid (through /proc)."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    """The child processes of ``pid``."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(p) for p in (task / "children").read_text().split()]
    return found


def worker_rank(pid: int) -> int | None:
    """The ``RANK`` of process ``pid`` (None: gone, or not a worker)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(e[5:]) for e in environ if e.startswith(b"RANK=")), None)

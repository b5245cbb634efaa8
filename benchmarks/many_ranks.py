"""A job of 64 worker processes on this one machine starts, trains, and names a worker
killed with ``kill -9``; the failure detector's load on the store per rank does not grow
with the job::

    python benchmarks/many_ranks.py [--quick] [--out RESULT.json]

``pipetrain train`` runs a tiny GPT (2 blocks of width 16, context 16) as 4 stages x
R / 4 replicas (1F1B, 4 micro-batches per replica), for R = 4 and R = 64 worker
processes, 10 steps each: the table gives the time to the first step, the median step,
and each rank's calls to the c10d store per second over the run (``metrics.json``'s
``monitor``: the failure detector's heartbeat, its two neighbours on a ring and the
root-cause key). Then a job of R = 64 runs until its third step is recorded and worker
rank 37 is killed with SIGKILL: the time until the launcher has ended with its one-line
error naming that rank, against ``--timeout``. ``--quick``: R = 3 and 4, rank 3 killed.
Prints the tables (and writes them with the raw figures as JSON with ``--out``). It is not a
case of ``pipetrain bench``: it measures no speed against an anchor, and its 64 processes
take the machine for several minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pipetrain.bench.case import Goal, Table

__all__ = ["layout", "main", "run", "worker_pids"]

_TINY = ["--layers", "2", "--width", "16", "--heads", "2", "--context", "16",
         "--microbatches", "4", "--eval-every", "0", "--sample-bytes", "0"]
TIMEOUT = 120
"""``--timeout`` of the killed job (seconds any wait may take)."""


def layout(ranks: int) -> list[str]:
    """The ``pipetrain train`` options of a job of ``ranks`` workers: 4 stages (fewer when
    fewer ranks) and the rest replicas, 4 sequences per replica.

    Example:
        >>> layout(64)
        ['--stages', '4', '--replicas', '16', '--batch-size', '64']
    """
    stages = min(4, ranks)
    replicas = ranks // stages
    return ["--stages", str(stages), "--replicas", str(replicas),
            "--batch-size", str(4 * replicas)]


def worker_pids(launcher: int) -> dict[int, int]:
    """``{rank: pid}`` of a local job's workers, the launcher's children (``/proc``)."""
    found: dict[int, int] = {}
    for task in Path(f"/proc/{launcher}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            rank = next((int(e[5:]) for e in environ if e.startswith(b"RANK=")), None)
            if rank is not None:
                found[rank] = int(pid)
    return found


def _command(ranks: int, folder: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pipetrain", "train", *_TINY, *layout(ranks), *extra,
            "--out", str(folder)]


def _trained(ranks: int, folder: Path) -> dict[str, Any]:
    """Train 10 steps with ``ranks`` workers; the start-up, the steps and the store load."""
    began = time.perf_counter()
    done = subprocess.run(_command(ranks, folder, "--steps", "10"), capture_output=True,
                          text=True, timeout=1800)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{ranks} ranks: pipetrain train failed: {done.stderr[-2000:]}")
    metrics = json.loads((folder / "metrics.json").read_text())
    seconds = [s["seconds"] for s in metrics["steps"]]
    calls = [entry["store_calls_per_s"] for entry in metrics["monitor"]]
    return {"ranks": ranks, "wall_s": wall, "steps": len(seconds),
            "first_step_s": seconds[0], "median_step_s": statistics.median(seconds[1:]),
            "store_calls_per_s": calls}


def _killed(ranks: int, victim: int, folder: Path) -> dict[str, Any]:
    """Run until the third step is recorded, kill worker ``victim`` with SIGKILL; how long
    the launcher took to end and whether its last line names the rank."""
    launcher = subprocess.Popen(_command(ranks, folder, "--steps", "100000", "--timeout",
                                         str(TIMEOUT)),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 1800
        steps = folder / "steps.jsonl"
        while time.monotonic() < deadline and launcher.poll() is None:
            if steps.exists() and len(steps.read_text().splitlines()) >= 3:
                pids = worker_pids(launcher.pid)
                if victim in pids:
                    break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"{ranks} ranks: no third step (or no rank {victim}) in time")
        at_step = len(steps.read_text().splitlines())
        os.kill(pids[victim], signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = launcher.communicate(timeout=3 * TIMEOUT)
        ended = time.monotonic() - killed
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    named = re.search(rf"worker rank {victim} \(.*\) was killed by SIGKILL", last) is not None
    return {"ranks": ranks, "victim": victim, "after_step": at_step, "seconds": ended,
            "returncode": launcher.returncode, "named": named, "last_line": last}


def run(*, quick: bool) -> dict[str, Any]:
    """Train at two sizes, then kill a worker of the larger job: the tables and figures."""
    sizes, victim = ((3, 4), 3) if quick else ((4, 64), 37)
    results = []
    with tempfile.TemporaryDirectory(prefix="pipetrain-many-ranks-") as scratch:
        for ranks in sizes:
            print(f"{ranks} ranks: 10 steps", file=sys.stderr)
            results.append(_trained(ranks, Path(scratch) / f"train{ranks}"))
        print(f"{sizes[-1]} ranks: kill -9 of rank {victim}", file=sys.stderr)
        kill = _killed(sizes[-1], victim, Path(scratch) / "kill")
    rows = [[r["ranks"], round(r["wall_s"], 1), round(r["first_step_s"], 2),
             round(r["median_step_s"], 3), round(statistics.median(r["store_calls_per_s"]), 2),
             round(max(r["store_calls_per_s"]), 2)] for r in results]
    few, many = (statistics.median(r["store_calls_per_s"]) for r in results)
    growth = many / few if few else None
    train = Table(
        title="Many worker processes on one machine: start-up, steps and the failure "
              "detector's store calls per rank",
        columns=["ranks", "job wall s (start-up, 10 steps, records)", "first step s",
                 "median step s", "store calls/s per rank (median)",
                 "store calls/s per rank (most)"],
        rows=rows,
        anchor=f"the {sizes[0]}-rank job (its store calls per rank)",
        notes="4 stages x ranks/4 replicas (fewer stages when fewer ranks), a GPT of 2 blocks "
              "of width 16, 1F1B, 4 micro-batches per replica; the workers share this "
              "machine's cores. Store calls: the failure detector's, from each rank's "
              "metrics.json monitor record.",
        key="train",
        goals=[Goal.at_most(f"store calls per rank, {sizes[1]} ranks / {sizes[0]}", growth, 1.5,
                            unit="x")])
    killed = Table(
        title=f"kill -9 of worker rank {victim} of {sizes[-1]}: the time until the launcher "
              "ends naming it",
        columns=["ranks", "killed rank", "after step", "seconds to the launcher's end",
                 "--timeout s", "return code", "last line names the rank", "last line"],
        rows=[[kill["ranks"], victim, kill["after_step"], round(kill["seconds"], 1), TIMEOUT,
               kill["returncode"], kill["named"], kill["last_line"]]],
        anchor="--timeout",
        notes="Killed once the third step is in steps.jsonl; timed from the kill to the "
              "launcher's exit.",
        key="kill",
        goals=[Goal.at_most("seconds to name the killed rank", kill["seconds"] if kill["named"]
                            else None, TIMEOUT, unit=" s")])
    return {"tables": [train.to_dict(), killed.to_dict()], "train": results, "kill": kill,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "cores": os.cpu_count()}


def main(argv: list[str] | None = None) -> int:
    """Run, print each table as Markdown with its goals, and write ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 and 4 ranks instead of 4 and 64")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)
    result = run(quick=args.quick)
    for table in result["tables"]:
        print(f"**{table['title']}**\n")
        print("| " + " | ".join(table["columns"]) + " |")
        print("|" + "---|" * len(table["columns"]))
        for row in table["rows"]:
            print("| " + " | ".join(str(cell) for cell in row) + " |")
        for goal in table.get("goals", []):
            print(f"\n- {Goal.from_dict(goal).text()}")
        print()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

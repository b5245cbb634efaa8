"""``pipetrain bench``: run the benchmark suite (all cases or some), one JSON file per case."""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path
from typing import Any

from pipetrain.bench.registry import available, case_names, check_names
from pipetrain.bench.suite import run_suite

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``bench`` sub-command."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="run the benchmark suite: pipetrain beside its anchors, as JSON",
        description=(
            "Run benchmark cases (all in the suite's order, or the NAMES given in their "
            "order): each measures pipetrain beside its anchors (torch.distributed."
            "pipelining, torchgpipe, plain PyTorch, PipeDream's optimizer) in the same run "
            "and writes "
            "OUT/<name>.json (tables, data, wall time, status, machine, versions, command, "
            "date) and OUT/summary.json. Progress goes to stderr. The tables of "
            "docs/benchmarks.md are generated from these files: python -m "
            "pipetrain.bench.docs OUT."
        ),
    )
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help="cases to run (default: all); see --list")
    parser.add_argument("--quick", action="store_true",
                        help="reduced sizes: the whole suite in a few minutes on 2 cores "
                             "(a smoke run; its figures are not the documented ones)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="folder for the results (default bench-results/<date-time>)")
    parser.add_argument("--list", action="store_true",
                        help="list the cases (title, expected seconds, whether they run here)")
    parser.set_defaults(run=run)
    return parser


def _fail(message: str) -> int:
    sys.stderr.write(f"pipetrain bench: error: {message}\n")
    return 2


def _progress(line: str) -> None:
    sys.stderr.write(f"pipetrain bench: {line}\n")
    sys.stderr.flush()


def _list() -> int:
    entries = available()
    width = max(len(e.name) for e in entries)
    for entry in entries:
        times = f"~{entry.quick_seconds:.0f} s quick, ~{entry.full_seconds:.0f} s full"
        line = f"{entry.name:<{width}}  {entry.title} ({times})"
        if entry.skip_reason:
            line += f"; skipped here: {entry.skip_reason}"
        sys.stdout.write(line + "\n")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``pipetrain bench``; 0 when no case failed, 1 when one did, 2 on bad input."""
    if args.list:
        return _list()
    try:
        names = check_names(args.names) if args.names else case_names()
    except ValueError as error:
        return _fail(str(error))
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        return _fail(f"case{'s' if len(twice) > 1 else ''} {', '.join(twice)} named twice; "
                     "name each case once")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out is not None else Path("bench-results") / stamp
    if out.exists() and not out.is_dir():
        return _fail(f"--out {str(out)!r} is a file; give a folder (new or existing)")
    command = shlex.join(["pipetrain", *(sys.argv[1:] if "bench" in sys.argv[1:]
                                         else ["bench", *_argv_of(args)])])
    try:
        summary = run_suite(names, quick=args.quick, out=out, command=command,
                            progress=_progress)
    except OSError as error:
        return _fail(f"cannot write --out {str(out)!r}: {error.strerror or error}")
    width = max(len(c["name"]) for c in summary["cases"])
    for case in summary["cases"]:
        line = (f"{case['name']:<{width}}  {case['status']:<7} {case['wall_s']:8.1f} s, "
                f"CPU {case['cpu_s']:7.1f} s")
        if case["reason"]:
            line += f"  {case['reason']}"
        sys.stdout.write(line + "\n")
    sys.stdout.write(f"{summary['wall_s']:.1f} s in all; results in {out}/ (docs: python -m "
                     f"pipetrain.bench.docs {out})\n")
    return 1 if any(c["status"] == "failed" for c in summary["cases"]) else 0


def _argv_of(args: argparse.Namespace) -> list[str]:
    """The command's arguments rebuilt from ``args`` (when called as a function, not from
    the command line)."""
    argv = list(args.names)
    if args.quick:
        argv.append("--quick")
    if args.out is not None:
        argv += ["--out", args.out]
    return argv

"""The one-call GPU check: run every item in its own process, each within its budget,
and write one JSON file per item and ``summary.json`` under ``OUT_DIR``.

Run it through the wrapper, from the repository root (it sets ``PYTHONPATH``)::

    bash benchmarks/gpu/run.sh OUT_DIR                      # on a GPU: --device cuda
    bash benchmarks/gpu/run.sh OUT_DIR --device cpu --quick  # here, in under 3 minutes
    bash benchmarks/gpu/run.sh OUT_DIR --items planner,nccl  # some items only

Every item ends with a status, ``ok``, ``failed`` (with the reason) or ``skipped``
(with the reason): an item that raises, crashes its process or overstays its budget is
recorded as failed and the next one runs. See ``docs/gpu.md``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_BENCHMARKS = os.path.dirname(_HERE)
_ROOT = os.path.dirname(_BENCHMARKS)
for _path in (os.path.join(_HERE, ".deps"), os.path.join(_ROOT, "src"), _BENCHMARKS):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from gpu.common import STATUSES, ItemContext, error_text  # noqa: E402
from gpu.items import CPU_TOTAL_S, CUDA_TOTAL_S, ITEMS, Item, by_name  # noqa: E402

__all__ = ["main", "run_all", "run_item", "spawn_item"]

GRACE_S = 20.0
"""Seconds an item's process may overstay its budget (start-up, writing) before it is ended."""


def _write(path: str, value: Any) -> None:
    from pipetrain.bench.harness import dump_json

    with open(path + ".partial", "w") as f:
        f.write(dump_json(value))
        f.write("\n")
    os.replace(path + ".partial", path)


def _environment() -> dict[str, Any]:
    """What the check runs on (printed as JSON by ``--environment``)."""
    import platform

    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(), "executable": sys.executable,
        "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(), "cuda_available": torch.cuda.is_available(),
        "cuda_device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    if env["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        env.update(device_name=props.name, device_memory_gib=round(props.total_memory / 2**30, 2),
                   multiprocessors=props.multi_processor_count)
    try:
        import torchgpipe

        env["torchgpipe"] = {"version": torchgpipe.__version__, "path": torchgpipe.__file__}
    except ImportError as error:
        env["torchgpipe"] = {"error": error_text(error)}
    env["pytest_timeout"] = importlib.util.find_spec("pytest_timeout") is not None
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_ROOT, text=True,
                                           capture_output=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    return env


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [os.path.join(_ROOT, "src"), _BENCHMARKS, os.path.join(_HERE, ".deps")]
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(paths + ([old] if old else []))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _budget(item: Item, args: argparse.Namespace) -> float:
    if args.device == "cuda":
        return item.cuda_s
    return item.cpu_s if args.quick else 2 * item.cpu_s


def run_item(item: Item, args: argparse.Namespace) -> int:
    """In the item's own process: run it and write ``OUT_DIR/<item>.json``."""
    ctx = ItemContext(name=item.name, device=args.device, quick=args.quick,
                      out_dir=args.out_dir, budget_s=args.budget or _budget(item, args))
    if args.device == "cpu":
        # a CPU run is a check that the items work, not a benchmark: one intra-op thread
        # (OpenMP's barriers in several threads stall for up to seconds on a shared CPU)
        import torch

        torch.set_num_threads(1)
    try:
        result = importlib.import_module(item.module).run(ctx)
    except Exception as error:
        result = {"status": "failed", "reason": error_text(error),
                  "traceback": traceback.format_exc()[-4000:]}
    if result.get("status") not in STATUSES:
        result = {**result, "status": "failed",
                  "reason": f"the item gave no valid status ({result.get('status')!r})"}
    if result["status"] != "ok" and not result.get("reason"):
        result["reason"] = "(no reason given)"
    record = {"item": item.name, "title": item.title, "device": args.device,
              "quick": args.quick, "budget_s": ctx.budget_s,
              "seconds": round(ctx.elapsed(), 2), **result}
    _write(os.path.join(args.out_dir, f"{item.name}.json"), record)
    return 0


def _tail(path: str, chars: int = 2000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def spawn_item(item: Item, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """Run ``item`` in a child process within ``timeout``; its record (a failure when it
    wrote none)."""
    path = os.path.join(args.out_dir, f"{item.name}.json")
    log = os.path.join(args.out_dir, "logs", f"{item.name}.log")
    if os.path.exists(path):
        os.remove(path)
    command = [sys.executable, os.path.abspath(__file__), args.out_dir, "--item", item.name,
               "--device", args.device, "--budget", str(_budget(item, args))]
    if args.quick:
        command.append("--quick")
    began = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=_ROOT, env=_child_env(), stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:  # the item and anything it left running (spawned ranks, pytest workers)
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            process.wait(timeout=30)
    seconds = round(time.monotonic() - began, 2)
    if code is None:
        reason = (f"did not finish within {timeout:.0f} s (its budget of "
                  f"{_budget(item, args):.0f} s and {GRACE_S:.0f} s of grace); ended")
    else:
        try:
            with open(path) as f:
                record: dict[str, Any] = json.load(f)
            return record
        except (OSError, ValueError) as error:
            reason = (f"its process ended (exit code {code}) without a result: "
                      f"{error_text(error)}")
    record = {"item": item.name, "title": item.title, "device": args.device,
              "quick": args.quick, "status": "failed", "reason": reason, "seconds": seconds,
              "log_tail": _tail(log)}
    _write(path, record)
    return record


def _skip_record(item: Item, args: argparse.Namespace, reason: str) -> dict[str, Any]:
    record = {"item": item.name, "title": item.title, "device": args.device, "quick": args.quick,
              "status": "skipped", "reason": reason, "seconds": 0.0}
    _write(os.path.join(args.out_dir, f"{item.name}.json"), record)
    return record


def _probe(args: argparse.Namespace) -> dict[str, Any]:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), args.out_dir,
                           "--environment"], cwd=_ROOT, env=_child_env(), text=True,
                          capture_output=True, timeout=120)
    if done.returncode != 0:
        raise SystemExit(f"could not start Python with torch ({sys.executable}):\n{done.stderr}")
    environment: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return environment


def run_all(args: argparse.Namespace) -> int:
    began = time.monotonic()
    os.makedirs(os.path.join(args.out_dir, "logs"), exist_ok=True)
    environment = _probe(args)
    if args.device is None:
        args.device = "cuda" if environment["cuda_available"] else "cpu"
    if args.device == "cuda" and not environment["cuda_available"]:
        print(f"--device cuda: torch {environment['torch']} sees no CUDA device here; "
              "fix: --device cpu (with --quick for the small sizes)", file=sys.stderr)
        return 2
    items = ITEMS if args.items is None else tuple(by_name(n) for n in args.items.split(","))
    total = CUDA_TOTAL_S if args.device == "cuda" else CPU_TOTAL_S if args.quick else 2 * CPU_TOTAL_S
    print(f"GPU check on {args.device}{' (quick)' if args.quick else ''}: {len(items)} items, "
          f"at most {total:.0f} s; results in {args.out_dir}", flush=True)
    records = []
    for item in items:
        left = total - (time.monotonic() - began)
        if left < 15:
            record = _skip_record(item, args, f"the run's budget of {total:.0f} s is spent "
                                  f"({left:.0f} s left when the item was due)")
        else:
            record = spawn_item(item, args, min(_budget(item, args) + GRACE_S, left))
        records.append(record)
        print(f"  {item.name:<22} {record['status']:<8} {record.get('seconds', 0):7.1f} s"
              f"{'  ' + str(record.get('reason'))[:150] if record.get('reason') else ''}",
              flush=True)
    counts = {s: sum(r["status"] == s for r in records) for s in STATUSES}
    summary = {
        "check": "pipetrain GPU check (benchmarks/gpu/run.sh)",
        "device": args.device, "quick": args.quick, "environment": environment,
        "budget_s": total, "total_seconds": round(time.monotonic() - began, 2),
        "counts": counts,
        "items": [{"item": r["item"], "title": r.get("title"), "status": r["status"],
                   "reason": r.get("reason"), "seconds": r.get("seconds"),
                   "file": f"{r['item']}.json"} for r in records],
    }
    _write(os.path.join(args.out_dir, "summary.json"), summary)
    print(f"done in {summary['total_seconds']:.0f} s: {counts}", flush=True)
    return 1 if counts["failed"] else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="folder for the JSON results (created if missing)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="default: cuda if torch sees a GPU, else cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes (the CPU test's)")
    parser.add_argument("--items", default=None,
                        help=f"comma-separated subset of: {','.join(i.name for i in ITEMS)}")
    parser.add_argument("--item", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--environment", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.items is not None:
        try:
            [by_name(n) for n in args.items.split(",")]
        except ValueError as error:
            parser.error(f"--items {args.items}: {error}")
    args.out_dir = os.path.abspath(args.out_dir)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.environment:
        from pipetrain.bench.harness import dump_json

        print(dump_json(_environment()))
        return 0
    if args.item is not None:
        args.device = args.device or "cpu"
        return run_item(by_name(args.item), args)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())

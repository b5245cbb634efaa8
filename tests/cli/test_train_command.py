"""``pipetrain train`` end to end: the run folder, resume, and loss independent of the layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.train_runs import (
    one_process_losses,
    recorded_losses,
    refused_here,
    run_here,
    run_train,
    run_trains,
)

pytestmark = pytest.mark.distributed

SMALL = ["--layers", "2", "--width", "32", "--heads", "2", "--context", "32", "--batch-size", "8",
         "--microbatches", "4", "--warmup", "2", "--lr", "1e-2", "--sample-bytes", "0"]


def _train(*args: str, out: Path, timeout: float = 240,
           environment: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_train(SMALL, *args, out=out, timeout=timeout, environment=environment)


_losses = recorded_losses


def test_train_writes_the_run_folder_and_the_loss_falls(tmp_path: Path) -> None:
    out, temporary = tmp_path / "run", tmp_path / "tmp"
    temporary.mkdir()
    done = _train("--steps", "12", "--eval-every", "6", "--sample-bytes", "16", out=out,
                  environment={"TMPDIR": str(temporary)})
    assert done.returncode == 0, done.stderr[-3000:]
    # the launcher's temporary files are gone (the agent's log folder was not); torch's
    # compiler cache, one folder shared by every run, may stay
    assert [p.name for p in temporary.iterdir() if not p.name.startswith("torchinductor_")] == []
    assert "trained 12 steps: loss" in done.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    steps = metrics["steps"]
    assert [s["step"] for s in steps] == list(range(1, 13))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5  # from ~5.5 (uniform over bytes)
    assert "val_loss" in steps[5] and "val_loss" in steps[11]
    assert all(0.0 <= s["bubble"] < 1.0 and s["tokens_per_s"] > 0 for s in steps)
    summary = metrics["summary"]
    assert len(summary["median_busy_seconds_per_rank"]) == 2 and len(summary["median_idle_seconds_per_rank"]) == 2
    assert summary["last_step"]["step"] == 12
    assert summary["last_step"]["makespan_seconds"] > 0 and summary["last_step"]["simulated_makespan_seconds"] > 0
    assert metrics["stopped"]["reason"] == "finished" and metrics["checkpoint"]["step"] == 12
    assert [m["stages"] for m in metrics["memory"]] == [[0], [1]]
    assert all(m["peak_memory_bytes"] > 10_000_000 for m in metrics["memory"])
    # each rank's failure detector: a heartbeat, a neighbour, the root-cause key, every 0.5 s
    assert [m["rank"] for m in metrics["monitor"]] == [0, 1]
    assert all(2.0 < m["store_calls_per_s"] < 12.0 for m in metrics["monitor"]), metrics["monitor"]
    assert (out / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    trace = json.loads((out / "trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    # the trace numbers steps as the run does (the last three of 12)
    assert {e["args"]["step"] for e in trace["traceEvents"] if e.get("cat") == "step"} == {10, 11, 12}
    assert {"0F0", "1F0", "1B7", "0B7"} <= names or {"0F0", "1F0", "1B3", "0B3"} <= names
    assert (out / "checkpoint" / ".metadata").exists()
    assert len((out / "sample.txt").read_text(encoding="utf-8", errors="replace")) >= 16

    # resuming into a new folder continues from step 12 to 16, exactly where the data and
    # schedule left off, and the new folder holds the whole run's history
    more = _train("--steps", "16", "--resume", str(out), out=tmp_path / "more")
    assert more.returncode == 0, more.stderr[-3000:]
    assert "resuming" in more.stderr and "at step 12: training steps 13-16 (4 steps)" in more.stderr
    assert "trained 4 steps (13-16)" in more.stdout
    resumed = json.loads((tmp_path / "more" / "metrics.json").read_text())
    assert [s["step"] for s in resumed["steps"]] == list(range(1, 17))
    assert resumed["steps"][:12] == steps
    assert [g["first_step"] for g in resumed["segments"]] == [1, 13]

    # a single process samples from the two-stage checkpoint, with the run's settings the
    # very text the two ranks sampled at its end (only the last stage held the logits)
    sample = run_here(["sample", str(out), "--bytes", "16", "--seed", str(metrics["config"]["args"]["seed"])])
    assert sample.returncode == 0, sample.stderr[-2000:]
    assert sample.stdout.startswith("def ")
    assert sample.stdout == (out / "sample.txt").read_text(encoding="utf-8") + "\n"


def test_the_loss_does_not_depend_on_stages_replicas_schedule_or_checkpointing(tmp_path: Path) -> None:
    from pipetrain.schedule import zb_v

    schedule_file = tmp_path / "my-zb-v.txt"  # a user schedule: V placement, 2 ranks, 4 micro-batches
    schedule_file.write_text(str(zb_v(2, 4)))
    layouts = [
        ["--stages", "2", "--schedule", "gpipe", "--checkpoint", "always"],
        ["--stages", "2", "--replicas", "2", "--schedule", "zb-h1", "--checkpoint", "except_last"],
        ["--schedule", str(schedule_file), "--checkpoint", "always"],
    ]
    runs = []
    dones = run_trains(SMALL, [(["--steps", "5", "--eval-every", "0", *layout], tmp_path / f"run{k}")
                               for k, layout in enumerate(layouts)])
    for k, (layout, done) in enumerate(zip(layouts, dones)):
        assert done.returncode == 0, (layout, done.stderr[-3000:])
        runs.append(_losses(tmp_path / f"run{k}"))
    reference = one_process_losses([*SMALL, "--steps", "5", "--eval-every", "0"])
    for layout, losses in zip(layouts, runs):
        assert len(losses) == 5
        for step, (a, b) in enumerate(zip(reference, losses)):
            assert abs(a - b) <= 1e-4 * abs(a), f"{layout} step {step + 1}: {b} vs {a} in one process"
    # the V placement of the file (as of dualpipe-v, whose math the API's tests check):
    # rank 0 holds the first and last stages
    memory = json.loads((tmp_path / "run2" / "metrics.json").read_text())["memory"]
    assert [m["stages"] for m in memory] == [[0, 3], [1, 2]]


def test_bad_arguments_are_named_before_any_worker_starts(tmp_path: Path) -> None:
    done = refused_here(["train", *SMALL, "--stages", "9", "--schedule", "zigzag", "--data",
                         str(tmp_path / "none.txt"), "--out", str(tmp_path / "bad")])
    assert done.returncode == 2
    assert "more stages than layers: 9 stages for 4 layers" in done.stderr
    assert "unknown schedule 'zigzag'" in done.stderr
    assert "none.txt" in done.stderr and "does not exist" in done.stderr
    assert not (tmp_path / "bad").exists()


def test_the_same_entry_point_runs_under_torchrun(tmp_path: Path) -> None:
    """``torchrun ... -m pipetrain train`` (the multi-machine launch line, on one machine):
    every worker writes into one run folder, rank 0's, even without --out."""
    from pipetrain.launch import free_port

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), TMPDIR=str(tmp_path))  # torchrun's logs
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
         "-m", "pipetrain", "train", *SMALL, "--steps", "3", "--eval-every", "0"],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1, runs
    assert (runs[0] / "checkpoint" / ".metadata").exists()
    assert [s["step"] for s in json.loads((runs[0] / "metrics.json").read_text())["steps"]] == [1, 2, 3]

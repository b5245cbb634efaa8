"""A worker that dies without a word (``kill -9``, the out-of-memory killer) ends
``pipetrain train`` with one line naming its rank and stage, the last step, the
checkpoint the run keeps and the command that continues it (it used to end with the
elastic agent's ``Signal 9 (SIGKILL) received by PID 18325``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.workers import children, worker_rank
from pipetrain.cli import worker_death
from pipetrain.cli.main import build_parser
from pipetrain.cli.train import _failure_line
from pipetrain.launch.local import LaunchError

TINY = ["--layers", "1", "--width", "16", "--heads", "2", "--context", "16", "--batch-size", "4",
        "--microbatches", "2", "--warmup", "2", "--eval-every", "0", "--sample-bytes", "0"]


def _args(*argv: str) -> object:
    return build_parser().parse_args(["train", *argv])


def test_the_killed_rank_is_found_among_the_failures() -> None:
    # rank 0 saw its peer die and said so; rank 1 was killed; SIGTERM is the launcher's stop
    error = LaunchError("x", rank=0, exitcode=1, worker_message="PeerFailure: rank 0: pipeline "
                        "stopped because rank 1 died", exitcodes={0: 1, 1: -9, 2: -15})
    assert error.killed == (1, "SIGKILL")
    assert LaunchError("x", rank=0, exitcode=-15, worker_message="").killed is None


def test_the_last_line_names_rank_stage_step_checkpoint_and_the_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "x"
    out.mkdir()
    started = time.time() - 1
    (out / "metrics.json").write_text(json.dumps(
        {"steps": [{"step": 37}], "stopped": {"reason": "error", "at_step": 37}}))
    monkeypatch.setattr(worker_death, "intact_checkpoint_step", lambda folder: 30)
    args = _args("--stages", "2", "--save-every", "10", "--out", str(out))
    error = LaunchError("x", rank=1, exitcode=-9, worker_message="", exitcodes={1: -9, 0: 1})
    assert _failure_line(error, args, started) == (
        f"worker rank 1 (stage 1) was killed by SIGKILL after step 37; the checkpoint in {out} "
        f"is at step 30; continue with: pipetrain train --resume {out}")
    # records of an earlier session say nothing about this one's steps
    os.utime(out / "metrics.json", (started - 100, started - 100))
    assert " after step" not in _failure_line(error, args, started)
    # rank 0 writes the records: when it dies they end at their last write
    (out / "metrics.json").write_text(json.dumps({"steps": [{"step": 36}]}))
    line = _failure_line(LaunchError("x", rank=0, exitcode=-9, worker_message=""), args, started)
    assert line.startswith("worker rank 0 (stage 0) was killed by SIGKILL after step 36 or later")


def test_without_a_checkpoint_the_line_says_to_start_again(tmp_path: Path) -> None:
    args = _args("--stages", "2", "--replicas", "2", "--out", str(tmp_path / "run"))
    line = _failure_line(LaunchError("x", rank=2, exitcode=-9, worker_message=""), args, 0.0)
    assert line == ("worker rank 2 (stage 1, replica 0) was killed by SIGKILL; no checkpoint "
                    "was saved (without --save-every a run saves only at its end): start the run "
                    "again with a new --out, and --save-every N to save every N steps")


def test_a_workers_own_message_stays_the_last_line() -> None:
    error = LaunchError("x", rank=1, exitcode=1, worker_message="ValueError: corpus file ...",
                        exitcodes={1: 1, 0: 1})
    assert _failure_line(error, _args(), 0.0) == "ValueError: corpus file ..."


@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the workers in /proc")
def test_kill_9_of_a_worker_ends_in_one_line_and_the_run_resumes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    command = [sys.executable, "-m", "pipetrain", "train", *TINY]
    launcher = subprocess.Popen([*command, "--steps", "100000", "--save-every", "2",
                                 "--out", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (out / "checkpoint").is_dir():
                workers = {worker_rank(pid): pid for pid in children(launcher.pid)}
                if 1 in workers:
                    break
            time.sleep(0.2)
        else:
            pytest.fail("no checkpoint, or no worker of rank 1, in 120 s")
        time.sleep(1.0)  # a few more steps
        os.kill(workers[1], signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 1, stderr[-3000:]
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if line.strip()]
    found = re.fullmatch(
        r"pipetrain train: error: worker rank 1 \(stage 1\) was killed by SIGKILL after step "
        r"(\d+)( or later \(the last one recorded\))?; the checkpoint in (.+) is at step (\d+); "
        r"continue with: pipetrain train --resume (.+)", lines[-1])
    assert found is not None, lines[-1]
    step, folder, saved, resume = int(found[1]), found[3], int(found[4]), found[5]
    assert folder == resume == str(out) and 2 <= saved <= step
    assert "Signal 9" not in stderr and "Traceback" not in stderr
    # the command it names continues the run from that checkpoint
    done = subprocess.run([sys.executable, "-m", "pipetrain", "train", "--resume", resume,
                           "--steps", str(saved + 2)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = json.loads((out / "metrics.json").read_text())["steps"]
    assert steps[-1]["step"] == saved + 2

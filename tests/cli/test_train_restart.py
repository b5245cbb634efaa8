"""``--max-restarts N`` (pipetrain's launcher, or torchrun's with ``--out``): a job whose
worker is killed restarts from its newest checkpoint and finishes with the losses of a run
never killed, one history and the restart recorded;
what cannot be helped by a restart (no checkpoint, a usage error, a non-finite stop, no
restarts left) ends the run as before, saying why."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.workers import children, worker_rank
from pipetrain.cli import restarts

TINY = ["--layers", "1", "--width", "16", "--heads", "2", "--context", "16", "--batch-size", "4",
        "--microbatches", "2", "--warmup", "2", "--eval-every", "0", "--sample-bytes", "0",
        "--stages", "2", "--schedule", "1f1b", "--steps", "40", "--save-every", "4"]


def _steps(out: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines() if line]
    except (OSError, ValueError):
        return []


def test_what_a_restart_cannot_help_ends_the_run_and_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = str(tmp_path)
    assert restarts.restart_record(out, cause="x", exitcode=-9, done=0, limit=2,
                                   failed_at=0.0)[1].startswith("no checkpoint to restart from")
    # under torchrun, a worker started again (restart 1) resumes --out, or says why not
    monkeypatch.setenv(restarts.TORCHRUN_ATTEMPT_ENV, "1")
    monkeypatch.delenv("PIPETRAIN_LAUNCHED", raising=False)
    args = argparse.Namespace(resume=None, steps=9)
    with pytest.raises(ValueError, match=r"has no --out: .*fix: give --out DIR"):
        restarts.torchrun_restart(args, None)
    with pytest.raises(ValueError, match="cannot resume: no checkpoint to restart from"):
        restarts.torchrun_restart(args, out)
    monkeypatch.setenv("PIPETRAIN_LAUNCHED", "1")  # pipetrain's own launcher restarts itself
    assert restarts.torchrun_restart(args, out) is None
    monkeypatch.setattr("pipetrain.cli.worker_death.intact_checkpoint_step", lambda folder: 8)
    (tmp_path / "steps.jsonl").write_text("".join(
        json.dumps({"step": s, "seconds": 0.5}) + "\n" for s in range(1, 11)))
    record, _ = restarts.restart_record(out, cause="worker rank 1 was killed", exitcode=-9,
                                        done=1, limit=2, failed_at=100.0)
    assert record is not None
    assert (record["number"], record["after_step"], record["resumed_from_step"],
            record["steps_lost"], record["seconds_lost"]) == (2, 10, 8, 2, 1.0)
    assert restarts.restart_record(out, cause="x", exitcode=-9, done=2, limit=2,
                                   failed_at=0.0)[1] == "after 2 restarts (--max-restarts 2)"
    assert "mistake in the options" in restarts.restart_record(
        out, cause="x", exitcode=2, done=0, limit=2, failed_at=0.0)[1]
    (tmp_path / "metrics.json").write_text(json.dumps({"steps": [], "stopped": {"reason": "nonfinite"}}))
    assert "non-finite" in restarts.restart_record(out, cause="x", exitcode=1, done=0, limit=2,
                                                   failed_at=0.0)[1]


@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the workers in /proc")
def test_a_killed_worker_restarts_and_the_run_ends_as_if_never_killed(tmp_path: Path) -> None:
    """pipetrain's launcher (``--max-restarts 2``) and torchrun (its own ``--max-restarts
    1``, the workers resuming ``--out``), each with rank 1 killed at a random step after the
    first checkpoint, beside the same run never killed: all three at once (the machine's
    cores are shared)."""
    from pipetrain.launch import free_port

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), TMPDIR=str(tmp_path))  # torchrun's logs
    command = [sys.executable, "-m", "pipetrain", "train", *TINY]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--max-restarts", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "pipetrain", "train", *TINY]
    jobs = {"local": [*command, "--max-restarts", "2", "--out", str(tmp_path / "local")],
            "torchrun": [*torchrun, "--out", str(tmp_path / "torchrun")],
            "straight": [*command, "--out", str(tmp_path / "straight")]}
    running = {name: subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env) for name, argv in jobs.items()}
    kill_after = {name: random.Random().randint(5, 15) for name in ("local", "torchrun")}
    try:
        deadline = time.monotonic() + 150
        while kill_after and time.monotonic() < deadline:
            for name, after in list(kill_after.items()):
                done = len(_steps(tmp_path / name))
                workers = {worker_rank(pid): pid for pid in children(running[name].pid)}
                if done >= after and 1 in workers:
                    os.kill(workers[1], signal.SIGKILL)
                    del kill_after[name]
            time.sleep(0.02)
        assert not kill_after, f"no step {kill_after} with a worker of rank 1 in 150 s"
        ended = {name: job.communicate(timeout=240)[1] for name, job in running.items()}
    finally:
        for job in running.values():
            if job.poll() is None:
                job.kill()
                job.communicate()
    for name, job in running.items():
        assert job.returncode == 0, (name, ended[name][-3000:])
    assert ("pipetrain train: restart 1 of 2: worker rank 1 (stage 1) was killed by SIGKILL"
            in ended["local"])
    expected = json.loads((tmp_path / "straight" / "metrics.json").read_text())
    for name, cause in (("local", "killed by SIGKILL"), ("torchrun", "torchrun restarted")):
        metrics = json.loads((tmp_path / name / "metrics.json").read_text())
        assert [s["step"] for s in metrics["steps"]] == list(range(1, 41))  # one history
        assert [s["loss"] for s in metrics["steps"]] == [s["loss"] for s in expected["steps"]]
        (restart,) = metrics["restarts"]
        assert restart["number"] == 1 and cause in restart["cause"], restart
        assert restart["resumed_from_step"] % 4 == 0
        assert restart["resumed_from_step"] <= restart["after_step"]
        assert restart["steps_lost"] == restart["after_step"] - restart["resumed_from_step"]
        assert 0 < restart["seconds_to_next_step"] < 120
        assert [g["first_step"] for g in metrics["segments"]] == [
            1, restart["resumed_from_step"] + 1]

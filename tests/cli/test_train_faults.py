"""Faults that must not lose a ``pipetrain train`` run: a frozen peer, damaged checkpoints,
a full disk, two jobs on one run folder.

Each test drives the real command (its own launcher and workers) and checks what a user
sees: how long the run took to end, its last line, and what the run folder kept.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.distributed

TINY = ["--layers", "1", "--width", "16", "--heads", "2", "--context", "16", "--batch-size", "4",
        "--microbatches", "2", "--warmup", "2", "--eval-every", "0", "--sample-bytes", "0"]


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipetrain", "train", *TINY, *args]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))


def _metrics(out: Path) -> dict[str, Any]:
    return json.loads((out / "metrics.json").read_text())  # type: ignore[no-any-return]


def _steps_recorded(out: Path) -> int:
    try:
        return len(_metrics(out)["steps"])
    except (OSError, ValueError, KeyError):
        return 0


def _last_line(text: str) -> str:
    lines = [line for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _worker_pid(launcher: int, rank: int) -> int:
    """The pid of worker ``rank`` among the launcher's children."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/environ", "rb") as environ:
                variables = environ.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if parent == launcher and f"RANK={rank}".encode() in variables:
            return int(entry)
    raise AssertionError(f"no worker of rank {rank} under pid {launcher}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux only)")
def test_a_frozen_peer_ends_the_run_in_time_and_the_history_is_kept(tmp_path: Path) -> None:
    """SIGSTOP rank 1 mid-run: rank 0 finds it silent, ends with the named error after
    writing metrics.json with every step it finished and how the run stopped."""
    out = tmp_path / "run"
    timeout = 15
    launcher = subprocess.Popen(_command("--steps", "100000", "--timeout", str(timeout), "--out", str(out)),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    frozen: int | None = None
    try:
        deadline = time.monotonic() + 120
        while _steps_recorded(out) < 5 and time.monotonic() < deadline:
            assert launcher.poll() is None, launcher.communicate()[0][-3000:]
            time.sleep(0.5)
        before = _steps_recorded(out)
        assert before >= 5, "the run never got going"
        frozen = _worker_pid(launcher.pid, 1)
        os.kill(frozen, signal.SIGSTOP)
        stopped_at = time.monotonic()
        # rank 0 ends within --timeout; the launcher then stops the frozen worker (torch's
        # elastic agent gives a worker 30 s to answer SIGTERM before SIGKILL)
        output, _ = launcher.communicate(timeout=timeout + 60)
        took = time.monotonic() - stopped_at
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate(timeout=20)
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert launcher.returncode == 1, output[-3000:]
    assert took <= timeout + 45, f"took {took:.0f} s"
    assert "rank 1 stopped answering" in _last_line(output), output[-3000:]
    metrics = _metrics(out)
    steps = [s["step"] for s in metrics["steps"]]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= before
    assert metrics["stopped"]["reason"] == "error" and metrics["stopped"]["at_step"] == len(steps)
    assert "rank 1 stopped answering" in metrics["stopped"]["message"]


def test_hosts_launched_with_different_options_are_refused_by_name(tmp_path: Path) -> None:
    """Two workers started by hand as one job (as two torchrun machines start them), one
    with --balance 1,2 and the other with 2,1: before this check the job trained with a
    layer on no rank. Now every rank refuses, naming the option and each rank's value."""
    from pipetrain.launch.processes import free_port

    port = str(free_port())
    out = tmp_path / "run"
    workers = []
    for rank, balance in enumerate(("1,2", "2,1")):
        env = dict(_env(), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1")
        workers.append(subprocess.Popen(
            _command("--steps", "3", "--balance", balance, "--timeout", "60", "--out", str(out)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    outputs = [w.communicate(timeout=120)[0] for w in workers]
    assert [w.returncode for w in workers] == [2, 2], outputs
    assert _last_line(outputs[0]) == (
        "pipetrain train: error: ranks disagree on --balance: rank 0 has '1,2', rank 1 has "
        "'2,1'; fix: launch every host with the same options"), outputs[0]
    assert not (out / "checkpoint").exists()

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
    """Steps recorded so far (steps.jsonl gets each step's line as it ends)."""
    try:
        return (out / "steps.jsonl").read_text().count("\n")
    except OSError:
        return 0


def _last_line(text: str) -> str:
    lines = [line for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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
    timeout = 8
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
        survivor = _worker_pid(launcher.pid, 0)
        os.kill(frozen, signal.SIGSTOP)
        stopped_at = time.monotonic()
        # rank 0 ends within --timeout (the launcher would then give the frozen worker 30 s
        # to answer SIGTERM before its SIGKILL: the test sends that SIGKILL itself)
        while os.path.exists(f"/proc/{survivor}") and _alive(survivor) \
                and time.monotonic() < stopped_at + timeout + 45:
            time.sleep(0.2)
        took = time.monotonic() - stopped_at
        os.kill(frozen, signal.SIGKILL)
        output, _ = launcher.communicate(timeout=60)
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
    # the step in flight may have finished on the pipeline without its metrics (their
    # gather failed): at most one step past the history
    assert metrics["stopped"]["reason"] == "error"
    assert len(steps) <= metrics["stopped"]["at_step"] <= len(steps) + 1
    assert "rank 1 stopped answering" in metrics["stopped"]["message"]
    # where the ranks were: rank 0's report (what it waited for, from rank 1 when in the
    # step), the frozen rank named as silent, in one line of the launcher
    report = json.loads((out / "hang" / "rank0.json").read_text())
    assert not (out / "hang" / "rank1.json").exists()
    where = next(line for line in output.splitlines()
                 if line.startswith("pipetrain train: where the ranks were: "))
    assert "rank 1 left no report (killed or frozen)" in where, where
    if report["waits_for"] is not None and report["waits_for"]["kind"] != "collective":
        assert report["waits_for"]["from_rank"] == 1
        assert f"micro-batch {report['waits_for']['microbatch']} from stage 1 (rank 1)" in where
    else:  # the freeze found rank 0 in a collective of the run, or computing
        assert any(f"rank 0 {form}" in where for form in (
            "was between steps", "waited", "was running")), where
    assert report["done"], report  # the actions it completed last


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


_FAULTS = Path(__file__).resolve().parents[1] / "helpers" / "faults"


def _train(*args: str, fault: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = _env()
    if fault is not None:  # tests/helpers/faults/sitecustomize.py kills a worker in a save
        env["PYTHONPATH"] = os.pathsep.join([str(_FAULTS), env["PYTHONPATH"]])
        env["PIPETRAIN_TEST_FAULT"] = fault
    return subprocess.run(_command(*args), capture_output=True, text=True, timeout=timeout, env=env)


def _assert_whole_history(out: Path, last: int) -> dict[str, Any]:
    metrics = _metrics(out)
    assert [s["step"] for s in metrics["steps"]] == list(range(1, last + 1))
    return metrics


def test_a_damaged_checkpoint_is_set_aside_and_a_second_damage_still_resumes(tmp_path: Path) -> None:
    """Step 6 truncated: the resume falls back to step 3 and sets step 6 aside, so that
    the next saves keep intact checkpoints; damaging the newest again still resumes."""
    from pipetrain.api.checkpoint_files import checkpoint_problem

    out = tmp_path / "run"
    first = _train("--steps", "6", "--save-every", "3", "--out", str(out))
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint*")) == ["checkpoint", "checkpoint.step-3"]
    shard = sorted((out / "checkpoint").glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.truncate(100)
    resumed = _train("--resume", str(out), "--steps", "8")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    warnings = [line for line in resumed.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, resumed.stderr[-3000:]
    assert warnings[0].startswith(f"pipetrain train: warning: checkpoint {out}/checkpoint (step 6) "
                                  f"is damaged: {shard.name} is 100 bytes, saved as")
    assert warnings[0].endswith(f"(truncated); set aside as {out}/checkpoint.damaged-step-6; "
                                f"using {out}/checkpoint.step-3 (step 3)")
    metrics = _assert_whole_history(out, 8)  # steps 4-6 trained again, once in the history
    assert metrics["segments"][-1]["first_step"] == 4
    assert sorted(p.name for p in out.glob("checkpoint*")) == [
        "checkpoint", "checkpoint.damaged-step-6", "checkpoint.step-6"]
    assert checkpoint_problem(out / "checkpoint") is None  # the new newest is intact
    (out / "checkpoint" / "pipetrain-manifest.json").unlink()  # a second damage
    again = _train("--resume", str(out), "--steps", "9")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "no pipetrain-manifest.json" in again.stderr and "(step 6)" in again.stderr
    assert _metrics(out)["segments"][-1]["first_step"] == 7


def test_a_full_disk_ends_in_one_line_and_the_older_checkpoint_survives(tmp_path: Path) -> None:
    """The second save does not fit on a small tmpfs: one line, not a 3,000-character
    CheckpointException, and the first save's checkpoint stays intact."""
    from pipetrain.api.checkpoint_files import checkpoint_problem, read_meta

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=900k", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        out = disk / "run"
        done = _train("--steps", "4", "--save-every", "2", "--out", str(out))
        kept = checkpoint_problem(out / "checkpoint"), read_meta(str(out / "checkpoint"))["step"]
        leftovers = sorted(p.name for p in out.glob("checkpoint*"))
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
    assert done.returncode == 1, done.stderr[-3000:]
    line = _last_line(done.stderr)
    assert "saving the checkpoint failed: no space left on the device of" in line, done.stderr[-3000:]
    assert "the previous checkpoint is kept" in line and len(line) < 500
    assert "Traceback" not in done.stderr and "CheckpointException" not in done.stderr
    assert kept == (None, 2) and leftovers == ["checkpoint"]  # the failed save's files removed


def test_a_kill_before_the_manifest_is_named_and_the_resume_does_not_hang(tmp_path: Path) -> None:
    """Rank 1 dies after step 4's shards and index are written, before its manifest: the
    run ends naming rank 1; the resume passes over the unfinished save (no manifest, no
    checkpoint), continues from step 2 and saves again without waiting on anyone."""
    out = tmp_path / "run"
    done = _train("--steps", "6", "--save-every", "2", "--out", str(out), fault="manifest:4:1")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "gloo/" not in done.stderr, done.stderr[-3000:]
    assert "rank 1" in _last_line(done.stderr), done.stderr[-3000:]
    metrics = _metrics(out)
    assert metrics["stopped"]["reason"] == "error" and "rank 1" in metrics["stopped"]["message"]
    assert [s["step"] for s in metrics["steps"]] == [1, 2, 3, 4]
    assert (out / "checkpoint.partial" / ".metadata").is_file()
    began = time.monotonic()
    resumed = _train("--resume", str(out), "--steps", "6", "--timeout", "60", timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert time.monotonic() - began < 60
    assert "at step 2" in resumed.stderr, resumed.stderr[-2000:]
    _assert_whole_history(out, 6)
    assert sorted(p.name for p in out.glob("checkpoint*")) == ["checkpoint", "checkpoint.step-4"]


def test_a_crafted_checkpoint_is_refused_in_one_line_and_runs_nothing(tmp_path: Path) -> None:
    """A run folder whose .metadata is a pickle that calls os.system, with a manifest
    that matches it: refused by name before any worker starts; the command never runs."""
    import pickle

    from pipetrain.api.checkpoint_files import write_manifest

    marker = tmp_path / "ran"

    class Crafted:
        def __reduce__(self) -> tuple[object, ...]:
            return (os.system, (f"touch {marker}",))

    checkpoint = tmp_path / "run" / "checkpoint"
    checkpoint.mkdir(parents=True)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Crafted()))
    write_manifest(str(checkpoint), step=5)
    done = _train("--resume", str(tmp_path / "run"), "--steps", "10", timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    line = _last_line(done.stderr)
    assert ".metadata holds what a checkpoint does not" in line and "posix.system" in line, line
    assert not marker.exists()


def test_a_kill_between_the_save_and_its_rename_loses_no_history(tmp_path: Path) -> None:
    """Rank 0 dies with step 4's checkpoint complete in checkpoint.partial, before the
    rename: the resume continues from step 4 and the history holds steps 1-4 (an older
    version wrote the history after the rename, so steps 3-4 were lost for good)."""
    out = tmp_path / "run"
    killed = _train("--steps", "4", "--save-every", "2", "--out", str(out), fault="commit:4:0")
    assert killed.returncode != 0
    assert (out / "checkpoint.partial" / ".metadata").is_file()
    resumed = _train("--resume", str(out), "--steps", "6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stderr and "at step 4" in resumed.stderr, resumed.stderr[-2000:]
    metrics = _assert_whole_history(out, 6)
    assert metrics["segments"][-1]["first_step"] == 5


def test_a_second_job_on_a_running_run_is_refused_naming_the_first(tmp_path: Path) -> None:
    """... and the running job listens on loopback only (its store and gloo)."""
    from helpers.listeners import descendants, listening_addresses

    out = tmp_path / "run"
    env = {k: v for k, v in _env().items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    first = subprocess.Popen(_command("--steps", "100000", "--out", str(out)), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while _steps_recorded(out) < 2 and time.monotonic() < deadline:
            assert first.poll() is None, first.communicate()[0][-3000:]
            time.sleep(0.5)
        listening = listening_addresses(descendants(first.pid))
        assert len(listening) >= 3  # the store, and each worker's gloo
        assert {address for address, _ in listening} == {"127.0.0.1"}, listening
        second = _train("--resume", str(out), "--steps", "200000", timeout=120)
        assert second.returncode == 2, second.stderr[-3000:]
        line = _last_line(second.stderr)
        assert f"the run folder {str(out)!r} is in use by another pipetrain train job (pid {first.pid} on host" in line
        assert f"then --resume {out}" in line
        assert first.poll() is None  # the first job goes on, untouched
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=120)
    assert first.returncode == 130
    from pipetrain.cli.run_lock import RunLock

    lock = RunLock(str(out))  # the lock went with the first job: the next launcher gets it
    assert lock.busy() is None
    lock.acquire()
    lock.release()


def test_the_non_finite_message_names_a_fix_that_changes_something(tmp_path: Path) -> None:
    """Bug: it suggested --clip 1, the default, to a run that already clipped at 1."""
    out = tmp_path / "run"
    done = _train("--steps", "8", "--lr", "1e9", "--warmup", "1", "--out", str(out))
    assert done.returncode == 1
    line = _last_line(done.stderr)
    assert "is not finite" in line and "--clip" not in line, line
    assert "a lower --lr (now 1000000000, e.g. --lr 100000000)" in line and f"--resume {out}" in line

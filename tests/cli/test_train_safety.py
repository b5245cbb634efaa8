"""``pipetrain train`` never loses a user's work and ends every failure in one clear line.

Regression tests of what a new user hit: a replicated run that crashed while sampling
and wrote no records, a second run that overwrote the first, a resume that broke on the
leftover of an interrupted save or trained nothing, a NaN that replaced the good
checkpoint, Ctrl-C that left five tracebacks, and mistakes that surfaced as tracebacks.
"""

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
import torch

from helpers.train_runs import refused_here

pytestmark = pytest.mark.distributed

TINY = ["--layers", "1", "--width", "16", "--heads", "2", "--context", "16", "--batch-size", "4",
        "--microbatches", "2", "--warmup", "2", "--eval-every", "0", "--sample-bytes", "0"]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "run-folder.md"


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipetrain", "train", *TINY, *args]


def _default_sigint() -> None:
    """Ctrl-C as a terminal delivers it: a shell's background job (a CI runner's, say)
    inherits SIGINT ignored, and Python keeps it ignored until the program sets a handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))


def _train(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_command(*args), capture_output=True, text=True, timeout=timeout, env=_env())


def _last_line(text: str) -> str:
    lines = [line for line in text.replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _checkpoint_tensors(folder: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder), str(tmp / "flat.pt"))
    state = torch.load(tmp / "flat.pt", weights_only=False)
    return {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}


def _keys(value: object, prefix: str = "") -> set[str]:
    if isinstance(value, dict):
        found = set()
        for key, inner in value.items():
            found.add(key)
            found |= _keys(inner, key)
        return found
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return set().union(*(_keys(v) for v in value))
    return set()


def test_a_replicated_run_keeps_its_whole_folder_and_a_second_run_is_refused(tmp_path: Path) -> None:
    """Bug: --replicas 2 crashed while sampling (one sample cannot feed two replicas) and
    wrote no metrics, timeline, trace or sample; --out into an existing run overwrote it."""
    out = tmp_path / "run"
    done = _train("--stages", "2", "--replicas", "2", "--steps", "3", "--sample-bytes", "12",
                  "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("config.json", "metrics.json", "timeline.png", "trace.json", "sample.txt",
                 "checkpoint/.metadata"):
        assert (out / name).is_file(), name
    assert len((out / "sample.txt").read_bytes()) >= 12
    assert "sample.txt" in done.stdout
    metrics = _metrics(out)
    assert [s["step"] for s in metrics["steps"]] == [1, 2, 3] and metrics["stopped"]["reason"] == "finished"
    assert "run" not in metrics["config"]["args"]  # no function repr among the options
    documented = DOCS.read_text()
    missing = sorted(k for k in _keys(metrics) - set(metrics["config"]["args"])
                     if f"`{k}`" not in documented)
    assert not missing, f"metrics.json fields not documented in docs/run-folder.md: {missing}"

    before = _files(out)
    again = refused_here(["train", *TINY, "--steps", "3", "--out", str(out)])
    assert again.returncode == 2
    line = _last_line(again.stderr)
    assert "already holds a run" in line and f"--resume {out}" in line
    assert _files(out) == before  # the old checkpoint and records are untouched


def test_a_resume_survives_a_leftover_save_and_keeps_the_run_history(tmp_path: Path) -> None:
    """Bugs: a half-deleted checkpoint.previous/ made every later save fail; a resume
    with --steps not above the saved step trained nothing and exited 0; metrics.json of
    a resume held only the new steps; another --lr was silently ignored."""
    from pipetrain.api.lr_schedule import lr_factor

    out = tmp_path / "run"
    first = _train("--steps", "4", "--out", str(out))
    assert first.returncode == 0, first.stderr[-3000:]
    leftover = out / "checkpoint.previous"
    leftover.mkdir()
    (leftover / "__1_0.distcp").write_bytes(b"half deleted")

    nothing = refused_here(["train", *TINY, "--resume", str(out)])
    assert nothing.returncode == 2
    assert "nothing to do" in nothing.stderr and "at step 4" in nothing.stderr and "--steps 104" in nothing.stderr
    wider = refused_here(["train", *TINY, "--resume", str(out), "--steps", "6", "--width", "32"])
    assert wider.returncode == 2 and "--width 32 differs from the resumed run's --width 16" in wider.stderr

    more = _train("--resume", str(out), "--steps", "6", "--lr", "1e-3")
    assert more.returncode == 0, more.stderr[-3000:]
    assert "at step 4: training steps 5-6 (2 steps)" in more.stderr and "--lr 0.01 -> 0.001" in more.stderr
    assert "trained 2 steps (5-6)" in more.stdout
    assert not leftover.exists()
    metrics = _metrics(out)
    assert [s["step"] for s in metrics["steps"]] == [1, 2, 3, 4, 5, 6]
    assert metrics["segments"][-1] == {"first_step": 5, "args": metrics["config"]["args"],
                                       "changed": {"steps": [4, 6], "lr": [0.01, 0.001]}}
    assert metrics["config"]["args"]["lr"] == 0.001
    # the new learning rate is the one used (records hold the LR after each step's update)
    assert metrics["steps"][-1]["lr"] == pytest.approx(1e-3 * lr_factor(2, 6)(6))
    assert metrics["steps"][3]["lr"] == pytest.approx(1e-2 * lr_factor(2, 4)(4))


def test_a_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    """Bug: --lr 1e9 trained on NaN to the end, replaced the good checkpoint with NaN
    weights and exited 0."""
    out = tmp_path / "run"
    done = _train("--steps", "8", "--lr", "1e9", "--warmup", "1", "--clip", "0", "--out", str(out))
    assert done.returncode == 1
    line = _last_line(done.stderr)
    assert re.search(r"step \d is not finite \(loss nan", line), line
    assert "--lr" in line and "--nonfinite skip" in line and "Traceback" not in done.stderr
    metrics = _metrics(out)
    stopped = metrics["stopped"]
    assert stopped["reason"] == "nonfinite" and stopped["checkpoint_step"] == stopped["at_step"] - 1
    assert [s["step"] for s in metrics["steps"]] == list(range(1, stopped["at_step"]))
    tensors = _checkpoint_tensors(out / "checkpoint", tmp_path)
    assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors.values())


def test_ctrl_c_saves_at_the_next_step_and_ends_in_one_line(tmp_path: Path) -> None:
    """Bug: SIGINT ended the run with five tracebacks, no checkpoint and no metrics; later,
    a second Ctrl-C a second after the first turned the clean stop into a traceback and
    exit status 1, and a stop right after a periodic save saved that step again, pushing
    out the older kept checkpoint. Ctrl-C reaches the launcher and its workers (the
    terminal's process group), then again every quarter second while they stop; every step is saved (--save-every 1)."""
    from pipetrain.api.checkpointing import read_checkpoint_info

    out = tmp_path / "run"
    process = subprocess.Popen(_command("--steps", "100000", "--save-every", "1", "--out", str(out)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                               start_new_session=True, preexec_fn=_default_sigint)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (out / "checkpoint" / "pipetrain-manifest.json").exists():
                break
            time.sleep(0.2)
        else:
            pytest.fail("the run saved no checkpoint in 120 s")
        # where are the ranks? asked of the launcher: each worker answers in the run folder
        os.kill(process.pid, signal.SIGUSR1)
        reports = [out / "hang" / f"rank{rank}.json" for rank in (0, 1)]
        while not all(r.exists() for r in reports) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(3.5)  # the launcher says what they answered 3 s after asking
        os.killpg(process.pid, signal.SIGINT)
        for _ in range(8):  # impatient Ctrl-Cs while the workers save and exit
            time.sleep(0.25)
            if process.poll() is not None:
                break
            os.killpg(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 128 + signal.SIGINT, stderr[-3000:]
    asked = next(line for line in stderr.splitlines()
                 if line.startswith("pipetrain train: where the ranks are: "))
    assert "rank 0 " in asked and "rank 1 " in asked and "left no report" not in asked, asked
    assert all(json.loads(r.read_text())["done"] for r in reports)
    line = _last_line(stderr)
    assert line.startswith("pipetrain train: interrupted by SIGINT after step"), line
    assert f"pipetrain train --resume {out}" in line and "Traceback" not in stderr
    assert len(re.findall(r"SIGINT: stopping after step \d+", stderr)) == 1, stderr[-2000:]
    stopped = _metrics(out)["stopped"]
    assert stopped["reason"] == "interrupted" and not stopped["saved_now"]
    assert read_checkpoint_info(out / "checkpoint")["step"] == stopped["at_step"] == stopped["checkpoint_step"]
    assert sorted(p.name for p in out.glob("checkpoint*")) == [
        "checkpoint", f"checkpoint.step-{stopped['at_step'] - 1}"]
    assert len(_metrics(out)["steps"]) == stopped["at_step"]


@pytest.mark.parametrize(
    ("args", "phrases"),
    [
        (["--batch-size", "2", "--microbatches", "8"],
         ["--batch-size 2", "--microbatches 8", "fix: --batch-size 8 or --microbatches 2"]),
        (["--schedule", "foo"], ["unknown schedule 'foo'", "--schedule 1f1b"]),
        (["--virtual", "2"], ["--virtual 2 needs an interleaved schedule", "--schedule interleaved-1f1b"]),
        (["--schedule", "zb-v", "--virtual", "3"],  # with --layers 1: too few layers, too
         ["--schedule zb-v runs 2 stages per rank (not --virtual 3)", "fix: --virtual 2"]),
        (["--lr", "-1"], ["argument --lr: must be above 0, got -1"]),
        (["--width", "30", "--heads", "4"], ["--width 30 is not divisible by --heads 4"]),
        (["--lr", "1e300"], ["argument --lr: must be at most 3.4e+38"]),
        (["--sample-bytes", "1000000000000"], ["argument --sample-bytes: must be at most 1,000,000"]),
        (["--batch-size", "1000000000"], ["--batch-size 1000000000 x --context 16 token ids",
                                          "fix: a smaller --batch-size"]),
        (["--width", "100000000"], ["for --layers 1 --width 100000000 over --stages 2",
                                    "fix: a smaller --batch-size, --context, --width"]),
        (["--checkpoint", "selective,sometimes"],
         ["--checkpoint selective,sometimes: stage 1's mode 'sometimes' is not one of always, "
          "except_last, never, selective", "fix: e.g. --checkpoint never"]),
        (["--checkpoint", "always,never,never"], ["3 modes for 2 stages"]),
        (["--offload", "-1"], ["--offload -1.0: stage 0's budget -1.0 is not a number of MiB >= 0",
                               "fix: e.g. --offload 0"]),
        (["--checkpoint", "per_layer", "--offload", "0"],
         ["--offload 0.0 with checkpoint 'per_layer' on stage 0", "fix: no budget for that stage"]),
        (["--schedule", "pipedream", "--offload", "0"],
         ["--offload 0.0 is not available with asynchronous schedules"]),
    ],
)
def test_option_mistakes_are_named_in_flags_before_any_worker_starts(args: list[str], phrases: list[str]) -> None:
    """Bugs: --batch-size 2 --microbatches 8 silently ran 2 micro-batches; --schedule foo
    listed 'forward', which train rejects; fixes quoted API names instead of flags."""
    done = refused_here(["train", *TINY, *args])
    assert done.returncode == 2
    for phrase in phrases:
        assert phrase in done.stderr, (phrase, done.stderr)
    assert "forward" not in done.stderr and "stages_per_rank" not in done.stderr
    assert "Traceback" not in done.stderr


def test_data_that_is_empty_or_not_text_is_refused(tmp_path: Path) -> None:
    """Bug: --data pointing at a binary file trained on it without a warning."""
    empty, binary = tmp_path / "empty.txt", tmp_path / "model.bin"
    empty.write_bytes(b"")
    binary.write_bytes(bytes(range(256)) * 8)
    for path, phrase in ((empty, "is empty"), (binary, "does not look like text (a NUL byte at offset 0)")):
        done = refused_here(["train", *TINY, "--data", str(path)])
        assert done.returncode == 2 and phrase in _last_line(done.stderr), done.stderr


def test_a_mistake_found_inside_a_worker_is_the_last_line_without_a_traceback(tmp_path: Path) -> None:
    """Bug: mistakes found in a worker ended in 2-12 tracebacks and torch.elastic's
    'To enable traceback see ...' URL as the last line. The launcher imports the model
    file (it is fine); only a worker calls its function, which refuses its arguments."""
    model = tmp_path / "net.py"
    model.write_text("def build(vocab_size, context):\n"
                     "    raise ValueError(f'this model needs a context of 64, got {context}')\n")
    argv = ["--model", f"{model}:build", "--context", "16", "--batch-size", "4", "--microbatches", "2",
            "--eval-every", "0", "--sample-bytes", "0", "--steps", "2"]
    env = _env()
    runs = {name: subprocess.Popen([sys.executable, "-m", "pipetrain", *flags, "train", *argv,
                                    "--out", str(tmp_path / name)], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=env)
            for name, flags in (("quiet", []), ("verbose", ["-v"]))}  # at once
    try:
        ended = {name: (run.communicate(timeout=240), run.returncode) for name, run in runs.items()}
    finally:
        for run in runs.values():
            if run.poll() is None:
                run.kill()
                run.communicate()
    quiet = subprocess.CompletedProcess([], ended["quiet"][1], *ended["quiet"][0])
    verbose = subprocess.CompletedProcess([], ended["verbose"][1], *ended["verbose"][0])
    assert quiet.returncode == 1, quiet.stderr[-3000:]
    line = _last_line(quiet.stderr)
    assert line == "pipetrain train: error: ValueError: this model needs a context of 64, got 16", line
    assert "Traceback" not in quiet.stderr and "To enable traceback" not in quiet.stderr
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr
    assert "needs a context of 64" in _last_line(verbose.stderr)


@pytest.mark.parametrize("folder", ["empty checkpoint folder", "not a run"])
def test_a_resume_of_a_folder_without_a_checkpoint_is_one_line(tmp_path: Path, folder: str) -> None:
    """Bug: both ended in a 70-line traceback ('AssertionError: metadata is None')."""
    run = tmp_path / "run"
    if folder == "empty checkpoint folder":
        (run / "checkpoint").mkdir(parents=True)
    else:
        run.mkdir()
        (run / "notes.txt").write_text("not a run")
    done = refused_here(["train", *TINY, "--resume", str(run), "--steps", "5"])
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"{str(run)!r} holds no complete checkpoint" in _last_line(done.stderr)


def test_ctrl_c_while_the_command_starts_is_one_line(tmp_path: Path) -> None:
    """Bug: a Ctrl-C during the first seconds (imports, checks) printed a KeyboardInterrupt
    traceback."""
    process = subprocess.Popen(_command("--steps", "5", "--out", str(tmp_path / "run")),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                               start_new_session=True, preexec_fn=_default_sigint)
    time.sleep(0.5)  # torch alone takes longer to import
    os.killpg(process.pid, signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    # 130, or killed by SIGINT (a shell shows both as 130): Python ends a process that
    # a KeyboardInterrupt reached late in an import that way
    assert process.returncode in (128 + signal.SIGINT, -signal.SIGINT), stderr[-2000:]
    assert "Traceback" not in stderr and _last_line(stderr) == "pipetrain: interrupted by SIGINT"

"""The records of a run (pipetrain.cli.train_records, step_log, record_writes): steps
appended to steps.jsonl, metrics.json written whole at the start and the end, strict
JSON, a resumed run's history, and writes that fail without ending the run."""

from __future__ import annotations

import array
import errno
import gc
import json
import os
import shutil
import subprocess
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipetrain.cli import run_logs
from pipetrain.cli.record_writes import RecordWrites
from pipetrain.cli.run_logs import RETRY_SECONDS, TensorBoardLog
from pipetrain.cli.step_log import StepLog, last_recorded, read_steps
from pipetrain.cli.train_records import WINDOW, RunRecords
from pipetrain.schedule import build_schedule, simulate
from pipetrain.trace import measure_step

TIMELINE = list(simulate(build_schedule("gpipe", num_ranks=2, num_microbatches=2)).timeline)
MEASURE = measure_step(TIMELINE)


def _strict(path: Path) -> Any:
    """The JSON in ``path``, refusing NaN and infinities as a strict parser does."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{path.name} holds {constant}: not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def _record(step: int, loss: float | None = None) -> dict[str, Any]:
    return {"step": step, "loss": 5.0 - step / 1000 if loss is None else loss, "seconds": 0.01,
            "tokens_per_s": 6400.0, "bubble": 0.25, "lr": 1e-3, "grad_norm": 1.0}


def _train(records: RunRecords, steps: range, **losses: float) -> None:
    for step in steps:
        record = _record(step, losses.get(f"s{step}"))
        records.add(record, MEASURE, TIMELINE)
        records.logged(record)


def _records(out: Path, *, first_step: int = 1, history: Path | None = None,
             warnings: list[str] | None = None) -> RunRecords:
    return RunRecords(str(out), {"lr": 1e-3}, world_size=2, first_step=first_step,
                      history=None if history is None else str(history),
                      warn=(warnings if warnings is not None else []).append)


def _lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


def test_steps_are_appended_and_metrics_json_is_written_at_the_start_and_the_end(tmp_path: Path) -> None:
    records = _records(tmp_path)
    records.write()
    started = _strict(tmp_path / "metrics.json")
    assert started["steps"] == [] and started["stopped"] is None and started["schema"] == 3
    _train(records, range(1, 6), s3=float("nan"), s4=float("inf"))
    # steps.jsonl is current after every step; metrics.json is not rewritten meanwhile
    assert [s["step"] for s in _lines(tmp_path)] == [1, 2, 3, 4, 5]
    assert _strict(tmp_path / "metrics.json") == started
    records.stopped = {"reason": "nonfinite", "at_step": 6, "loss": float("nan"),
                       "grad_norm": float("inf")}
    records.sample = "def f():"
    written = records.write(pictures=True, title="gpipe")
    records.close()
    assert written == ["metrics.json", "sample.txt", "timeline.png", "trace.json", "loss.png"]
    metrics = _strict(tmp_path / "metrics.json")
    assert metrics["steps"] == _lines(tmp_path)
    assert [s["loss"] for s in metrics["steps"]][2:4] == [None, None]  # NaN and inf: null
    assert metrics["stopped"]["loss"] is None and metrics["stopped"]["grad_norm"] is None
    assert metrics["summary"]["session_steps"] == 5
    assert metrics["summary"]["first_loss"] == pytest.approx(4.999)
    assert metrics["summary"]["final_loss"] == pytest.approx(4.995)
    assert (tmp_path / "sample.txt").read_text() == "def f():"


def test_a_resume_continues_the_history_up_to_its_checkpoint(tmp_path: Path) -> None:
    first = _records(tmp_path)
    _train(first, range(1, 9))
    first.stop({"reason": "error", "at_step": 8})
    first.close()
    # resumed in place from the checkpoint at step 5: steps 6-8 are trained again
    again = _records(tmp_path, first_step=6, history=tmp_path)
    assert [s["step"] for s in _lines(tmp_path)] == [1, 2, 3, 4, 5]
    assert again.first_loss == pytest.approx(4.999) and again.last == _record(5)
    _train(again, range(6, 8))
    again.write()
    metrics = _strict(tmp_path / "metrics.json")
    assert [s["step"] for s in metrics["steps"]] == [1, 2, 3, 4, 5, 6, 7]
    assert [g["first_step"] for g in metrics["segments"]] == [1, 6]
    assert metrics["summary"]["session_steps"] == 2
    # into a new folder, from a run folder written before steps.jsonl existed
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.json").write_text(json.dumps(
        {"segments": [{"first_step": 1}], "steps": [_record(1), _record(2), _record(3)]}))
    moved = _records(tmp_path / "new", first_step=3, history=old)
    assert [s["step"] for s in _lines(tmp_path / "new")] == [1, 2]
    assert [g["first_step"] for g in moved.segments] == [1, 3]


def test_a_line_cut_short_by_a_crash_is_left_out(tmp_path: Path) -> None:
    (tmp_path / "steps.jsonl").write_text(json.dumps(_record(1)) + "\n" + '{"step": 2, "lo')
    assert [s["step"] for s in read_steps(str(tmp_path))] == [1]
    assert last_recorded(str(tmp_path)) == (1, str(tmp_path / "steps.jsonl"))
    records = _records(tmp_path, first_step=3, history=tmp_path)
    _train(records, range(3, 4))
    assert [s["step"] for s in _lines(tmp_path)] == [1, 3]


def test_the_medians_cover_the_sessions_last_steps_after_its_first_fifth(tmp_path: Path) -> None:
    records = _records(tmp_path)
    for step in range(1, 11):  # the first two (a fifth) are slow: warm-up
        record = {**_record(step), "tokens_per_s": 10.0 if step <= 2 else 1000.0 + step}
        records.add(record, MEASURE, TIMELINE)
        records.logged(record)
    assert records.summary()["median_tokens_per_s"] == pytest.approx(1006.5)  # steps 3-10
    _train(records, range(11, WINDOW + 200))
    assert records.summary()["median_tokens_per_s"] == 6400.0  # the last WINDOW steps only
    assert len(records._window) == WINDOW


def test_a_stop_from_another_thread_writes_the_step_in_flight_once(tmp_path: Path) -> None:
    records = _records(tmp_path)
    _train(records, range(1, 3))
    record = _record(3)
    records.add(record, MEASURE, TIMELINE)  # its validation has not run yet
    stopper = threading.Thread(target=records.stop, args=({"reason": "error", "at_step": 3},))
    stopper.start()
    stopper.join()
    record["val_loss"] = 4.0
    records.logged(record)  # the main thread goes on: no second line for step 3
    assert [s["step"] for s in _lines(tmp_path)] == [1, 2, 3]
    assert [s["step"] for s in _strict(tmp_path / "metrics.json")["steps"]] == [1, 2, 3]


def _failing_write(monkeypatch: pytest.MonkeyPatch, fail: list[bool], *, partial: bool) -> None:
    """os.write in step_log fails with ENOSPC while ``fail[0]``; with ``partial`` it first
    writes half of what it was given, as a file system does when it fills up."""
    real = os.write

    def write(fd: int, data: Any) -> int:
        if not fail[0]:
            return real(fd, data)
        if partial and len(data) > 1:
            real(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", write)


def test_a_full_disk_warns_once_keeps_training_and_loses_no_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    warnings: list[str] = []
    records = _records(tmp_path, warnings=warnings)
    records.write()
    _train(records, range(1, 3))
    fail = [True]
    _failing_write(monkeypatch, fail, partial=True)
    _train(records, range(3, 7))  # no exception: training goes on
    path = tmp_path / "steps.jsonl"
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"could not write {str(path)!r}: no space left on the device (")
    assert "MiB free there)" in warnings[0] and "Fix: free space on that file system" in warnings[0]
    assert [s["step"] for s in _lines(tmp_path)] == [1, 2]  # whole lines only: the half cut off
    # the steps not written are kept: in metrics.json if it can be written...
    records.write()
    assert [s["step"] for s in _strict(tmp_path / "metrics.json")["steps"]] == [1, 2, 3, 4, 5, 6]
    fail[0] = False  # ...and in steps.jsonl at the next write once the disk takes them
    _train(records, range(7, 8))
    assert [s["step"] for s in _lines(tmp_path)] == [1, 2, 3, 4, 5, 6, 7]
    assert warnings[1:] == [f"{str(path)!r} is written again"]


def test_metrics_json_on_a_full_disk_warns_with_the_free_space_of_its_own_file_system(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug: a failed rewrite of metrics.json ended the run with a traceback and the free
    space of the working directory's file system."""
    warnings: list[str] = []
    records = _records(tmp_path, warnings=warnings)
    _train(records, range(1, 3))
    real = os.replace

    def full(source: str, target: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    asked: list[str] = []
    disk_usage = shutil.disk_usage

    def watched(path: str) -> Any:
        asked.append(str(path))
        return disk_usage(path)

    monkeypatch.setattr(shutil, "disk_usage", watched)
    assert records.write() == []  # nothing raised
    assert records.write() == []
    assert len(warnings) == 1 and str(tmp_path / "metrics.json") in warnings[0]
    assert asked == [str(tmp_path)]  # the run folder's file system, not the working directory's
    monkeypatch.setattr(os, "replace", real)
    assert records.write() == ["metrics.json"]
    assert warnings[-1].endswith("is written again")


def test_tensorboard_events_that_fail_are_tried_again_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    full, now = [False], [0.0]

    class Filling:
        """A file that refuses writes while the disk is full."""

        def __init__(self, path: str, mode: str) -> None:
            self.file = open(path, mode)

        def write(self, data: bytes) -> int:
            if full[0]:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.file.write(data)

        def flush(self) -> None:
            self.file.flush()

        def close(self) -> None:
            self.file.close()

    monkeypatch.setattr(run_logs, "open", Filling, raising=False)
    warnings: list[str] = []
    log = TensorBoardLog(str(tmp_path), writes=RecordWrites(warn=warnings.append),
                         clock=lambda: now[0])
    log.step({"step": 1, "loss": 2.0, "lr": 0.01})
    full[0] = True
    log.step({"step": 2, "loss": float("nan")})  # nothing finite to write: no failure
    log.step({"step": 3, "loss": 1.5})
    log.step({"step": 4, "loss": 1.5})
    assert len(warnings) == 1 and "events.out.tfevents.*" in warnings[0]
    full[0] = False
    now[0] = RETRY_SECONDS / 2
    log.step({"step": 5, "loss": 1.0})  # too soon: no new file
    now[0] = RETRY_SECONDS
    log.step({"step": 6, "loss": 1.0})
    log.close()
    assert warnings[-1].endswith("is written again")
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.0), (6, 1.0)]
    assert [e.step for e in events.Scalars("train/lr")] == [1]


def test_a_step_log_whose_history_cannot_be_copied_keeps_it_in_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = StepLog(str(tmp_path), writes=RecordWrites(warn=lambda line: None), first_step=1)
    for step in range(1, 5):
        first.append(_record(step))
    first.close()
    real_open = open

    def no_space(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path).endswith(".partial"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_space)
    warnings: list[str] = []
    again = StepLog(str(tmp_path), writes=RecordWrites(warn=warnings.append), first_step=3,
                    history=str(tmp_path))
    monkeypatch.setattr("builtins.open", real_open)
    assert len(warnings) == 1
    assert [r["step"] for r in again.records()] == [1, 2]
    again.append(_record(3))  # the file starts again: steps 3 and 4 of before are gone
    assert [s["step"] for s in _lines(tmp_path)] == [1, 2, 3]


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs (skips where it cannot be mounted: the core tests do not need it)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_records_on_a_disk_that_fills_up_keep_every_step(tiny_disk: Path) -> None:
    warnings: list[str] = []
    out = tiny_disk / "run"
    records = _records(out, warnings=warnings)
    ballast = tiny_disk / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT)
    try:
        while True:  # fill the disk
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    _train(records, range(1, 200))
    head = f"could not write {str(out / 'steps.jsonl')!r}: no space left on the device ("
    assert any(line.startswith(head) for line in warnings), warnings
    assert all(line.endswith("}") for line in (out / "steps.jsonl").read_text().splitlines())
    ballast.unlink()
    _train(records, range(200, 201))
    assert [s["step"] for s in _lines(out)] == list(range(1, 201))
    assert records.write() and [s["step"] for s in _strict(out / "metrics.json")["steps"]] == list(range(1, 201))


@pytest.mark.slow
def test_recording_a_step_costs_no_more_late_in_a_long_run(tmp_path: Path) -> None:
    """Bug: rank 0 rewrote metrics.json with every step so far every 2 s and kept every
    step in memory: the cost of a step grew with the number of steps (a rewrite took
    16 ms at 2k steps and 766 ms at 100k). Records of 10,000 synthetic steps, each with
    the work of a real one (the record, its measure, TensorBoard; the fsync of a
    checkpoint every 100 steps): the cost of a step's records over steps 8,000-10,000
    is within 3 times that over steps 1,000-3,000 (compared with each other, not with a
    number; the bug made it 25 times larger at this length; a busy machine has made it
    1.6 times without the bug), and the memory that Python
    allocates for the records does not grow with the steps."""
    records = _records(tmp_path)
    records.write()
    cost = array.array("d", bytes(8 * 10_001))  # allocates nothing as it fills
    traced: dict[int, int] = {}
    tracemalloc.start()
    try:
        for step in range(1, 10_001):
            record = _record(step)
            began = time.perf_counter()
            records.add(record, MEASURE, TIMELINE)
            records.logged(record)
            if step % 100 == 0:
                records.sync()
            cost[step] = time.perf_counter() - began
            if step in (3_000, 10_000):
                gc.collect()
                traced[step] = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    records.close()

    def typical(first: int, last: int) -> float:
        # the median of 100-step means: a busy spell of a shared machine moves one block
        means = [sum(cost[s] for s in range(b, b + 100)) / 100 for b in range(first, last, 100)]
        return sorted(means)[len(means) // 2]

    early, late = typical(1_000, 3_000), typical(8_000, 10_000)
    assert late < 3 * early, f"{late * 1e6:.0f} us per step late, {early * 1e6:.0f} us early"
    grown = traced[10_000] - traced[3_000]
    assert grown < 256 * 1024, f"the records' memory grew by {grown} bytes over 7,000 steps"
    assert len(_lines(tmp_path)) == 10_000

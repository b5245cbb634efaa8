"""``--log``: the step scalars to Weights & Biases and MLflow through one interface, offline,
continued on resume, never stopping a run: the real packages (the dev extra installs them),
read back from their own files, and stand-ins for what the real ones cannot be made to do
(fail, be missing)."""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from helpers.trackers import wandb_history
from pipetrain.cli.main import build_parser
from pipetrain.cli.train_records import RunRecords
from pipetrain.schedule import build_schedule, simulate
from pipetrain.trace import measure_step

TIMELINE = list(simulate(build_schedule("gpipe", num_ranks=2, num_microbatches=2)).timeline)


def _fake_wandb(calls: list[Any]) -> types.ModuleType:
    module = types.ModuleType("wandb")

    class Run:
        def __init__(self, **kwargs: Any) -> None:
            self.id = kwargs["id"] or "w123"
            calls.append(("init", kwargs))

        def log(self, scalars: dict[str, float], step: int) -> None:
            calls.append(("log", step, scalars))

        def finish(self) -> None:
            calls.append(("finish",))

    module.init = lambda **kwargs: Run(**kwargs)  # type: ignore[attr-defined]
    return module


def _fake_mlflow(calls: list[Any]) -> types.ModuleType:
    module = types.ModuleType("mlflow")
    info = types.SimpleNamespace(run_id="m456")
    module.set_tracking_uri = lambda uri: calls.append(("uri", uri))  # type: ignore[attr-defined]
    module.start_run = lambda run_id=None, run_name=None: (  # type: ignore[attr-defined]
        calls.append(("start", run_id, run_name)) or types.SimpleNamespace(info=info))
    module.log_params = lambda params: calls.append(("params", params))  # type: ignore[attr-defined]
    module.log_metrics = lambda metrics, step: calls.append(("log", step, metrics))  # type: ignore[attr-defined]
    module.end_run = lambda: calls.append(("end",))  # type: ignore[attr-defined]
    return module


def _unset_tracker_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start without the trackers' variables, and drop at the end those a tracker sets for
    its process and its children (MLflow's ``set_tracking_uri`` exports
    ``MLFLOW_TRACKING_URI``, ``wandb.init`` its service's ``WANDB_SERVICE``: left set, a
    later test's runs went to this test's store and service)."""
    for name in ("WANDB_MODE", "WANDB_SERVICE", "MLFLOW_TRACKING_URI",
                 "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.setenv(name, "")  # recorded: the end of the test removes it again
        monkeypatch.delenv(name)


def _train(records: RunRecords, steps: range) -> None:
    for step in steps:
        record = {"step": step, "loss": 5.0 - step / 10, "seconds": 0.01, "tokens_per_s": 100.0,
                  "bubble": 0.25, "lr": 1e-3, "grad_norm": float("nan")}
        records.add(record, measure_step(TIMELINE), TIMELINE)
        records.logged(record)


def test_wandb_and_mlflow_get_every_steps_scalars_offline_and_a_resume_continues_their_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb_calls: list[Any] = []
    mlflow_calls: list[Any] = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(wandb_calls))
    monkeypatch.setitem(sys.modules, "mlflow", _fake_mlflow(mlflow_calls))
    _unset_tracker_environment(monkeypatch)
    records = RunRecords(str(tmp_path), {"lr": 1e-3}, world_size=2, first_step=1,
                         log="tensorboard,wandb,mlflow")
    _train(records, range(1, 4))
    records.close()
    init = wandb_calls[0][1]  # W&B and MLflow hold the losses TensorBoard holds
    assert (init["mode"], init["dir"], init["config"], init["id"]) == (
        "offline", str(tmp_path), {"lr": 1e-3}, None)
    logged = [c for c in wandb_calls if c[0] == "log"]
    assert [(step, s["train/loss"]) for _, step, s in logged] == [(1, 4.9), (2, 4.8), (3, 4.7)]
    assert "train/grad_norm" not in logged[0][2]  # not finite: left out, as TensorBoard does
    assert wandb_calls[-1] == ("finish",)
    assert mlflow_calls[0] == ("uri", f"file:{tmp_path}/mlruns")
    assert mlflow_calls[1] == ("start", None, tmp_path.name)
    assert ("params", {"lr": "0.001"}) in mlflow_calls
    assert [(c[1], c[2]["train.loss"]) for c in mlflow_calls if c[0] == "log"] == [
        (1, 4.9), (2, 4.8), (3, 4.7)]
    assert json.loads((tmp_path / "trackers.json").read_text()) == {"wandb": "w123",
                                                                    "mlflow": "m456"}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tensorboard = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert tensorboard == [(step, pytest.approx(s["train/loss"])) for _, step, s in logged]
    # the resumed run continues the same tracker runs
    wandb_calls.clear()
    mlflow_calls.clear()
    again = RunRecords(str(tmp_path), {"lr": 1e-3}, world_size=2, first_step=4, history=str(tmp_path),
                       log="wandb,mlflow")
    again.close()
    assert (wandb_calls[0][1]["id"], wandb_calls[0][1]["resume"]) == ("w123", "allow")
    assert mlflow_calls[1][:2] == ("start", "m456") and not any(c[0] == "params" for c in mlflow_calls)


def test_a_missing_package_is_named_and_a_failing_tracker_is_dropped_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    calls: list[Any] = []
    broken = _fake_mlflow(calls)

    def refuse(metrics: Any, step: int) -> None:
        calls.append(("tried", step))
        raise ConnectionError("the tracking server went away")

    broken.log_metrics = refuse  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mlflow", broken)
    records = RunRecords(str(tmp_path), {}, world_size=2, first_step=1, log="wandb,mlflow")
    assert [t.missing for t in records.trackers] == [
        "--log wandb needs the wandb package: pip install wandb", None]
    with caplog.at_level(logging.WARNING):
        _train(records, range(1, 4))
    records.close()
    assert [c for c in calls if c[0] == "tried"] == [("tried", 1)]  # dropped after the failure
    assert sum("mlflow stopped logging" in r.message for r in caplog.records) == 1
    assert (tmp_path / "steps.jsonl").read_text().count("\n") == 3  # the run's own records go on


def test_log_names_are_checked_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args(["train", "--log", "wandb,mlflow"]).log == "wandb,mlflow"
    for bad in ("tensorbord", "none,wandb"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["train", "--log", bad])
    assert "none goes alone" in capsys.readouterr().err


def test_a_tracker_that_cannot_start_is_named_and_the_run_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    refusing = _fake_mlflow(calls)

    def start_run(run_id: Any = None, run_name: Any = None) -> Any:
        raise RuntimeError("The filesystem tracking backend is in maintenance mode")

    refusing.start_run = start_run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mlflow", refusing)
    _unset_tracker_environment(monkeypatch)
    records = RunRecords(str(tmp_path), {}, world_size=2, first_step=1, log="mlflow")
    (tracker,) = records.trackers
    assert tracker.missing == ("--log mlflow could not start (RuntimeError: The filesystem "
                               "tracking backend is in maintenance mode); the run trains without it")
    _train(records, range(1, 3))
    records.close()
    assert (tmp_path / "steps.jsonl").read_text().count("\n") == 2


def test_the_real_packages_hold_the_losses_tensorboard_holds_and_a_resume_continues_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _unset_tracker_environment(monkeypatch)
    monkeypatch.setenv("WANDB_SILENT", "true")
    records = RunRecords(str(tmp_path), {"lr": 1e-3}, world_size=2, first_step=1,
                         log="tensorboard,wandb,mlflow")
    _train(records, range(1, 4))
    records.close()
    again = RunRecords(str(tmp_path), {"lr": 1e-3}, world_size=2, first_step=4,
                       history=str(tmp_path), log="tensorboard,wandb,mlflow")
    _train(again, range(4, 6))
    again.close()
    ids = json.loads((tmp_path / "trackers.json").read_text())
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    expected = [(e.step, pytest.approx(e.value)) for e in events.Scalars("train/loss")]
    assert [step for step, _ in expected] == [1, 2, 3, 4, 5]
    mlflow = MlflowClient(tracking_uri=f"file:{tmp_path}/mlruns")
    assert [(m.step, m.value) for m in sorted(mlflow.get_metric_history(
        ids["mlflow"], "train.loss"), key=lambda m: m.step)] == expected  # one run, continued
    assert mlflow.get_run(ids["mlflow"]).data.params == {"lr": "0.001"}
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2  # offline, a folder per session of the one run id
    first, second = (wandb_history(run) for run in runs)
    assert first[0] == second[0] == ids["wandb"]
    assert first[1] + second[1] == expected

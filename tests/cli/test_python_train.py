"""``pipetrain.train(...)``: the command from Python, with a model function and the
command's options as keyword arguments."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import pipetrain
from pipetrain.cli.python_train import _argv, _model_spec

_MODEL = '''
import torch
from torch import nn


def build(vocab_size, context):
    return {"model": nn.Sequential(nn.Embedding(vocab_size, 16), nn.Linear(16, vocab_size)),
            "split_points": ["1"],
            "train_data": [torch.arange(n) % 256 for n in range(20, 60)]}
'''


def _import(path: Path) -> object:
    spec = importlib.util.spec_from_file_location("users_model_for_train", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_options_become_the_commands_flags_and_unknown_ones_are_named(tmp_path: Path) -> None:
    assert _argv({"stages": 2, "lr_schedule": "linear", "betas": (0.9, 0.99), "compile": True,
                  "fsdp": False, "data": None}) == [
        "--stages", "2", "--lr-schedule", "linear", "--betas", "0.9", "0.99", "--compile"]
    with pytest.raises(TypeError, match=r"'stage' \(did you mean 'stages'\?\)"):
        pipetrain.train(stage=2)
    with pytest.raises(ValueError, match="not a lambda"):
        _model_spec(lambda vocab_size: None)
    path = tmp_path / "users_model.py"
    path.write_text(_MODEL)
    assert _model_spec(_import(path).build) == f"{path}:build"  # type: ignore[attr-defined]


@pytest.mark.distributed
def test_a_model_function_trains_and_a_refused_option_raises_with_the_commands_message(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "users_model.py"
    path.write_text(_MODEL)
    build = _import(path).build  # type: ignore[attr-defined]
    run = pipetrain.train(build, stages=2, steps=3, context=16, batch_size=4, microbatches=2,
                          eval_every=0, sample_bytes=0, out=tmp_path / "run")
    assert run.folder == str(tmp_path / "run") and len(run.losses) == 3
    assert run.losses == [s["loss"] for s in json.loads(
        (tmp_path / "run" / "metrics.json").read_text())["steps"]]
    assert "starting 2 workers" in capsys.readouterr().err  # its progress, shown as it comes
    with pytest.raises(pipetrain.TrainFailed, match="already holds a run") as failed:
        pipetrain.train(build, stages=2, steps=3, out=tmp_path / "run")
    assert failed.value.status == 2

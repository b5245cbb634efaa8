"""``--optimizer``, its settings and ``--lr-schedule``: what a run trains with, checked
against plain PyTorch, and the settings that do not go together refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.train_runs import recorded_losses, refused_here, run_train
from pipetrain.api.lr_schedule import lr_factor
from pipetrain.cli.main import build_parser
from pipetrain.cli.train_checks import prepare

SMALL = ["--layers", "2", "--width", "32", "--heads", "2", "--context", "32", "--batch-size", "8",
         "--microbatches", "4", "--sample-bytes", "0", "--eval-every", "0"]
SGD = ["--optimizer", "sgd", "--momentum", "0.8", "--weight-decay", "0.01", "--lr", "0.05",
       "--lr-schedule", "linear", "--min-lr", "0", "--warmup", "1", "--steps", "5"]


def _problems(*argv: str) -> list[str]:
    return prepare(build_parser().parse_args(["train", *SMALL, *argv]))[2]


def _one_process(model: Any, opt: Any, sched: Any, loss_fn: Any,
                 dataset: Any) -> tuple[list[float], list[float]]:
    """5 steps of the run's batches of 8 in one process, clipped at 1.0 as the run clips:
    each step's loss, and the learning rate after it."""
    losses, rates = [], []
    for step in range(5):
        x, y = dataset.batch(step, 8)
        loss = loss_fn(model(x), y)
        losses.append(loss.item())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        rates.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
    return losses, rates


@pytest.mark.parametrize(("schedule", "expected"), [
    ("cosine", [0.5, 1.0, 1.0, 0.5, 0.0, 0.0]),
    ("linear", [0.5, 1.0, 1.0, 0.5, 0.0, 0.0]),
    ("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ("wsd", [0.5, 1.0, 1.0, 1.0, 0.0, 0.0]),  # the last 20% of 8 steps after warm-up: 2
])
def test_each_schedule_warms_up_then_decays_to_its_floor(schedule: str, expected: list[float]) -> None:
    factor = lr_factor(2, 10, schedule=schedule, min_ratio=0.0, decay_fraction=0.25)
    assert [round(factor(step), 6) for step in (0, 1, 2, 6, 10, 12)] == expected
    with pytest.raises(ValueError, match="must be one of cosine, linear"):
        lr_factor(2, 10, schedule="step")


def test_settings_of_another_optimizer_and_a_floor_above_the_peak_are_refused() -> None:
    assert _problems("--optimizer", "sgd", "--momentum", "0.5") == []
    assert any("--momentum 0.5 is a setting of --optimizer sgd, not of --optimizer adamw" in p
               for p in _problems("--momentum", "0.5"))
    assert any("--betas" in p and "not of --optimizer sgd" in p
               for p in _problems("--optimizer", "sgd", "--betas", "0.9", "0.99"))
    assert any("--min-lr 0.1 is above --lr 0.01" in p for p in _problems("--min-lr", "0.1",
                                                                           "--lr", "0.01"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--betas", "0.9", "1.5"])


@pytest.mark.distributed
def test_sgd_with_a_linear_schedule_trains_as_plain_pytorch(tmp_path: Path) -> None:
    """2 stages with SGD (momentum, weight decay), a linear decay to 0 and 4 batches
    accumulated per step: the losses and learning rates of one process with torch's SGD
    on the 4x batch; the records say what ran; resuming with another optimizer is
    refused."""
    from pipetrain.cli.run_config import RunConfig
    from pipetrain.cli.run_model import run_dataset
    from pipetrain.cli.train_options import gpt_config
    from pipetrain.models import build_gpt, gpt_loss

    # --accumulate 4 of 2 sequences: each step one process's batch of 8
    done = run_train(SMALL, *SGD, "--stages", "2", "--save-every", "5", "--batch-size", "2",
                     "--microbatches", "1", "--accumulate", "4", out=tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    config = RunConfig()
    config.set("command line", layers=2, width=32, heads=2, context=32, batch_size=8)
    dataset, _ = run_dataset(config)
    model = build_gpt(gpt_config(config), seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.8, weight_decay=0.01)
    # warm-up 1 step, then a straight line from 1 at step 1 to 0 at step 5
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 1 else 1 - (s - 1) / 4)
    losses, rates = _one_process(model, opt, sched, gpt_loss, dataset)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    got = recorded_losses(tmp_path / "run")
    for step, (a, b) in enumerate(zip(losses, got)):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step + 1}: {b} vs one process {a}"
    assert [round(s["lr"], 9) for s in metrics["steps"]] == [round(r, 9) for r in rates]
    args = json.loads((tmp_path / "run" / "config.json").read_text())["args"]
    assert (args["optimizer"], args["momentum"], args["lr_schedule"], args["accumulate"]) == (
        "sgd", 0.8, "linear", 4)
    record = json.loads((tmp_path / "run" / "config.json").read_text())["optimizer"]
    assert (record["class"], record["source"], record["settings"]["weight_decay"]) == (
        "SGD", "the options", 0.01)
    again = refused_here(["train", *SMALL, "--resume", str(tmp_path / "run"), "--steps", "6",
                          "--optimizer", "adamw", "--momentum", "0.8", "--out", str(tmp_path / "run")])
    assert again.returncode == 2
    assert "--optimizer adamw differs from the resumed run's --optimizer sgd" in again.stderr


_MODEL_FILE = '''
import functools
import torch
from torch import nn

def linear(step):
    return 1.0 if step < 1 else 1 - (step - 1) / 4

def build(vocab_size):
    model = nn.Sequential(nn.Embedding(vocab_size, 32), nn.Linear(32, 32), nn.GELU(),
                          nn.Linear(32, vocab_size))
    return {"model": model, "split_points": ["2"],
            "optimizer": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.8,
                                           weight_decay=0.01),
            "lr_scheduler": functools.partial(torch.optim.lr_scheduler.LambdaLR,
                                              lr_lambda=linear)}
'''


@pytest.mark.distributed
def test_a_model_files_optimizer_and_schedule_train_as_plain_pytorch(tmp_path: Path) -> None:
    """The model file's SGD and LambdaLR on 2 stages: one process's losses with the same
    ones; config.json says they came from the model file; an --optimizer beside them is
    refused (in every worker, before the pipeline is built)."""
    from pipetrain.cli.run_config import RunConfig
    from pipetrain.cli.run_model import run_dataset
    from pipetrain.cli.user_models import build_user_model, lm_loss

    path = tmp_path / "sgd_model.py"
    path.write_text(_MODEL_FILE)
    options = [*SMALL[6:], "--model", f"{path}:build", "--steps", "5"]  # not the GPT's shape
    done = run_train(options, "--stages", "2", out=tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    config = RunConfig()
    config.set("command line", model=f"{path}:build", context=32, batch_size=8)
    dataset, _ = run_dataset(config)
    user = build_user_model(config, vocab_size=256)  # seeded with --seed, as the run does
    model, opt = user.model, user.optimizer(user.model.parameters())
    sched = user.lr_scheduler(opt)
    losses, _ = _one_process(model, opt, sched, lm_loss, dataset)
    got = recorded_losses(tmp_path / "run")
    for step, (a, b) in enumerate(zip(losses, got)):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step + 1}: {b} vs one process {a}"
    record = json.loads((tmp_path / "run" / "config.json").read_text())["optimizer"]
    assert (record["class"], record["source"], record["lr_scheduler_source"]) == (
        "SGD", "the model file", "the model file")
    assert record["settings"]["momentum"] == 0.8
    from pipetrain.cli.train_optimizer import training_factories
    from pipetrain.cli.worker_errors import UsageError

    config.set("command line", optimizer="adam")
    with pytest.raises(UsageError, match="--optimizer and the 'optimizer' the model file "
                                         "returns both set the optimizer"):
        training_factories(config, {"optimizer": user.optimizer})

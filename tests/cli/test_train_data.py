"""A model file's own samples (``train_data`` / ``val_data``): packed by default, padded
per step when it returns a SampleDataset that says so; trained as one process trains, and
a resumed run trains on the same samples as an uninterrupted one would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.train_runs import recorded_losses, run_here, run_train
from pipetrain.cli.run_config import RunConfig
from pipetrain.cli.run_model import data_line, data_record, run_dataset
from pipetrain.data import SampleDataset

_MODEL_FILE = '''
import functools
import torch
from torch import nn
from pipetrain.data import SampleDataset


def constant(step):
    return 1.0


def documents(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(n),), generator=g)
            for n in torch.randint(16, 129, (30,), generator=g)]


def build(vocab_size, context, seed):
    model = nn.Sequential(nn.Embedding(vocab_size, 32), nn.Linear(32, 32), nn.GELU(),
                          nn.Linear(32, vocab_size))
    return {"model": model, "split_points": ["2"],
            "optimizer": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
            "lr_scheduler": functools.partial(torch.optim.lr_scheduler.LambdaLR,
                                              lr_lambda=constant),
            "train_data": SampleDataset(documents(1), context=context, seed=seed, pack=False,
                                        val_data=documents(2))}


def kept(vocab_size, context, seed):
    from pipetrain.models import GPTConfig, build_gpt

    config = GPTConfig(vocab_size=vocab_size, context=context, num_layers=2, width=32)
    return {"model": build_gpt(config, seed=seed), "split_points": ["2"],
            "optimizer": functools.partial(torch.optim.SGD, lr=0.05),
            "lr_scheduler": functools.partial(torch.optim.lr_scheduler.LambdaLR,
                                              lr_lambda=constant),
            "train_data": SampleDataset(documents(1), context=context, seed=seed,
                                        boundaries=True, val_data=documents(2)[:3])}


def packed(vocab_size):
    return {"model": nn.Sequential(nn.Embedding(vocab_size, 8), nn.Linear(8, vocab_size)),
            "train_data": documents(1), "val_data": documents(2)[:3]}
'''
OPTIONS = ["--context", "128", "--batch-size", "4", "--microbatches", "2", "--sample-bytes", "0",
           "--eval-every", "2", "--stages", "2"]


def _config(path: Path, function: str) -> RunConfig:
    config = RunConfig()
    config.set("command line", model=f"{path}:{function}", context=128, batch_size=4)
    return config


def _one_process(user: Any, batches: list[tuple[Any, torch.Tensor]]) -> list[float]:
    """The losses of the model file's model trained on ``batches`` in this process, as
    ``pipetrain train`` trains it (its optimizer, gradients clipped to norm 1)."""
    from pipetrain.cli.user_models import lm_loss

    optimizer = user.optimizer(user.model.parameters())
    losses = []
    for x, y in batches:
        loss = lm_loss(user.model(x), y)
        losses.append(loss.item())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(user.model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return losses


def test_a_list_of_documents_is_packed_and_its_record_says_so(tmp_path: Path) -> None:
    path = tmp_path / "model.py"
    path.write_text(_MODEL_FILE)
    dataset, _ = run_dataset(_config(path, "packed"))
    assert isinstance(dataset, SampleDataset) and dataset.pack
    x, y = dataset.batch(0, 3)
    assert x.shape == (3, 128) and bool((y >= 0).all())
    record = data_record(_config(path, "packed"), dataset, _)
    line = data_line(record)
    assert line.startswith("data: SampleDataset(train=30 samples") and ", packed;" in line
    assert f"{record['val_tokens']:,} to validate on" in line


@pytest.mark.distributed
def test_packed_documents_with_their_boundaries_train_from_the_command_line(tmp_path: Path) -> None:
    """A model file's built-in GPT and SampleDataset(boundaries=True): the model is captured
    on a batch of input_ids and position_ids, 2 stages train 2 steps, and each step's loss is
    one process's on the same batches (which attention across documents would change); the
    run samples, and `pipetrain sample` loads its checkpoint and samples."""
    path = tmp_path / "model.py"
    path.write_text(_MODEL_FILE)
    run = run_train(OPTIONS, "--model", f"{path}:kept", "--steps", "2", "--sample-bytes", "8",
                    out=tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "packed, each document attending to itself only" in run.stderr
    assert (tmp_path / "run" / "sample.txt").read_bytes().startswith(b"def ")
    # one process samples from it too, with the model file's optimizer (SGD: its state is
    # not AdamW's) and the prompt as one document
    sampled = run_here(["sample", str(tmp_path / "run"), "--bytes", "8"])
    assert sampled.returncode == 0 and sampled.stdout.startswith("def "), sampled.stderr[-2000:]

    from pipetrain.cli.user_models import build_user_model, lm_loss

    config = _config(path, "kept")
    dataset, _ = run_dataset(config)
    user = build_user_model(config, vocab_size=256)
    batches = [dataset.batch(step, 4) for step in range(2)]
    with torch.no_grad():
        crossing = [lm_loss(user.model(x["input_ids"]), y).item() for x, y in batches[:1]]
    losses = _one_process(user, batches)
    recorded = recorded_losses(tmp_path / "run")
    assert len(recorded) == 2 and abs(crossing[0] - losses[0]) > 1e-4
    for step, (a, b) in enumerate(zip(losses, recorded)):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step + 1}: {b} vs one process {a}"


@pytest.mark.distributed
def test_padded_documents_train_as_one_process_through_a_resume(tmp_path: Path) -> None:
    """Documents of 16-128 tokens padded per step (the length changes from step to step),
    2 stages, a run of 2 steps resumed to 4: every step's loss is one process's (the mean
    over real tokens) on the same samples, the resumed steps included (a step's batch is a
    function of the step: tests/api/test_pipeline_samples.py)."""
    path = tmp_path / "model.py"
    path.write_text(_MODEL_FILE)
    first = run_train(OPTIONS, "--model", f"{path}:build", "--steps", "2", out=tmp_path / "run")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "padded per step" in first.stderr
    rest = run_train([], "--resume", str(tmp_path / "run"), "--steps", "4", out=tmp_path / "run")
    assert rest.returncode == 0, rest.stderr[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [s["step"] for s in metrics["steps"]] == [1, 2, 3, 4]
    assert all("val_loss" in s for s in metrics["steps"][1::2])

    from pipetrain.cli.user_models import build_user_model

    config = _config(path, "build")
    dataset, _ = run_dataset(config)
    user = build_user_model(config, vocab_size=256)
    batches = [dataset.batch(step, 4) for step in range(4)]
    assert len({x.shape[1] for x, _ in batches}) > 1  # the length changes with the step
    losses = _one_process(user, batches)
    for step, (a, b) in enumerate(zip(losses, recorded_losses(tmp_path / "run"))):
        assert abs(a - b) <= 1e-5 * abs(a), f"step {step + 1}: {b} vs one process {a}"

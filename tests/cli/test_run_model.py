"""Tests of pipetrain.cli.run_model's data: a run trains on the whole ``--data`` file (50 MiB
here) and says so at start-up and in ``config.json`` (a 6.5 MB file used to be cut to its
first 4 MiB without a word, its validation split taken from the end of those 4 MiB); the
file is mapped, not read: the memory a run holds does not grow with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.memory import anonymous_bytes
from pipetrain.cli.run_config import RunConfig
from pipetrain.cli.run_model import data_record, run_dataset

SIZE = 50 * 2**20
VAL = int(SIZE * 0.05)


def _large_file(path: Path) -> Path:
    """'a' for 4 MiB (the old cap), 'b' up to the validation split, 'c' in the last 5%."""
    path.write_bytes(b"a" * 2**22 + b"b" * (SIZE - VAL - 2**22) + b"c" * VAL)
    return path


def test_a_run_dataset_holds_the_whole_file_and_validates_on_its_end(tmp_path: Path) -> None:
    config = RunConfig(data=str(_large_file(tmp_path / "big.txt")), context=32)
    dataset, tokenizer = run_dataset(config)
    record = data_record(config, dataset, tokenizer)
    assert record == {"corpus": config.data, "bytes": SIZE, "tokens": "bytes",
                      "train_tokens": SIZE - VAL, "val_tokens": VAL,
                      "description": f"{config.data} (52,428,800 bytes, all of it)"}
    train = torch.cat([dataset.batch(step, 256)[0] for step in range(10)])
    assert bool((train == ord("b")).any())  # past the old cap
    val = torch.cat([dataset.batch(step, 256, split="val")[0] for step in range(3)])
    assert set(val.unique().tolist()) == {ord("c")}


def test_the_file_is_mapped_not_read_the_memory_stays_steady(tmp_path: Path) -> None:
    """Checking, mapping and drawing 40 batches of a 50 MiB file: the memory the process
    allocates grows by less than a tenth of the file (reading it would add all of it, its
    int64 copy eight times that)."""
    from pipetrain.cli.train_inputs import corpus_problem

    path = _large_file(tmp_path / "big.txt")
    config = RunConfig(data=str(path), context=128)
    torch.zeros(1).add_(1)  # torch's own first allocations, before the measure
    before = anonymous_bytes()
    assert corpus_problem(config) is None
    dataset, tokenizer = run_dataset(config)
    data_record(config, dataset, tokenizer)
    for step in range(40):
        dataset.batch(step, 32)
        dataset.batch(step, 32, split="val")
    grown = anonymous_bytes() - before
    assert grown < SIZE / 10, f"allocated memory grew by {grown / 2**20:.1f} MiB"


@pytest.mark.distributed
def test_train_states_the_corpus_at_start_up_and_in_config_json(tmp_path: Path) -> None:
    data = _large_file(tmp_path / "big.txt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, "-m", "pipetrain", "train", "--layers", "2", "--width", "16", "--heads",
         "2", "--context", "16", "--batch-size", "4", "--microbatches", "2", "--steps", "1",
         "--eval-every", "0", "--sample-bytes", "0", "--data", str(data), "--out", "run"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = (f"pipetrain train: data: {data} (52,428,800 bytes, all of it): "
            f"{SIZE - VAL:,} tokens to train on, the last {VAL:,} to validate on")
    assert line in done.stderr.splitlines(), done.stderr
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data"]["bytes"] == SIZE
    assert (config["data"]["train_tokens"], config["data"]["val_tokens"]) == (SIZE - VAL, VAL)

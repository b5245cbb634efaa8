"""Tests of pipetrain.data.dataset: deterministic batches, splits, errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pipetrain.data.dataset import TextDataset

DATA = bytes(range(256)) * 40  # 10240 tokens


def test_batch_shapes_and_shift() -> None:
    dataset = TextDataset(DATA, context=32, seed=0)
    inputs, targets = dataset.batch(0, 8)
    assert inputs.shape == targets.shape == (8, 32)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal((inputs + 1) % 256, targets)  # DATA counts up: the next byte


def test_batches_are_a_pure_function_of_seed_and_step() -> None:
    a = TextDataset(DATA, context=16, seed=3)
    b = TextDataset(DATA, context=16, seed=3)
    for step in (0, 1, 50, 10_000):
        torch.manual_seed(step)  # the global RNG must not matter
        assert all(torch.equal(x, y) for x, y in zip(a.batch(step, 4), b.batch(step, 4)))
    assert not torch.equal(a.batch(0, 4)[0], a.batch(1, 4)[0])
    assert not torch.equal(a.batch(0, 4)[0], TextDataset(DATA, context=16, seed=4).batch(0, 4)[0])
    # resuming at step 2 gives what an uninterrupted run sees at step 2
    uninterrupted = [a.batch(step, 4)[0] for step in range(3)]
    assert torch.equal(TextDataset(DATA, context=16, seed=3).batch(2, 4)[0], uninterrupted[2])


def test_batches_are_the_same_in_another_process() -> None:
    code = (
        "from pipetrain.data.dataset import TextDataset;"
        "d = TextDataset(bytes(range(256)) * 40, context=16, seed=3);"
        "print(d.batch(17, 4)[0].flatten().tolist())"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": ":".join(sys.path)},
        timeout=60,
    )
    expected = TextDataset(DATA, context=16, seed=3).batch(17, 4)[0].flatten().tolist()
    assert result.stdout.strip() == str(expected)


def test_train_and_val_splits_do_not_overlap() -> None:
    tokens = torch.arange(10_000)  # each token names its position
    dataset = TextDataset(tokens, context=20, seed=0, val_fraction=0.1)
    assert dataset.num_train_tokens == 9_000 and dataset.num_val_tokens == 1_000
    train_max = max(int(torch.cat(dataset.batch(s, 64)).max()) for s in range(20))
    val_min = min(int(torch.cat(dataset.batch(s, 64, split="val")).min()) for s in range(20))
    assert train_max < 9_000 <= val_min
    assert not torch.equal(dataset.batch(0, 4)[0], dataset.batch(0, 4, split="val")[0])


def test_windows_cover_the_ends_of_the_split() -> None:
    dataset = TextDataset(torch.arange(30), context=8, seed=0, val_fraction=0.0)
    starts = torch.cat([dataset.batch(s, 32)[0][:, 0] for s in range(10)])
    assert int(starts.min()) == 0 and int(starts.max()) == 30 - 9


def test_short_corpus_and_bad_arguments_explain_the_fix() -> None:
    with pytest.raises(
        ValueError,
        match=r"train split has 10 tokens .* context=16 needs at least 17: .*context <= 9",
    ):
        TextDataset(b"0123456789", context=16, seed=0, val_fraction=0.0)
    with pytest.raises(
        ValueError, match=r"val split has 5 tokens \(of 100\).*val_fraction >= 0.17"
    ):
        TextDataset(bytes(100), context=16, seed=0)
    with pytest.raises(ValueError) as info:
        TextDataset(DATA, context=0, seed=0, val_fraction=1.0)
    assert "context=0" in str(info.value) and "val_fraction=1.0" in str(info.value)
    with pytest.raises(TypeError, match=r"1-D integer tensor.*float32"):
        TextDataset(torch.zeros(100), context=4, seed=0)
    dataset = TextDataset(DATA, context=4, seed=0, val_fraction=0.0)
    with pytest.raises(ValueError) as info:
        dataset.batch(-1, 0, split="test")
    message = str(info.value)
    assert "step=-1" in message and "batch_size=0" in message and "split='test'" in message
    with pytest.raises(ValueError, match="val_fraction=0"):
        dataset.batch(0, 2, split="val")

"""Tests of pipetrain.data.corpus: the default corpus and user files (whole, however large)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from pipetrain.data import TextDataset
from pipetrain.data.corpus import (
    DEFAULT_CORPUS_BYTES,
    corpus_size,
    corpus_tokens,
    describe_corpus,
    load_corpus,
    stdlib_source_files,
)

OLD_CAP = 4 * 2**20
"""The size at which a --data file used to be cut without a word."""


def test_stdlib_files_are_sorted_and_skip_tests_and_packages() -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_source_files()
    relative = [path.relative_to(root).as_posix() for path in files]
    assert relative == sorted(relative)
    assert "argparse.py" in relative
    skipped = {"site-packages", "test", "tests", "idle_test", "encodings", "__pycache__"}
    assert not any(skipped & set(name.split("/")[:-1]) for name in relative)
    assert all(name.endswith(".py") for name in relative)


def test_default_corpus_is_the_stdlib_source_in_order() -> None:
    files = stdlib_source_files()
    corpus = load_corpus(max_bytes=100_000)
    assert len(corpus) == 100_000
    assert corpus.startswith(files[0].read_bytes()[:1000])
    assert load_corpus(max_bytes=100_000) == corpus  # deterministic
    assert load_corpus(max_bytes=50_000) == corpus[:50_000]  # a prefix


def test_default_corpus_is_its_first_4_mib_every_time() -> None:
    corpus = load_corpus()
    assert len(corpus) == DEFAULT_CORPUS_BYTES == 4 * 2**20 == corpus_size()
    assert b"def " in corpus and b"import " in corpus
    assert load_corpus(max_bytes=None) == corpus  # the default corpus has its own size
    assert load_corpus(max_bytes=10 * DEFAULT_CORPUS_BYTES) == corpus
    tokens = corpus_tokens()
    assert tokens.dtype == torch.uint8 and bytes(tokens.numpy()) == corpus
    # the batches of a default run: the same in a fresh load (runs resume on them)
    again = TextDataset(corpus_tokens(), context=64, seed=0)
    first = TextDataset(corpus, context=64, seed=0)
    for step in (0, 999):
        assert torch.equal(again.batch(step, 8)[0], first.batch(step, 8)[0])
    assert "the first 4 MiB of this Python's standard library source" in describe_corpus(
        None, len(corpus))


def _large_file(path: Path) -> tuple[int, int]:
    """A text file of 5 MiB: 'a' up to the old cap, 'b' to the validation split, 'c'
    after it (the last 5%); its training and validation sizes."""
    size = 5 * 2**20
    val = int(size * 0.05)
    path.write_bytes(b"a" * OLD_CAP + b"b" * (size - val - OLD_CAP) + b"c" * val)
    return size - val, val


def test_a_file_larger_than_the_old_cap_is_used_whole(tmp_path: Path) -> None:
    path = tmp_path / "big.txt"
    num_train, num_val = _large_file(path)
    assert len(load_corpus(path)) == path.stat().st_size == corpus_size(path) > OLD_CAP
    tokens = corpus_tokens(path)
    assert tokens.dtype == torch.uint8 and len(tokens) == num_train + num_val
    assert bytes(tokens[-3:].numpy()) == b"ccc"
    dataset = TextDataset(tokens, context=64, seed=0)
    assert (dataset.num_train_tokens, dataset.num_val_tokens) == (num_train, num_val)
    seen = torch.cat([torch.cat(dataset.batch(step, 64)).flatten() for step in range(20)])
    assert seen.dtype == torch.int64
    assert set(seen.unique().tolist()) == {ord("a"), ord("b")}  # past the old cap, never val
    val = torch.cat([torch.cat(dataset.batch(step, 64, split="val")).flatten()
                     for step in range(5)])
    assert set(val.unique().tolist()) == {ord("c")}  # the last 5% of the whole file
    assert describe_corpus(path, len(tokens)) == f"{path} (5,242,880 bytes, all of it)"


def test_the_last_bytes_of_a_large_file_reach_training_batches(tmp_path: Path) -> None:
    path = tmp_path / "big.txt"
    num_train, _ = _large_file(path)
    with path.open("r+b") as file:  # mark the training split's last 4 KiB
        file.seek(num_train - 4096)
        file.write(b"Z" * 4096)
    dataset = TextDataset(corpus_tokens(path), context=16, seed=0)
    inputs, targets = zip(*(dataset.batch(step, 4096) for step in range(20)))
    assert bool((torch.cat(targets) == ord("Z")).any())  # about 70 windows of 82k reach it
    assert not bool((torch.cat(inputs) == ord("c")).any())


def test_user_file_and_max_bytes(tmp_path: Path) -> None:
    path = tmp_path / "input.txt"
    path.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n")
    assert load_corpus(path).startswith(b"First Citizen:")
    assert load_corpus(str(path), max_bytes=5) == b"First"
    assert load_corpus(path, max_bytes=None) == path.read_bytes()


def test_errors_name_the_path_and_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(
        FileNotFoundError,
        match=r"corpus file '.*nope\.txt' does not exist.*no path for the default corpus",
    ):
        load_corpus(missing)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        load_corpus(empty)
    with pytest.raises(ValueError, match="holds no text file"):
        load_corpus(tmp_path)  # only the empty file
    with pytest.raises(ValueError, match="max_bytes=0 must be a positive int"):
        load_corpus(max_bytes=0)
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"text" + bytes(100))
    for read in (load_corpus, corpus_tokens):
        with pytest.raises(ValueError, match=r"'.*weights\.bin' does not look like text \(a NUL "
                                             r"byte at offset 4\).*pass a text file"):
            read(binary)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        corpus_tokens(missing)


def test_a_folder_is_its_text_files_in_path_order(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_bytes(b"second")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.md").write_bytes(b"first")
    (tmp_path / "image.bin").write_bytes(bytes(range(256)) * 4)  # not text: skipped
    (tmp_path / ".hidden").write_bytes(b"secret")
    assert load_corpus(tmp_path) == b"first\nsecond"
    assert load_corpus(tmp_path, max_bytes=8) == b"first\nse"

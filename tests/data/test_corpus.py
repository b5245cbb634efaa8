"""Tests of pipetrain.data.corpus: the default corpus and user files."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from pipetrain.data.corpus import DEFAULT_MAX_BYTES, load_corpus, stdlib_source_files


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


def test_default_size_is_a_few_megabytes() -> None:
    corpus = load_corpus()
    assert len(corpus) == DEFAULT_MAX_BYTES == 4 * 2**20
    assert b"def " in corpus and b"import " in corpus


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


def test_a_folder_is_its_text_files_in_path_order(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_bytes(b"second")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.md").write_bytes(b"first")
    (tmp_path / "image.bin").write_bytes(bytes(range(256)) * 4)  # not text: skipped
    (tmp_path / ".hidden").write_bytes(b"secret")
    assert load_corpus(tmp_path) == b"first\nsecond"
    assert load_corpus(tmp_path, max_bytes=8) == b"first\nse"

"""``pipetrain train`` checks what it reads and writes before any worker starts: an
``--out`` that cannot be written, a ``--data`` file too short for ``--context``, and
``--model hf-*`` without transformers are each one line naming the flag and a fix that
works (they used to surface in the workers, seconds later, some with impossible fixes)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

import pipetrain.launch
from pipetrain.cli import train_inputs
from pipetrain.cli.main import build_parser, main
from pipetrain.cli.train_checks import prepare
from pipetrain.data import TextDataset

TINY = ["--layers", "1", "--width", "16", "--heads", "2", "--context", "16", "--batch-size", "4",
        "--microbatches", "2", "--steps", "2", "--sample-bytes", "0"]


@pytest.fixture(autouse=True)
def _no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    def launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("workers were launched although the input is bad")

    monkeypatch.setattr(pipetrain.launch, "launch_local", launch)
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    assert main(["train", *argv]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("pipetrain train: error: ") for line in lines), lines
    return lines


def _args(*argv: str) -> argparse.Namespace:
    args = build_parser().parse_args(["train", *argv])
    args.given = set(getattr(args, "given", ()))
    return args


def test_an_out_folder_under_a_file_is_refused(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("a file")
    out = tmp_path / "notes.txt" / "run"
    [line] = _refused(capsys, *TINY, "--out", str(out))
    assert f"--out {str(out)!r} cannot be created: {str(tmp_path / 'notes.txt')!r} is a file, " \
           "not a folder; fix: --out a folder in a place you can write to" in line


def test_an_out_folder_where_no_folder_can_be_made_is_refused(
    capsys: pytest.CaptureFixture[str]
) -> None:
    # root may write anywhere on disk, but not make folders in /proc
    [line] = _refused(capsys, *TINY, "--out", "/proc/pipetrain-run")
    assert "--out '/proc/pipetrain-run' cannot be created: '/proc' does not take a new folder" in line
    assert "fix: --out a folder in a place you can write to" in line


def test_an_existing_out_folder_that_is_not_writable_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    real_access = train_inputs.os.access

    def access(path: object, mode: int) -> bool:  # as for a user without write permission
        return False if Path(str(path)) == out else real_access(path, mode)  # type: ignore[arg-type]

    monkeypatch.setattr(train_inputs.os, "access", access)
    [line] = _refused(capsys, *TINY, "--out", str(out))
    assert f"--out {str(out)!r} is not writable" in line and "fix: --out a folder" in line


def test_data_too_short_for_the_context_names_fixes_that_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("hello world, this is tiny\n")  # 26 bytes
    [line] = _refused(capsys, *TINY, "--context", "128", "--data", str(tiny))
    assert f"--data {str(tiny)!r} has 26 bytes, too few for --context 128" in line
    # no context fits 26 bytes (1 byte of validation): only a larger file helps
    assert line.endswith("fix: a --data file of at least 2,580 bytes")
    assert "val_fraction" not in line and "<=" not in line
    TextDataset(b"x" * 2580, context=128, seed=0)
    with pytest.raises(ValueError):
        TextDataset(b"x" * 2579, context=128, seed=0)

    short = tmp_path / "short.txt"
    short.write_text("x" * 1000)
    [line] = _refused(capsys, *TINY, "--context", "128", "--data", str(short))
    assert line.endswith("fix: --context 49 or less, or a --data file of at least 2,580 bytes")
    TextDataset(short.read_bytes(), context=49, seed=0)
    with pytest.raises(ValueError):
        TextDataset(short.read_bytes(), context=50, seed=0)


def test_a_resume_keeps_its_context_so_only_a_larger_file_is_offered(tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("x" * 1000)
    args = argparse.Namespace(data=str(short), context=128)
    line = train_inputs.corpus_problem(args, context_fixed=True)
    assert line is not None and line.endswith("fix: a --data file of at least 2,580 bytes")


def test_hf_models_without_transformers_are_refused_before_the_workers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "site" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named tokenizers')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for name in [name for name in sys.modules if name.split(".")[0] == "transformers"]:
        monkeypatch.delitem(sys.modules, name)
    for model in ("hf-gpt2", "hf-llama"):
        [line] = _refused(capsys, *TINY, "--layers", "2", "--model", model,
                          "--out", str(tmp_path / model))
        assert line == (
            f"pipetrain train: error: --model {model} needs Hugging Face transformers, which "
            "cannot be imported here (No module named tokenizers); fix: pip install -c "
            "constraints.txt -e '.[hf]' (the hf extra), or --model gpt")
    # the same check runs in every worker (under torchrun there is no launcher)
    _, _, problems = prepare(_args(*TINY, "--layers", "2", "--model", "hf-gpt2",
                                "--out", str(tmp_path / "w")))
    assert any("needs Hugging Face transformers" in problem for problem in problems)
    assert not (tmp_path / "hf-gpt2").exists()


def test_good_inputs_pass(tmp_path: Path) -> None:
    data = tmp_path / "data.txt"
    data.write_text("x = 1\n" * 2000)
    _, _, problems = prepare(_args(*TINY, "--data", str(data), "--out", str(tmp_path / "a" / "b")))
    assert problems == []
    assert not (tmp_path / "a").exists() or list((tmp_path / "a").iterdir()) == []


@pytest.mark.parametrize("module", ["pipetrain.cli.train_inputs", "pipetrain.cli.train_layout",
                                    "pipetrain.cli.worker_death"])
def test_doctests(module: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0

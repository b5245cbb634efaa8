"""The ``pipetrain`` command's entry point: ``--version``, and a mistyped option named by
its sub-command with the closest option (it used to print the top-level usage)."""

from __future__ import annotations

from importlib import metadata

import pytest

import pipetrain
from pipetrain.cli.main import build_parser, closest_option, main


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as stopped:
        main(list(argv))
    assert stopped.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, command, suggestion", [
    (["train", "--stage", "4"], "train", "--stages"),
    (["train", "--microbatch=8"], "train", "--microbatches"),
    (["profile", "--outptu", "p.json"], "profile", "--out"),
    (["plan", "--profile", "p.json", "--workers", "2", "--bandwidth", "1e9", "--strait"],
     "plan", "--straight"),
])
def test_a_mistyped_option_shows_its_commands_usage_and_the_closest_option(
    argv: list[str], command: str, suggestion: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(capsys, *argv)
    assert err.startswith(f"usage: pipetrain {command} "), err[:200]
    assert "usage: pipetrain [-h]" not in err
    assert err.rstrip().endswith(f"did you mean {suggestion}?"), err[-300:]
    mistyped = next(a for a in argv[1:] if a.startswith("--") and a.split("=")[0] != "--profile"
                    and a not in ("--workers", "--bandwidth"))
    assert f"pipetrain {command}: error: unrecognized arguments: {mistyped}" in err


def test_nothing_close_is_not_guessed(capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(capsys, "train", "--zzzzzz")
    assert err.rstrip().endswith("pipetrain train: error: unrecognized arguments: --zzzzzz")
    assert closest_option(build_parser().commands["train"], "--zzzzzz") is None


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["--version"])
    assert stopped.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"pipetrain {pipetrain.__version__} (torch {metadata.version('torch')}, "
                          "Python 3.")
    assert pipetrain.__version__ == metadata.version("pipetrain")  # one version, installed

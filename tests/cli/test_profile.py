"""``pipetrain profile`` (``pipetrain/cli/profile.py``), run in-process: its file option is
``--out`` as ``plan``'s (``--output`` still works, unlisted), it takes no ``--resume``, it
shows progress while it measures (a GPT of 8 blocks used to print nothing for 132 s), and
capturing a model logs nothing at INFO."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from pipetrain.cli.main import main

TINY = ["--layers", "2", "--width", "16", "--heads", "2", "--context", "16", "--batch-size", "4",
        "--microbatches", "2", "--repetitions", "3"]


def test_help_lists_out_and_neither_output_nor_resume(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["profile", "--help"])
    text = capsys.readouterr().out
    assert "--out FILE" in text and "the profile file to write" in text
    assert "--output" not in text and "--resume DIR" not in text and "\n  --resume" not in text


@pytest.mark.parametrize("option", ["--out", "--output"])
def test_the_profile_is_written_where_out_says_with_progress_per_layer(
    option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "profile.json"
    assert main(["profile", *TINY, option, str(path)]) == 0
    assert json.loads(path.read_text())["layers"]
    err = capsys.readouterr().err.splitlines()
    progress = [line for line in err if line.startswith("layer ")]
    assert [line.split(" [")[0] for line in progress] == [f"layer {k}/4" for k in range(1, 5)]
    assert "thread(s)" not in "\n".join(err)


def test_resume_is_refused_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", *TINY, "--resume", "runs/old"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipetrain profile: error: --resume 'runs/old': pipetrain profile "
                          "measures a model, it does not continue a run; fix: ")


def test_a_captured_model_logs_nothing_at_info(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bug: every own-model and Hugging Face run, and ``sample``, printed the capture's
    INFO lines (use_cache=False, static shapes)."""
    pytest.importorskip("transformers")
    caplog.set_level(logging.DEBUG, logger="pipetrain")
    assert main(["profile", "--model", "hf-gpt2", *TINY, "--out", str(tmp_path / "p.json")]) == 0
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("pipetrain")]
    assert any("capturing with use_cache=False" in message for _, message in said)  # the path ran
    assert [message for level, message in said if level >= logging.INFO] == []

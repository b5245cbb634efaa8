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


def _profile(times: list[float], spread: float = 0.0) -> object:
    from pipetrain.plan import LayerProfile, Profile

    return Profile(layers=tuple(
        LayerProfile(name=str(i), description="Block(64)", forward_s=t, backward_s=2 * t,
                     parameter_bytes=4096, spread=spread) for i, t in enumerate(times)))


def test_alike_layers_measured_apart_and_a_busy_machine_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug: on a loaded machine one of eight identical blocks measured 2.3x the others and
    profile said nothing (each layer's own repetitions agreed)."""
    from pipetrain.cli.profile import profile_warnings

    monkeypatch.setattr("os.getloadavg", lambda: (0.1, 0.1, 0.1))
    assert profile_warnings(_profile([1e-3] * 8)) == []
    warnings = profile_warnings(_profile([1e-3] * 7 + [2.3e-3]))
    assert warnings == ["layers 0, 1, 2, 3, 4, 5, 6 and 7 are alike (Block(64)) but took 3.0 to "
                        "6.9 ms (2.3x)"]
    assert "spread by more than 20% (up to 35%)" in profile_warnings(_profile([1e-3] * 2, 0.35))[0]
    monkeypatch.setattr("os.getloadavg", lambda: (64.0, 64.0, 64.0))
    assert profile_warnings(_profile([1e-3] * 2))[-1].startswith("load average 64.0 above the")


def test_plan_warns_about_a_profile_measured_on_a_busy_machine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "profile.json"
    path.write_text(_profile([1e-3] * 3 + [2.3e-3]).to_json())  # type: ignore[attr-defined]
    assert main(["plan", "--profile", str(path), "--workers", "2", "--bandwidth", "1e9"]) == 0
    err = capsys.readouterr().err
    assert "pipetrain plan: warning: the profile's layers 0, 1, 2 and 3 are alike" in err
    assert "fix: profile again on a quiet machine" in err

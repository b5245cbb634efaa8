"""``pipetrain train --schedule pipedream|2bw``: a run and its resume end to end, the model
they train (untied embeddings), and the options they refuse, named in flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.train_runs import refused_here
from pipetrain.cli.main import build_parser
from pipetrain.cli.run_config import RunConfig
from pipetrain.cli.train_checks import prepare
from pipetrain.cli.train_options import gpt_config, pipeline_config

SMALL = ["--layers", "2", "--width", "32", "--heads", "2", "--context", "32", "--batch-size", "8",
         "--microbatches", "4", "--warmup", "2", "--lr", "1e-2", "--sample-bytes", "0"]


def _problems(*argv: str) -> list[str]:
    args = build_parser().parse_args(["train", *SMALL, *argv])
    return prepare(args)[2]


def _resolved(*argv: str) -> RunConfig:
    config, _, problems = prepare(build_parser().parse_args(["train", *SMALL, *argv]))
    assert problems == []
    return config


def test_asynchronous_options_make_the_config_and_the_untied_model() -> None:
    args = _resolved("--schedule", "pipedream", "--vertical-sync")
    config = pipeline_config(args)
    assert (config.schedule, config.vertical_sync, config.clip_grad_norm, config.nonfinite) == (
        "pipedream", True, None, "ignore")
    assert gpt_config(args).tie_embeddings is False
    plain = _resolved()
    assert gpt_config(plain).tie_embeddings is True and pipeline_config(plain).clip_grad_norm == 1.0
    assert _problems("--schedule", "2bw") == []


def test_an_asynchronous_run_records_the_clip_and_the_non_finite_handling_it_runs_with() -> None:
    """Bug: config.json of a pipedream run said clip 1.0 and nonfinite error, which that
    run refuses; the resolved options are what it runs with, and say where they came from."""
    config = _resolved("--schedule", "pipedream")
    assert (config.clip, config.nonfinite) == (0.0, "ignore")
    assert config.source("clip") == config.source("nonfinite") == "schedule"
    assert config.record()["options"]["clip"] == 0.0


def test_the_recipe_warned_about_is_the_one_the_benchmark_found() -> None:
    from pipetrain.cli.train_checks import RECIPES, schedule_notes

    results = Path(__file__).resolve().parents[2] / "docs" / "bench" / "async_convergence.json"
    recipe = json.loads(results.read_text())["data"]["recipe"]
    assert RECIPES["2bw"] == (recipe["lr"], recipe["steps"])
    inside = _resolved("--schedule", "2bw", "--lr", str(recipe["lr"]), "--steps", str(recipe["steps"]))
    assert [n.split(":")[0] for n in schedule_notes(inside)] == ["note"]
    assert schedule_notes(_resolved("--schedule", "1f1b")) == []


@pytest.mark.parametrize(("argv", "phrases"), [
    (["--schedule", "pipedream", "--clip", "0.5"],
     ["--clip 0.5 with --schedule pipedream", "no update has a gradient norm over all stages",
      "fix: leave out --clip"]),
    (["--schedule", "2bw", "--nonfinite", "error"],
     ["--nonfinite error with --schedule 2bw", "fix: leave out --nonfinite"]),
    (["--schedule", "2bw", "--vertical-sync"],
     ["--vertical-sync is an option of schedule 'pipedream'", "fix: --schedule pipedream or "
      "without --vertical-sync"]),
    (["--schedule", "pipedream", "--checkpoint", "except_last"],
     ["--checkpoint except_last", "schedule 'pipedream' has no flush",
      "fix: --checkpoint always or --checkpoint never"]),
    (["--schedule", "pipedream", "--virtual", "2"], ["--virtual 2 needs an interleaved schedule"]),
])
def test_what_an_asynchronous_schedule_cannot_do_is_refused_in_flags(argv: list[str], phrases: list[str]) -> None:
    text = "\n".join(_problems(*argv))
    for phrase in phrases:
        assert phrase in text, (phrase, text)


@pytest.mark.distributed
def test_a_run_and_its_resume(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))

    def train(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pipetrain", "train", *argv], capture_output=True,
                              text=True, timeout=300, env=env)

    out = tmp_path / "run"
    done = train(*SMALL, "--schedule", "2bw", "--steps", "4", "--eval-every", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["tie_embeddings"] is False and config["args"]["schedule"] == "2bw"
    # start-up says what the schedule changed, and that 4 steps are outside 2BW's recipe
    assert ("pipetrain train: note: --schedule 2bw runs with --clip 0.0 and --nonfinite ignore"
            in done.stderr), done.stderr[-2000:]
    assert "pipetrain train: warning: --schedule 2bw with --lr" in done.stderr
    assert "is outside its recipe (a peak LR of at most 0.0003 and at least 100 steps" in done.stderr
    more = train("--steps", "6", "--resume", str(out))
    assert more.returncode == 0, more.stderr[-3000:]
    steps = json.loads((out / "metrics.json").read_text())["steps"]
    assert [s["step"] for s in steps] == list(range(1, 7))
    assert all(s["loss"] > 0 and 0 <= s["bubble"] < 1 for s in steps)
    refused = refused_here(["train", "--steps", "8", "--schedule", "1f1b", "--resume", str(out)])
    assert refused.returncode == 2 and "differs from the resumed run's --schedule 2bw in kind" in refused.stderr

"""A user's workflow end to end: profile -> plan -> train --plan, a model file of their own,
a TOML config, a Hugging Face folder, TensorBoard events, and sampling every kind of run.

Every record of a run (config.json, metrics.json, the trace, the timeline's title) must
describe the run that happened: the plan's schedule, micro-batches, stages and replicas,
the config file's values, with where each came from.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers.trackers import wandb_history
from helpers.train_runs import refused_here, run_here

pytestmark = pytest.mark.distributed

SHAPE = ["--layers", "2", "--width", "16", "--heads", "2", "--context", "16"]
QUIET = ["--warmup", "2", "--eval-every", "0", "--sample-bytes", "0"]
_GLIBC = platform.libc_ver()[0] == "glibc"

MODEL_FILE = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class TinyLM(nn.Module):
    def __init__(self, vocab_size, context, width=16):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.head = nn.Linear(width, vocab_size)

    def forward(self, ids):
        x = self.embed(ids) + self.position[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(vocab_size, context):
    return TinyLM(vocab_size, context)
'''


def _pipetrain(*args: str, cwd: Path, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "pipetrain", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=cwd)


def _here(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A command that starts no workers, in this process."""
    return run_here(list(args), cwd=cwd)


def _ok(done: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    return done


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def _records(run: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    trace = _json(run / "trace.json")
    return _json(run / "config.json"), _json(run / "metrics.json"), trace["otherData"]


def test_profile_plan_and_train_with_the_plan_record_what_ran(tmp_path: Path) -> None:
    """Bug: with --plan, config.json, metrics.json, the trace and the picture said
    '1f1b, 2 stages x 1 replicas, 8 micro-batches' whatever the plan ran, and the
    simulated makespan came from those settings."""
    _ok(_here("profile", *SHAPE, "--batch-size", "8", "--microbatches", "2",
                   "--repetitions", "5", "--output", "profile.json", cwd=tmp_path))
    profile = _json(tmp_path / "profile.json")
    assert profile["model"]["summary"].startswith("gpt: 4 layers (Embedding, 2 x Block, Head)")
    assert profile["microbatch_size"] == 4 and all("spread" in layer for layer in profile["layers"])
    # straight: two stages of one worker each, whatever the profiled times (without it a
    # noisy profile may make one stage on two replicas the fastest plan)
    _ok(_here("plan", "--profile", "profile.json", "--workers", "2", "--bandwidth", "1e9",
                   "--straight", "--out", "plan.json", cwd=tmp_path))
    plan = _json(tmp_path / "plan.json")
    assert [s["replicas"] for s in plan["stages"]] == [1, 1]
    _ok(_pipetrain("train", *SHAPE, *QUIET, "--batch-size", "8", "--steps", "4", "--plan",
                   "plan.json", "--out", "run", cwd=tmp_path))
    config, metrics, trace = _records(tmp_path / "run")
    ran = config["args"]
    stages = [s for s in plan["stages"]]
    assert ran["stages"] == len(stages) and ran["microbatches"] == plan["num_microbatches"]
    assert ran["schedule"] == plan["schedule"] and ran["checkpoint"] == plan["checkpoint"]
    assert ran["balance"] == ",".join(str(len(s["nodes"])) for s in stages)
    assert config["sources"]["microbatches"] == config["sources"]["stages"] == "plan"
    assert config["sources"]["layers"] == "command line" and "--plan" in config["command_line"]
    assert metrics["config"]["args"] == ran == trace["options"]
    # the workers keep the memory a step frees (glibc), as config.json says
    assert ran["host_memory"] == "keep"
    assert config["host_memory"].startswith("kept: " if _GLIBC else "released: ")
    micro = plan["num_microbatches"]
    assert trace["layout"] == (f"{plan['schedule']}, {len(stages)} stages x 1 replica, {micro} "
                               f"micro-batch{'es' * (micro != 1)}")
    last = metrics["summary"]["last_step"]
    assert 0.5 < last["simulated_makespan_seconds"] / last["makespan_seconds"] < 2.0
    # a plan made for another model of as many layers is refused, naming both
    other = refused_here(["train", "--layers", "2", "--width", "32", "--heads", "2", "--context",
                          "16", *QUIET, "--steps", "2", "--plan", "plan.json", "--out", "other"],
                         cwd=tmp_path)
    assert other.returncode == 2 and "was made from a profile of another model" in other.stderr


def test_a_plan_with_stages_of_different_replicas_is_recorded_as_it_ran(tmp_path: Path) -> None:
    from pipetrain.plan import Plan, PlanStage

    Plan(stages=(PlanStage(nodes=(0, 1), replicas=2), PlanStage(nodes=(2, 3), replicas=1)),
         cost_model="pipetrain", time_per_step=1.0, num_workers=3, schedule="gpipe",
         num_microbatches=2, checkpoint="never").save(tmp_path / "plan.json")
    _ok(_pipetrain("train", *SHAPE, *QUIET, "--batch-size", "8", "--steps", "3", "--plan",
                   "plan.json", "--out", "run", "--host-memory", "release", cwd=tmp_path))
    config, metrics, trace = _records(tmp_path / "run")
    assert config["world_size"] == metrics["config"]["world_size"] == 3
    assert config["args"]["host_memory"] == "release"
    assert config["host_memory"] == "released: glibc's defaults"
    ran = config["args"]
    assert (ran["stage_replicas"], ran["schedule"], ran["microbatches"]) == ([2, 1], "gpipe", 2)
    assert trace["layout"] == "gpipe, 2 stages (replicas 2, 1), 2 micro-batches"


def test_a_model_file_of_ones_own_with_a_toml_config_trains_logs_and_samples(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WANDB_MODE", "WANDB_SERVICE", "MLFLOW_TRACKING_URI"):  # the run's own
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "my_model.py").write_text(MODEL_FILE)
    (tmp_path / "run.toml").write_text(
        '# the run, as a user keeps it\n'
        'model = "my_model.py:build"\n'
        'context = 16\n'
        '[pipeline]\nstages = 2\nmicrobatches = 2\nschedule = "gpipe"\n'
        '[training]\nsteps = 8\nbatch-size = 8\nwarmup = 2\neval-every = 4\n'
        '[output]\nsample_bytes = 0\nout = "run"\nlog = "tensorboard,wandb,mlflow"\n')
    _ok(_pipetrain("train", "--config", "run.toml", "--steps", "6", cwd=tmp_path))
    run = tmp_path / "run"
    config, metrics, _ = _records(run)
    ran, sources = config["args"], config["sources"]
    assert ran["model"] == f"{tmp_path / 'my_model.py'}:build"  # absolute: sample finds it
    assert (ran["steps"], sources["steps"]) == (6, "command line")  # the flag wins
    assert (ran["schedule"], sources["schedule"]) == ("gpipe", "config file")
    assert (ran["batch_size"], sources["batch_size"]) == (8, "config file")
    # what ran, and only that: the model file's block, no GPT shape, the command as typed
    assert sources["config"] == "command line" and ran["config"] == "run.toml"
    assert config["command_line"] == ["train", "--config", "run.toml", "--steps", "6"]
    assert metrics["config"]["command_line"] == config["command_line"]
    assert not {"layers", "width", "heads", "dropout"} & (set(ran) | set(sources))
    model = config["model"]
    assert (model["kind"], model["source"], model["context"]) == ("file", ran["model"], 16)
    assert model["class"] and model["parameters"] > 0 and "num_layers" not in model
    assert config["layout"]["unit"] == "captured units" and len(config["layout"]["per_stage"]) == 2
    assert sum(config["layout"]["per_stage"]) >= 3 and config["layout"]["stage_to_rank"] == [0, 1]
    assert [s["step"] for s in metrics["steps"]] == list(range(1, 7))
    assert metrics["steps"][-1]["loss"] < metrics["steps"][0]["loss"]
    # TensorBoard events, read by the tensorboard package's own reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [step for step, _ in losses] == list(range(1, 7))
    assert [round(v, 5) for _, v in losses] == [round(s["loss"], 5) for s in metrics["steps"]]
    assert [e.step for e in events.Scalars("train/val_loss")] == [4]
    # W&B (offline) and MLflow (its file store) hold the same losses, read from their files
    from mlflow.tracking import MlflowClient

    ids = json.loads((run / "trackers.json").read_text())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the run itself does
    expected = [(step, pytest.approx(value)) for step, value in losses]
    mlflow = MlflowClient(tracking_uri=f"file:{run / 'mlruns'}")
    assert sorted((m.step, m.value) for m in mlflow.get_metric_history(
        ids["mlflow"], "train.loss")) == expected
    (wandb_run,) = (run / "wandb").glob("offline-run-*")
    assert wandb_history(wandb_run) == (ids["wandb"], expected)
    for tag in ("train/lr", "speed/tokens_per_s", "speed/bubble", "memory/peak_bytes/rank_1"):
        assert events.Scalars(tag), tag
    assert (run / "loss.png").stat().st_size > 1000
    sampled = _ok(_here("sample", str(run), "--bytes", "8", cwd=tmp_path.parent))
    assert sampled.stdout.startswith("def ")


def test_config_file_mistakes_are_named_with_the_key_and_the_fix(tmp_path: Path) -> None:
    from pipetrain.cli.main import build_parser
    from pipetrain.cli.train_checks import prepare

    path = tmp_path / "bad.toml"
    path.write_text('stage = 2\nmicrobatches = 0\n[training]\nvertical-sync = "yes"\n')
    _, _, problems = prepare(build_parser().parse_args(["train", "--config", str(path)]))
    assert f"{path}: stage is not an option of pipetrain train; did you mean 'stages'" in problems[0]
    assert any("training.vertical-sync must be true or false" in p for p in problems)
    path.write_text("microbatches = 0\n")
    _, _, problems = prepare(build_parser().parse_args(["train", "--config", str(path)]))
    assert problems == [f"{path}: microbatches: must be at least 1, got 0"]
    path.write_text("steps = [1\n")
    _, _, problems = prepare(build_parser().parse_args(["train", "--config", str(path)]))
    assert problems[0].startswith(f"--config {str(path)!r} is not valid TOML")


def test_a_hugging_face_folder_with_its_tokenizer_trains_and_samples(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(Path(__file__).read_text() * 4)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([corpus.read_text()], vocab_size=300, min_frequency=2)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    folder = tmp_path / "tiny-gpt2"
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=16, n_layer=2,
                               n_head=2, bos_token_id=0, eos_token_id=0)).save_pretrained(folder)
    _ok(_pipetrain("train", "--model", str(folder), "--data", str(corpus), "--context", "16",
                   "--batch-size", "8", "--microbatches", "2", *QUIET, "--steps", "3", "--out", "run",
                   cwd=tmp_path))
    metrics = _json(tmp_path / "run" / "metrics.json")
    assert len(metrics["steps"]) == 3
    model = _json(tmp_path / "run" / "config.json")["model"]
    assert (model["kind"], model["class"]) == ("hugging face", "GPT2LMHeadModel")
    assert model["parameters"] > 0 and "width" not in model
    # the loss starts at the folder's weights on its own tokens: about ln(300), not ln(256)
    assert 5.4 < metrics["steps"][0]["loss"] < 6.2
    sampled = _ok(_here("sample", "run", "--bytes", "4", cwd=tmp_path))
    assert sampled.stdout.startswith("def")


def test_start_up_says_what_it_does_and_a_slow_precision_is_named(tmp_path: Path) -> None:
    """A new user saw ~20 s of blank screen, and bf16 ran 7.6x slower on this CPU without a
    word: the launcher's first line comes at once, then each phase; a precision slower than
    fp32 here is named with the fix."""
    import time

    from pipetrain.cli.precision_probe import precision_slowdown

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    process = subprocess.Popen(
        [sys.executable, "-m", "pipetrain", "train", *SHAPE, *QUIET, "--batch-size", "4",
         "--microbatches", "2", "--steps", "2", "--precision", "fp16", "--out", "run"],
        cwd=tmp_path, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert process.stderr is not None
    began = time.monotonic()
    first = process.stderr.readline()
    waited = time.monotonic() - began
    rest = process.stderr.read()
    assert process.wait(timeout=300) == 0, rest[-3000:]
    lines = [first, *rest.splitlines()]
    slower = precision_slowdown("fp16", width=16, context=16, heads=2) > 1.2
    assert waited < 20  # the interpreter and torch import first: no training before it
    assert any(line.startswith("pipetrain train: starting 2 workers (1f1b, 2 stages x 1 replica, "
                               "2 micro-batches) into run") for line in lines), lines
    assert any("2 workers joined; building the model" in line for line in lines)
    assert any("pipeline ready" in line for line in lines)
    if slower:  # fp16 on a CPU: 8-26x slower here
        warning = next(line for line in lines if "--precision fp16 is slower than fp32" in line)
        assert "--precision fp32 trains faster on this machine" in warning

"""``pipetrain train --fsdp --tensor-parallel T``: the replicas shard each stage (FSDP2), the
GPT's blocks split over T workers, the loss is the one of one process, config.json records
the mesh, and what cannot run is refused before any worker starts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from helpers.train_runs import one_process_losses, recorded_losses, refused_here, run_train

pytestmark = pytest.mark.distributed

SMALL = ["--context", "32", "--batch-size", "8", "--microbatches", "2", "--warmup", "2", "--lr",
         "1e-2", "--sample-bytes", "0"]
GPT = ["--layers", "2", "--width", "32", "--heads", "2"]


def _train(*args: str, out: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return run_train(SMALL, *args, out=out, timeout=timeout)


_losses = recorded_losses


def test_three_dimensions_train_as_one_process_and_record_their_mesh(tmp_path: Path) -> None:
    """--stages 2 --replicas 2 --fsdp --tensor-parallel 2: 8 workers, the GPT's blocks split
    over 2 (with sequence parallelism), its stages sharded over 2 replicas, each
    micro-batch's gradients reduce-scattered after its backward; the losses of one process."""
    layout = ["--stages", "2", "--replicas", "2", "--fsdp", "--tensor-parallel", "2",
              "--fsdp-reduce-each-microbatch", "--sequence-parallel"]
    done = _train(*GPT, "--steps", "5", "--eval-every", "0", *layout, out=tmp_path / "3d",
                  timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 stages x 2 replicas (FSDP) x 2 tensor-parallel (sequence-parallel)" in (
        done.stderr + done.stdout)
    assert "8 workers joined" in done.stderr + done.stdout
    reference = one_process_losses([*SMALL, *GPT, "--steps", "5", "--eval-every", "0"])
    losses = _losses(tmp_path / "3d")
    assert len(losses) == 5
    for step, (a, b) in enumerate(zip(reference, losses)):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step + 1}: {b} with 2 x 2 x 2 vs {a} in one process"
    config = json.loads((tmp_path / "3d" / "config.json").read_text())
    assert config["mesh"] == {"pp": 2, "dp": 2, "tp": 2, "world_size": 8,
                              "data_parallel": "fsdp", "reshard_after_forward": False,
                              "reduce_each_microbatch": True}
    assert config["args"]["fsdp"] is True and config["args"]["tensor_parallel"] == 2
    assert config["args"]["sequence_parallel"] is True
    metrics = json.loads((tmp_path / "3d" / "metrics.json").read_text())
    trace = json.loads((tmp_path / "3d" / "trace.json").read_text())
    assert metrics["config"]["mesh"] == trace["otherData"]["mesh"] == config["mesh"]
    assert "x 2 tensor-parallel" in trace["otherData"]["layout"]  # the timeline's title too


def test_what_fsdp_cannot_run_is_refused_before_any_worker_starts(tmp_path: Path) -> None:
    done = refused_here(["train", *SMALL, *GPT, "--stages", "2", "--replicas", "2", "--fsdp",
                         "--schedule", "zb-h1", "--precision", "bf16", "--out", str(tmp_path / "bad")])
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--fsdp: schedule 'zb-h1' splits each backward" in done.stderr
    assert "fix: --schedule 1f1b" in done.stderr
    assert "--fsdp with --precision bf16 is not available yet" in done.stderr
    assert "starting" not in done.stderr
    done = refused_here(["train", *SMALL, "--layers", "2", "--width", "30", "--heads", "3",
                         "--dropout", "0.1", "--tensor-parallel", "2", "--out", str(tmp_path / "bad")])
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--heads 3 / --width 30 do not divide by 2" in done.stderr
    assert "--dropout 0.1 with --tensor-parallel 2" in done.stderr
    done = refused_here(["train", *SMALL, "--model", "my_model.py:build", "--tensor-parallel", "2",
                         "--out", str(tmp_path / "bad")])
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--tensor-parallel 2 splits pipetrain's GPT only" in done.stderr
    done = refused_here(["train", *SMALL, "--sequence-parallel", "--out", str(tmp_path / "bad")])
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--sequence-parallel splits positions" in done.stderr and "--tensor-parallel is 1" in done.stderr


USER_MODEL = '''
import torch
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab_size, context, width=32):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(),
                          nn.Linear(2 * width, width)) for _ in range(2))
        self.head = nn.Linear(width, vocab_size)

    def forward(self, ids):
        x = self.embed(ids) + self.position[: ids.shape[1]]
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def build(vocab_size, context):
    torch.manual_seed(0)
    return TinyLM(vocab_size, context)
'''


def test_a_captured_model_trains_with_fsdp_and_its_checkpoint_resumes_replicated(tmp_path: Path) -> None:
    """A user's model captured and cut into units: the units are sharded (the model's own
    names in the checkpoint hold the shards), and the run resumed in one process continues
    as one process would."""
    model = tmp_path / "my_model.py"
    model.write_text(USER_MODEL)
    user = ["--model", f"{model}:build", "--eval-every", "0"]
    one = _train(*user, "--stages", "1", "--steps", "3", out=tmp_path / "one")
    assert one.returncode == 0, one.stderr[-3000:]
    fsdp = _train(*user, "--stages", "2", "--replicas", "2", "--fsdp", "--steps", "2",
                  out=tmp_path / "fsdp")
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    resumed = _train("--resume", str(tmp_path / "fsdp"), "--stages", "1", "--replicas", "1",
                     "--steps", "3", out=tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, got = _losses(tmp_path / "one"), _losses(tmp_path / "resumed")
    assert len(got) == 3
    for step, (a, b) in enumerate(zip(expected, got)):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step + 1}: {b} vs {a} in one process"

"""``python -m pipetrain`` ends as any Python program does: a job's workers too.

Bug: workers ended with ``os._exit`` once main returned (hiding a hang that was in fact
a collective on rank 0 alone, in the final save of a resumed run): a user's ``atexit``
handler never ran, nor anything else of the interpreter's tear-down.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MODEL_FILE = '''
import atexit
import os

from torch import nn


def _goodbye(path=os.environ["ATEXIT_MARKS"], rank=os.environ.get("RANK", "launcher")):
    with open(os.path.join(path, f"rank-{rank}"), "w") as file:
        file.write("atexit ran")


atexit.register(_goodbye)


class TinyLM(nn.Module):
    def __init__(self, vocab_size, width=16):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU())
        self.head = nn.Linear(width, vocab_size)

    def forward(self, ids):
        return self.head(self.mlp(self.embed(ids)))


def build(vocab_size, context):
    return TinyLM(vocab_size)
'''


@pytest.mark.distributed
def test_a_users_atexit_handler_runs_in_every_worker(tmp_path: Path) -> None:
    (tmp_path / "my_model.py").write_text(MODEL_FILE)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), ATEXIT_MARKS=str(marks))
    done = subprocess.run(
        [sys.executable, "-m", "pipetrain", "train", "--model", "my_model.py:build",
         "--stages", "2", "--context", "16", "--batch-size", "4", "--microbatches", "2",
         "--steps", "2", "--warmup", "1", "--eval-every", "0", "--sample-bytes", "0",
         "--out", "run"],
        capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    # the workers import the model file (rank 0 and 1); the launcher only checks it
    assert {p.name for p in marks.iterdir()} >= {"rank-0", "rank-1"}, done.stderr[-3000:]
    assert all(p.read_text() == "atexit ran" for p in marks.iterdir())

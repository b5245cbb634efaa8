"""Random ops in a multi-process ``Pipeline`` are reproducible and independent of the cut.

A model with ``nn.Dropout``, ``F.dropout`` called inside a custom layer and Gaussian
noise is trained for 3 steps with 1, 2 and 4 stages (and replicas), every schedule and
checkpoint mode, uneven micro-batches; the losses and the weights equal those of the
single-process reference (:mod:`helpers.parity_jobs`: the layers run in order, each
seeded from (seed, step, layer, micro-batch)), so the masks depend on the layer and the
micro-batch, never on the stage, and a recomputation repeats them. Each test starts one
gloo job that trains every configuration.
"""

from __future__ import annotations

import pytest

from helpers.distributed import run_workers
from helpers.parity_jobs import SCHEDULES, SEED, compare, every_schedule, reference, train_job

pytestmark = pytest.mark.distributed

STEPS = 3
SIZE = 11  # 5 micro-batches of 3, 2, 2, 2, 2 (uneven)
MICROBATCHES = 5


def test_the_reference_depends_on_the_seed_so_the_comparisons_can_fail() -> None:
    """The random ops are active: another seed gives other losses, by far more than
    the tolerance."""
    _, losses, _ = reference("dropout", STEPS, SIZE, num_microbatches=MICROBATCHES)
    _, other, _ = reference("dropout", STEPS, SIZE, num_microbatches=MICROBATCHES, seed=SEED + 1)
    assert max(abs(a - b) for a, b in zip(losses, other)) > 1e-3


def test_one_and_two_stages_every_schedule_and_checkpoint_mode_equal_the_reference() -> None:
    """K=2 with every schedule and checkpoint mode (selective, per-layer and one mode per
    stage too),
    and K=1 (with 2 replicas, in the same job) with every schedule."""
    one_stage = [
        {"schedule": schedule, "num_stages": 1, "replicas": 2, "checkpoint": checkpoint,
         "num_microbatches": 3, "stages_per_rank": 2 if schedule == "interleaved-1f1b" else 1}
        for schedule, checkpoint in zip(SCHEDULES, ("always", "never", "except_last", "always"))
    ]
    # selective and per-layer recomputation re-run the random ops inside the backward: the
    # same masks
    selective = [{"schedule": schedule, "num_stages": 2, "checkpoint": checkpoint,
                  "num_microbatches": MICROBATCHES}
                 for schedule, checkpoint in (("1f1b", "selective"),
                                              ("zb-h1", ("selective", "always")),
                                              ("1f1b", "per_layer"),
                                              ("zb-h1", ("always", "per_layer")))]
    chosen = every_schedule(2, num_microbatches=MICROBATCHES) + one_stage + selective
    results = run_workers(train_job, 2, "dropout", chosen, STEPS, SIZE, timeout=300)
    failures = compare("dropout", results, chosen, steps=STEPS, size=SIZE)
    assert not failures, "\n".join(failures)


def test_four_stages_and_replicas_equal_the_reference() -> None:
    """K=4 with every schedule and checkpoint mode, D=2 x K=2 and D=4 x K=1 (a
    replica's micro-batches follow the previous replica's in the random streams' keys)."""
    replicated = [
        {"schedule": "1f1b", "num_stages": 2, "replicas": 2, "num_microbatches": 3},
        {"schedule": "zb-h1", "num_stages": 2, "replicas": 2, "num_microbatches": 2,
         "checkpoint": "always"},
        {"schedule": "interleaved-1f1b", "num_stages": 2, "stages_per_rank": 2, "replicas": 2,
         "num_microbatches": 3, "checkpoint": "except_last"},
        {"schedule": "gpipe", "num_stages": 1, "replicas": 4, "num_microbatches": 2,
         "checkpoint": "always"},
    ]
    chosen = every_schedule(4, num_microbatches=MICROBATCHES) + replicated
    results = run_workers(train_job, 4, "dropout", chosen, STEPS, SIZE, timeout=300)
    failures = compare("dropout", results, chosen, steps=STEPS, size=SIZE)
    assert not failures, "\n".join(failures)

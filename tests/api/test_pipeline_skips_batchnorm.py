"""Skip connections and deferred batch norm in a multi-process ``Pipeline``.

The model (:mod:`helpers.parity_jobs`, ``"skips"``) stashes at layer 0 a tensor that
carries a gradient (popped at layer 4) and one that does not (the input, popped at
layer 7), stashes at layer 2 a tensor in a :class:`~pipetrain.skip.Namespace` (popped at
layer 6; each process has its own namespace object), and has batch norms at layers 1, 3
and 5 and ``F.dropout`` at layer 2. With K=4 the skips travel from stage 0 through stage
1 to stage 2 and beyond; with interleaved stages they cross ranks several times. After
3 steps with ``deferred_batch_norm=True`` the parameters, the running statistics, the
losses and the eval-mode loss equal single-process training (1e-5), for K in {2, 4},
every schedule and checkpoint mode, and with 2 replicas (whose statistics are merged).
"""

from __future__ import annotations

import pytest

from helpers.distributed import run_workers
from helpers.parity_jobs import compare, every_schedule, train_job, unmatched_job

pytestmark = pytest.mark.distributed

STEPS = 3
SIZE = 13  # uneven micro-batches, for 3 and for 2 x 2
MICROBATCHES = 3


def test_two_stages_every_schedule_and_checkpoint_mode_equal_single_process() -> None:
    chosen = every_schedule(2, num_microbatches=MICROBATCHES, deferred_batch_norm=True)
    results = run_workers(train_job, 2, "skips", chosen, STEPS, SIZE, timeout=300)
    failures = compare("skips", results, chosen, steps=STEPS, size=SIZE)
    assert not failures, "\n".join(failures)
    # the running statistics moved (the comparison of buffers means something)
    state = {k: v for rank in results for k, v in rank[0][0].items()}
    assert int(state["layers.1.1.num_batches_tracked"]) == STEPS
    assert float(state["layers.3.1.running_mean"].abs().max()) > 1e-3


def test_four_stages_and_two_replicas_equal_single_process() -> None:
    replicated = [
        {"schedule": "1f1b", "num_stages": 2, "replicas": 2, "num_microbatches": 2,
         "deferred_batch_norm": True},
        {"schedule": "interleaved-1f1b", "num_stages": 2, "stages_per_rank": 2, "replicas": 2,
         "num_microbatches": 2, "checkpoint": "always", "deferred_batch_norm": True},
        {"schedule": "zb-h1", "num_stages": 2, "replicas": 2, "num_microbatches": 3,
         "checkpoint": "except_last", "deferred_batch_norm": True},
    ]
    chosen = every_schedule(4, num_microbatches=4, deferred_batch_norm=True) + replicated
    results = run_workers(train_job, 4, "skips", chosen, STEPS, SIZE, timeout=300)
    failures = compare("skips", results, chosen, steps=STEPS, size=SIZE)
    assert not failures, "\n".join(failures)


def test_a_stash_without_pop_is_named_on_every_rank() -> None:
    errors = run_workers(unmatched_job, 2, timeout=120)
    for text in errors:
        assert "'raw'" in text and "no later layer pops it" in text, text

"""Worker programs for the two-host tests: ``python -m helpers.multihost_jobs MODE``.

Each runs as one rank of a job (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
in the environment) inside a network namespace of its own, and prints one line starting
with ``RESULT`` that the test reads:

- ``init``: join the job and report the roster, or the start-up error;
- ``kill``: train a two-stage MLP pipeline; rank ``VICTIM`` SIGKILLs itself at the start
  of step 3; the others report the error they got and how long it took.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

TIMEOUT = float(os.environ.get("JOB_TIMEOUT", "60"))


def _report(**fields: object) -> None:
    sys.stdout.write("RESULT " + json.dumps(fields) + "\n")
    sys.stdout.flush()


def init_job() -> int:
    from pipetrain.runtime.errors import StartupError
    from pipetrain.runtime.process_group import init_distributed

    started = time.monotonic()
    try:
        context = init_distributed(timeout=TIMEOUT)
    except StartupError as error:
        _report(ok=False, kind=type(error).__name__, message=str(error),
                seconds=time.monotonic() - started)
        return 3
    _report(ok=True, addresses=[p.address for p in context.roster], seconds=time.monotonic() - started)
    return 0


def kill_job() -> int:
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F

    from pipetrain.api.config import PipelineConfig
    from pipetrain.api.pipeline import Pipeline
    from pipetrain.models import mlp_layer_factories
    from pipetrain.runtime.errors import PeerFailure
    from pipetrain.runtime.process_group import init_distributed

    context = init_distributed(timeout=TIMEOUT)
    victim = int(os.environ["VICTIM"])
    pipe = Pipeline(mlp_layer_factories(width=16, depth=4, seed=0), loss_fn=F.mse_loss,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
                    config=PipelineConfig(num_stages=context.world_size, num_microbatches=4,
                                          heartbeat_timeout=5.0, timeout=TIMEOUT),
                    context=context)
    x = torch.randn(8, 16)
    for step in range(1000):
        if step == 3 and context.rank == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.monotonic()
        try:
            pipe.train_step(x, x)
        except PeerFailure as failure:
            _report(ok=False, message=str(failure), dead=list(failure.dead_ranks),
                    seconds=time.monotonic() - started)
            pipe.close()
            return 3
    pipe.close()
    dist.destroy_process_group()
    _report(ok=True)
    return 0


if __name__ == "__main__":
    mode = sys.argv[1]
    sys.exit({"init": init_job, "kill": kill_job}[mode]())

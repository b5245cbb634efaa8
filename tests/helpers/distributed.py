"""Run a function in several processes that form a gloo job on 127.0.0.1.

:func:`pipetrain.launch.run_processes` under the names the tests use, its ranks forked
from one server that imported torch once per test session (seconds saved per job).
"""

from __future__ import annotations

import functools

from pipetrain.launch.processes import ProcessesFailed, free_port, run_processes

__all__ = ["WorkerFailed", "free_port", "run_workers"]

WorkerFailed = ProcessesFailed
run_workers = functools.partial(run_processes, start="forkserver")

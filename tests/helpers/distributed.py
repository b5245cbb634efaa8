"""Run a function in several processes that form a gloo job on 127.0.0.1.

A thin alias of :func:`pipetrain.launch.run_processes` under the names the tests use.
"""

from __future__ import annotations

from pipetrain.launch.processes import ProcessesFailed, free_port, run_processes

__all__ = ["WorkerFailed", "free_port", "run_workers"]

WorkerFailed = ProcessesFailed
run_workers = run_processes

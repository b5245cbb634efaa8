"""Launching workers: local processes through torch.distributed.elastic, or under torchrun."""

from pipetrain.launch.local import (
    LAUNCHED_ENV,
    LaunchError,
    LaunchInterrupted,
    in_worker,
    launch_local,
)
from pipetrain.launch.processes import ProcessesFailed, free_port, run_processes

__all__ = [
    "LAUNCHED_ENV",
    "LaunchError",
    "LaunchInterrupted",
    "ProcessesFailed",
    "free_port",
    "in_worker",
    "launch_local",
    "run_processes",
]

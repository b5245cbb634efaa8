"""Launching workers: local processes through torch.distributed.elastic, or under torchrun."""

from pipetrain.launch.local import LaunchError, in_worker, launch_local
from pipetrain.launch.processes import ProcessesFailed, free_port, run_processes

__all__ = [
    "LaunchError",
    "ProcessesFailed",
    "free_port",
    "in_worker",
    "launch_local",
    "run_processes",
]

"""Launching workers: local processes through torch.distributed.elastic, or under torchrun."""

from pipetrain.launch.local import LaunchError, in_worker, launch_local

__all__ = ["LaunchError", "in_worker", "launch_local"]

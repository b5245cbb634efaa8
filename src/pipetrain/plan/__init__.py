"""Automatic partitioning: profiles of a model's layers, PipeDream's planner with stage
replication, and plan files that ``Pipeline`` and ``pipetrain train --plan`` run.

The profile format, the graph and the optimizers are pure Python (no torch); the
profiler that measures a model imports torch when used.
"""

from pipetrain.plan.profile import PROFILE_FORMAT, LayerProfile, Profile

__all__ = ["PROFILE_FORMAT", "LayerProfile", "Profile"]

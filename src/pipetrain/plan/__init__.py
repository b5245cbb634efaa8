"""Automatic partitioning: profiles of a model's layers, PipeDream's planner with stage
replication, and plan files that ``Pipeline`` and ``pipetrain train --plan`` run.

The profile format, the graph and the optimizers are pure Python (no torch); the
profiler that measures a model (``profile_model``) imports torch on first use.
"""

from typing import Any

from pipetrain.plan.profile import PROFILE_FORMAT, LayerProfile, Profile

__all__ = ["PROFILE_FORMAT", "LayerProfile", "Profile"]


def __getattr__(name: str) -> Any:
    if name == "profile_model":  # imports torch: loaded on first use
        from pipetrain.plan.profiler import profile_model

        return profile_model
    raise AttributeError(f"module 'pipetrain.plan' has no attribute {name!r}")

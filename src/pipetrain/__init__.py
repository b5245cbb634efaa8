"""pipetrain: pipeline-parallel training of giant neural networks in PyTorch.

Names are loaded on first use, so ``import pipetrain.schedule`` (pure Python) does not
import torch.

Example:
    >>> import pipetrain
    >>> pipetrain.__version__
    '0.1.0'
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY_NAMES = {
    "GPipe": "pipetrain.api.gpipe",
    "is_checkpointing": "pipetrain.checkpoint",
    "is_recomputing": "pipetrain.checkpoint",
    "Pipeline": "pipetrain.api.pipeline",
    "PipelineConfig": "pipetrain.api.config",
    "config_from_plan": "pipetrain.api.plan_config",
    "init_distributed": "pipetrain.runtime.process_group",
    "train": "pipetrain.cli.python_train",
    "TrainedRun": "pipetrain.cli.python_train",
    "TrainFailed": "pipetrain.cli.python_train",
}
# torchgpipe-compatible submodules: ``pipetrain.skip``, ``pipetrain.balance``, ...
_LAZY_MODULES = ("skip", "balance", "batchnorm", "microbatch", "checkpoint", "schedule")

__all__ = ["__version__", *_LAZY_NAMES, *_LAZY_MODULES]


def __getattr__(name: str) -> Any:
    if name in _LAZY_NAMES:
        value = getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    elif name in _LAZY_MODULES:
        value = importlib.import_module(f"pipetrain.{name}")
    else:
        raise AttributeError(f"module 'pipetrain' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

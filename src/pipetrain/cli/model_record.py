"""What a run folder records of the model that ran and of how it was cut.

``config.json``'s ``model`` block describes the model of the run's kind, with that kind's
fields only: pipetrain's GPT (its shape), a model file (``FILE.py:FUNCTION``) or a
Hugging Face model (``hf-gpt2``, ``hf-llama``, a folder): its source, class and number
of parameters. ``layout`` is the cut that ran, whoever chose it (an even split, the
options, a plan, the planner, a model's split points): the layers (or captured units)
of each model stage and the pipeline rank that runs it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from pipetrain.cli.hf_models import HF_MODELS
from pipetrain.cli.run_config import RunConfig
from pipetrain.models import GPTConfig, count_parameters

__all__ = ["gpt_config_of", "layout_record", "model_kind", "model_record"]


def model_kind(config: RunConfig) -> str:
    """``"gpt"``, ``"hugging face"`` or ``"file"``.

    Example:
        >>> model_kind(RunConfig(model="hf-gpt2")), model_kind(RunConfig(model="net.py:build"))
        ('hugging face', 'file')
    """
    if config.model == "gpt":
        return "gpt"
    if config.model in HF_MODELS or os.path.isdir(config.model):
        return "hugging face"
    return "file"


def model_record(config: RunConfig, gpt: GPTConfig, model: Any) -> dict[str, Any]:
    """The ``model`` block of ``config.json``: the GPT's shape, or a user's or Hugging
    Face model's source, class and parameter count (``model``: what the run built).

    Example:
        >>> model_record(RunConfig(), GPTConfig(num_layers=1, width=16, num_heads=2), None)["parameters"]
        9456
    """
    kind = model_kind(config)
    if kind == "gpt":
        return {"kind": kind, **dataclasses.asdict(gpt), "parameters": gpt.parameters}
    block = {"kind": kind, "source": config.model, "class": type(model).__qualname__,
             "context": config.context, "parameters": count_parameters(model)}
    if config.model in HF_MODELS:  # sized by the options
        block |= {"layers": config.layers, "width": config.width, "heads": config.heads}
    return block


def layout_record(pipe: Any) -> dict[str, Any]:
    """The cut that ran: layers (GPT) or captured units per model stage, and the
    pipeline rank of each stage."""
    layout = pipe.layout
    return {"unit": "layers" if pipe.captured is None else "captured units",
            "per_stage": [len(r) for r in layout.layer_ranges],
            "stage_to_rank": list(layout.stage_to_rank)}


def gpt_config_of(block: dict[str, Any]) -> GPTConfig:
    """The GPT shape of a ``config.json`` model block (the defaults for a model of another
    kind, which does not use it).

    Example:
        >>> gpt_config_of({"kind": "gpt", "num_layers": 2, "width": 32, "parameters": 1}).num_layers
        2
    """
    if block.get("kind", "gpt") != "gpt":
        return GPTConfig()
    names = {f.name for f in dataclasses.fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in block.items() if k in names})

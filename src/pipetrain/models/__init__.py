"""Reference models as sequences of layers, offered as layer factories.

Example:
    >>> from pipetrain.models import GPTConfig, build_gpt
    >>> len(build_gpt(GPTConfig(num_layers=2), seed=0))  # Embedding, 2 Blocks, Head
    4
"""

from __future__ import annotations

from pipetrain.models.amoebanet import (
    AmoebaNetConfig,
    amoebanet_layer_factories,
    build_amoebanet,
)
from pipetrain.models.factory import (
    LayerFactory,
    Tie,
    build_sequential,
    count_parameters,
    tie_parameters,
)
from pipetrain.models.gpt import (
    GPTConfig,
    build_gpt,
    generate,
    gpt_layer_factories,
    gpt_loss,
    gpt_ties,
)
from pipetrain.models.mlp import build_mlp, mlp_layer_factories
from pipetrain.models.registry import MODELS, get_model_factories, get_model_ties
from pipetrain.models.resnet import ResNetConfig, build_resnet, resnet_layer_factories
from pipetrain.models.unet import unet

__all__ = [
    "MODELS",
    "AmoebaNetConfig",
    "GPTConfig",
    "LayerFactory",
    "ResNetConfig",
    "Tie",
    "amoebanet_layer_factories",
    "build_amoebanet",
    "build_gpt",
    "build_mlp",
    "build_resnet",
    "build_sequential",
    "count_parameters",
    "generate",
    "get_model_factories",
    "get_model_ties",
    "gpt_layer_factories",
    "gpt_loss",
    "gpt_ties",
    "mlp_layer_factories",
    "resnet_layer_factories",
    "tie_parameters",
    "unet",
]

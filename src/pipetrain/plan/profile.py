"""A model's profile: what each layer (or graph node) costs, as a JSON file the planner reads.

A profile describes one model at one batch size on one device: per layer, the time of
its forward pass and of its backward pass (split into the input-gradient and the
weight-gradient halves where the layer has weights, as zero-bubble schedules need), the
bytes of its output activation, of its parameters, of their gradients and optimizer
state, and of the activations it keeps for its backward. A model that is a graph (a
ResNet, GNMT) also lists its edges; a model that is a sequence of layers has none (layer
``i`` feeds layer ``i + 1``).

All times are seconds for one pass of the profile's ``batch_size`` samples and all sizes
are bytes for that batch, so that a planner can scale them to any micro-batch size;
a profile with a ``microbatch_size`` also holds each layer's times measured at that
size (``microbatch_forward_s``..., for small batches that run less efficiently).
The JSON form (``Profile.to_json`` / ``Profile.from_json``)::

    {"format": "pipetrain-profile", "version": 1,
     "device": "cpu", "dtype": "float32", "batch_size": 32, "microbatch_size": 4,
     "torch_version": "2.13.0", "optimizer": "adamw",
     "layers": [{"name": "0", "description": "Embedding", "forward_s": 0.001, ...,
                 "microbatch_forward_s": 0.0002, ...}, ...],
     "edges": [[0, 1], [1, 2], ...]}

This module is pure Python (no torch), like the schedule package.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["PROFILE_FORMAT", "LayerProfile", "Profile", "model_identity"]

PROFILE_FORMAT = "pipetrain-profile"
"""The ``format`` field of a profile file."""
_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    """What one layer or graph node costs, for the profile's whole batch.

    Example:
        >>> LayerProfile(name="0", forward_s=0.002, backward_s=0.004).compute_s
        0.006
    """

    name: str
    """The node's id: the layer index for a sequence (``"3"``), the node name for a graph."""
    description: str = ""
    """What the node is (``"Linear(512, 512)"``, PipeDream's node description)."""
    forward_s: float
    """Seconds of the forward pass."""
    backward_s: float
    """Seconds of the whole backward pass (input and weight gradients)."""
    backward_input_s: float | None = None
    """Seconds of the input-gradient half (None: not measured; planners assume all of
    ``backward_s`` without weights, half of it with weights)."""
    backward_weight_s: float | None = None
    """Seconds of the weight-gradient half (None: not measured)."""
    output_bytes: int = 0
    """Bytes of the output activation (what crosses a cut after this node)."""
    parameter_bytes: int = 0
    """Bytes of the parameters."""
    gradient_bytes: int | None = None
    """Bytes of the parameters' gradients (None: as ``parameter_bytes``)."""
    optimizer_bytes: int = 0
    """Bytes of the optimizer's state for these parameters (Adam: twice the parameters)."""
    saved_bytes: int = 0
    """Bytes of activations the node keeps from its forward for its backward."""
    backward_workspace_bytes: int | None = None
    """The most bytes its whole backward needs above what the micro-batch holds before it
    and leaves after it (temporaries; gradients of parameters not counted; None: not
    measured)."""
    backward_input_workspace_bytes: int | None = None
    """Likewise for the input-gradient pass of a split backward, with what that pass keeps
    for the weight pass (None: not measured)."""
    microbatch_forward_s: float | None = None
    """Seconds of the forward pass of one micro-batch of the profile's ``microbatch_size``
    samples (None: not measured); the other ``microbatch_*`` times likewise."""
    microbatch_backward_s: float | None = None
    microbatch_backward_input_s: float | None = None
    microbatch_backward_weight_s: float | None = None
    spread: float | None = None
    """How much the timed repetitions disagreed: the larger of the forward's and the
    backward's interquartile range over their median (at the micro-batch size where
    measured; None: not measured). Above about 0.2 the times are unreliable: profile
    again on a quiet machine, or with more repetitions."""
    optimizer_step_s: float | None = None
    """Seconds of one step of the profile's optimizer over the layer's parameters (None:
    not measured); it does not depend on the batch size."""

    @property
    def compute_s(self) -> float:
        """Forward plus backward seconds."""
        return self.forward_s + self.backward_s

    @property
    def weight_memory_bytes(self) -> int:
        """Parameters, gradients and optimizer state."""
        gradients = self.parameter_bytes if self.gradient_bytes is None else self.gradient_bytes
        return self.parameter_bytes + gradients + self.optimizer_bytes


def _check_layer(index: int, record: dict[str, Any]) -> LayerProfile:
    known = {f.name for f in fields(LayerProfile)}
    unknown = sorted(set(record) - known)
    if unknown:
        raise ValueError(f"profile layer {index}: unknown fields {unknown}; known: {sorted(known)}")
    missing = [name for name in ("name", "forward_s", "backward_s") if name not in record]
    if missing:
        raise ValueError(f"profile layer {index}: missing field(s) {missing}")
    layer = LayerProfile(**record)
    optional = [f.name for f in fields(LayerProfile)
                if f.name.endswith("_s") and f.name not in ("forward_s", "backward_s")]
    for name in ("forward_s", "backward_s", "output_bytes", "parameter_bytes", "optimizer_bytes",
                 "saved_bytes", *optional):
        value = getattr(layer, name)
        if value is None and name in optional:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"profile layer {index} ({layer.name!r}): {name}={value!r} must be a number >= 0")
    return layer


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Every layer's costs, the edges of a graph model, and how they were measured.

    Example:
        >>> p = Profile(layers=(LayerProfile(name="0", forward_s=1.0, backward_s=2.0),
        ...                     LayerProfile(name="1", forward_s=1.0, backward_s=2.0)))
        >>> p.is_sequence, Profile.from_json(p.to_json()) == p
        (True, True)
    """

    layers: tuple[LayerProfile, ...]
    edges: tuple[tuple[int, int], ...] = ()
    """Graph edges ``(producer, consumer)`` by layer index; empty for a sequence."""
    device: str = "unknown"
    dtype: str = "float32"
    batch_size: int = 1
    """Samples the times and sizes are for."""
    microbatch_size: int | None = None
    """The micro-batch size the layers were also measured at, if any."""
    torch_version: str = ""
    optimizer: str = ""
    """The optimizer ``optimizer_bytes`` is for (``"adamw"``, ``"sgd"``...)."""
    source: str = ""
    """Where the profile came from (``"pipetrain"``, ``"pipedream graph.txt"``)."""
    model: dict[str, Any] = field(default_factory=dict)
    """The model the profile describes (:func:`model_identity`: a digest of its layers'
    kinds and parameter shapes, and a summary to show); empty when unknown."""
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        n = len(self.layers)
        if n == 0:
            raise ValueError("a profile needs at least one layer")
        for a, b in self.edges:
            if not (0 <= a < n and 0 <= b < n) or a == b:
                raise ValueError(f"profile edge {(a, b)} is not between two of the {n} layers")

    @property
    def is_sequence(self) -> bool:
        """Whether the model is a plain sequence of layers (no edges given)."""
        return not self.edges

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def successors(self) -> list[list[int]]:
        """Each node's consumers (a sequence: the next layer)."""
        if self.is_sequence:
            return [[i + 1] if i + 1 < len(self.layers) else [] for i in range(len(self.layers))]
        out: list[list[int]] = [[] for _ in self.layers]
        for a, b in self.edges:
            out[a].append(b)
        return out

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form (see the module docstring)."""
        body = asdict(self)
        body["layers"] = [
            {k: v for k, v in layer.items() if v is not None and (v != "" or k == "name")}
            for layer in body["layers"]
        ]
        body["edges"] = [list(e) for e in self.edges]
        return {"format": PROFILE_FORMAT, "version": _VERSION, **body}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Profile:
        """Read the JSON form; errors name the bad field (and layer)."""
        if data.get("format") != PROFILE_FORMAT:
            raise ValueError(
                f"not a pipetrain profile (format {data.get('format')!r}, expected "
                f"{PROFILE_FORMAT!r}); for PipeDream's graph.txt use the PipeDream reader"
            )
        if "layers" not in data:
            raise ValueError("profile: missing field 'layers'")
        layers = tuple(_check_layer(i, dict(r)) for i, r in enumerate(data["layers"]))
        keys = {f.name for f in fields(Profile)} - {"layers", "edges"}
        rest = {k: v for k, v in data.items() if k in keys}
        edges: Sequence[Sequence[int]] = data.get("edges", [])
        return Profile(layers=layers, edges=tuple((int(a), int(b)) for a, b in edges), **rest)

    @staticmethod
    def from_json(text: str) -> Profile:
        return Profile.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the profile as JSON to ``path``."""
        with open(path, "w", encoding="utf-8") as file:
            file.write(self.to_json())

    @staticmethod
    def load(path: str | os.PathLike[str]) -> Profile:
        """Read a profile written by :meth:`save`."""
        with open(path, encoding="utf-8") as file:
            return Profile.from_json(file.read())


def model_identity(layers: Sequence[tuple[str, Sequence[tuple[str, Sequence[int]]]]],
                   *, name: str = "") -> dict[str, Any]:
    """What identifies a model that is a sequence of layers: a digest of every layer's
    kind and its parameters' names and shapes, and a summary a message can show.

    ``layers`` holds, per layer, its kind (its class name) and its ``(parameter name,
    shape)`` pairs; ``name`` (``"gpt"``, a file) goes into the summary only.

    Example:
        >>> a = model_identity([("Linear", [("weight", (4, 4)), ("bias", (4,))])] * 3)
        >>> a["summary"]
        '3 layers (3 x Linear), 60 parameters'
        >>> a == model_identity([("Linear", [("weight", (4, 4)), ("bias", (4,))])] * 3)
        True
        >>> a["digest"] == model_identity([("Linear", [("weight", (4, 5))])] * 3)["digest"]
        False
    """
    canonical = [[kind, [[pname, list(shape)] for pname, shape in params]] for kind, params in layers]
    digest = hashlib.sha256(json.dumps(canonical, separators=(",", ":")).encode()).hexdigest()
    count = sum(_numel(shape) for _, params in layers for _, shape in params)
    kinds = Counter(kind for kind, _ in layers)
    runs: list[str] = []
    for kind, _ in layers:
        shown = f"{kinds[kind]} x {kind}" if kinds[kind] > 1 else kind
        if not runs or runs[-1] != shown:
            runs.append(shown)
    parts = ", ".join(dict.fromkeys(runs))
    summary = f"{len(layers)} layers ({parts}), {count:,} parameters"
    return {"digest": f"sha256:{digest[:16]}", "summary": f"{name}: {summary}" if name else summary}


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for size in shape:
        total *= int(size)
    return total

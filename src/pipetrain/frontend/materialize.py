"""Materialization: a rank turns the meta tensors of its own stage into real ones.

A model built on the meta device (``with torch.device("meta"): model = Model(config)``)
holds no memory. Each rank materializes only the modules whose tensors its units read:
every meta parameter or buffer of such a module is replaced by an empty tensor on the
rank's device (one new tensor per original, so tied weights stay one ``nn.Parameter``),
then initialized by the model's own initialization (Hugging Face's ``_init_weights``;
otherwise the module's ``reset_parameters``) and, when a checkpoint is given, loaded
from it: a safetensors file, or a Hugging Face folder (``model.safetensors`` or a
sharded ``model.safetensors.index.json``), read lazily with ``safe_open`` so that only
this stage's tensors are read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from pipetrain.frontend.hf import module_initializer

__all__ = ["Materializer", "SafetensorsWeights"]


class SafetensorsWeights:
    """Lazy reader of a safetensors checkpoint (a file, or a Hugging Face folder).

    ``aliases`` maps a name to the other names of the same tensor (tied weights are
    saved once, under one of their names).

    Example::

        weights = SafetensorsWeights("gpt2/model.safetensors")
        weights.get("transformer.wte.weight")   # only this tensor is read
    """

    def __init__(self, path: str | os.PathLike[str],
                 aliases: Mapping[str, Iterable[str]] | None = None) -> None:
        path = os.fspath(path)
        files: dict[str, str] = {}
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            single = os.path.join(path, "model.safetensors")
            if os.path.isfile(index):
                with open(index) as handle:
                    weight_map = json.load(handle)["weight_map"]
                files = {k: os.path.join(path, v) for k, v in weight_map.items()}
            elif os.path.isfile(single):
                path = single
            else:
                raise FileNotFoundError(
                    f"no model.safetensors or model.safetensors.index.json in {path!r}; fix: "
                    "pass a safetensors file or a folder written by save_pretrained"
                )
        elif not os.path.isfile(path):
            raise FileNotFoundError(f"no checkpoint file {path!r}; fix: pass an existing "
                                    "safetensors file or Hugging Face model folder")
        from safetensors import safe_open  # an optional dependency ([hf] extra)

        self._open = safe_open
        if not files:
            with safe_open(path, framework="pt") as handle:
                files = {k: path for k in handle.keys()}
        self.files = files
        self.aliases = {k: tuple(v) for k, v in (aliases or {}).items()}
        self.read: list[str] = []
        """Names of the tensors read so far (in order)."""

    def get(self, name: str) -> torch.Tensor | None:
        """The tensor saved as ``name`` (or as one of its aliases), or ``None``."""
        for candidate in (name, *self.aliases.get(name, ())):
            if candidate in self.files:
                with self._open(self.files[candidate], framework="pt") as handle:
                    self.read.append(candidate)
                    tensor: torch.Tensor = handle.get_tensor(candidate)
                    return tensor
        return None


def _owner(model: nn.Module, name: str) -> tuple[str, nn.Module]:
    path = name.rpartition(".")[0]
    return path, model.get_submodule(path) if path else model


class Materializer:
    """Materializes the meta tensors of a model, module by module, on one rank.

    ``weights`` (optional) loads every materialized tensor from a checkpoint.
    """

    def __init__(self, model: nn.Module, *, weights: SafetensorsWeights | None = None) -> None:
        self.model = model
        self.weights = weights
        self.init: Callable[[nn.Module], bool] | None = module_initializer(model)
        self._new: dict[int, torch.Tensor] = {}
        self._done: set[str] = set()
        self._ancestors: set[str] = set()

    def _replace(self, module: nn.Module, device: torch.device) -> bool:
        changed = False
        for attr, tensor in [*module.named_parameters(recurse=False),
                             *module.named_buffers(recurse=False)]:
            if tensor is None or not tensor.is_meta:
                continue
            new = self._new.get(id(tensor))
            if new is None:
                empty = torch.empty_like(tensor, device=device)
                new = nn.Parameter(empty, requires_grad=tensor.requires_grad) \
                    if isinstance(tensor, nn.Parameter) else empty
                self._new[id(tensor)] = new
                self._new[id(new)] = new
            setattr(module, attr, new)
            changed = True
        return changed

    def _initialize(self, path: str, module: nn.Module) -> None:
        if self.init is not None and self.init(module):
            return
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        elif self.weights is None and any(True for _ in module.parameters(recurse=False)):
            raise ValueError(
                f"cannot initialize module {path!r} ({type(module).__name__}) materialized "
                "from the meta device: it has parameters but no reset_parameters(); fix: "
                "give it reset_parameters(), or load a checkpoint (weights=PATH)"
            )

    def tensors(self, names: Iterable[str], *, device: torch.device) -> dict[str, torch.Tensor]:
        """The real tensors of ``names`` (parameters and buffers of the model): their
        modules are materialized and initialized (then their ancestors whose tensors are
        all real, as ``post_init`` initializes every module), then loaded."""
        names = list(names)
        fresh: list[tuple[str, nn.Module]] = []
        with torch.no_grad():
            for name in names:
                path, module = _owner(self.model, name)
                if path not in self._done:
                    self._done.add(path)
                    if self._replace(module, device):
                        fresh.append((path, module))
            for path, module in fresh:
                self._initialize(path, module)
            for path, _ in fresh:
                self._initialize_ancestors(path)
            for path, module in fresh:
                self._load(path, module)
        found: dict[str, torch.Tensor] = {}
        for name in names:
            path, module = _owner(self.model, name)
            found[name] = getattr(module, name.rpartition(".")[2])
        return found

    def _initialize_ancestors(self, path: str) -> None:
        parts = path.split(".") if path else []
        for depth in range(len(parts) - 1, -1, -1):
            ancestor = ".".join(parts[:depth])
            if ancestor in self._ancestors:
                continue
            module = self.model.get_submodule(ancestor) if ancestor else self.model
            if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
                return
            self._ancestors.add(ancestor)
            if self.init is not None:
                self.init(module)
            else:
                reset = getattr(module, "reset_parameters", None)
                if callable(reset):
                    reset()

    def _load(self, path: str, module: nn.Module) -> None:
        if self.weights is None:
            return
        prefix = f"{path}." if path else ""
        for attr, tensor in [*module.named_parameters(recurse=False),
                             *module.named_buffers(recurse=False)]:
            saved = self.weights.get(prefix + attr)
            if saved is not None:
                tensor.copy_(saved)


def tied_aliases(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """For every parameter name, the other names of the same parameter.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> model[1].weight = model[0].weight
        >>> tied_aliases(model)["1.weight"]
        ('0.weight',)
    """
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return {name: tuple(n for n in group if n != name)
            for group in groups.values() for name in group}



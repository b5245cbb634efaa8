"""``CapturedModel``: any ``nn.Module`` as the layer sequence that pipelines run.

:meth:`CapturedModel.create` captures a model once (:mod:`.capture`), cuts it into
units (:mod:`.cuts`, :mod:`.units`) and is then a sequence of layer factories: factory
``u`` builds unit ``u``, a module ``forward(message) -> message`` that holds only the
tensors the unit reads, under the model's own names (materialized from the meta device
if the model is there, :mod:`.materialize`). ``Pipeline`` and ``GPipe`` take it where
they take layer factories, with :attr:`CapturedModel.ties` (a parameter read by several
units, e.g. GPT-2's token embedding and output head) as ties and
:meth:`CapturedModel.container` for the model's names.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import torch
from torch import nn

from pipetrain.frontend.capture import CONSTANT_PREFIX, capture
from pipetrain.frontend.cuts import module_starts, split_positions, unit_starts
from pipetrain.frontend.hf import training_kwargs
from pipetrain.frontend.inputs import bind_inputs, leaves_with_paths
from pipetrain.frontend.materialize import Materializer, SafetensorsWeights, tied_aliases
from pipetrain.frontend.names import stage_container
from pipetrain.frontend.units import UnitPlan, build_unit, plan_units, register_tensor

__all__ = ["CapturedModel", "Tie"]

Tie = tuple[tuple[int, str], ...]
"""Tied parameters as ``((unit, name), ...)`` (the ``Tie`` of ``Pipeline``)."""


def _tensor(model: nn.Module, name: str) -> torch.Tensor:
    path, _, attr = name.rpartition(".")
    value = getattr(model.get_submodule(path) if path else model, attr)
    assert isinstance(value, torch.Tensor), name
    return value


def _is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


class CapturedModel(Sequence[Callable[[], nn.Module]]):
    """A captured model cut into units: layer factories for ``Pipeline`` / ``GPipe``.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> captured = CapturedModel.create(model, (torch.randn(3, 4),), split_points=["2"],
        ...                                 num_stages=2)
        >>> len(captured), captured.split_balance
        (3, [2, 1])
        >>> units = [factory() for factory in captured]
        >>> x = torch.randn(5, 4)
        >>> torch.allclose(units[2](units[1](units[0](x))), model(x))
        True
    """

    def __init__(self, model: nn.Module, plan: UnitPlan, *, sample: dict[str, Any],
                 split_balance: list[int] | None,
                 weights: SafetensorsWeights | None = None) -> None:
        self.model = model
        self.plan = plan
        self.sample = sample
        """The example inputs by name (what the planner profiles on)."""
        self.split_balance = split_balance
        """Units per stage of the split points (``None`` without split points)."""
        self.device = torch.device("cpu")
        """Where the factories build the units (a pipeline sets its device)."""
        self.state_keys = list(model.state_dict().keys())
        self.persistent = set(self.state_keys)
        self.meta = _is_meta(model)
        self.materializer = Materializer(model, weights=weights)
        self.captured_on = {t.device for _, t in leaves_with_paths(sample)
                            if isinstance(t, torch.Tensor)}
        self.aliases = tied_aliases(model)
        used = {alias for names in plan.attributes for name in names
                for alias in (name, *self.aliases.get(name, ()))}
        every = [*dict(model.named_parameters(remove_duplicate=False)), *self.state_keys]
        self.unused = [n for n in dict.fromkeys(every) if n not in used]
        """Parameters and state the graph never reads (held by unit 0, so saved)."""
        self.ties = self._find_ties()
        """Parameters read by more than one unit, as ``((unit, name), ...)``."""

    @staticmethod
    def create(model: nn.Module, example_inputs: Any = (), example_kwargs: Mapping[str, Any] | None = None,
               *, split_points: Sequence[str] | None = None, num_stages: int | None = None,
               weights: str | os.PathLike[str] | None = None) -> CapturedModel:
        """Capture ``model`` on the example inputs and cut it into units (at every
        candidate module and every split point; ``num_stages`` checks the split points).

        Raises:
            TypeError: ``model`` is not an ``nn.Module``, or the example inputs do not fit
                its ``forward``.
            ValueError: bad split points, ``use_cache=True``, or a model that cannot be
                captured (:class:`~pipetrain.frontend.errors.CaptureError`).
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"expected an nn.Module to pipeline, got {type(model).__name__}; "
                            "fix: Pipeline(model, example_inputs=(batch,), ...)")
        args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        named = training_kwargs(model, bind_inputs(model, args, dict(example_kwargs or {})))
        if not any(isinstance(v, torch.Tensor) for _, v in leaves_with_paths(named)):
            raise TypeError(
                f"the example inputs of {type(model).__name__} hold no tensor; fix: pass "
                "example_inputs=(batch,) with a real batch (2 or more samples)"
            )
        captured = capture(model, named)
        starts = module_starts(captured.graph)
        positions: list[int] = []
        if split_points is not None:
            positions = split_positions(model, list(split_points), starts,
                                        num_stages=num_stages or len(split_points) + 1)
        units = unit_starts(model, starts, positions)
        balance = None
        if split_points is not None:
            bounds = [0, *positions, len(captured.graph.nodes)]
            balance = [sum(1 for s in units if lo <= s < hi) for lo, hi in itertools.pairwise(bounds)]
        if weights is not None and not _is_meta(model):
            raise ValueError(
                f"weights={os.fspath(weights)!r} is loaded into a model built on the meta "
                f"device, stage by stage, but {type(model).__name__} already holds its "
                "tensors; fix: build it under `with torch.device('meta'):`, or load the "
                "checkpoint into it yourself (model.load_state_dict) and drop weights="
            )
        reader = SafetensorsWeights(weights, tied_aliases(model)) if weights is not None else None
        return CapturedModel(model, plan_units(captured, units), sample=named,
                             split_balance=balance, weights=reader)

    # -- the layer sequence ---------------------------------------------------------------
    def __len__(self) -> int:
        return self.plan.num_units

    @overload
    def __getitem__(self, index: int) -> Callable[[], nn.Module]: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Callable[[], nn.Module]]: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        if not -len(self) <= index < len(self):
            raise IndexError(f"unit {index} out of range for {len(self)} units")
        return functools.partial(self.build, index % len(self))

    def __iter__(self) -> Iterator[Callable[[], nn.Module]]:
        return (self[i] for i in range(len(self)))

    def _state(self, names: Sequence[str], device: torch.device) -> dict[str, torch.Tensor]:
        model_names = [n for n in names if not n.startswith(CONSTANT_PREFIX)]
        if self.meta:
            state = self.materializer.tensors(model_names, device=device)
        else:
            state = {n: _tensor(self.model, n) for n in model_names}
        for name in names:
            if name.startswith(CONSTANT_PREFIX):
                state[name] = self.plan.captured.constants[name].to(device)
        return state

    def build(self, unit: int, device: torch.device | None = None) -> nn.Module:
        """Unit ``unit`` on ``device`` (default :attr:`device`), holding only its tensors."""
        device = self.device if device is None else device
        names = self.plan.attributes[unit]
        # the unit also holds its parameters under their other names (tied weights), and
        # unit 0 what the graph never reads, so that the state dicts have every name
        others = [a for n in names for a in self.aliases.get(n, ()) if a not in names]
        others += self.unused if unit == 0 else []
        state = self._state([*names, *others], device)

        def extra(module: nn.Module) -> None:
            for name in dict.fromkeys(others):
                register_tensor(module, name, state[name], name in self.persistent)

        return build_unit(self.plan, unit, state, persistent=self.persistent, device=device,
                          captured_on=self.captured_on, extra=extra)

    # -- ties, names, sizes ---------------------------------------------------------------
    def _find_ties(self) -> list[Tie]:
        holders: dict[int, list[tuple[int, str]]] = {}
        for unit, names in enumerate(self.plan.attributes):
            for name in names:
                if name.startswith(CONSTANT_PREFIX):
                    continue
                tensor = _tensor(self.model, name)
                if isinstance(tensor, nn.Parameter):
                    holders.setdefault(id(tensor), []).append((unit, name))
        return [tuple(pairs) for pairs in holders.values() if len({u for u, _ in pairs}) > 1]

    def container(self, units: Mapping[int, nn.Module]) -> nn.Module:
        """This rank's ``units`` as one module named as the model (see :mod:`.names`)."""
        return stage_container(units, persistent=self.persistent)

    def unit_bytes(self) -> list[int]:
        """Bytes of the distinct parameters each unit reads (meta tensors included)."""
        sizes = []
        for names in self.plan.attributes:
            tensors = {id(t): t for n in names if not n.startswith(CONSTANT_PREFIX)
                       for t in [_tensor(self.model, n)] if isinstance(t, nn.Parameter)}
            sizes.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        return sizes

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
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import torch
from torch import nn

from pipetrain.frontend.capture import CONSTANT_PREFIX, CapturedGraph, capture
from pipetrain.frontend.cuts import module_starts, split_positions, unit_starts
from pipetrain.frontend.hf import training_kwargs
from pipetrain.frontend.inputs import bind_inputs, leaves_with_paths
from pipetrain.frontend.materialize import Materializer, SafetensorsWeights, tied_aliases
from pipetrain.frontend.names import stage_container
from pipetrain.frontend.recapture import capture_at, matched_to, meta_skeleton
from pipetrain.frontend.sizes import Sizes, sizes_of
from pipetrain.frontend.unit_module import CapturedUnit
from pipetrain.frontend.units import UnitPlan, plan_units, register_tensor

__all__ = ["CapturedModel", "Tie"]

logger = logging.getLogger(__name__)

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
                 weights: SafetensorsWeights | None = None,
                 split_points: Sequence[str] | None = None, num_stages: int | None = None) -> None:
        self.model = model
        self.plan = plan
        """The units of the example's capture."""
        self.split_points = None if split_points is None else list(split_points)
        self.num_stages = num_stages
        self.plans: dict[Sizes, UnitPlan] = {}
        """The units of the captures made for other sizes, by the sizes they were made at."""
        self._lock = threading.Lock()
        self._skeleton: nn.Module | None = None
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
        units, positions = CapturedModel._cuts(model, captured, split_points, num_stages)
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
                             split_balance=balance, weights=reader, split_points=split_points,
                             num_stages=num_stages)

    @staticmethod
    def _cuts(model: nn.Module, captured: CapturedGraph, split_points: Sequence[str] | None,
              num_stages: int | None) -> tuple[list[int], list[int]]:
        """Where the units begin, and where the split points begin."""
        starts = module_starts(captured.graph)
        positions: list[int] = []
        if split_points is not None:
            positions = split_positions(model, list(split_points), starts,
                                        num_stages=num_stages or len(split_points) + 1)
        return unit_starts(model, starts, positions), positions

    def __deepcopy__(self, memo: dict[int, Any]) -> CapturedModel:
        """The captured model itself: a copied unit (the planner times copies) shares it."""
        return self

    # -- captures for other sizes ---------------------------------------------------------
    def choose(self, tensors: Sequence[torch.Tensor]) -> Sizes | None:
        """The sizes of the capture that serves a batch of ``tensors``: ``None`` (the
        example's) if it does, else one made earlier that does, else the batch's own
        (captured by :meth:`plan_for`)."""
        sizes = sizes_of(tensors)
        reason = self.plan.captured.sizes.why_not(sizes)
        if reason is None:
            return None
        with self._lock:
            made = list(self.plans.items())
        for at, plan in made:
            if plan.captured.sizes.why_not(sizes) is None:
                return at
        logger.debug("%s: the graph captured on the example does not serve a batch of %s (%s); "
                     "capturing the model for these sizes", type(self.model).__name__,
                     sizes, reason)
        return sizes

    def plan_for(self, sizes: Sizes | None) -> UnitPlan:
        """The units of the capture made at ``sizes`` (``None``: the example's), captured
        the first time they are asked for.

        Raises:
            CaptureError: the model cannot be captured at ``sizes``, or its graph there is
                not cut into the same units reading the same tensors as the example's.
        """
        if sizes is None:
            return self.plan
        with self._lock:
            if sizes not in self.plans:
                model = self.model
                if self.meta:  # each rank made only its own stage real: capture all on meta
                    if self._skeleton is None:
                        self._skeleton = meta_skeleton(self.model)
                    model = self._skeleton
                captured = capture_at(model, sample=self.sample, example=self.plan.captured,
                                      sizes=sizes)
                units, _ = CapturedModel._cuts(self.model, captured, self.split_points,
                                               self.num_stages)
                self.plans[sizes] = matched_to(plan_units(captured, units), example=self.plan,
                                               model=self.model, sizes=sizes)
            return self.plans[sizes]

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
        module = CapturedUnit(self, unit, num_units=len(self), binding=self.plan.captured.binding,
                              device=device, captured_on=self.captured_on,
                              buffers=[n for n in names if not isinstance(state[n], nn.Parameter)])
        for name in dict.fromkeys([*names, *others]):
            register_tensor(module, name, state[name], name in self.persistent)
        module.prepare(None)
        return module

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

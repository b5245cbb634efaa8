"""What ``Pipeline`` and ``GPipe`` call when they are given a model to capture.

Both take a model as they take a layer sequence: :func:`pipeline_units` and
:func:`gpipe_units` capture it (:class:`~pipetrain.frontend.source.CapturedModel`) and
decide the units of each stage: from the split points, from a given balance (a plan
file's, counted in units), or from the planner (:mod:`.planning`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.frontend.planning import agree, balance_by_bytes, balance_by_profile
from pipetrain.frontend.source import CapturedModel

__all__ = [
    "CAPTURE_HINT",
    "gpipe_units",
    "partition_units",
    "pipeline_units",
    "wants_capture",
]


CAPTURE_HINT = ("pipetrain can also capture any nn.Module into stages: pass "
                "example_inputs=(batch,) (see docs/frontend.md)")
"""What an error about a non-sequential module adds (a note)."""


def wants_capture(layers: Any, example_inputs: Any, example_kwargs: Any, *,
                  strict: bool = True) -> bool:
    """Whether ``layers`` is a model to capture: example inputs are given, or (``strict``)
    it is an ``nn.Module`` that is not an ``nn.Sequential`` (which runs as a layer list).

    Raises:
        TypeError: with ``strict``, a model to capture comes without example inputs.
    """
    if example_inputs is not None or example_kwargs is not None:
        return True
    if strict and isinstance(layers, nn.Module) and not isinstance(layers, nn.Sequential):
        raise TypeError(
            f"{type(layers).__name__} is not an nn.Sequential nor a list of layer factories: "
            "pipetrain captures it into a graph, which needs an example of its inputs; fix: "
            f"pass example_inputs=(batch,) (and example_kwargs={{...}} for keyword inputs), "
            "e.g. Pipeline(model, example_inputs=(input_ids,), split_points=[...], ...)"
        )
    return False


def _planned(captured: CapturedModel, num_stages: int, device: torch.device) -> list[int]:
    if len(captured) < num_stages:
        raise ValueError(
            f"the model has {len(captured)} units where a stage may begin, fewer than the "
            f"{num_stages} stages; fix: use at most {len(captured)} stages, or name "
            "split_points inside the units"
        )
    if captured.meta:  # nothing to run: balance the parameter bytes
        return balance_by_bytes(captured.unit_bytes(), num_stages)
    units = [captured.build(u, device) for u in range(len(captured))]
    return balance_by_profile(units, captured.sample, num_stages, device=device)


def pipeline_units(model: Any, *, example_inputs: Any, example_kwargs: Mapping[str, Any] | None,
                   split_points: Sequence[str] | None, weights: str | os.PathLike[str] | None,
                   num_stages: int, balance: Sequence[int] | None,
                   device: torch.device) -> tuple[CapturedModel, list[int]]:
    """The captured model and the units of each of its ``num_stages`` model stages
    (every rank of the job calls it; rank 0 plans when neither split points nor a
    balance are given).

    Raises:
        ValueError: split points and a balance are both given, or as
            :meth:`CapturedModel.create`.
    """
    if split_points is not None and balance is not None:
        raise ValueError(
            f"both split_points={list(split_points)} and balance={list(balance)} cut the "
            "model; fix: give one of them (a plan file's balance counts units)"
        )
    captured = CapturedModel.create(model, example_inputs if example_inputs is not None else (),
                                    example_kwargs, split_points=split_points,
                                    num_stages=num_stages, weights=weights)
    captured.device = device
    if captured.split_balance is not None:
        return captured, captured.split_balance
    if balance is not None:
        return captured, list(balance)
    if num_stages == 1:
        return captured, [len(captured)]
    first = dist.get_rank() == 0 if dist.is_initialized() else True
    return captured, agree(_planned(captured, num_stages, device) if first else None)


def _devices(devices: Any, num: int | None) -> list[torch.device]:
    if devices is None:
        if torch.cuda.is_available():
            devices = range(torch.cuda.device_count())
        elif num is None:
            raise TypeError(
                "GPipe of a captured model needs its number of partitions; fix: pass "
                "split_points=[...] (module names where partitions begin), a balance "
                "(units per partition), or devices=['cpu', 'cpu'] (one per partition, the "
                "planner then cuts the model)"
            )
        else:
            devices = ["cpu"] * num
    return [torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in devices]


def gpipe_units(model: nn.Module, *, example_inputs: Any, example_kwargs: Mapping[str, Any] | None,
                split_points: Sequence[str] | None, balance: Any,
                devices: Any) -> tuple[nn.Sequential, list[int], bool]:
    """The units of a captured model as an ``nn.Sequential`` (unit ``u`` built on its
    partition's device), the units per partition (from the split points, else
    ``balance`` in units, else planned over one partition per device), and whether some
    parameter is shared by two partitions (tied weights: one ``nn.Parameter`` whose
    gradients autograd sums; they must then be on one device)."""
    balance = None if balance is None else list(balance)
    num = len(split_points) + 1 if split_points is not None else (
        len(balance) if balance is not None else None)
    devices = _devices(devices, num)
    num = len(devices) if num is None else num
    captured, counts = pipeline_units(
        model, example_inputs=example_inputs, example_kwargs=example_kwargs,
        split_points=split_points, weights=None, num_stages=num, balance=balance,
        device=devices[0] if devices else torch.device("cpu"))
    units: list[nn.Module] = []
    for j, count in enumerate(counts):
        device = devices[j] if j < len(devices) else devices[-1]
        for _ in range(count):
            units.append(captured.build(len(units), device))
    partition_of = [j for j, count in enumerate(counts) for _ in range(count)]
    shared = any(len({partition_of[u] for u, _ in tie}) > 1 for tie in captured.ties)
    return nn.Sequential(*units), counts, shared


def partition_units(units: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """``units`` cut into ``balance[j]`` consecutive units per partition (units of a
    captured model may share tied parameters, which ``split_module`` refuses).

    Example:
        >>> [len(p) for p in partition_units(nn.Sequential(*[nn.ReLU()] * 3), [2, 1])]
        [2, 1]
    """
    layers = list(units)
    starts = [sum(balance[:j]) for j in range(len(balance))]
    return [nn.Sequential(*layers[s:s + n]) for s, n in zip(starts, balance)]

"""Cuts: where in a captured graph a module begins, split points, and the units of a cut.

Every operation of a captured graph records the modules it ran in (torch.export's
``nn_module_stack``). A module *begins* at its first operation in graph order; a split
point ``"transformer.h.6"`` puts that operation and everything after it into the next
stage. The graph is cut into *units* at every candidate module (each child of a
``ModuleList`` / ``Sequential``, and the other children of the modules that hold them,
e.g. GPT-2's ``transformer.wte``, ``transformer.h.0`` ... ``transformer.ln_f``,
``lm_head``) and at every split point; stages are runs of consecutive units, so the
planner chooses among the candidates and a given cut does not change the units (nor the
random streams, which are keyed by unit).
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Sequence

from torch import fx, nn

__all__ = ["candidate_modules", "compute_nodes", "module_starts", "split_positions", "unit_starts"]

_CONTAINERS = (nn.ModuleList, nn.Sequential)


def compute_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The operations of ``graph`` in order (no placeholders, attributes or output)."""
    return [n for n in graph.nodes if n.op in ("call_function", "call_module", "call_method")]


def module_starts(graph: fx.Graph) -> dict[str, int]:
    """The position (in :func:`compute_nodes`) of each module's first operation."""
    starts: dict[str, int] = {}
    for position, node in enumerate(compute_nodes(graph)):
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            starts.setdefault(str(path), position)
    return starts


def _start(name: str, starts: dict[str, int]) -> int | None:
    found = [p for path, p in starts.items() if path == name or path.startswith(name + ".")]
    return min(found) if found else None


def _holds_container(module: nn.Module) -> bool:
    return any(isinstance(m, _CONTAINERS) for m in module.modules())


def candidate_modules(model: nn.Module) -> list[str]:
    """Modules where a stage may begin (see the module docstring), in model order.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> candidate_modules(model)
        ['0', '1']
    """
    names: list[str] = []

    def expand(module: nn.Module, prefix: str) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}{child_name}"
            if isinstance(child, _CONTAINERS) or _holds_container(child):
                expand(child, name + ".")
            else:
                names.append(name)

    if isinstance(model, _CONTAINERS) or _holds_container(model):
        expand(model, "")
    else:
        names.extend(name for name, _ in model.named_children())
    return names


def split_positions(model: nn.Module, split_points: Sequence[str], starts: dict[str, int], *,
                    num_stages: int) -> list[int]:
    """Where each split point begins; every problem is reported at once.

    Raises:
        ValueError: a split point names no module, or a module that runs no operation;
            split points out of order or beginning at the same operation; their count
            is not ``num_stages - 1``.
    """
    if isinstance(split_points, str) or not all(isinstance(s, str) for s in split_points):
        raise TypeError(
            f"split_points must be a list of module names, got {split_points!r}; fix: e.g. "
            "split_points=['transformer.h.6']"
        )
    modules = dict(model.named_modules())
    problems: list[str] = []
    if len(split_points) != num_stages - 1:
        more = len(split_points) > num_stages - 1
        problems.append(
            f"{'more' if more else 'fewer'} split points than the pipeline's stages allow: "
            f"{len(split_points)} split points make {len(split_points) + 1} stages, the "
            f"pipeline has {num_stages}; fix: give {num_stages - 1} split points, or set the "
            f"number of stages to {len(split_points) + 1}"
        )
    positions: list[int] = []
    for name in split_points:
        if name not in modules:
            near = difflib.get_close_matches(name, list(modules), n=3)
            problems.append(
                f"split point {name!r} names no module of {type(model).__name__}"
                + (f" (did you mean {', '.join(repr(n) for n in near)}?)" if near else "")
                + "; fix: use names from model.named_modules(), e.g. "
                f"{candidate_modules(model)[1:3]}"
            )
            continue
        start = _start(name, starts)
        if start is None:
            problems.append(f"split point {name!r} names a module that runs no operation in "
                            "the captured graph (never called); fix: split at a module the "
                            "forward calls")
        elif start == 0:
            problems.append(f"split point {name!r} begins at the model's first operation, "
                            "which would leave the first stage empty; fix: drop it")
        else:
            positions.append(start)
    if len(positions) == len(split_points):
        ordered = sorted(zip(positions, split_points))
        if positions != sorted(positions):
            problems.append(
                f"split points out of order: {list(split_points)} begin at operations "
                f"{positions} of the graph; fix: list them in the order the model runs "
                f"them: {[name for _, name in ordered]}"
            )
        for (a, first), (b, second) in itertools.pairwise(ordered):
            if a == b:
                problems.append(f"split points {first!r} and {second!r} begin at the same "
                                "operation, leaving an empty stage; fix: keep one of them")
    if problems:
        raise ValueError("bad split_points:\n" + "\n".join(f"  * {p}" for p in problems))
    return positions


def unit_starts(model: nn.Module, starts: dict[str, int], extra: Sequence[int] = ()) -> list[int]:
    """Positions where the units begin: 0, every candidate module's start, and ``extra``."""
    found = {0, *extra}
    for name in candidate_modules(model):
        start = _start(name, starts)
        if start is not None:
            found.add(start)
    return sorted(found)

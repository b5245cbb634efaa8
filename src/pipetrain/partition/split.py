"""Splitting an ``nn.Sequential`` into partitions (stages) by a balance.

A *balance* lists how many consecutive layers (children) each partition holds:
``[3, 2]`` puts layers 0-2 in partition 0 and layers 3-4 in partition 1.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, cast

from torch import nn

from pipetrain.counts import whole_number

__all__ = ["BalanceError", "split_module", "verify_balance", "verify_module"]


class BalanceError(ValueError):
    """A balance that does not fit the module (like torchgpipe's ``BalanceError``)."""


def _even_balance(num_layers: int, num_partitions: int) -> list[int]:
    quotient, remainder = divmod(num_layers, num_partitions)
    return [quotient + 1] * remainder + [quotient] * (num_partitions - remainder)


def _fix(num_layers: int, num_partitions: int) -> str:
    num_partitions = max(1, min(num_partitions, num_layers))
    return (
        f"fix: give each partition a positive number of layers summing to {num_layers}, "
        f"e.g. balance = {_even_balance(num_layers, num_partitions)}; or, while the model "
        f"still changes, let 'pipetrain.balance' measure the layers and balance them "
        f"automatically:\n\n"
        f"    from pipetrain.balance import balance_by_time\n"
        f"    balance = balance_by_time({num_partitions}, model, sample)\n"
    )


def verify_module(module: nn.Module) -> None:
    """Check that ``module`` can be cut into partitions.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: it has no layers, holds the same layer object twice, or shares a
            parameter between two layers (all such problems, named, at once).

    Example:
        >>> from torch import nn

from pipetrain.counts import whole_number
        >>> layer = nn.Linear(2, 2)
        >>> try:
        ...     verify_module(nn.Sequential(layer, nn.ReLU(), layer))
        ... except ValueError as error:
        ...     print(str(error).splitlines()[1])
        * module with duplicate children is not supported: layer '2' is the same module object as layer '0'
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"module must be nn.Sequential to be partitioned, got "
            f"{type(module).__name__}; fix: list its layers in order, e.g. "
            f"nn.Sequential(layer1, layer2, ...) or nn.Sequential(OrderedDict(name=layer))"
        )
    if len(module) == 0:
        raise ValueError(
            "module is an empty nn.Sequential: there are no layers to partition; fix: "
            "add the model's layers, nn.Sequential(layer1, layer2, ...)"
        )
    problems = []
    first_name: dict[int, str] = {}
    owner: dict[int, str] = {}
    for name, child in module._modules.items():
        if child is None:
            problems.append(f"layer {name!r} is None")
            continue
        if id(child) in first_name:
            problems.append(
                f"module with duplicate children is not supported: layer {name!r} is the "
                f"same module object as layer {first_name[id(child)]!r}"
            )
            continue
        first_name[id(child)] = name
        for param_name, param in child.named_parameters(prefix=name):
            if id(param) in owner:
                problems.append(
                    f"module with duplicate parameters in distinct children is not "
                    f"supported: parameter {param_name!r} is shared with "
                    f"{owner[id(param)]!r} (another layer)"
                )
            else:
                owner[id(param)] = param_name
    if problems:
        listed = "\n".join(f"* {problem}" for problem in problems)
        raise ValueError(
            f"module cannot be partitioned: partitions must not share layers or "
            f"parameters:\n{listed}\nfix: give each position its own layer "
            f"(copy.deepcopy(layer)), or put the layers that share weights into one child, "
            f"nn.Sequential(a, b), so that they stay in one partition"
        )


def verify_balance(balance: Any, num_layers: int) -> list[int]:
    """Check a balance against a module of ``num_layers`` layers; return it as a list.

    Entries may be whole floats (``2.0``), as torchgpipe accepts; they are returned as
    ``int``. An empty balance fits only an empty module.

    Raises:
        BalanceError: (a ``ValueError``) the balance is missing, empty, not a list of
            whole numbers, has a non-positive entry, does not sum to ``num_layers``, or
            has more partitions than layers; every problem is listed (each with
            torchgpipe's wording first), then a runnable fix.

    Example:
        >>> verify_balance((2, 3.0), 5)
        [2, 3]
        >>> try:
        ...     verify_balance([2, 2], 5)
        ... except ValueError as error:
        ...     print(str(error).splitlines()[1])
        * module and sum of balance have different length (module: 5, sum of balance: 4); the balance [2, 2] must add up to the module's 5 layers
    """
    problems = []
    values: list[int] = []
    num_partitions = 2
    if balance is None:
        problems.append("balance is required (got None): pipetrain needs the number of "
                        "layers of each partition")
    elif isinstance(balance, (int, float, str, bytes)):
        problems.append(f"the balance must be a list of layer counts, one per partition, "
                        f"got {balance!r}")
    else:
        try:
            entries = list(balance)
        except TypeError:
            entries = None
            problems.append(f"the balance must be a list of layer counts, got {balance!r}")
        if entries is not None:
            num_partitions = len(entries) or num_partitions
            problems.extend(_balance_problems(entries, num_layers))
            if not problems:
                values = [cast(int, whole_number(x)) for x in entries]
    if problems:
        listed = "\n".join(f"* {problem}" for problem in problems)
        raise BalanceError(
            f"invalid balance:\n{listed}\n{_fix(num_layers, num_partitions)}"
        )
    return values


def _balance_problems(entries: list[Any], num_layers: int) -> list[str]:
    """What is wrong with a balance given as a list (nothing: ``[]``)."""
    counts = [whole_number(x) for x in entries]
    wrong = [f"balance[{j}] = {x!r}" for j, (x, n) in enumerate(zip(entries, counts))
             if n is None]
    if wrong:
        return [f"all balance numbers must be positive integer (balance: {entries}); "
                f"not whole numbers: {', '.join(wrong)}"]
    values = cast(list[int], counts)
    problems = []
    bad = [f"balance[{j}] = {x}" for j, x in enumerate(values) if x <= 0]
    if bad:
        problems.append(
            f"all balance numbers must be positive integer (balance: {entries}); every "
            f"partition needs at least one layer, got {', '.join(bad)}"
        )
    if sum(values) != num_layers:
        empty = "; the balance is empty: it needs at least one partition" if not values else ""
        plain = all(type(x) in (int, float) for x in entries)  # shown as given, 4.0 too
        problems.append(
            f"module and sum of balance have different length (module: {num_layers}, sum "
            f"of balance: {sum(entries) if plain else sum(values)}); the balance {values} "
            f"must add up to the module's {num_layers} layers{empty}"
        )
    if len(values) > num_layers:
        problems.append(
            f"the balance has {len(values)} partitions but the module has only "
            f"{num_layers} layers"
        )
    return problems


def split_module(module: nn.Sequential, balance: Any) -> list[nn.Sequential]:
    """Cut ``module`` into ``len(balance)`` partitions of consecutive layers.

    The partitions hold the module's own layers (not copies) under their original
    names, and take the module's training flag. Nothing is moved between devices.

    Raises:
        TypeError, ValueError: as :func:`verify_module` and :func:`verify_balance`.

    Example:
        >>> from torch import nn

from pipetrain.counts import whole_number
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> first, second = split_module(model, [2, 1])
        >>> [name for name, _ in second.named_children()], second[0] is model[2]
        (['2'], True)
    """
    verify_module(module)
    sizes = verify_balance(balance, len(module))
    children = list(module.named_children())
    partitions = []
    start = 0
    for size in sizes:
        partition = nn.Sequential(OrderedDict(children[start : start + size]))
        partition.training = module.training
        partitions.append(partition)
        start += size
    return partitions

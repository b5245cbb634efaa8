"""Namespaces: isolating skip connections that share a name."""

from __future__ import annotations

import uuid

__all__ = ["Namespace", "SkipKey"]


class Namespace:
    """A token that keeps skips of the same name apart (see :meth:`Skippable.isolate`).

    Skips are keyed by ``(namespace, name)``; the default namespace is ``None``. A
    namespace is an identity: copying or deep-copying a model keeps its namespaces
    (so the copy's skips still match), and pickling keeps its id.

    Example:
        >>> import copy
        >>> ns = Namespace()
        >>> ns == copy.deepcopy(ns), ns == Namespace()
        (True, False)
    """

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace {self.id.hex[:8]}>"

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Namespace) and other.id == self.id

    def __copy__(self) -> Namespace:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> Namespace:
        return self


SkipKey = tuple[Namespace | None, str]
"""How a skip is identified: ``(namespace, name)``; ``None`` is the default namespace."""


def _format_key(key: SkipKey) -> str:
    """``'name'``, or ``'name' in <Namespace ...>`` outside the default namespace."""
    ns, name = key
    return repr(name) if ns is None else f"{name!r} in {ns!r}"

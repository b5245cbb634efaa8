"""Namespaces: isolating skip connections that share a name."""

from __future__ import annotations

import abc
import functools
import uuid

__all__ = ["Namespace", "SkipKey"]


@functools.total_ordering
class Namespace(metaclass=abc.ABCMeta):  # noqa: B024 - ABCMeta only to register None
    """A token that keeps skips of the same name apart (see :meth:`Skippable.isolate`).

    Skips are keyed by ``(namespace, name)``; the default namespace is ``None``, which,
    as in torchgpipe, counts as a ``Namespace`` (``isinstance(None, Namespace)``). A
    namespace is identified by its id: copies (``copy.copy``, ``copy.deepcopy``, pickling)
    are new objects equal to it, so a copied model's skips still match. Namespaces are
    ordered (by id, arbitrarily but consistently), so skip keys can be sorted.

    Example:
        >>> import copy
        >>> ns = Namespace()
        >>> ns == copy.copy(ns), ns is copy.copy(ns), ns == Namespace()
        (True, False, False)
        >>> isinstance(None, Namespace)
        True
    """

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace {self.id.hex[:8]}>"

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: object) -> bool:
        # `other is not None`: None is a virtual subclass (the default namespace)
        return isinstance(other, Namespace) and other is not None and other.id == self.id

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Namespace) or other is None:
            return NotImplemented
        return self.id < other.id


# None is the default namespace: isinstance(None, Namespace) is True, as in torchgpipe.
Namespace.register(type(None))


SkipKey = tuple[Namespace | None, str]
"""How a skip is identified: ``(namespace, name)``; ``None`` is the default namespace."""


def _format_key(key: SkipKey) -> str:
    """``'name'``, or ``'name' in <Namespace ...>`` outside the default namespace."""
    ns, name = key
    return repr(name) if ns is None else f"{name!r} in {ns!r}"

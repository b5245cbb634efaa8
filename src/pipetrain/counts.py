"""Counts: whole numbers given as ``4``, ``4.0`` or a NumPy integer, as torchgpipe accepts,
and counts in words (``1 stage``, ``4 stages``).

torchgpipe passes ``chunks`` through ``int()`` and compares balance entries with
``==``, so code written for it may say ``chunks=n / 2`` or ``balance=[2.0, 2.0]``.
pipetrain accepts such values when they are whole numbers and stores them as ``int``;
a fraction (``2.5``), a bool or a non-number is still a mistake. Pure Python.
"""

from __future__ import annotations

import numbers
import operator

__all__ = ["count_of", "whole_number"]


def whole_number(value: object) -> int | None:
    """``value`` as an ``int`` if it is a whole number, else None.

    Accepts ints and anything with ``__index__`` (NumPy integers, integer 0-dim
    tensors), and real numbers with no fractional part (``4.0``, NumPy floats);
    rejects bools, fractions, infinities, strings and everything else.

    Example:
        >>> whole_number(4), whole_number(4.0), whole_number(2.5), whole_number(True)
        (4, 4, None, None)
        >>> whole_number("4") is None
        True
    """
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        pass
    if isinstance(value, numbers.Real):  # float, NumPy floats
        number = float(value)
        return int(number) if number.is_integer() else None
    return None


def count_of(number: int, noun: str, plural: str | None = None) -> str:
    """``number`` and ``noun``, plural unless ``number`` is 1 (``plural``, else ``noun``
    with ``es`` after ``ch``, ``sh``, ``s`` or ``x``, else ``s``).

    Example:
        >>> count_of(1, "stage"), count_of(4, "stage"), count_of(8, "micro-batch")
        ('1 stage', '4 stages', '8 micro-batches')
        >>> count_of(2, "process"), count_of(1, "replica"), count_of(3, "entry", "entries")
        ('2 processes', '1 replica', '3 entries')
    """
    if number == 1:
        return f"{number} {noun}"
    if plural is None:
        plural = noun + ("es" if noun.endswith(("ch", "sh", "s", "x")) else "s")
    return f"{number} {plural}"

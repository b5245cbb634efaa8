"""Reference models written as sequences of layers."""

from __future__ import annotations

__all__: list[str] = []

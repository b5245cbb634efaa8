"""Test-suite set-up: make ``tests/helpers`` importable as ``helpers`` (also in spawned workers)."""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

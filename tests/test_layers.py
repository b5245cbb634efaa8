"""The layers of CONTRIBUTING's table that an import could cross without a cycle checker
noticing (an import inside a function): the benchmark suite and the launcher never import
the command (``pipetrain.cli`` runs the suite and uses the launcher)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pipetrain

PACKAGE = Path(pipetrain.__file__).parent


def _imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", ["bench", "launch"])
def test_lower_layers_never_import_the_command(layer: str) -> None:
    crossing = {
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in sorted((PACKAGE / layer).rglob("*.py"))
        for name in _imported(path)
        if name == "pipetrain.cli" or name.startswith("pipetrain.cli.")
    }
    assert not crossing, sorted(crossing)
    assert any((PACKAGE / layer).rglob("*.py"))  # the layer is where the test looks

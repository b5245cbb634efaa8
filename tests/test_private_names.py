"""Every private name of another library that pipetrain's source reads is listed, with why
it stays, in docs/runtime.md ("Private torch names"), and the fused backward's ones are
read only behind pipetrain.compat's gate."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src" / "pipetrain"
GATED = {"_saved_mat1", "_saved_self", "_saved_alpha", "_saved_beta", "_backward_hooks",
         "_post_accumulate_grad_hooks"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in sorted(SOURCE.rglob("*.py"))}


def _own_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Private attributes of pipetrain's own objects: methods and class attributes of its
    classes, and attributes it assigns."""
    own: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        own.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        own.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        own.update(t.id for t in item.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
    return {name for name in own if _private(name)}


def _foreign(trees: dict[Path, ast.Module]) -> dict[str, set[str]]:
    """Private names read from other libraries' objects: name -> files (relative)."""
    own = _own_names(trees)
    found: dict[str, set[str]] = {}
    for path, tree in trees.items():
        where = str(path.relative_to(SOURCE.parent))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Attribute) and _private(node.attr):
                # super()._x: the base class's (a library's) name, even when overridden
                inherited = isinstance(node.value, ast.Call) and isinstance(
                    node.value.func, ast.Name) and node.value.func.id == "super"
                if inherited or node.attr not in own:
                    found.setdefault(node.attr, set()).add(where)
                continue
            elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith(
                    ("pipetrain", "__future__")):
                names = [a.name for a in node.names if _private(a.name)]
                names += [part for part in (node.module or "").split(".") if _private(part)]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str)):
                names = [node.args[1].value] if _private(node.args[1].value) else []
            for name in names:
                if name not in own:
                    found.setdefault(name, set()).add(where)
    return found


def _section() -> str:
    text = (ROOT / "docs" / "runtime.md").read_text()
    start = text.index("## Private torch names")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_every_private_name_read_is_listed_in_the_docs() -> None:
    section = _section()
    missing = {name: sorted(where) for name, where in _foreign(_trees()).items()
               if f"{name}" not in section}
    assert not missing, (
        f"private names of other libraries read in src/ but not listed in docs/runtime.md's "
        f"'Private torch names' section: {missing}; list each with why it stays (or use a "
        f"public API instead)")


def test_the_fused_backwards_private_names_are_read_only_behind_the_gate() -> None:
    found = _foreign(_trees())
    assert GATED <= set(found), sorted(GATED - set(found))  # the scan sees them
    outside = {name: sorted(found[name] - {"pipetrain/compat.py"}) for name in GATED}
    assert not any(outside.values()), outside


def test_the_scan_finds_a_private_torch_name() -> None:
    """The scan itself: a private attribute read off a torch object is reported."""
    tree = ast.parse("import torch\nx = torch.ones(1)\ny = x._version\n")
    assert _foreign({SOURCE / "example.py": tree}) == {"_version": {"pipetrain/example.py"}}

"""The cases of ``pipetrain bench``: each name and the module that defines it, imported lazily.

A case module (``pipetrain/bench/cases/<name>.py``) defines ``CASE``
(:class:`~pipetrain.bench.case.Case`). :data:`CASES` lists them in the order the suite
runs them; a new case adds its line here. Modules are imported only when a case is
listed or run, so that ``pipetrain bench --list`` works without the optional packages a
case needs (``torchgpipe``, ``transformers``): such a case is listed with the reason it
would be skipped, and :func:`skip_reason` gives it to the suite.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

from pipetrain.bench.case import Case

__all__ = ["CASES", "Entry", "available", "case_names", "check_names", "import_failure",
           "load_case", "skip_reason"]

CASES: dict[str, str] = {
    "vs_torch_pipelining": "pipetrain.bench.cases.vs_torch_pipelining",
    "schedules": "pipetrain.bench.cases.schedules",
    "activation_memory": "pipetrain.bench.cases.activation_memory",
    "gpipe_vs_torchgpipe": "pipetrain.bench.cases.gpipe_vs_torchgpipe",
    "torchgpipe_paper": "pipetrain.bench.cases.torchgpipe_paper",
    "transport": "pipetrain.bench.cases.transport",
    "vs_torch_frontend": "pipetrain.bench.cases.vs_torch_frontend",
    "vs_torch_fsdp": "pipetrain.bench.cases.vs_torch_fsdp",
    "frontend_meta_memory": "pipetrain.bench.cases.frontend_meta_memory",
    "async_convergence": "pipetrain.bench.cases.async_convergence",
    "planner": "pipetrain.bench.cases.planner",
    "planner_speed": "pipetrain.bench.cases.planner_speed",
    "planner_vs_pipedream": "pipetrain.bench.cases.planner_vs_pipedream",
    "pipedream_claims": "pipetrain.bench.cases.pipedream_claims",
    "gpipe_table1": "pipetrain.bench.cases.gpipe_table1",
    "gpipe_table2": "pipetrain.bench.cases.gpipe_table2",
}
"""Case name -> the module defining its ``CASE``, in the order the suite runs them."""

_EXTRAS = {"torchgpipe": "bench", "transformers": "hf", "safetensors": "hf"}
"""The ``pipetrain[extra]`` that installs an optional package a case needs."""


@dataclass(frozen=True, kw_only=True)
class Entry:
    """A case as ``pipetrain bench --list`` shows it: its name, title, expected seconds
    on a 2-core CPU, and why it would be skipped here (``None``: it runs)."""

    name: str
    title: str
    quick_seconds: float
    full_seconds: float
    skip_reason: str | None


def case_names() -> list[str]:
    """Every case's name, in the suite's order.

    Example:
        >>> "transport" in case_names()
        True
    """
    return list(CASES)


def check_names(names: Sequence[str]) -> list[str]:
    """``names`` in the order given, or a :class:`ValueError` naming every unknown one and
    listing the known ones.

    Example:
        >>> check_names(["transport"])
        ['transport']
    """
    unknown = [name for name in names if name not in CASES]
    if unknown:
        raise ValueError(f"unknown case{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(repr(n) for n in unknown)}; the cases are: "
                         f"{', '.join(CASES)} (pipetrain bench --list describes them)")
    return list(names)


def load_case(name: str) -> Case:
    """The ``CASE`` of case ``name`` (its module imported now).

    Raises:
        ValueError: ``name`` is not a case (the message lists the cases).
        ModuleNotFoundError: the module needs a package that is not installed.

    Example:
        >>> load_case("planner_speed").name
        'planner_speed'
    """
    check_names([name])
    module = importlib.import_module(CASES[name])
    case = getattr(module, "CASE", None)
    if not isinstance(case, Case) or case.name != name:
        raise TypeError(f"{CASES[name]} must define CASE = Case(name={name!r}, ...), "
                        f"found {case!r}")
    return case


def _install_hint(package: str) -> str:
    extra = _EXTRAS.get(package)
    return (f"pip install 'pipetrain[{extra}]'" if extra is not None
            else f"pip install {package}")


def skip_reason(case: Case) -> str | None:
    """Why ``case`` cannot run here (a package it needs is missing, and how to install
    it), or ``None``.

    Example:
        >>> from pipetrain.bench.case import BenchResult
        >>> case = Case(name="x", title="x", run=lambda c: BenchResult(tables=[]),
        ...             quick_seconds=1, full_seconds=1, needs=("no_such_package_xyz",))
        >>> skip_reason(case)
        'needs no_such_package_xyz, which is not installed (pip install no_such_package_xyz)'
    """
    missing = [p for p in case.needs if importlib.util.find_spec(p) is None]
    if not missing:
        return None
    hints = sorted({_install_hint(p) for p in missing})
    return (f"needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
            f"installed ({'; '.join(hints)})")


def import_failure(error: ModuleNotFoundError) -> str:
    """Why a case module could not be imported: the optional package it needs and how to
    install it, or the error itself when a pipetrain module is missing.

    Example:
        >>> import_failure(ModuleNotFoundError("No module named 'torchgpipe'", name="torchgpipe"))
        "needs torchgpipe, which is not installed (pip install 'pipetrain[bench]')"
    """
    missing = (error.name or "").split(".")[0]
    if not missing or missing == "pipetrain":
        return f"cannot be imported: {error}"
    return f"needs {missing}, which is not installed ({_install_hint(missing)})"


def available() -> list[Entry]:
    """Every case with its title, durations and whether it runs here (``--list``).

    A case whose module cannot be imported for want of a package is listed with that
    reason.

    Example:
        >>> [e.name for e in available()] == case_names()
        True
    """
    entries = []
    for name in CASES:
        try:
            case = load_case(name)
        except ModuleNotFoundError as error:
            entries.append(Entry(name=name, title="(cannot be imported)", quick_seconds=0.0,
                                 full_seconds=0.0, skip_reason=import_failure(error)))
            continue
        entries.append(Entry(name=name, title=case.title, quick_seconds=case.quick_seconds,
                             full_seconds=case.full_seconds, skip_reason=skip_reason(case)))
    return entries

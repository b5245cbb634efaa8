"""The tables of ``docs/benchmarks.md``, generated from the result files of ``pipetrain bench``.

A document marks where a case's tables go, each marker a line of its own::

    <!-- bench:transport:begin -->
    (generated: every line in between is replaced)
    <!-- bench:transport:end -->

``bench:NAME`` takes every table of case ``NAME``; ``bench:NAME/KEY`` the one table whose
:attr:`~pipetrain.bench.case.Table.key` is ``KEY``; ``bench:NAME/plots`` the case's pictures
(links to its PNG files in the results folder, relative to the document). Each generated block ends with a line
stating the run that produced it: the date, the machine, the versions and the command.
A case the results folder does not hold leaves its blocks as they are. Run::

    python -m pipetrain.bench.docs RESULTS_DIR [--into docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipetrain.bench.case import Table

__all__ = ["PLOTS", "block_text", "grouped_warnings", "load_results", "main", "markers", "plots_text", "provenance",
           "regenerate"]

_MARKER = re.compile(r"^<!-- bench:(?P<name>[\w-]+)(?:/(?P<key>[\w-]+))?:begin -->$",
                     re.MULTILINE)
_END = "<!-- bench:{target}:end -->"


def load_results(folder: Path) -> dict[str, dict[str, Any]]:
    """Every case's record in ``folder`` (``<name>.json`` as ``pipetrain bench`` writes
    them; ``summary.json`` left out), by case name.

    Raises:
        ValueError: the folder holds no result file.

    Example::

        results = load_results(Path("bench-results/20261128-101500"))
    """
    records: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob("*.json")):
        if path.name == "summary.json":
            continue
        record = json.loads(path.read_text())
        if isinstance(record, dict) and "name" in record and "metadata" in record:
            records[record["name"]] = record
    if not records:
        raise ValueError(f"{str(folder)!r} holds no result of pipetrain bench (no <case>.json "
                         "with a name and metadata); run: pipetrain bench --out "
                         f"{folder}")
    return records


def _gib(value: Any) -> str:
    return "? GiB" if not value else f"{value / 2**30:.0f} GiB"


_SPREAD = re.compile(r"^(?P<label>.+): repetitions disagree \(spread (?P<spread>\d+%) of the "
                     r"median [^,]+, (?P<n>\d+) values; more than (?P<tol>\d+%)\)$")


def grouped_warnings(warnings: Sequence[str]) -> list[str]:
    """``warnings`` with those about repetitions that disagree in one sentence (their
    labels and spreads), after the others; the record keeps each one whole.

    Example:
        >>> grouped_warnings([
        ...     "a: repetitions disagree (spread 20% of the median 0.11, 25 values; more than 10%)",
        ...     "b: repetitions disagree (spread 15% of the median 1.2, 25 values; more than 10%)",
        ...     "after the case: load average 3.5 above the 2 cores"])
        ['after the case: load average 3.5 above the 2 cores', 'repetitions spread more than 10% of their median (25 values each) for a 20%, b 15%']
    """
    spread = [m for w in warnings if (m := _SPREAD.match(w))]
    if len(spread) < 2:
        return list(warnings)
    others = [w for w in warnings if not _SPREAD.match(w)]
    tolerances = {m["tol"] for m in spread}
    counts = sorted({m["n"] for m in spread}, key=int)
    each = f"{counts[0]} values each" if len(counts) == 1 else f"{'-'.join((counts[0], counts[-1]))} values"
    tol = tolerances.pop() if len(tolerances) == 1 else "the tolerance"
    return [*others, f"repetitions spread more than {tol} of their median ({each}) for "
                     + ", ".join(f"{m['label']} {m['spread']}" for m in spread)]


def provenance(record: Mapping[str, Any]) -> str:
    """The line that says which run produced a case's tables: date, machine (with the
    load average before and after the case), versions, command, size, wall time; then
    the run's warnings about its measurements (a busy machine, repetitions that disagree).

    Example:
        >>> record = {"name": "transport", "quick": False, "wall_s": 12.0, "status": "ok",
        ...           "metadata": {"date": "2026-11-28T10:00:00+00:00",
        ...                        "command": "pipetrain bench transport",
        ...                        "machine": {"cpu_model": "AMD EPYC", "cores": 2,
        ...                                    "memory_bytes": 2**34,
        ...                                    "load_average_before": [0.1, 0.2, 0.3],
        ...                                    "load_average_after": [1.0, 0.5, 0.4]},
        ...                        "versions": {"python": "3.11.9", "torch": "2.13.0",
        ...                                     "pipetrain": "0.1.0", "torchgpipe": None,
        ...                                     "transformers": None}}}
        >>> print(provenance(record))
        *Generated from `pipetrain bench transport`, run 2026-11-28T10:00:00+00:00 (12 s): AMD EPYC, 2 cores, 16 GiB, load average 0.1 before and 1.0 after; Python 3.11.9, torch 2.13.0, pipetrain 0.1.0.*
    """
    meta = record["metadata"]
    machine = meta.get("machine", {})
    before, after = machine.get("load_average_before"), machine.get("load_average_after")
    load = ("" if not before or not after else
            f", load average {before[0]:.1f} before and {after[0]:.1f} after")
    warnings = "".join(f" Warning: {w}." for w in grouped_warnings(record.get("warnings") or []))
    versions = meta.get("versions", {})
    named = [f"{'Python' if name == 'python' else name} {version}"
             for name, version in versions.items() if version]
    size = ", quick sizes: a smoke run" if record.get("quick") else ""
    return (f"*Generated from `{meta.get('command', 'pipetrain bench')}`, run "
            f"{meta.get('date', '?')} ({record.get('wall_s', 0):.0f} s{size}): "
            f"{machine.get('cpu_model', '?')}, {machine.get('cores', '?')} cores, "
            f"{_gib(machine.get('memory_bytes'))}{load}; {', '.join(named)}.*{warnings}")


PLOTS = "plots"
"""The key of a block that shows a case's pictures instead of a table."""


def plots_text(record: Mapping[str, Any], folder: str) -> str:
    """Markdown image links to the case's PNG files, ``folder`` being the results folder
    relative to the document.

    Example:
        >>> print(plots_text({"name": "x", "plots": ["x_speed.png"]}, "bench"))
        ![x_speed.png](bench/x_speed.png)
    """
    plots = list(record.get("plots") or [])
    if not plots:
        return f"*Case `{record['name']}` drew no picture in this run.*"
    return "\n\n".join(f"![{name}]({folder}/{name})" for name in plots)


def block_text(record: Mapping[str, Any], key: str | None = None) -> str:
    """The generated content of a block: the case's tables (or the one with ``key``),
    each under its title, then :func:`provenance`; a case that did not run says why.

    Raises:
        ValueError: no table of the case has ``key`` (the message lists the keys).

    Example:
        >>> record = {"name": "x", "status": "skipped", "reason": "needs torchgpipe",
        ...           "metadata": {"date": "2026-11-28", "command": "pipetrain bench x"}}
        >>> block_text(record)
        '*Not measured: `pipetrain bench x` (2026-11-28) skipped this case: needs torchgpipe.*'
    """
    meta = record["metadata"]
    if record.get("status") != "ok":
        return (f"*Not measured: `{meta.get('command', 'pipetrain bench')}` "
                f"({meta.get('date', '?')}) {record.get('status', 'failed')} this case: "
                f"{record.get('reason') or 'no reason recorded'}.*")
    tables = [Table.from_dict(t) for t in record.get("tables", [])]
    if key is not None:
        chosen = [t for t in tables if t.key == key]
        if not chosen:
            raise ValueError(f"case {record['name']!r} has no table with key {key!r}; its "
                             f"keys: {', '.join(t.key for t in tables if t.key) or 'none'} "
                             f"(use <!-- bench:{record['name']}:begin --> for all its tables)")
        tables = chosen
    parts = [f"**{t.title}**\n\n{t.markdown()}" for t in tables]
    return "\n\n".join([*parts, provenance(record)])


def markers(text: str) -> list[str]:
    """The blocks a document marks, as ``NAME`` or ``NAME/KEY``, in order.

    Example:
        >>> markers("a\\n<!-- bench:x:begin -->\\n<!-- bench:x:end -->\\n")
        ['x']
    """
    found = []
    for match in _MARKER.finditer(text):
        name, key = match.group("name"), match.group("key")
        found.append(name if key is None else f"{name}/{key}")
    return found


def regenerate(text: str, results: Mapping[str, Mapping[str, Any]], *,
               pictures: str = ".") -> tuple[str, list[str]]:
    """``text`` with every block of a case in ``results`` regenerated; the new text and
    the blocks it regenerated (``NAME`` or ``NAME/KEY``). ``pictures`` is the results
    folder relative to the document (for the ``NAME/plots`` blocks).

    Raises:
        ValueError: a block has no end marker, or names a table key its case lacks.

    Example:
        >>> doc = "<!-- bench:x:begin -->\\nold\\n<!-- bench:x:end -->\\n"
        >>> record = {"name": "x", "status": "failed", "reason": "boom",
        ...           "metadata": {"date": "d", "command": "c"}}
        >>> new, done = regenerate(doc, {"x": record})
        >>> done, "old" in new
        (['x'], False)
    """
    pieces: list[str] = []
    done: list[str] = []
    position = 0
    for match in _MARKER.finditer(text):
        if match.start() < position:
            raise ValueError(f"block {match.group(0)!r} starts inside another block")
        name, key = match.group("name"), match.group("key")
        target = name if key is None else f"{name}/{key}"
        closing = re.compile("^" + re.escape(_END.format(target=target)) + "$", re.MULTILINE)
        found = closing.search(text, match.end())
        end = -1 if found is None else found.start()
        if end < 0:
            raise ValueError(f"block {match.group(0)!r} has no end marker "
                             f"{_END.format(target=target)!r}")
        pieces.append(text[position:match.end()])
        if name in results:
            made = (plots_text(results[name], pictures) if key == PLOTS
                    else block_text(results[name], key))
            pieces.append("\n" + made + "\n")
            done.append(target)
        else:
            pieces.append(text[match.end():end])
        position = end
    pieces.append(text[position:])
    return "".join(pieces), done


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipetrain.bench.docs RESULTS_DIR [--into FILE ...]``: regenerate the
    documents' blocks from the results; 0, or 2 on bad input (message on stderr)."""
    parser = argparse.ArgumentParser(
        prog="python -m pipetrain.bench.docs",
        description="Regenerate the tables of documents (docs/benchmarks.md) from the "
                    "result files of pipetrain bench.")
    parser.add_argument("results", type=Path, metavar="RESULTS_DIR",
                        help="the --out folder of a pipetrain bench run")
    parser.add_argument("--into", type=Path, nargs="+", default=[Path("docs/benchmarks.md")],
                        metavar="FILE",
                        help="the documents to update (default docs/benchmarks.md)")
    args = parser.parse_args(argv)
    try:
        results = load_results(args.results)
        updates = []
        for into in args.into:
            text = into.read_text()
            pictures = os.path.relpath(args.results.resolve(), into.resolve().parent)
            new, done = regenerate(text, results, pictures=Path(pictures).as_posix())
            updates.append((into, text, new, done))
    except (OSError, ValueError) as error:
        sys.stderr.write(f"python -m pipetrain.bench.docs: error: {error}\n")
        return 2
    for into, text, new, done in updates:
        into.write_text(new)
        left = [m for m in markers(text) if m not in done]
        sys.stderr.write(f"{into}: {len(done)} block{'s' if len(done) != 1 else ''} "
                         f"regenerated ({', '.join(done) or 'none'})"
                         + (f"; not in {args.results}: {', '.join(left)}" if left else "") + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Drawing a results folder's pictures again from its result files, without measuring.

For every ``<case>.json`` that ``pipetrain bench`` wrote into the folder, of a case that
ran (status ``ok``) and has a :attr:`~pipetrain.bench.case.Case.draw`, the case's
pictures are drawn again from the record's tables and data into the same folder, and
the record's ``plots`` lists them (after the pictures it listed already, each once);
nothing else in the record changes. Records of cases that failed or were skipped, of
cases without ``draw``, and other JSON files are left alone. Run::

    python -m pipetrain.bench.redraw RESULTS_DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetrain.bench.drawings import draw_record, merge_plots
from pipetrain.bench.registry import case_names, import_failure, load_case
from pipetrain.bench.suite import write_json

__all__ = ["Redrawn", "main", "redraw", "redraw_file", "redraw_record"]


@dataclass(frozen=True, kw_only=True)
class Redrawn:
    """What :func:`redraw` did with one result file: the pictures drawn (file names), or
    why none were (``reason``; ``failed``: the case's drawing raised)."""

    name: str
    plots: tuple[str, ...] = ()
    reason: str | None = None
    failed: bool = False


def redraw_record(record: dict[str, Any], folder: Path) -> Redrawn:
    """Draw the pictures of one result file's ``record`` into ``folder`` and add their
    names to ``record["plots"]`` (in place); what was done.

    A record of a case that did not run (``failed``, ``skipped``), of an unknown case or
    of a case without ``draw`` is left as it is (``reason`` says why).

    Example::

        record = json.loads((folder / "transport.json").read_text())
        done = redraw_record(record, folder)   # done.plots: ("transport_round_trip.png",)
    """
    name = str(record.get("name"))
    if record.get("status") != "ok":
        return Redrawn(name=name, reason=f"status {record.get('status')!r}, not 'ok'")
    if name not in case_names():
        return Redrawn(name=name, reason="not a case of pipetrain bench")
    try:
        case = load_case(name)
    except ModuleNotFoundError as error:
        return Redrawn(name=name, reason=import_failure(error))
    if case.draw is None:
        return Redrawn(name=name, reason="the case draws no pictures")
    drawn = draw_record(case.draw, record, folder)
    record["plots"] = merge_plots(list(record.get("plots") or []), drawn)
    return Redrawn(name=name, plots=tuple(drawn))


def redraw_file(path: Path) -> Redrawn | None:
    """Draw again the pictures of result file ``path`` into its folder and rewrite it
    with their names in ``plots``; what was done (``None``: not a case's result file).

    A drawing that fails leaves the file as it was (``failed``, with the error as
    ``reason``).

    Example::

        done = redraw_file(Path("bench-results/full/transport.json"))
    """
    if path.name == "summary.json":
        return None
    record = json.loads(path.read_text())
    if not isinstance(record, dict) or "name" not in record or "tables" not in record:
        return None
    try:
        result = redraw_record(record, path.parent)
    except Exception as error:  # this case's pictures; the other files are still drawn
        return Redrawn(name=str(record["name"]), failed=True,
                       reason=f"drawing failed: {type(error).__name__}: {error}")
    if result.reason is None:
        write_json(path, record)
    return result


def redraw(folder: Path) -> list[Redrawn]:
    """Draw again the pictures of every result file in ``folder`` (see the module's
    docstring); one entry per result file.

    Raises:
        ValueError: ``folder`` is not a folder.

    Example::

        for done in redraw(Path("bench-results/full")):
            print(done.name, done.plots or done.reason)
    """
    if not folder.is_dir():
        raise ValueError(f"{str(folder)!r} is not a folder; give the --out folder of a "
                         "pipetrain bench run")
    done = [redraw_file(path) for path in sorted(folder.glob("*.json"))]
    return [result for result in done if result is not None]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipetrain.bench.redraw RESULTS_DIR``: draw the pictures again; 0, or 1
    when a case's drawing failed, 2 on bad input (one line per result file on stderr)."""
    parser = argparse.ArgumentParser(
        prog="python -m pipetrain.bench.redraw",
        description="Draw the pictures of a pipetrain bench results folder again from its "
                    "result files (no measuring) and list them in each record's plots.")
    parser.add_argument("results", type=Path, metavar="RESULTS_DIR",
                        help="the --out folder of a pipetrain bench run")
    args = parser.parse_args(argv)
    try:
        done = redraw(args.results)
    except (OSError, ValueError) as error:
        sys.stderr.write(f"python -m pipetrain.bench.redraw: error: {error}\n")
        return 2
    for result in done:
        what = (", ".join(result.plots) or "no picture" if result.reason is None
                else f"left as it is ({result.reason})")
        sys.stderr.write(f"{result.name}: {what}\n")
    return 1 if any(result.failed for result in done) else 0


if __name__ == "__main__":
    sys.exit(main())

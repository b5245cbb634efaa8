"""``pipetrain bench``: the benchmark suite, every figure the docs show, measured against
the anchors in the same run.

A benchmark is a *case* (:mod:`.case`): a module under :mod:`pipetrain.bench.cases` with a
``CASE`` object that runs at full or ``--quick`` size and returns a :class:`~.case.BenchResult`
(tables of pipetrain's figures beside the anchors' and the papers', plots, raw data).
:mod:`.registry` lists them; :mod:`.suite` runs any subset and writes one JSON file per
case (and its PNGs) into ``--out``, with what :mod:`.run_info` records about the run
(machine, versions, command, date); :mod:`.docs` regenerates the tables in
``docs/benchmarks.md`` from those files. The cases share :mod:`.harness` (job launch,
interleaved timing, statistics, machine load, peak memory, JSON); larger ones keep their
engine beside it (:mod:`.vs_torch`, :mod:`.gpipe_runs`).
"""

from __future__ import annotations

from pipetrain.bench.case import BenchContext, BenchResult, Case, SkipCase, Table

__all__ = ["BenchContext", "BenchResult", "Case", "SkipCase", "Table"]

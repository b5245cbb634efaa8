"""The shared benchmark harness: job launch, interleaved timing, statistics, machine load, output.

Every benchmark under ``benchmarks/`` measures pipetrain against anchors run in the same
job, in repetitions that go round-robin over the runners (a busy period of a shared
machine hits all of them alike), and reports medians and ratios. The pieces:

- :mod:`.jobs`: spawn the ranks of a gloo job with one intra-op thread each
  (:func:`run_job`), agree on failures across ranks (:func:`agree`), gather to rank 0;
- :mod:`.timing`: the interleaved timing loop (:func:`interleave`), each step after a
  barrier, wall and CPU time per rank; step times as the max over the ranks;
- :mod:`.stats`: medians, quartiles, summaries;
- :mod:`.machine`: what else used the CPU while we measured (``/proc/stat``), the load
  average, the machine's description;
- :mod:`.output`: strict JSON and the small formatters of the reports.

Scripts import it as ``from harness import ...`` (``python benchmarks/<script>.py`` puts
``benchmarks/`` on the path; the spawned ranks inherit it).
"""

from __future__ import annotations

from harness.jobs import agree, gather_objects, run_job
from harness.machine import CpuWindow, foreign_load, load_line, machine_info
from harness.output import dump_json, finite, ms, pct, stage_ms
from harness.stats import median, quartiles, summary
from harness.timing import Sample, interleave, step_times

__all__ = [
    "CpuWindow",
    "Sample",
    "agree",
    "dump_json",
    "finite",
    "foreign_load",
    "gather_objects",
    "interleave",
    "load_line",
    "machine_info",
    "median",
    "ms",
    "pct",
    "quartiles",
    "run_job",
    "stage_ms",
    "step_times",
    "summary",
]

"""The shared benchmark harness: job launch, interleaved timing, statistics, machine load, output.

Every case of ``pipetrain bench`` (:mod:`pipetrain.bench.cases`) measures pipetrain
against anchors run in the same job, in repetitions that go round-robin over the runners
(a busy period of a shared machine hits all of them alike), and reports medians and
ratios. The pieces:

- :mod:`.jobs`: spawn the ranks of a gloo job with one intra-op thread each
  (:func:`run_job`), agree on failures across ranks (:func:`agree`), gather to rank 0;
- :mod:`.timing`: the interleaved timing loop (:func:`interleave`), each step after a
  barrier, wall and CPU time per rank; step times as the max over the ranks;
- :mod:`.stats`: medians, quartiles, summaries;
- :mod:`.machine`: what else used the CPU while we measured (``/proc/stat``), the load
  average, the machine's description;
- :mod:`.noise`: warnings when repetitions disagree or the load average is above the
  core count (plain functions, for any command that times something);
- :mod:`.memory`: the peak memory of a region of a process (RSS growth on the CPU, the
  CUDA allocator's peak on a GPU);
- :mod:`.output`: strict JSON and the small formatters of the reports.

Import it as ``from pipetrain.bench.harness import ...`` (the one-call GPU check under
``benchmarks/gpu`` does too).
"""

from __future__ import annotations

from pipetrain.bench.harness.jobs import (
    EXACT_MALLOC,
    agree,
    forked_jobs,
    gather_objects,
    ring_bandwidth,
    run_job,
)
from pipetrain.bench.harness.machine import CpuWindow, foreign_load, load_line, machine_info
from pipetrain.bench.harness.memory import PeakMemory, memory_available
from pipetrain.bench.harness.noise import (
    load_warning,
    measurement_warnings,
    spread_warning,
    spread_warnings,
)
from pipetrain.bench.harness.output import dump_json, finite, ms, pct, stage_ms
from pipetrain.bench.harness.stats import median, quartiles, summary
from pipetrain.bench.harness.timing import Sample, interleave, step_times

__all__ = [
    "EXACT_MALLOC",
    "CpuWindow",
    "PeakMemory",
    "Sample",
    "agree",
    "dump_json",
    "finite",
    "foreign_load",
    "forked_jobs",
    "gather_objects",
    "interleave",
    "load_line",
    "load_warning",
    "machine_info",
    "measurement_warnings",
    "median",
    "memory_available",
    "ms",
    "pct",
    "quartiles",
    "ring_bandwidth",
    "run_job",
    "spread_warning",
    "spread_warnings",
    "stage_ms",
    "step_times",
    "summary",
]

"""GPipe's Table 1: the largest model that trains under a fixed memory cap per worker.

Huang et al. (2019), "GPipe: Efficient Training of Giant Neural Networks using Pipeline
Parallelism" (arXiv:1811.06965, Table 1) grow a model until it no longer trains on
accelerators of fixed memory: without GPipe (Naive-1), with re-materialization on one
accelerator (Pipeline-1) and over K partitions (Pipeline-K). Here a worker is a CPU
process, its memory the growth of its resident set above a warmed-up start (see
:mod:`._gpipe_memory`), and the model pipetrain's GPT at a fixed width, grown in blocks.
For each runner the largest depth is found by doubling, then bisection
(:mod:`._gpipe_search`); the table gives its parameters and their ratio to naive-1,
next to the paper's Transformer-L and AmoebaNet-D rows.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pipetrain.bench.case import BenchContext, BenchResult, Case, Table
from pipetrain.bench.cases._gpipe_memory import (
    Workload,
    fresh_search,
    same_size_peaks,
    search_worker,
)
from pipetrain.bench.drawings import bars, find_table
from pipetrain.bench.harness import EXACT_MALLOC, run_job
from pipetrain.launch.processes import temporary_environment

__all__ = ["CASE", "PAPER", "RUNNERS", "Runner", "draw", "paper_rows", "run", "search_start"]

PAPER: dict[str, tuple[float, float]] = {
    "naive-1": (282.2e6, 82e6),
    "pipeline-1": (785.8e6, 318e6),
    "pipeline-2": (1.3e9, 542e6),
    "pipeline-4": (3.0e9, 1.05e9),
    "pipeline-8": (5.3e9, 1.8e9),
}
"""Parameters of the largest model in Huang et al. 2019, Table 1: (Transformer-L on Cloud
TPUv3, 16 GB per core; AmoebaNet-D on Cloud TPUv2, 8 GB per core). The AmoebaNet-D
column as quoted by torchgpipe's benchmarks (docs/benchmarks.rst: 82M, 318M, 542M,
1.05B, 1.8B); the Transformer's 282.2M (naive-1) as quoted by summaries of the paper
(which also give 2.7x for re-materialization on one core and 83.9B on 128 partitions);
1.3B, 3.0B and 5.3B to the paper's two digits (consistent with its ~50M parameters per
Transformer-L layer)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Runner:
    """A row of the table: how the GPT is trained and on how many worker processes.

    Example:
        >>> [(r.kind, r.workers, r.checkpoint) for r in RUNNERS][-2:]
        [('pipeline-per-layer', 8, 'per_layer'), ('pipeline-fsdp', 8, 'per_layer')]
    """

    label: str
    kind: str
    workers: int
    paper_row: str | None
    weight: float
    """Share of the time budget (its trials are that much longer)."""
    start_from: tuple[int, float] | None
    """The full run's search starts from the smallest model with at least this factor
    times the parameters of this row's largest (``None``: from 4 blocks). The start sets
    how many trials the search takes (a start too large halves) and, within the search's
    tolerance, where it stops: a row held to a ratio of an earlier row's size (K = 4 x
    FSDP 2 to K = 4) starts at its goal, so that the goal's size is tried."""

    @property
    def checkpoint(self) -> str:
        """How it re-materializes: not at all (naive), each stage's micro-batches
        (``always``) or layer by layer (``per_layer``)."""
        return {"naive": "-", "gpipe": "always", "pipeline": "always"}.get(self.kind,
                                                                          "per_layer")

    @property
    def stages(self) -> int:
        """Pipeline stages, each worker's share of the blocks (FSDP: 2 workers a stage)."""
        return self.workers // 2 if self.kind == "pipeline-fsdp" else self.workers


RUNNERS = (
    Runner(label="naive-1 (nn.Sequential)", kind="naive", workers=1, paper_row="naive-1",
           weight=1.0, start_from=None),
    Runner(label="pipeline-1 (GPipe)", kind="gpipe", workers=1, paper_row="pipeline-1",
           weight=2.0, start_from=(0, 2.0)),
    Runner(label="pipeline-1 (Pipeline)", kind="pipeline", workers=1, paper_row=None,
           weight=1.0, start_from=(1, 1.0)),
    Runner(label="pipeline-2 (Pipeline)", kind="pipeline-per-layer", workers=2,
           paper_row="pipeline-2", weight=2.0, start_from=(2, 2.0)),
    Runner(label="pipeline-4 (Pipeline)", kind="pipeline-per-layer", workers=4,
           paper_row="pipeline-4", weight=3.5, start_from=(3, 2.0)),
    Runner(label="pipeline-8 (Pipeline)", kind="pipeline-per-layer", workers=8,
           paper_row="pipeline-8", weight=7.0, start_from=(4, 2.0)),
    Runner(label="pipeline-4 x FSDP 2 (Pipeline)", kind="pipeline-fsdp", workers=8,
           paper_row=None, weight=12.0, start_from=(4, 1.8)),
)

SIZES: dict[str, dict[str, Any]] = {
    "full": {"work": Workload(width=128, heads=4, context=64, batch=16, microbatches=16),
             "cap_mib": 128.0, "tolerance": 1 / 12, "limit": 4096, "budget_s": 1000.0,
             "trial_timeout_s": 240.0, "same_size_repeats": 3},
    "quick": {"work": Workload(width=64, heads=2, context=32, batch=16, microbatches=8),
              "cap_mib": 24.0, "tolerance": 1 / 4, "limit": 1024, "budget_s": 90.0,
              "starts": (4, 12, 12, 24), "max_workers": 2},
}


_SEARCH_KEYS = ("cap_mib", "tolerance", "limit", "trial_timeout_s")


def _full_searches(context: BenchContext, sizes: dict[str, Any]) -> list[dict[str, Any]]:
    """Every runner's search, one after another, each trial in fresh processes, within
    its share of the time budget; it starts from an earlier row's size
    (:attr:`Runner.start_from`)."""
    results: list[dict[str, Any]] = []
    ends = time.monotonic() + sizes["budget_s"]
    for k, runner in enumerate(RUNNERS):
        start = 4
        if runner.start_from is not None:
            row, factor = runner.start_from
            start = search_start(sizes["work"].parameters, results[row]["search"]["largest"],
                                 factor)
        share = runner.weight / sum(r.weight for r in RUNNERS[k:])
        deadline = time.monotonic() + (ends - time.monotonic()) * share
        context.progress(f"{runner.label}: searching from {start} blocks "
                         f"(cap {sizes['cap_mib']:.0f} MiB per worker)")
        result = fresh_search(runner.kind, runner.workers, sizes["work"], start=start,
                              deadline=deadline, **{k: sizes[k] for k in _SEARCH_KEYS})
        largest = result["search"]["largest"]
        context.progress(f"{runner.label}: {largest} blocks "
                         f"({len(result['records'])} trials)")
        results.append(result)
    return results


def search_start(parameters: Callable[[int], int], largest: int, factor: float) -> int:
    """The fewest blocks whose model has at least ``factor`` times the parameters of the
    model of ``largest`` blocks (at least 1).

    Example:
        >>> search_start(lambda n: 1000 + 100 * n, largest=10, factor=1.8)  # 3600 parameters
        26
    """
    goal = factor * parameters(max(largest, 0))
    start = max(1, math.ceil(largest * factor))
    while parameters(start) < goal:
        start += 1
    while start > 1 and parameters(start - 1) >= goal:
        start -= 1
    return start


def _quick_searches(context: BenchContext, sizes: dict[str, Any]) -> list[dict[str, Any]]:
    """The searches in one job per process count (the 1-process runners share one), the
    jobs at once: no spawn per trial. Runners of more than ``max_workers`` processes are
    left out (their processes' start-up alone would take the quick run's time)."""
    runners = [r for r in RUNNERS if r.workers <= sizes["max_workers"]]
    groups: dict[int, list[Runner]] = {}
    for runner in runners:
        groups.setdefault(runner.workers, []).append(runner)
    context.progress(f"{len(runners)} searches in {len(groups)} jobs "
                     f"(cap {sizes['cap_mib']:.0f} MiB per worker)")

    def job(workers: int) -> list[dict[str, Any]]:
        kinds = [r.kind for r in groups[workers]]
        starts = [start for r, start in zip(RUNNERS, sizes["starts"]) if r.workers == workers]
        result: list[dict[str, Any]] = run_job(
            search_worker, kinds, sizes["work"], sizes["cap_mib"], starts, sizes["tolerance"],
            sizes["limit"], world_size=workers, threads=1, timeout=sizes["budget_s"])[0]
        return result

    # run_job sets OMP_NUM_THREADS around each spawn; jobs started at once could leave
    # it set here, so this process's own value is put back after them
    saved = os.environ.get("OMP_NUM_THREADS")
    try:
        with ThreadPoolExecutor(max_workers=len(groups)) as pool:
            done = dict(zip(groups, pool.map(job, groups)))
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    order = {workers: iter(results) for workers, results in done.items()}
    skipped = {"search": {"largest": 0, "first_too_large": None, "trials": [],
                          "stopped": "full run only"}, "records": []}
    return [next(order[r.workers]) if r.workers in order else {"kind": r.kind, **skipped}
            for r in RUNNERS]


def _per_block(records: list[dict[str, Any]], stages: int) -> float | None:
    """MiB per block on a worker: the least-squares slope of the measured peaks (the
    largest worker's) over the blocks per worker (the blocks over the ``stages``)."""
    points = [(r["depth"], max(r["peak_mib"])) for r in records if r.get("peak_mib")]
    if len({d for d, _ in points}) < 2:
        return None
    n = len(points)
    mean_d = sum(d for d, _ in points) / n
    mean_p = sum(p for _, p in points) / n
    num = sum((d - mean_d) * (p - mean_p) for d, p in points)
    den = sum((d - mean_d) ** 2 for d, _ in points)
    return float(num / den) * stages


def paper_rows() -> list[list[Any]]:
    """The paper's rows: configuration, Transformer-L and AmoebaNet-D parameters, and
    each one's ratio to its naive-1.

    Example:
        >>> paper_rows()[1]
        ['pipeline-1', '785.8M', '2.78x', '318M', '3.88x']
    """
    base_t, base_a = PAPER["naive-1"]
    return [[name, _params(t), f"{t / base_t:.2f}x", _params(a), f"{a / base_a:.2f}x"]
            for name, (t, a) in PAPER.items()]


def _params(n: float) -> str:
    """``n`` parameters as the paper writes them: 282.2M, 3.0B."""
    if n >= 1e9:
        text = f"{n / 1e9:.3g}"
        return f"{text}{'' if '.' in text else '.0'}B"
    return f"{n / 1e6:.4g}M"


def _ratio(value: float | None, base: float | None) -> str:
    """``value / base`` as ``1.23x``; ``-`` where either is missing (0 or less)."""
    return f"{value / base:.2f}x" if value and base and value > 0 and base > 0 else "-"


def _tables(found: list[dict[str, Any]], sizes: dict[str, Any], params: list[int], *,
            method: str, same_size: dict[str, Any] | None) -> list[Table]:
    work: Workload = sizes["work"]
    naive = params[0]
    gpipe = params[1]
    base_t, base_a = PAPER["naive-1"]
    rows: list[list[Any]] = []
    for runner, result, n in zip(RUNNERS, found, params):
        search = result["search"]
        paper = PAPER.get(runner.paper_row or "")
        fitting = [r for r in result["records"] if r["fits"] and r["depth"] == search["largest"]]
        peak = max(fitting[0]["peak_mib"]) if fitting else None
        per_block = _per_block(result["records"], runner.stages)
        blocks = f"{search['largest']}" + (f" (search stopped: {search['stopped']})"
                                           if search["stopped"] else "")
        if not search["trials"]:
            blocks = f"not run ({search['stopped']})"
        rows.append([runner.label, runner.workers, runner.checkpoint, blocks, _params(n) if n > 0 else "-",
                     _ratio(n, naive), peak, None if per_block is None else round(per_block, 2),
                     _params(paper[0]) if paper else "-",
                     _ratio(paper[0], base_t) if paper else "-",
                     _params(paper[1]) if paper else "-",
                     _ratio(paper[1], base_a) if paper else "-"])
    weights_mib = 16 * (work.parameters(2) - work.parameters(1)) / float(1 << 20)
    main = Table(
        key="sizes",
        title="GPipe Table 1: the largest GPT that trains under a memory cap per worker",
        columns=["configuration", "workers", "checkpoint", "blocks", "parameters", "x naive-1",
                 "peak MiB per worker", "MiB per block on a worker", "paper Transformer-L",
                 "paper x naive-1", "paper AmoebaNet-D", "paper x naive-1 (AmoebaNet)"],
        rows=rows,
        anchor=("plain PyTorch (naive-1: the nn.Sequential of the same layers, every "
                "activation kept) measured in the same run; the paper's figures are "
                "Huang et al. 2019 (arXiv:1811.06965), Table 1: Transformer-L on Cloud "
                "TPUv3 (16 GB per core), AmoebaNet-D on Cloud TPUv2 (8 GB per core)"),
        notes=(f"GPT of width {work.width} ({work.heads} heads), batch {work.batch} x "
               f"{work.context} tokens, AdamW; pipeline rows re-materialize over "
               f"{work.microbatches} micro-batches (FSDP: half a replica), Pipeline with the "
               f"gpipe schedule: pipeline-1 as GPipe's single partition does (checkpoint "
               f"'always': a micro-batch keeps its stage's input, a backward rebuilds the "
               f"stage), the rows of K >= 2 layer by layer (checkpoint 'per_layer': a "
               f"micro-batch keeps its layers' inputs, a backward rebuilds one layer); one "
               f"thread per worker process. A configuration fits if "
               f"two training steps keep every worker's peak resident memory at most "
               f"{sizes['cap_mib']:.0f} MiB above its start (taken after the same runner "
               f"trained a model of K blocks, so torch's code and thread pools are not "
               f"counted; glibc's mmap threshold fixed at 64 KiB, so that the resident set "
               f"follows the live tensors rather than what the C heap kept after a free); the "
               f"search stops when its bracket is narrower than "
               f"{sizes['tolerance']:.0%} of the size found. The weights, gradients and AdamW "
               f"state of one block take {weights_mib:.1f} MiB; the rest of naive-1's MiB per "
               f"block is activations, which dominate it as in the paper's AmoebaNet-D row "
               f"(6.26 GB of activations beside 1.05 GB of parameters), so that "
               f"re-materialization pays. Trials: {method}. The CPU's figures are not the "
               f"TPU's: a TPU's memory holds no code, and the paper grows AmoebaNet in width "
               f"as well."),
    )
    return [main, _checks(params, gpipe, _buffers_note(same_size, weights_mib / 4))]


def _buffers_note(same_size: dict[str, Any] | None, param_mib: float) -> str:
    """What a Pipeline worker holds beyond GPipe's single partition: both single-worker
    runners measured at one size (``same_size``: its ``depth`` and each runner's
    ``peaks_mib``), the medians' difference in buffers of one block's parameters
    (``param_mib``) per block.

    Example:
        >>> same = {"depth": 10, "peaks_mib": {"gpipe": [40.0, 41.0, 42.0],
        ...                                    "pipeline": [44.0, 42.0, 43.0]}}
        >>> print(_buffers_note(same, 0.5).split("; ")[0].split("(")[-1])
        +0.40 parameter-sized buffers per block
    """
    if same_size is None:
        return "The two single-worker rows were not measured at one size (full run only). "
    peaks = same_size["peaks_mib"]
    gpipe, pipeline = peaks.get("gpipe") or [], peaks.get("pipeline") or []
    if not gpipe or not pipeline:
        return "The two single-worker rows could not both be measured at one size. "
    depth = same_size["depth"]
    g, p = statistics.median(gpipe), statistics.median(pipeline)
    spread = max(max(v) - min(v) for v in (gpipe, pipeline))
    return (f"At one size, {depth} blocks ({min(len(gpipe), len(pipeline))} trials each in "
            f"fresh processes, taking turns, medians), a Pipeline worker peaks at {p:.1f} MiB "
            f"against {g:.1f} for GPipe's single partition "
            f"({(p - g) / depth / param_mib:+.2f} parameter-sized buffers per block; each "
            f"runner's trials within {spread:.1f} MiB). ")


def _checks(params: list[int], gpipe: int, buffers: str) -> Table:
    naive, pipe1, pipe2, pipe4, pipe8, fsdp = params[0], *params[2:7]
    t1, t2, t4 = PAPER["pipeline-1"][0], PAPER["pipeline-2"][0], PAPER["pipeline-4"][0]
    t8 = PAPER["pipeline-8"][0]
    lines = [
        ["re-materialization alone: pipeline-1 (GPipe) / naive-1", _ratio(gpipe, naive),
         ">= 2x", f"{t1 / PAPER['naive-1'][0]:.2f}x",
         _verdict(gpipe, naive, 2.0)],
        ["K = 2 over K = 1, both Pipeline", _ratio(pipe2, pipe1), "-", f"{t2 / t1:.2f}x", "-"],
        ["K = 4 over K = 1, both Pipeline", _ratio(pipe4, pipe1), ">= 3.6x",
         f"{t4 / t1:.2f}x", _verdict(pipe4, pipe1, 3.6)],
        ["K = 4 (Pipeline) over pipeline-1 (GPipe)", _ratio(pipe4, gpipe), ">= 3.6x",
         f"{t4 / t1:.2f}x", _verdict(pipe4, gpipe, 3.6)],
        ["K = 8 over K = 1, both Pipeline", _ratio(pipe8, pipe1), "-", f"{t8 / t1:.2f}x", "-"],
        ["K = 4 x FSDP 2 over K = 4, both Pipeline", _ratio(fsdp, pipe4), ">= 1.8x", "-",
         _verdict(fsdp, pipe4, 1.8)],
    ]
    return Table(key="shape", title="GPipe Table 1: does the paper's shape hold?",
                 columns=["check", "pipetrain", "goal", "paper (Transformer-L)", "met"],
                 rows=lines,
                 anchor="the ratios of the sizes table; the paper's from Huang et al. 2019, "
                        "Table 1",
                 notes=("Parameters grow a little slower than blocks (the embedding and head "
                        f"are fixed), so the ratios of parameters are slightly below those of "
                        f"blocks. {buffers}K = 4 is compared with both single-worker rows: "
                        "with Pipeline's own K = 1 the growth is the pipelining's, with "
                        "GPipe's it also carries what a Pipeline worker holds beyond it. "
                        "K = 4 x FSDP 2 runs the 4 stages on 8 workers, each stage sharded "
                        "over 2 by FSDP2 (parameters gathered for each forward and "
                        "backward, gradients reduce-scattered after each backward), each "
                        "replica taking half the micro-batches of the same size: every "
                        "parameter, gradient and optimizer state a worker keeps is halved, "
                        "the activations of a micro-batch are not."))


def _verdict(value: int, base: int, goal: float) -> str:
    if value < 0 or base < 0:
        return "not run (full run only)"
    if not value or not base:
        return "no (a search found nothing)"
    return "yes" if value / base >= goal else f"no ({value / base:.2f}x)"


def run(context: BenchContext) -> BenchResult:
    """Search every runner's largest GPT under the cap; the tables and every trial.

    Example::

        result = run(BenchContext(quick=True, out=Path("bench-out")))
        print(result.tables[1].markdown())
    """
    sizes = SIZES["quick" if context.quick else "full"]
    began = time.monotonic()
    with temporary_environment(EXACT_MALLOC):  # read by each trial process's allocator
        found = (_quick_searches if context.quick else _full_searches)(context, sizes)
        same_size = None if context.quick else _same_size(context, found, sizes)
    work: Workload = sizes["work"]
    params = [work.parameters(r["search"]["largest"]) if r["search"]["largest"]
              else (0 if r["search"]["trials"] else -1) for r in found]
    method = ("fresh processes each, ended by a watchdog past the cap" if not context.quick
              else "one job per process count (quick run), what earlier trials left "
                   "resident counted against later ones")
    data = {"workload": dataclasses.asdict(work), "cap_mib": sizes["cap_mib"],
            "tolerance": sizes["tolerance"], "method": method,
            "runners": [{**dataclasses.asdict(r), "parameters": n if n >= 0 else None, **f}
                        for r, n, f in zip(RUNNERS, params, found)],
            "paper": {k: {"transformer": t, "amoebanet": a} for k, (t, a) in PAPER.items()},
            "same_size": same_size, "seconds": round(time.monotonic() - began, 1)}
    return BenchResult(tables=_tables(found, sizes, params, method=method, same_size=same_size),
                       data=data)


def _same_size(context: BenchContext, found: list[dict[str, Any]],
               sizes: dict[str, Any]) -> dict[str, Any] | None:
    """GPipe's single partition and Pipeline's K = 1 at one size, the smaller of the two
    found (``None``: a search found nothing)."""
    depth = min(found[1]["search"]["largest"], found[2]["search"]["largest"])
    if depth < 1:
        return None
    context.progress(f"GPipe and Pipeline (K = 1) at {depth} blocks, "
                     f"{sizes['same_size_repeats']} trials each")
    peaks = same_size_peaks(("gpipe", "pipeline"), depth, sizes["work"],
                            repeats=sizes["same_size_repeats"],
                            timeout=sizes["trial_timeout_s"])
    return {"depth": depth, "peaks_mib": peaks}


def draw(tables: list[Table], data: dict[str, Any], out: Path) -> list[str]:
    """The largest model per configuration over naive-1's, pipetrain's GPT beside the
    paper's Transformer-L and AmoebaNet-D: one PNG.

    Example::

        draw(tables, data, Path("results"))  # ['gpipe_table1_sizes.png']
    """
    return bars(out / "gpipe_table1_sizes.png", find_table(tables, "sizes"), "configuration",
                {"pipetrain (GPT)": "x naive-1", "paper (Transformer-L)": "paper x naive-1",
                 "paper (AmoebaNet-D)": "paper x naive-1 (AmoebaNet)"},
                title="GPipe Table 1: the largest model per configuration, over naive-1's",
                ylabel="x naive-1", reference=1.0)


CASE = Case(name="gpipe_table1",
            title="GPipe Table 1: largest GPT under a memory cap, naive vs re-materialization "
                  "vs K workers",
            run=run, draw=draw, quick_seconds=20, full_seconds=1130)

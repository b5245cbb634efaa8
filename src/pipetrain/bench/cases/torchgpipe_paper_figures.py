"""The torchgpipe paper's published benchmark figures (Kim et al., 2020), as tables.

The figures are torchgpipe's own benchmarks of AmoebaNet-D and U-Net, reported in the
paper's experiments and published with the library (``docs/benchmarks.rst`` and
``benchmarks/*/README.md`` of kakaobrain/torchgpipe, v0.0.5 on 8 Tesla P40 GPUs,
PyTorch 1.3); the AmoebaNet-D tables repeat GPipe's (Huang et al., 2019, Tables 1 and 2,
TPUs) beside them. Speed-ups are computed from the published throughputs.

Example:
    >>> [t.key for t in paper_tables()]
    ['paper_amoebanet_speed', 'paper_unet_speed', 'paper_amoebanet_memory', 'paper_unet_memory']
"""

from __future__ import annotations

from pipetrain.bench.case import Table

__all__ = [
    "AMOEBANET_MEMORY",
    "AMOEBANET_SPEED",
    "SOURCE",
    "UNET_MEMORY",
    "UNET_SPEED",
    "paper_checkpoint",
    "paper_tables",
]

SOURCE = ("Kim et al. 2020 (torchgpipe, arXiv 2004.09910), §4 benchmarks as published in "
          "kakaobrain/torchgpipe docs/benchmarks.rst and benchmarks/*/README.md "
          "(torchgpipe 0.0.5, 8 Tesla P40 GPUs)")

AMOEBANET_SPEED: list[tuple[int, int, float, float]] = [
    # (partitions n, micro-batches m, torchgpipe samples/s, Huang et al.'s speed-up)
    (2, 1, 26.733, 1.0), (2, 4, 41.133, 1.07), (2, 32, 47.386, 1.21),
    (4, 1, 26.827, 1.13), (4, 4, 44.543, 1.26), (4, 32, 72.412, 1.84),
    (8, 1, 24.918, 1.38), (8, 4, 70.065, 1.72), (8, 32, 132.413, 3.48),
]
"""AmoebaNet-D (18, 256) speed; speed-ups are over n=2, m=1 (GPipe's Table 2 setting)."""

UNET_SPEED: list[tuple[str, int, int, int, float]] = [
    # (experiment, partitions (0: plain model), micro-batches, batch, samples/s)
    ("baseline", 0, 1, 40, 28.500), ("pipeline-1", 1, 2, 80, 24.456),
    ("pipeline-2", 2, 32, 512, 35.502), ("pipeline-4", 4, 16, 512, 67.042),
    ("pipeline-8", 8, 40, 640, 88.497),
]
"""U-Net (5, 64) speed at 192x192; speed-ups are over the baseline (no pipeline)."""

AMOEBANET_MEMORY: list[tuple[str, str, str, str, str, str, str, str]] = [
    # (experiment, (L, D), torchgpipe: parameters, model memory, peak activation memory,
    #  Huang et al.: parameters, model memory, peak activation memory)
    ("baseline", "(18, 208)", "81.5M", "0.91 GiB", "out of memory", "82M", "1.05 GB",
     "6.26 GB"),
    ("pipeline-1", "(18, 416)", "319.0M", "3.57 GiB", "0.91 GiB", "318M", "3.8 GB", "3.46 GB"),
    ("pipeline-2", "(18, 544)", "542.7M", "6.07 GiB", "3.39 GiB", "542M", "6.45 GB", "8.11 GB"),
    ("pipeline-4", "(36, 544)", "1.06B", "11.80 GiB", "6.91 GiB", "1.05B", "12.53 GB",
     "15.21 GB"),
    ("pipeline-8", "(72, 512)", "1.84B", "20.62 GiB", "10.83 GiB", "1.8B", "24.62 GB",
     "26.24 GB"),
]
"""AmoebaNet-D (L, D): the largest model each setting trains (GPipe's Table 1 setting)."""

UNET_MEMORY: list[tuple[str, str, str, str]] = [
    # (experiment, (B, C), parameters, memory usage)
    ("baseline", "(6, 72)", "362.2M", "20.3 GiB"),
    ("pipeline-1", "(11, 128)", "2.21B", "20.5 GiB"),
    ("pipeline-2", "(24, 128)", "4.99B", "43.4 GiB"),
    ("pipeline-4", "(24, 160)", "7.80B", "79.1 GiB"),
    ("pipeline-8", "(48, 160)", "15.82B", "154.1 GiB"),
]
"""U-Net (B, C): the largest model each setting trains."""


def paper_checkpoint(num_microbatches: int) -> str:
    """The checkpoint mode of the paper's AmoebaNet-D speed run with ``num_microbatches``
    (``benchmarks/amoebanetd-speed``: ``always`` for one micro-batch, else
    ``except_last``).

    Example:
        >>> paper_checkpoint(1), paper_checkpoint(4)
        ('always', 'except_last')
    """
    return "always" if num_microbatches == 1 else "except_last"


def paper_tables() -> list[Table]:
    """The four published tables, as the paper (and torchgpipe's docs) give them."""
    base = AMOEBANET_SPEED[0][2]
    amoebanet_speed = Table(
        key="paper_amoebanet_speed",
        title="Paper: AmoebaNet-D (18, 256) speed, 224x224 images",
        columns=["partitions n", "micro-batches m", "torchgpipe samples/s",
                 "torchgpipe speed-up", "Huang et al. speed-up"],
        rows=[[n, m, f"{rate:.3f}", f"{rate / base:.3f}x", f"{huang:.2f}x"]
              for n, m, rate, huang in AMOEBANET_SPEED],
        anchor=SOURCE + "; Huang et al. 2019 (GPipe) Table 2, on TPUs",
        notes="Speed-ups over n=2, m=1; batch sizes were tuned per row (96 to 1280), "
              "checkpoint 'always' for m=1 and 'except_last' otherwise.")
    unet_base = UNET_SPEED[0][4]
    unet_speed = Table(
        key="paper_unet_speed",
        title="Paper: U-Net (5, 64) speed, 192x192 images",
        columns=["experiment", "partitions", "micro-batches", "batch", "samples/s",
                 "speed-up"],
        rows=[[name, n or "-", m, batch, f"{rate:.3f}", f"{rate / unet_base:.3f}x"]
              for name, n, m, batch, rate in UNET_SPEED],
        anchor=SOURCE,
        notes="Speed-ups over the baseline (the model on one GPU, no pipeline, no "
              "checkpointing); pipelines use torchgpipe's default checkpoint mode "
              "('except_last').")
    amoebanet_memory = Table(
        key="paper_amoebanet_memory",
        title="Paper: AmoebaNet-D (L, D) memory, the largest model per setting",
        columns=["experiment", "(L, D)", "torchgpipe parameters", "model memory",
                 "peak activation memory", "Huang et al. parameters", "model memory",
                 "peak activation memory"],
        rows=[list(row) for row in AMOEBANET_MEMORY],
        anchor=SOURCE + "; Huang et al. 2019 (GPipe) Table 1",
        notes="torchgpipe's figures on P40s (24 GB each), GPipe's on TPUs; 'baseline' is "
              "the model without pipeline or re-materialization.")
    unet_memory = Table(
        key="paper_unet_memory",
        title="Paper: U-Net (B, C) memory, the largest model per setting",
        columns=["experiment", "(B, C)", "parameters", "memory usage"],
        rows=[list(row) for row in UNET_MEMORY],
        anchor=SOURCE,
        notes="B and C scale the layers and filters; memory usage over all the GPUs.")
    return [amoebanet_speed, unet_speed, amoebanet_memory, unet_memory]

"""PipeDream's published figures: its clusters, its per-model speedups over data parallelism,
its communication claim, and where each figure is from.

Sources:

- SOSP: Narayanan, Harlap, Phanishayee, Seshadri, Devanur, Ganger, Gibbons, Zaharia,
  "PipeDream: Generalized Pipeline Parallelism for DNN Training", SOSP 2019. Abstract:
  "up to 5.3x faster than commonly used intra-batch parallelism techniques". Table 1:
  per-model speedups over data parallelism (DP), per epoch and to target accuracy (TTA);
  section 5.1: the clusters.
- ARXIV: Harlap et al., "PipeDream: Fast and Efficient Pipeline Parallel DNN Training",
  arXiv:1806.03377 (2018), the paper's earlier version. Abstract: "PipeDream reduces
  communication by up to 95% for large DNNs relative to data-parallel training" (the
  SOSP abstract says only that pipelining reduces communication "when possible").
- REPO: the authors' repository, msr-fiddle/pipedream, commit 7db6a1c (its
  ``EXPERIMENTS.md`` and ``runtime/*/driver_configs``: the configurations run for the
  SOSP paper, on servers of 4 GPUs).

``verified`` says whether a figure was checked against text of its source for this case
(the abstracts, the repository) or is transcribed from the paper's Table 1 without that
check: for those, the configurations agree with the authors' repository and the largest
speedup (5.28x) with the abstract's "up to 5.3x".

Example:
    >>> [row.speedup_epoch for row in TABLE1 if row.model == "VGG-16"]
    [5.28, 2.98]
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CLAIMS", "CLUSTERS", "MINIBATCH", "SOURCES", "TABLE1", "Claim", "Cluster", "PaperRow"]

SOURCES = {
    "SOSP": "Narayanan et al., PipeDream: Generalized Pipeline Parallelism for DNN "
            "Training, SOSP 2019",
    "ARXIV": "Harlap et al., PipeDream: Fast and Efficient Pipeline Parallel DNN "
             "Training, arXiv:1806.03377 (2018)",
    "REPO": "github.com/msr-fiddle/pipedream @ 7db6a1c, EXPERIMENTS.md and "
            "runtime/*/driver_configs",
}


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """One of the paper's clusters, as a two-level topology (GPUs in servers)."""

    name: str
    gpus_per_server: int
    inside: str
    inside_bandwidth: float
    """Bytes per second between the GPUs of a server assumed for planning (the paper
    names the interconnect, not a figure: see ``inside``)."""
    between_gbps: float
    """The servers' Ethernet, gigabits per second (the paper's figure)."""
    source: str

    @property
    def between_bandwidth(self) -> float:
        """Bytes per second between servers."""
        return self.between_gbps * 1e9 / 8


CLUSTERS = {
    "A": Cluster(name="Cluster-A", gpus_per_server=4,
                 inside="PCIe (1e10 B/s assumed: PCIe 3.0 x16, 16 GB/s nominal, shared)",
                 inside_bandwidth=1e10, between_gbps=10.0,
                 source="SOSP section 5.1: servers of 4 V100s, PCIe inside, 10 Gbps Ethernet"),
    "B": Cluster(name="Cluster-B", gpus_per_server=8,
                 inside="NVLink (2.5e10 B/s assumed: one NVLink 2.0 link, 25 GB/s each way)",
                 inside_bandwidth=2.5e10, between_gbps=25.0,
                 source="SOSP section 5.1: AWS p3.16xlarge, 8 V100s, NVLink inside, 25 Gbps Ethernet"),
}


@dataclass(frozen=True, kw_only=True)
class PaperRow:
    """One row of the paper's Table 1 (speedup of PipeDream over DP)."""

    model: str
    profile: str | None
    """The published profile of this model (a folder name), None when none is shipped."""
    num_servers: int
    cluster: str
    config: str
    """PipeDream's configuration: replicas per stage ("15-1"), "Straight" (one worker
    per stage) or the worker count of pure data parallelism ("16")."""
    speedup_epoch: float
    speedup_tta: float | None
    """Time-to-accuracy speedup (None: the paper gives none, synthetic data)."""
    verified: bool = False
    repo_config: str = ""
    """The configuration the authors' repository runs for it, where it has one."""

    @property
    def num_workers(self) -> int:
        return self.num_servers * CLUSTERS[self.cluster].gpus_per_server

    @property
    def shape(self) -> str:
        return f"{self.num_servers}x{CLUSTERS[self.cluster].gpus_per_server} ({self.cluster})"


def _row(model: str, profile: str | None, servers: int, cluster: str, config: str,
         epoch: float, tta: float | None, repo: str = "") -> PaperRow:
    return PaperRow(model=model, profile=profile, num_servers=servers, cluster=cluster,
                    config=config, speedup_epoch=epoch, speedup_tta=tta, repo_config=repo)


TABLE1 = (
    _row("VGG-16", "vgg16", 4, "A", "15-1", 5.28, 5.28,
         "15-1 (vgg16/gpus=16/hybrid_conf.json, 4 servers of 4)"),
    _row("VGG-16", "vgg16", 2, "B", "15-1", 2.98, 2.46),
    _row("ResNet-50", "resnet50", 4, "A", "16", 1.0, 1.0, "16 (resnet50_16dp.yml: DP only)"),
    _row("ResNet-50", "resnet50", 2, "B", "16", 1.0, 1.0),
    _row("AlexNet", "alexnet", 4, "A", "15-1", 4.92, None,
         "15-1 (alexnet/gpus=16/hybrid_conf.json, 4 servers of 4)"),
    _row("AlexNet", "alexnet", 2, "B", "15-1", 2.04, None),
    _row("GNMT-16", None, 1, "A", "Straight", 1.46, 2.2),
    _row("GNMT-16", None, 4, "A", "Straight", 2.34, 2.92),
    _row("GNMT-16", None, 2, "B", "Straight", 3.14, 3.14),
    _row("GNMT-8", "gnmt", 1, "A", "Straight", 1.5, 1.5),
    _row("GNMT-8", "gnmt", 3, "A", "Straight", 2.95, 2.95,
         "straight (gnmt/gpus=12/mp_conf.json, 3 servers of 4)"),
    _row("GNMT-8", "gnmt", 2, "B", "16", 1.0, 1.0),
)
"""SOSP Table 1, the rows of the models with published profiles (GNMT-16's profile has
too many cuts to plan; its rows are kept for reference). AWD LM (4.25x on 1x4, A) and
S2VT (3.01x on 4x1, Cluster-C) have no published profile."""


MINIBATCH = {"vgg16": 64, "resnet50": 128, "alexnet": 256, "gnmt": 64}
"""The minibatch per GPU of the paper's runs (REPO: ``batch_size`` of the driver configs
``vgg16_16dp.yml``, ``resnet50_16dp.yml``, ``alexnet_16dp.yml``, ``gnmt_12dp.yml``)."""


@dataclass(frozen=True, kw_only=True)
class Claim:
    """A headline claim, quoted, and where it is from."""

    name: str
    text: str
    value: float
    source: str
    verified: bool


CLAIMS = {
    "communication": Claim(
        name="communication", value=0.95, source="ARXIV abstract", verified=True,
        text="PipeDream reduces communication by up to 95% for large DNNs relative to "
             "data-parallel training"),
    "speedup": Claim(
        name="speedup", value=5.3, source="SOSP abstract", verified=True,
        text="trains models to high accuracy up to 5.3x faster than commonly used "
             "intra-batch parallelism techniques"),
}

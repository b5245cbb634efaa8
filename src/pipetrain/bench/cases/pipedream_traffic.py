"""Bytes a plan exchanges per sample, against data parallelism's all-reduce; and where
PipeDream's published profiles are found.

Per minibatch of the profile's ``batch_size`` samples entering the pipeline:

- every cut between two stages carries the activations of the nodes before it that
  have consumers after it, forward, and their gradients back: ``2 x boundary`` bytes;
- a stage of ``r`` replicas all-reduces its weights ``W`` once per round of ``r``
  minibatches (one each, 1F1B-RR); a ring all-reduce sends ``2 (r - 1) / r x W`` bytes
  per worker, ``2 (r - 1) x W`` in all, so ``2 (r - 1) / r x W`` per minibatch;
- data parallelism on ``n`` workers is the one stage of all the weights on ``n`` replicas.

On GPUs in servers (a plan of several topology levels), :func:`between_servers` counts
the part that crosses servers: the cuts between stages of different outer stages, and
each stage's all-reduce done hierarchically (summed inside each server, then a ring over
its ``s`` servers: ``2 (s - 1) x W`` per round of its ``r`` replicas' minibatches).

Bytes sent (each is received once); dividing by the batch size gives bytes per sample.

Example:
    >>> from pipetrain.plan import LayerProfile, Profile
    >>> layers = tuple(LayerProfile(name=str(k), forward_s=1.0, backward_s=1.0,
    ...                             output_bytes=10, parameter_bytes=1000) for k in range(4))
    >>> traffic = plan_traffic(Profile(layers=layers, batch_size=2), [(("0", "1"), 1), (("2", "3"), 1)])
    >>> traffic.activation_bytes, traffic.allreduce_bytes, traffic.per_sample
    (20.0, 0.0, 10.0)
    >>> data_parallel_bytes(Profile(layers=layers, batch_size=2), num_workers=2)
    4000.0
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipetrain.plan import Plan, Profile, load_pipedream_graph

__all__ = [
    "PROFILE_BATCH_SIZES",
    "PROFILE_ENV",
    "Traffic",
    "at_minibatch",
    "between_servers",
    "data_parallel_between_servers",
    "data_parallel_bytes",
    "find_profiles",
    "load_profile",
    "plan_traffic",
    "shown_folder",
]

PROFILE_ENV = "PIPETRAIN_PIPEDREAM_PROFILES"
"""Environment variable naming a folder of PipeDream profiles (``<model>/graph.txt``)."""

PROFILE_BATCH_SIZES = {
    "vgg16": (128, "its Input node's 77,070,336 bytes = 128 x 3x224x224 float32"),
    "resnet50": (128, "its Input node's 77,070,336 bytes = 128 x 3x224x224 float32"),
    "alexnet": (256, "its Input node's 154,140,672 bytes = 256 x 3x224x224 float32"),
    "gnmt": (32, "its LSTMs' state, 131,072 bytes = 1 x 32 x 1024 float32, and its "
                 "logits, 194,437,120 bytes = 47 x 32 x 32320 float32"),
}
"""The minibatch each published profile was taken at (the files do not say; read from
their sizes), with how it was read."""


_PACKAGE_DATA = Path(__file__).resolve().parents[1] / "data" / "pipedream"
"""Profiles shipped with the package (none are, today)."""


def _checkout() -> Path | None:
    """The source checkout this module runs from (``src/pipetrain/bench/cases/..``), if any."""
    here = Path(__file__).resolve()
    return here.parents[4] if len(here.parents) > 5 else None


def _candidates() -> list[Path]:
    found = []
    if os.environ.get(PROFILE_ENV):
        found.append(Path(os.environ[PROFILE_ENV]))
    found.append(_PACKAGE_DATA)
    checkout = _checkout()
    if checkout is not None:  # a source checkout: the shared folder beside it
        found.append(checkout.parent / "shared" / "pipedream")
    return found


def shown_folder(folder: Path) -> str:
    """Where profiles were found, as records show it, without this machine's paths:
    ``$PIPETRAIN_PIPEDREAM_PROFILES``, the package's folder, or a path relative to the
    source checkout (``../shared/pipedream``).

    Example:
        >>> folder = find_profiles()
        >>> folder is None or shown_folder(folder) in ("../shared/pipedream",
        ...     "$PIPETRAIN_PIPEDREAM_PROFILES", "pipetrain/bench/data/pipedream")
        True
    """
    folder = folder.resolve()
    if os.environ.get(PROFILE_ENV) and Path(os.environ[PROFILE_ENV]).resolve() == folder:
        return f"${PROFILE_ENV}"
    if folder == _PACKAGE_DATA:
        return "pipetrain/bench/data/pipedream"
    checkout = _checkout()
    if checkout is not None:
        return os.path.relpath(folder, checkout)
    return folder.name


def find_profiles(names: Sequence[str] = tuple(PROFILE_BATCH_SIZES)) -> Path | None:
    """The first folder holding ``<name>/graph.txt`` for every name: ``$PIPETRAIN_PIPEDREAM_PROFILES``,
    the package's ``pipetrain/bench/data/pipedream``, or ``shared/pipedream`` beside a
    source checkout; None when none does.

    Example:
        >>> folder = find_profiles()
        >>> folder is None or (folder / "vgg16" / "graph.txt").is_file()
        True
    """
    for folder in _candidates():
        if all((folder / name / "graph.txt").is_file() for name in names):
            return folder
    return None


def load_profile(folder: Path, name: str) -> Profile:
    """PipeDream's profile ``name`` from ``folder``, with its minibatch size set.

    Example:
        >>> load_profile(Path("profiles"), "vgg16")  # doctest: +SKIP
    """
    if name not in PROFILE_BATCH_SIZES:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILE_BATCH_SIZES)}")
    return load_pipedream_graph(folder / name / "graph.txt",
                                batch_size=PROFILE_BATCH_SIZES[name][0])


@dataclass(frozen=True)
class Traffic:
    """Bytes sent per minibatch by a plan: activations and gradients across its cuts,
    and its replicated stages' all-reduces."""

    activation_bytes: float
    allreduce_bytes: float
    batch_size: int

    @property
    def total(self) -> float:
        return self.activation_bytes + self.allreduce_bytes

    @property
    def per_sample(self) -> float:
        return self.total / self.batch_size


def _owners(profile: Profile, stages: Sequence[Sequence[str | int]]) -> list[int]:
    index = {layer.name: k for k, layer in enumerate(profile.layers)}
    owner: dict[int, int] = {}
    for j, nodes in enumerate(stages):
        for node in nodes:
            k = index.get(str(node))
            if k is None or k in owner:
                raise ValueError(f"stage {j}: node {node!r} is unknown or in two stages")
            owner[k] = j
    if len(owner) != profile.num_layers:
        raise ValueError(f"the stages hold {len(owner)} of the profile's {profile.num_layers} nodes")
    return [owner[k] for k in range(profile.num_layers)]


def _crossing(profile: Profile, owner: Sequence[int], cut: int) -> float:
    """Bytes of the outputs of stages <= cut consumed by stages > cut."""
    successors = profile.successors()
    return float(sum(layer.output_bytes for k, layer in enumerate(profile.layers)
                     if owner[k] <= cut and any(owner[s] > cut for s in successors[k])))


def _weights(profile: Profile, owner: Sequence[int], stage: int) -> float:
    return float(sum(layer.parameter_bytes for k, layer in enumerate(profile.layers)
                     if owner[k] == stage))


def _ring_bytes(weights: float, replicas: int) -> float:
    return 2.0 * (replicas - 1) / replicas * weights


def plan_traffic(profile: Profile, stages: Sequence[tuple[Sequence[str | int], int]]) -> Traffic:
    """The bytes of a plan given as ``(node ids, replicas)`` per stage, in pipeline order
    (a :class:`~pipetrain.plan.Plan`'s ``(stage.nodes, stage.replicas)``).

    Raises:
        ValueError: the stages do not cover every node exactly once.
    """
    owner = _owners(profile, [nodes for nodes, _ in stages])
    activations = sum(2.0 * _crossing(profile, owner, cut) for cut in range(len(stages) - 1))
    allreduce = sum(_ring_bytes(_weights(profile, owner, j), replicas)
                    for j, (_, replicas) in enumerate(stages))
    return Traffic(activations, allreduce, profile.batch_size)


def between_servers(profile: Profile, plan: Plan) -> Traffic:
    """The part of a plan's bytes per minibatch that crosses servers (none for a plan on
    one level: one server). Data parallelism on ``S`` servers of ``G`` GPUs is the plan
    of one stage with ``replicas_per_level = (G, S)``: ``2 (S - 1) W / (S G)``.

    Example:
        >>> from pipetrain.plan import LayerProfile, PlanStage
        >>> layers = tuple(LayerProfile(name=str(k), forward_s=1.0, backward_s=1.0,
        ...                             output_bytes=10, parameter_bytes=1200) for k in range(2))
        >>> dp = Plan(stages=(PlanStage(nodes=(0, 1), replicas=8, replicas_per_level=(4, 2),
        ...                             outer_stage=(0,)),), cost_model="pipedream",
        ...           time_per_step=1.0, num_workers=8)
        >>> between_servers(Profile(layers=layers), dp).allreduce_bytes  # 2 x 1 x 2400 / 8
        600.0
    """
    owner = _owners(profile, [stage.nodes for stage in plan.stages])
    activations = sum(2.0 * _crossing(profile, owner, j) for j in range(plan.num_stages - 1)
                      if plan.stages[j].outer_stage != plan.stages[j + 1].outer_stage)
    allreduce = 0.0
    for j, stage in enumerate(plan.stages):
        servers = math.prod(stage.replicas_per_level[1:])
        allreduce += 2.0 * (servers - 1) * _weights(profile, owner, j) / stage.replicas
    return Traffic(activations, allreduce, profile.batch_size)


def data_parallel_bytes(profile: Profile, *, num_workers: int) -> float:
    """Bytes per minibatch of data parallelism on ``num_workers``: the ring all-reduce of
    every weight, ``2 (n - 1) / n x W``."""
    weights = float(sum(layer.parameter_bytes for layer in profile.layers))
    return _ring_bytes(weights, num_workers)


def data_parallel_between_servers(profile: Profile, *, num_servers: int, gpus_per_server: int) -> float:
    """Bytes per minibatch of data parallelism that cross servers (its all-reduce summed
    inside each server, then a ring over the servers): ``2 (S - 1) W / (S G)``.

    Example:
        >>> from pipetrain.plan import LayerProfile
        >>> one = Profile(layers=(LayerProfile(name="0", forward_s=1.0, backward_s=1.0,
        ...                                    parameter_bytes=1600),))
        >>> data_parallel_between_servers(one, num_servers=4, gpus_per_server=4)
        600.0
    """
    weights = float(sum(layer.parameter_bytes for layer in profile.layers))
    return 2.0 * (num_servers - 1) * weights / (num_servers * gpus_per_server)


def at_minibatch(profile: Profile, batch_size: int) -> Profile:
    """The profile scaled to another minibatch: times and activations in proportion,
    weights as they are (an approximation: a GPU is less busy on a smaller batch).

    Example:
        >>> from pipetrain.plan import LayerProfile
        >>> one = Profile(layers=(LayerProfile(name="0", forward_s=2.0, backward_s=4.0,
        ...                                    output_bytes=64, parameter_bytes=9),), batch_size=128)
        >>> half = at_minibatch(one, 64).layers[0]
        >>> half.forward_s, half.backward_s, half.output_bytes, half.parameter_bytes
        (1.0, 2.0, 32, 9)
    """
    k = batch_size / profile.batch_size
    layers = tuple(dataclasses.replace(layer, forward_s=layer.forward_s * k,
                                       backward_s=layer.backward_s * k,
                                       output_bytes=round(layer.output_bytes * k))
                   for layer in profile.layers)
    return dataclasses.replace(profile, layers=layers, batch_size=batch_size)

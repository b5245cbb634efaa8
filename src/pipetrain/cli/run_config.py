"""The resolved configuration of a ``pipetrain train`` run: every option, once, with its source.

A run's options come from five places, merged once (later ones win, each only for the
options it sets): the defaults, the run a ``--resume`` continues, ``--config FILE`` (TOML),
the command line, and then what the run's layout fixes: a schedule file (its stages,
micro-batches and stages per rank), ``--plan FILE`` (its stages, replicas per stage and
cut, and its schedule, micro-batches and checkpoint mode unless given), the schedule's
own defaults (stages per rank) and rules (an asynchronous schedule clips nothing and
applies every update), and, in the workers, ``--balance auto``'s planner. The result,
:class:`RunConfig`, is what everything downstream reads, the run's records included:
``config.json`` and ``metrics.json`` hold its options and where each came from, and the
trace and pictures are titled from it, so every record describes the run that happened.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "GPT_OPTIONS",
    "SOURCES",
    "RunConfig",
]

SOURCES = ("default", "resumed run", "config file", "command line", "schedule file", "plan",
           "schedule", "planner")
"""Where a value may come from, in the order they are applied."""
_GIVEN = ("config file", "command line")
GPT_OPTIONS = ("layers", "width", "heads", "dropout")
"""The options that shape the models pipetrain builds (a model file or folder has its own)."""
"""The sources by which the user gave a value for this invocation."""


@dataclass(kw_only=True)
class RunConfig:
    """Every option of a ``pipetrain train`` run as it runs, and where each came from.

    The field names are the options' (``--batch-size`` is ``batch_size``). ``virtual``
    is always resolved (the schedule's default filled in); ``stage_replicas`` is set by
    a plan whose stages have different replica counts; ``balance`` is ``None`` (even),
    ``"auto"`` or layers per stage (``"3,3"``).

    Example:
        >>> config = RunConfig()
        >>> config.set("command line", stages=4, microbatches=16)
        >>> config.stages, config.source("stages"), config.source("lr")
        (4, 'command line', 'default')
        >>> config.describe()
        '1f1b, 4 stages x 1 replica, 16 micro-batches'
    """

    # pipeline
    stages: int = 2
    replicas: int = 1
    microbatches: int = 8
    schedule: str = "1f1b"
    vertical_sync: bool = False
    fsdp: bool = False
    compile: bool = False
    fsdp_reshard: bool = False
    fsdp_reduce_each_microbatch: bool = False
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    virtual: int | None = None
    checkpoint: str = "never"
    offload: str | None = None
    balance: str | None = None
    plan: str | None = None
    stage_replicas: tuple[int, ...] | None = None
    # training
    steps: int = 1000
    batch_size: int = 32
    accumulate: int = 1
    lr: float = 1e-2
    warmup: int = 50
    lr_schedule: str = "cosine"
    min_lr: float | None = None
    optimizer: str = "adamw"
    weight_decay: float | None = None
    betas: tuple[float, float] = (0.9, 0.95)
    momentum: float = 0.9
    clip: float = 1.0
    seed: int = 0
    eval_every: int = 100
    save_every: int = 0
    keep_checkpoints: int = 2
    nonfinite: str = "error"
    precision: str = "fp32"
    # model
    model: str = "gpt"
    layers: int = 4
    width: int = 64
    heads: int = 4
    context: int = 128
    dropout: float = 0.0
    # data and output
    data: str | None = None
    out: str | None = None
    resume: str | None = None
    sample_bytes: int = 300
    log: str = "tensorboard"
    max_restarts: int = 0
    timeout: float = 300.0
    host_memory: str = "keep"
    config: str | None = None
    # provenance
    sources: dict[str, str] = field(default_factory=dict, repr=False)
    command_line: tuple[str, ...] = field(default=(), repr=False)

    # -- provenance ---------------------------------------------------------------------
    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The options (every field but the provenance)."""
        return tuple(f.name for f in fields(cls) if f.name not in ("sources", "command_line"))

    def set(self, source: str, **values: Any) -> None:
        """Set options from ``source`` (one of :data:`SOURCES`)."""
        assert source in SOURCES, source
        for name, value in values.items():
            if name not in self.option_names():
                raise KeyError(name)
            setattr(self, name, value)
            self.sources[name] = source

    def source(self, name: str) -> str:
        """Where option ``name`` came from (``"default"`` unless set)."""
        return self.sources.get(name, "default")

    def given(self, name: str) -> bool:
        """Whether the user gave option ``name`` for this invocation (on the command line
        or in the config file)."""
        return self.source(name) in _GIVEN

    # -- what the run is ----------------------------------------------------------------
    @property
    def folder(self) -> str:
        """The run folder (``out``, once the run has decided it)."""
        assert self.out is not None, "the run folder is decided before it is used"
        return self.out

    @property
    def stages_per_rank(self) -> int:
        """``virtual``, resolved (1 before resolution)."""
        return self.virtual or 1

    @property
    def num_workers(self) -> int:
        """The processes the run needs."""
        if self.stage_replicas is not None:
            return sum(self.stage_replicas) * self.tensor_parallel
        return self.stages * self.replicas * self.tensor_parallel

    @property
    def asynchronous(self) -> bool:
        """Whether the schedule is asynchronous (pipedream, 2bw)."""
        from pipetrain.schedule import ASYNC_SCHEDULES, canonical_name

        try:
            return canonical_name(self.schedule) in ASYNC_SCHEDULES
        except ValueError:
            return False

    def describe(self) -> str:
        """The layout in a few words, as titles show it.

        Example:
            >>> RunConfig(schedule="zb-h1", microbatches=1, stage_replicas=(2, 1)).describe()
            'zb-h1, 2 stages (replicas 2, 1), 1 micro-batch'
        """
        if self.stage_replicas is not None:
            layout = (f"{len(self.stage_replicas)} stages (replicas "
                      f"{', '.join(map(str, self.stage_replicas))})")
        else:
            layout = f"{self.stages} stage{'s' * (self.stages != 1)} x {self.replicas} replica{'s' * (self.replicas != 1)}"
        if self.fsdp:
            layout += " (FSDP)"
        if self.tensor_parallel > 1:
            layout += f" x {self.tensor_parallel} tensor-parallel"
            if self.sequence_parallel:
                layout += " (sequence-parallel)"
        if self.stages_per_rank > 1:
            layout += f", {self.stages_per_rank} per rank"
        text = (f"{self.schedule}, {layout}, {self.microbatches} "
                f"micro-batch{'es' * (self.microbatches != 1)}")
        return text + (f" x {self.accumulate} accumulated" if self.accumulate > 1 else "")

    @property
    def step_batch_size(self) -> int:
        """Sequences per optimizer step: ``--batch-size`` x ``--accumulate``."""
        return self.batch_size * self.accumulate

    # -- records --------------------------------------------------------------------------
    def recorded_names(self) -> tuple[str, ...]:
        """The options that apply to this run: the model's shape (``layers``, ``width``,
        ``heads``, ``dropout``) only for the models pipetrain sizes by them (its GPT,
        ``hf-gpt2``, ``hf-llama``), not for a model file or folder, which has its own."""
        from pipetrain.cli.user_models import is_user_model

        if not is_user_model(self.model):
            return self.option_names()
        return tuple(n for n in self.option_names() if n not in GPT_OPTIONS)

    def options(self) -> dict[str, Any]:
        """Every option that applies to this run by name, JSON-ready (what the run folder
        records as ``options``)."""
        values = {name: getattr(self, name) for name in self.recorded_names()}
        if values["stage_replicas"] is not None:
            values["stage_replicas"] = list(values["stage_replicas"])
        return values

    def record(self) -> dict[str, Any]:
        """The options, where each came from, and the command line as typed."""
        return {"options": self.options(),
                "sources": {name: self.source(name) for name in self.recorded_names()},
                "command_line": list(self.command_line)}

    # -- conversion -----------------------------------------------------------------------
    @classmethod
    def from_namespace(cls, args: argparse.Namespace, *, sources: Mapping[str, str],
                       command_line: Sequence[str] = ()) -> RunConfig:
        """The configuration of parsed (and resolved) options."""
        names = cls.option_names()
        values = {name: getattr(args, name) for name in names if hasattr(args, name)}
        config = cls(**values)
        config.sources = {name: source for name, source in sources.items() if name in names}
        config.command_line = tuple(command_line)
        return config

    def replace(self, source: str, **values: Any) -> RunConfig:
        """A copy with ``values`` set from ``source``."""
        copy = dataclasses.replace(self, sources=dict(self.sources))
        copy.set(source, **values)
        return copy

"""The action IR: what one pipeline rank does, one action at a time.

A schedule is, per rank, an ordered list of :class:`Action`. The same lists drive the
simulator, the single-process runtime (threads) and the multi-process runtime
(torch.distributed), so what is simulated is what runs.

Index legend, used everywhere in pipetrain:

- ``i``: micro-batch index (``microbatch``), ``0 <= i < num_microbatches``
- ``j``: stage index (``stage``), ``0 <= j < num_stages``; stage ``j`` holds a contiguous
  slice of layers, and stage ``j + 1`` consumes its output
- ``r``: rank (``rank``), a worker that executes one action list and holds one or more
  stages (several with interleaved / virtual stages)
- ``k``: clock tick (``clock``), used by the text grids

An action prints compactly as ``{stage}{op}{microbatch}`` with an optional weight version
suffix ``v{version}``: ``0F3`` (stage 0, forward of micro-batch 3), ``1B2`` (stage 1, full
backward of micro-batch 2), ``2I0`` / ``2W0`` (backward for inputs / for weights only),
``1SF3`` / ``2RF3`` (send / receive the activations of micro-batch 3 between stages 1 and
2), ``2SB3`` / ``1RB3`` (send / receive the gradients), ``0REDUCE`` (all-reduce stage 0's
gradients over its replicas; reduce-scatter them under FSDP), ``0UNSHARD`` / ``0RESHARD``
(FSDP: gather stage 0's sharded parameters over its replicas / free the gathered copy),
``0STEP`` (optimizer step of stage 0). :func:`parse_action` reads that form back.

Communication semantics: a send never blocks (it is posted and completes in the
background); a receive blocks until the matching send has been posted. Every send has
exactly one matching receive and vice versa.
"""

from __future__ import annotations

import enum
import re
from typing import NamedTuple

__all__ = [
    "COMMUNICATION_OPS",
    "COMPUTE_OPS",
    "Action",
    "Op",
    "format_actions",
    "parse_action",
    "parse_actions",
]


class Op(enum.Enum):
    """What an action does. The value is the code used in the compact form."""

    FORWARD = "F"
    """Run the stage's layers on one micro-batch."""
    BACKWARD = "B"
    """Full backward of one micro-batch: gradients for the stage's inputs and weights."""
    BACKWARD_INPUT = "I"
    """Backward for the stage's inputs only (zero-bubble "B"); needs a later ``W``."""
    BACKWARD_WEIGHT = "W"
    """Backward for the stage's weights only, after the micro-batch's ``I``."""
    SEND_FORWARD = "SF"
    """Send the stage's output activations of a micro-batch to stage ``j + 1``."""
    RECV_FORWARD = "RF"
    """Receive the stage's input activations of a micro-batch from stage ``j - 1``."""
    SEND_BACKWARD = "SB"
    """Send the gradients of the stage's inputs of a micro-batch to stage ``j - 1``."""
    RECV_BACKWARD = "RB"
    """Receive the gradients of the stage's outputs of a micro-batch from stage ``j + 1``."""
    REDUCE_GRAD = "REDUCE"
    """Start the all-reduce of the stage's gradients over its replica (and tie) groups
    (under FSDP: the reduce-scatter of the gradients its backwards accumulated)."""
    UNSHARD = "UNSHARD"
    """FSDP: start gathering the stage's sharded parameters over its replicas (an
    all-gather; the stage's next compute action waits for it)."""
    RESHARD = "RESHARD"
    """FSDP: free the stage's gathered parameters, keeping its shards (no communication)."""
    OPTIMIZER_STEP = "STEP"
    """Apply the stage's optimizer (and LR scheduler), then zero its gradients."""

    # Members are singletons compared by identity; the identity hash is much faster than
    # Enum's (a Python-level hash of the name), and ops are hashed in the validator's and
    # the simulator's inner loops.
    __hash__ = object.__hash__

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        """True for forward and backward work on a micro-batch."""
        return self in COMPUTE_OPS

    @property
    def is_communication(self) -> bool:
        """True for the point-to-point sends and receives between stages."""
        return self in COMMUNICATION_OPS

    @property
    def needs_microbatch(self) -> bool:
        """True where the action names a micro-batch (compute and communication)."""
        return self in COMPUTE_OPS or self in COMMUNICATION_OPS


COMPUTE_OPS: frozenset[Op] = frozenset(
    {Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT}
)
COMMUNICATION_OPS: frozenset[Op] = frozenset(
    {Op.SEND_FORWARD, Op.RECV_FORWARD, Op.SEND_BACKWARD, Op.RECV_BACKWARD}
)

_CODES = {op.value: op for op in Op}
_PATTERN = re.compile(r"^(\d+)([A-Z]+)(\d+)?(?:v(\d+))?$")


class Action(NamedTuple):
    """One step of a rank's action list.

    Example:
        >>> a = Action(1, Op.FORWARD, 3)
        >>> str(a)
        '1F3'
        >>> parse_action("1F3") == a
        True
    """

    stage: int
    """Stage index ``j`` the action works on."""
    op: Op
    """What the action does."""
    microbatch: int | None = None
    """Micro-batch index ``i``; ``None`` for per-step actions (``REDUCE``, ``STEP``,
    ``UNSHARD``, ``RESHARD``)."""
    version: int | None = None
    """Weight version the action uses or produces; ``None`` for the synchronous schedules
    (which always use the current weights). Asynchronous schedules (weight stashing, 2BW)
    set it."""

    def __str__(self) -> str:
        text = f"{self.stage}{self.op.value}"
        if self.microbatch is not None:
            text += str(self.microbatch)
        if self.version is not None:
            text += f"v{self.version}"
        return text

    def __repr__(self) -> str:
        return f"Action({self})"


def parse_action(text: str) -> Action:
    """Read an action back from its compact form.

    Example:
        >>> parse_action("2SF10")
        Action(2SF10)
        >>> parse_action("0STEP").microbatch is None
        True

    Raises:
        ValueError: the text is not ``{stage}{op}[{microbatch}][v{version}]`` with a
            known op, or the op needs a micro-batch and has none (or the reverse).
    """
    match = _PATTERN.match(text.strip())
    if match is None:
        raise ValueError(
            f"cannot parse action {text!r}: expected '{{stage}}{{op}}{{microbatch}}' such as "
            f"'0F3', '1SF2' or '0STEP'"
        )
    stage_text, code, microbatch_text, version_text = match.groups()
    op = _CODES.get(code)
    if op is None:
        known = ", ".join(sorted(_CODES))
        raise ValueError(f"unknown op {code!r} in action {text!r}; known ops: {known}")
    microbatch = int(microbatch_text) if microbatch_text is not None else None
    if op.needs_microbatch and microbatch is None:
        raise ValueError(f"action {text!r}: op {code} needs a micro-batch index, e.g. '0{code}3'")
    if not op.needs_microbatch and microbatch is not None:
        raise ValueError(f"action {text!r}: op {code} takes no micro-batch index, e.g. '0{code}'")
    version = int(version_text) if version_text is not None else None
    return Action(int(stage_text), op, microbatch, version)


def parse_actions(text: str) -> list[Action]:
    """Read a whitespace- or comma-separated list of actions.

    Example:
        >>> parse_actions("0F0 0F1, 0B0")
        [Action(0F0), Action(0F1), Action(0B0)]
    """
    return [parse_action(token) for token in re.split(r"[\s,]+", text.strip()) if token]


def format_actions(actions: list[Action] | tuple[Action, ...]) -> str:
    """Print actions in their compact form, separated by spaces.

    Example:
        >>> format_actions([Action(0, Op.FORWARD, 0), Action(0, Op.BACKWARD, 0)])
        '0F0 0B0'
    """
    return " ".join(str(action) for action in actions)

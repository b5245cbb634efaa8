"""What FSDP's collectives cost where its policy runs them, for the simulator.

By default a sharded stage gathers its parameters once per step (``UNSHARD``, in the
background before its first compute action) and reduce-scatters its gradients once
(``REDUCE``, in the background after its last backward): the ``unshard`` and ``reduce``
costs of :class:`~pipetrain.schedule.costs.Costs`. Two options of the runtime move them
into the compute actions, where FSDP's own hooks run them in line:

- ``reshard_after_forward``: every forward and every backward (or backward's input half)
  gathers the stage's parameters first, and the schedule has no ``UNSHARD`` /
  ``RESHARD`` (lower it without :func:`~pipetrain.schedule.add_fsdp_actions`);
- ``reduce_each_microbatch``: every backward (or backward's weight half) reduce-scatters
  the gradients it made, and ``REDUCE`` has nothing left to do.
"""

from __future__ import annotations

import dataclasses

from pipetrain.schedule.costs import Costs

__all__ = ["fsdp_policy_costs"]


def _plus(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(x + y for x, y in zip(a, b))


def fsdp_policy_costs(costs: Costs, num_stages: int, *, reshard_after_forward: bool = False,
                      reduce_each_microbatch: bool = False) -> Costs:
    """``costs`` of ``num_stages`` stages, one value per stage, with each stage's gather
    and reduce-scatter moved where the FSDP policy runs them (see the module docstring).

    Example:
        >>> c = Costs(forward=1.0, backward=2.0, unshard=0.5, reduce=0.25)
        >>> lean = fsdp_policy_costs(c, 1, reshard_after_forward=True,
        ...                          reduce_each_microbatch=True)
        >>> lean.forward, lean.backward, lean.unshard, lean.reduce
        ((1.5,), (2.75,), (0.0,), (0.0,))
        >>> fsdp_policy_costs(c, 2).forward  # both options off: the same costs, per stage
        (1.0, 1.0)
    """
    c = dataclasses.asdict(costs.per_stage(num_stages))
    zero = tuple(0.0 for _ in range(num_stages))
    if reshard_after_forward:
        for name in ("forward", "backward", "backward_input"):
            c[name] = _plus(c[name], c["unshard"])
        c["unshard"] = zero
    if reduce_each_microbatch:
        for name in ("backward", "backward_weight"):
            c[name] = _plus(c[name], c["reduce"])
        c["reduce"] = zero
    return Costs(**c)

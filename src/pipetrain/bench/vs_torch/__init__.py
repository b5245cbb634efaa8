"""pipetrain beside torch.distributed.pipelining: the runners and analyses of case ``vs_torch_pipelining``.

- :mod:`.runners`: one training step of pipetrain's ``Pipeline`` and of
  torch.distributed.pipelining for a schedule, same layers, same cut, same optimizer;
- :mod:`.plain`: plain autograd running a schedule's order, timed beside the pipelines:
  the costs of the *ideal* step;
- :mod:`.costs`: per-stage costs measured in isolation, the *ideal* step simulated from
  costs, torch's order as a pipetrain schedule;
- :mod:`.analysis`: the recorded actions of the timed steps against the simulator;
- :mod:`.mlp`, :mod:`.gpt_speedup`, :mod:`.transformer`: the three parts;
- :mod:`.options`: their sizes and repetitions;
- :mod:`.tables`: their tables (:mod:`pipetrain.bench.cases.vs_torch_pipelining`).
"""

from __future__ import annotations

__all__: list[str] = []

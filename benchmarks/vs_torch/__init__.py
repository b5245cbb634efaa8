"""The runners and analyses of ``benchmarks/vs_torch_pipelining.py``, one module per part.

- :mod:`.runners`: one training step of pipetrain's ``Pipeline`` and of
  torch.distributed.pipelining for a schedule, same layers, same cut, same optimizer;
- :mod:`.costs`: per-stage costs measured in isolation, the *ideal* step simulated from
  them, torch's order as a pipetrain schedule;
- :mod:`.analysis`: the recorded actions of the timed steps against the simulator;
- :mod:`.mlp`, :mod:`.gpt_speedup`, :mod:`.transformer`: the three parts;
- :mod:`.report`: their text reports.
"""

from __future__ import annotations

__all__: list[str] = []

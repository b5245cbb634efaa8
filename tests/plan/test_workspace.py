"""The profiler's temporary memory of a backward against the resident set of a process.

A GPT block's whole backward and its split backward's input pass are measured twice: by
the profiler (:class:`~pipetrain.plan.memory.TransientBytes`, every storage counted) and
by the process's resident-set peak above what it held before the pass (glibc set to map
every block of 64 KiB or more on its own, so that the resident set follows the tensors).
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest

_MEASURE = """
import ctypes, gc, json
libc = ctypes.CDLL(None)
libc.mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD fixed: RSS follows live tensors
import torch
from pipetrain.backward.fused import fused_backward
from pipetrain.backward.split import backward_input
from pipetrain.models import GPTConfig, gpt_layer_factories
from pipetrain.plan import profile_model

def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))

torch.set_num_threads(1)
config = GPTConfig(num_layers=1, width=256, num_heads=4, context=256, tie_embeddings=False)
factory = gpt_layer_factories(config, seed=0)[1]
x = torch.randn(4, 256, 256, requires_grad=True)
layer = profile_model([factory], x, device="cpu", warmup=0, repetitions=1).layers[0]
block = factory()
params = [p for p in block.parameters()]

def measured(split):
    peaks = []
    for _ in range(3):  # the first allocates the gradients; the others are measured
        leaf = x.detach().requires_grad_()
        out = block(leaf.clone())
        seed = torch.ones_like(out)
        gc.collect(); libc.malloc_trim(0)
        before = status("VmRSS")
        with open("/proc/self/clear_refs", "w") as c:
            c.write("5")
        if split:
            _, weight = backward_input([out], [seed], [leaf], params)
            peaks.append(status("VmHWM") - before)
            weight.run()
        else:
            fused_backward([out], [seed], [leaf], params)
            peaks.append(status("VmHWM") - before)
        del out, leaf, seed
    return min(peaks[1:])

print(json.dumps({"whole": [layer.backward_workspace_bytes, measured(False)],
                  "input": [layer.backward_input_workspace_bytes, measured(True)]}))
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "malloc_trim"), reason="needs glibc")
def test_the_profiled_workspace_is_what_the_process_grows_by() -> None:
    done = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.splitlines()[-1])
    for name, (profiled, grown) in figures.items():
        # measured here: a block of width 256 on 4 x 256 tokens needs 4.0 MiB (whole) and
        # 8.0 MiB (input pass) profiled, 3.9 and 7.9 MiB grown
        assert profiled > 1 << 20, figures
        assert abs(grown - profiled) <= 0.1 * profiled + (256 << 10), (name, figures)

"""Keeping the memory a CPU worker frees (glibc's malloc thresholds), in a process of its
own: the setting is process-wide."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest
import torch

from pipetrain.runtime.host_memory import host_memory_setting, keep_freed_memory

_PROBE = """
import json, resource, torch
from pipetrain.runtime.host_memory import keep_freed_memory

def faulted_steps(steps=6):
    # each "step" holds ten 4 MiB activations, then frees them all
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        held = [torch.empty(1 << 20).fill_(1.0) for _ in range(10)]
        del held
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / (10 << 10)

keep_freed_memory(mmap_threshold=1 << 16, trim_threshold=1 << 16)  # give back at once
faulted_steps(2)
released = faulted_steps()
kept = keep_freed_memory()
faulted_steps(2)  # the heap grows to hold a step first
print(json.dumps({"released": released, "kept": kept, "after": faulted_steps()}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")
def test_a_steps_freed_memory_is_used_again_without_page_faults_once_kept() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         timeout=120, check=True)
    result = json.loads(out.stdout)
    assert result["kept"] is True
    assert result["released"] >= 5  # given back: of 6 steps, (nearly) every one faulted in
    assert result["after"] < 0.5  # kept: the steps reuse the memory of the one before


def test_the_choices_and_thresholds_are_checked_and_a_gpu_worker_is_left_alone() -> None:
    with pytest.raises(ValueError, match="mmap_threshold=0 must be a positive number"):
        keep_freed_memory(mmap_threshold=0)
    with pytest.raises(ValueError, match="trim_threshold=True must be a positive number"):
        keep_freed_memory(trim_threshold=True)
    with pytest.raises(ValueError, match=r"trim_threshold=2147483648 .* below 2 GiB"):
        keep_freed_memory(trim_threshold=1 << 31)
    with pytest.raises(ValueError, match="host memory 'hold': choose one of keep, release"):
        host_memory_setting("hold", torch.device("cpu"))
    assert host_memory_setting("keep", torch.device("cuda", 0)) == (
        "not applied: the stages run on a GPU")
    assert host_memory_setting("release", torch.device("cpu")) == "released: glibc's defaults"

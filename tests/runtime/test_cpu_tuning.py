"""The CPU tunings of a single-process pipeline: built from GPipe's keywords, applied to
partitions on the CPU only, each off (or at its memory-free setting) unless asked for."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.backward.gradient_pool import GradientPool
from pipetrain.runtime.cpu_tuning import CpuTuning, ReusingGradientPool, join_openmp_count
from pipetrain.runtime.shared_recompute import RecomputeSharing
from pipetrain.runtime.threads import ThreadTransport


def test_defaults_ask_for_nothing_that_costs_memory_or_process_state() -> None:
    tuning = CpuTuning()
    assert tuning.worker_setup() is None
    assert type(tuning.gradient_pool()) is GradientPool
    assert tuning.recompute_ahead == 0


def test_each_option_turns_its_tuning_on() -> None:
    assert CpuTuning(throttle_openmp_spin=True).worker_setup() is join_openmp_count
    assert isinstance(CpuTuning(reuse_gradient_buffers=True).gradient_pool(), ReusingGradientPool)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "1", None])
def test_a_bad_recompute_ahead_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"recompute_ahead must be a non-negative integer, "
                                         rf"got {bad!r}.*fix: recompute_ahead=0"):
        CpuTuning(recompute_ahead=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="recompute_ahead"):
        pipetrain.GPipe(nn.Sequential(nn.Linear(2, 2)), [1], recompute_ahead=bad)


class _Stage:
    stage_index = 0
    touches_generators = False
    sharing: RecomputeSharing | None = None

    def pending_recomputations(self) -> list[int]:
        return []

    def graphs_held(self) -> int:
        return 0

    def rebuild(self, microbatch: int) -> None:
        return None


def test_recomputation_is_shared_between_two_cpu_workers_or_more() -> None:
    transport = ThreadTransport(timeout=5.0)
    stages = [_Stage(), _Stage()]
    assert CpuTuning().share_recomputation(stages[:1], helpers=[1], transport=transport) is None
    assert transport.idle is None and stages[0].sharing is None
    sharing = CpuTuning(recompute_ahead=2).share_recomputation(
        stages, helpers=[threading.get_ident(), 2], transport=transport)
    assert sharing is not None and sharing.limit == 3
    assert all(stage.sharing is sharing for stage in stages)
    assert transport.idle == sharing.help


def test_gpipe_gives_cpu_partitions_the_tunings_asked_for() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    plain = pipetrain.GPipe(model, [2, 1], devices=["cpu", "cpu"], chunks=2)
    plain(torch.randn(4, 4)).sum().backward()
    local = plain._local
    assert local is not None and local.sharing is None  # the default holds nothing ahead
    assert all(type(e.stages[j].gradient_pool) is GradientPool
               for j, e in enumerate(local.executors))
    tuned = pipetrain.GPipe(model, [2, 1], devices=["cpu", "cpu"], chunks=2, recompute_ahead=1,
                            reuse_gradient_buffers=True)
    tuned(torch.randn(4, 4)).sum().backward()
    local = tuned._local
    assert local is not None and local.sharing is not None and local.sharing.limit == 2
    assert all(isinstance(e.stages[j].gradient_pool, ReusingGradientPool)
               for j, e in enumerate(local.executors))


_THREADS = textwrap.dedent(
    """
    import os, sys, torch
    from torch import nn
    import pipetrain
    (torch.randn(256, 256) * 2).sum()  # the caller's own OpenMP team exists already
    before = len(os.listdir("/proc/self/task"))
    gpipe = pipetrain.GPipe(nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)), [1, 1],
                            devices=["cpu", "cpu"], throttle_openmp_spin=sys.argv[1] == "on")
    gpipe(torch.randn(8, 256)).sum().backward()
    print(len(os.listdir("/proc/self/task")) - before)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
@pytest.mark.skipif("OpenMP" not in torch.__config__.parallel_info(),
                    reason="torch is not built with OpenMP here")
def test_gpipe_joins_the_openmp_count_only_when_asked() -> None:
    """throttle_openmp_spin=True makes each CPU worker start an OpenMP team (the count
    then includes the workers); by default the process gets only the two workers."""
    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: the opt-in starts no OpenMP team either")

    def added(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", _THREADS, mode], capture_output=True,
                             text=True, timeout=120, check=True)
        return int(out.stdout.strip())

    assert added("off") == 2
    assert added("on") > 2

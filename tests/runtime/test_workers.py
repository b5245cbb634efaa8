"""Stage workers: persistent threads, counted by the OpenMP runtime."""

import subprocess
import sys
import textwrap

import pytest
import torch

from pipetrain.runtime.workers import StageWorkers

_SPIN_PROBE = textwrap.dedent(
    """
    import sys, time, torch
    if sys.argv[1] == "workers":
        from pipetrain.runtime.workers import StageWorkers
        workers = StageWorkers([torch.device("cpu")] * 2)
    x = torch.randn(512, 512)  # torch's default: one intra-op thread per CPU
    burnt = []
    for _ in range(5):
        (x * 2).sum()
        time.sleep(0.05)
        (x * 2).sum()  # a 2-thread region; then the CPU time while this thread sleeps
        start = time.process_time()
        time.sleep(0.03)
        burnt.append(time.process_time() - start)
    print(sorted(burnt)[2] * 1e3)
    """
)


def _idle_cpu_ms(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _SPIN_PROBE, mode], capture_output=True,
                         text=True, timeout=120, check=True)
    return float(out.stdout.strip())


def test_run_returns_each_workers_result_and_keeps_the_callers_thread_count():
    before = torch.get_num_threads()
    workers = StageWorkers([torch.device("cpu")] * 2)
    try:
        assert workers.run([lambda: torch.get_num_threads(), lambda: "b"]) == [
            max(1, before // 2), "b"]
        assert torch.get_num_threads() == before
        assert len(set(workers.thread_ids)) == 2
    finally:
        workers.close()


@pytest.mark.skipif("OpenMP" not in torch.__config__.parallel_info(),
                    reason="torch is not built with OpenMP here")
def test_workers_make_openmp_stop_spinning_after_the_callers_parallel_regions():
    """After a 2-thread region, GNU OpenMP's idle thread spins for milliseconds unless
    the process has more OpenMP threads than CPUs; the workers count themselves in, so
    the caller's loss no longer leaves a thread burning a core the stages need."""
    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: no parallel region to spin after")
    alone = _idle_cpu_ms("alone")
    if alone < 2.0:
        pytest.skip(f"this OpenMP runtime does not spin after a region ({alone:.2f} ms)")
    with_workers = _idle_cpu_ms("workers")
    assert with_workers < alone / 4, (alone, with_workers)

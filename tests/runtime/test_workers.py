"""Stage workers: persistent threads; counted by the OpenMP runtime only when asked
(``setup=join_openmp_count``, GPipe's ``throttle_openmp_spin=True``)."""

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
        from pipetrain.runtime.cpu_tuning import join_openmp_count
        from pipetrain.runtime.workers import StageWorkers
        workers = StageWorkers([torch.device("cpu")] * 2, setup=join_openmp_count)
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
def test_workers_asked_to_make_openmp_stop_spinning_after_the_callers_regions_do():
    """After a 2-thread region, GNU OpenMP's idle thread spins for milliseconds unless
    the process has more OpenMP threads than CPUs; workers asked to (opt-in) count
    themselves in, so the caller's loss no longer leaves a thread burning a core the
    stages need."""
    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: no parallel region to spin after")
    alone = _idle_cpu_ms("alone")
    if alone < 2.0:
        pytest.skip(f"this OpenMP runtime does not spin after a region ({alone:.2f} ms)")
    with_workers = _idle_cpu_ms("workers")
    assert with_workers < alone / 4, (alone, with_workers)


_THREADS_PROBE = textwrap.dedent(
    """
    import os, sys, torch
    from pipetrain.runtime.cpu_tuning import join_openmp_count
    from pipetrain.runtime.workers import StageWorkers
    (torch.randn(256, 256) * 2).sum()  # the caller's own OpenMP team exists already
    before = len(os.listdir("/proc/self/task"))
    workers = StageWorkers([torch.device("cpu")] * 2,
                           setup=join_openmp_count if sys.argv[1] == "on" else None)
    workers.run([lambda: (torch.randn(256, 256) @ torch.randn(256, 256)).sum()] * 2)
    print(len(os.listdir("/proc/self/task")) - before, torch.get_num_threads())
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
@pytest.mark.skipif("OpenMP" not in torch.__config__.parallel_info(),
                    reason="torch is not built with OpenMP here")
def test_default_workers_start_no_openmp_threads():
    """By default the workers change no process-wide OpenMP state: besides the two
    worker threads the process gets no thread (no OpenMP team joins the count); the
    opt-in starts OpenMP threads for the workers. The caller's thread count is kept."""
    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: the opt-in starts no OpenMP team either")

    def probe(mode: str) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", _THREADS_PROBE, mode], capture_output=True,
                             text=True, timeout=120, check=True)
        added, threads = out.stdout.split()
        return int(added), int(threads)

    off, on = probe("off"), probe("on")
    assert off == (2, torch.get_num_threads())
    assert on[0] > 2 and on[1] == torch.get_num_threads()


def test_a_task_run_here_runs_on_the_calling_thread_with_the_workers_thread_count():
    import threading

    before = torch.get_num_threads()
    workers = StageWorkers([torch.device("cpu")] * 2)
    try:
        seen = workers.run([lambda: threading.get_ident(),
                            lambda: (threading.get_ident(), torch.get_num_threads())], here=1)
        assert seen[0] == workers.thread_ids[0]
        assert seen[1] == (threading.get_ident(), max(1, before // 2))
        assert torch.get_num_threads() == before  # restored
    finally:
        workers.close()


def test_a_failing_task_run_here_wakes_the_others_and_is_raised():
    import threading

    woken = threading.Event()
    failures: list[BaseException] = []

    def on_error(error: BaseException) -> None:
        failures.append(error)
        woken.set()

    workers = StageWorkers([torch.device("cpu")] * 2, on_error=on_error)
    try:
        def fail() -> None:
            raise KeyError("stage 1")

        with pytest.raises(KeyError, match="stage 1"):
            # worker 0 waits for what the failed task would have sent: on_error wakes it
            workers.run([lambda: woken.wait(timeout=30), fail], here=1)
        assert len(failures) == 1 and isinstance(failures[0], KeyError)
    finally:
        workers.close()
    other = StageWorkers([torch.device("meta")])
    try:
        with pytest.raises(ValueError, match="not a CPU worker"):
            other.run([lambda: None], here=0)
    finally:
        other.close()

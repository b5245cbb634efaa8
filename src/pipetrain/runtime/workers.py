"""Stage workers: one persistent thread per stage of a single-process pipeline.

Each worker runs its tasks in order on its own thread, with its device set and its share
of the CPU's intra-op threads, so stages run concurrently even when they share a device
(torchgpipe serializes all stages of one device on a single thread). Workers live from
the first step to :meth:`StageWorkers.close` (or the owner's garbage collection).

Workers leave process-wide state as they found it (the caller's intra-op thread count
is restored), unless their ``setup`` changes it (a CPU tuning such as
:func:`pipetrain.runtime.cpu_tuning.join_openmp_count`, opt-in).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

__all__ = ["StageWorkers"]

_STOP = object()


def _worker_loop(
    tasks: queue.SimpleQueue[Any], device: torch.device, num_threads: int, ready: threading.Event,
    setup: Callable[[], None] | None,
) -> None:
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if num_threads > 0:
            torch.get_num_threads()  # torch sets a thread's count lazily, on first use: now
            if setup is not None:
                setup()
            torch.set_num_threads(num_threads)
    finally:
        ready.set()
    while True:
        item = tasks.get()
        if item is _STOP:
            return
        future, function = item
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(function())
        except BaseException as error:
            future.set_exception(error)
        # the finished task must not outlive its run (it may hold a whole pipeline step)
        del item, future, function


class StageWorkers:
    """One thread per stage; :meth:`run` gives each its task and waits for all of them.

    ``on_error`` is called with the first exception a task raises, before the other
    tasks are awaited: it must wake them (e.g. fail the transport's mailbox) so that a
    failed stage never leaves its neighbours waiting. ``setup`` runs on each CPU worker's
    thread when it starts, before the worker sets its share of intra-op threads (a CPU
    tuning: :meth:`pipetrain.runtime.cpu_tuning.CpuTuning.worker_setup`).

    Example:
        >>> workers = StageWorkers([torch.device("cpu")] * 2)
        >>> workers.run([lambda: 1, lambda: 2])
        [1, 2]
        >>> workers.close()
    """

    def __init__(
        self,
        devices: Sequence[torch.device],
        *,
        on_error: Callable[[BaseException], None] | None = None,
        setup: Callable[[], None] | None = None,
    ) -> None:
        num_cpu = sum(1 for d in devices if d.type == "cpu")
        cpu_threads = max(1, torch.get_num_threads() // max(1, num_cpu))
        self.on_error = on_error
        self._cpu_threads = [cpu_threads if d.type == "cpu" else 0 for d in devices]
        self._queues: list[queue.SimpleQueue[Any]] = []
        self._threads: list[threading.Thread] = []
        ready = []
        for j, device in enumerate(devices):
            tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
            ready.append(threading.Event())
            thread = threading.Thread(
                target=_worker_loop,
                args=(tasks, device, cpu_threads if device.type == "cpu" else 0, ready[-1],
                      setup),
                name=f"pipetrain-stage-{j}",
                daemon=True,
            )
            thread.start()
            self._queues.append(tasks)
            self._threads.append(thread)
        if num_cpu:
            # torch.set_num_threads in a worker also sets the count that every thread
            # started later begins with (a process-wide default): restore it
            previous = torch.get_num_threads()
            for event in ready:
                event.wait()
            torch.set_num_threads(previous)

    @property
    def thread_ids(self) -> list[int]:
        """The identifier (``threading.get_ident()``) of each worker's thread."""
        return [t.ident or 0 for t in self._threads]

    def __len__(self) -> int:
        return len(self._threads)

    def run(self, tasks: Sequence[Callable[[], Any] | None], *,
            here: int | None = None) -> list[Any]:
        """Run ``tasks[j]`` on worker ``j`` (``None``: nothing); return their results.

        ``here``: the index of a CPU worker whose task runs on the calling thread instead
        (which would only wait meanwhile), with that worker's share of intra-op threads
        (set for the task, then restored): what the task allocates then comes from the
        caller's memory, as when autograd runs a backward on the caller's thread.
        If tasks fail, the first failure is raised after every task has finished.
        """
        if len(tasks) != len(self._queues):
            raise ValueError(f"{len(tasks)} tasks for {len(self._queues)} workers")
        own: Callable[[], Any] | None = None
        if here is not None:
            if not self._cpu_threads[here]:
                raise ValueError(f"worker {here} is not a CPU worker: its task cannot run here")
            own, tasks = tasks[here], [None if j == here else t for j, t in enumerate(tasks)]
        futures: list[Future[Any] | None] = []
        for q, task in zip(self._queues, tasks):
            if task is None:
                futures.append(None)
                continue
            submitted: Future[Any] = Future()
            q.put((submitted, task))
            futures.append(submitted)
        first: BaseException | None = None
        lock = threading.Lock()

        def note(done: Future[Any]) -> None:
            nonlocal first
            error = done.exception()
            if error is None:
                return
            with lock:
                if first is not None:
                    return
                first = error
            if self.on_error is not None:
                self.on_error(error)

        for future in futures:
            if future is not None:
                future.add_done_callback(note)
        own_result = None
        if own is not None and here is not None:
            done: Future[Any] = Future()
            done.add_done_callback(note)
            own_result = self._run_here(own, self._cpu_threads[here], done)
        results = [None if f is None else _result(f) for f in futures]
        if here is not None:
            results[here] = own_result
        if first is not None:
            raise first
        return results

    @staticmethod
    def _run_here(task: Callable[[], Any], num_threads: int, done: Future[Any]) -> Any:
        """Run ``task`` on this thread with ``num_threads`` intra-op threads; its result
        (``None`` on failure) and its outcome in ``done``."""
        previous = torch.get_num_threads()
        if num_threads != previous:
            torch.set_num_threads(num_threads)
        try:
            result = task()
        except BaseException as error:
            done.set_exception(error)
            return None
        finally:
            if num_threads != previous:
                torch.set_num_threads(previous)
        done.set_result(result)
        return result

    def submit(self, j: int, task: Callable[[], Any]) -> None:
        """Queue ``task`` on worker ``j`` without waiting for it (its result and any
        error are dropped); tasks given to :meth:`run` later run after it."""
        self._queues[j].put((Future(), task))

    def close(self) -> None:
        """Stop the threads (after their current task)."""
        for q in self._queues:
            q.put(_STOP)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5)
        self._queues.clear()
        self._threads.clear()


def _result(future: Future[Any]) -> Any:
    try:
        return future.result()
    except BaseException:
        return None

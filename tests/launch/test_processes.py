"""``run_processes``: ranks spawned or forked from a server, each seeing the caller's
environment as it is at the call, and a start method it does not know refused by name."""

from __future__ import annotations

import os

import pytest

from helpers.pipeline_jobs import environment_job
from pipetrain.launch.processes import run_processes, temporary_environment

pytestmark = pytest.mark.distributed


def test_forked_ranks_see_the_environment_of_the_call_not_of_the_server() -> None:
    first = run_processes(environment_job, 2, "PIPETRAIN_PROBE", start="forkserver")
    assert [value for value, _ in first] == [None, None]  # the server may have started here
    with temporary_environment({"PIPETRAIN_PROBE": "later"}):
        second = run_processes(environment_job, 2, "PIPETRAIN_PROBE", start="forkserver")
    assert [value for value, _ in second] == ["later", "later"]
    pids = {pid for _, pid in first + second}
    assert len(pids) == 4 and os.getpid() not in pids  # a fresh process per rank per job


def test_an_unknown_start_method_is_named_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"start='fork'.*'spawn', 'forkserver'"):
        run_processes(environment_job, 1, "X", start="fork")

"""A job across two hosts: two network namespaces, each with its own hostname and hosts file.

Both hosts' names resolve to 127.0.1.1 on the host itself (the VM and container default
that made gloo advertise a loopback address); they reach each other only over a veth
pair. Skipped, with the reason, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers.namespaces import Host, NamespacesUnavailable, TwoHosts, two_hosts

pytestmark = pytest.mark.distributed

_TESTS = Path(__file__).resolve().parents[1]
_SRC = _TESTS.parent / "src"
_PORT = "29500"  # each namespace has its own ports: no clash with anything outside
_TINY = ["--steps", "3", "--layers", "1", "--width", "16", "--heads", "2", "--context", "16",
         "--batch-size", "4", "--microbatches", "2", "--sample-bytes", "0", "--eval-every", "0"]
_JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "GLOO_SOCKET_IFNAME")


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHosts]:
    try:
        with two_hosts() as made:
            yield made
    except NamespacesUnavailable as reason:
        pytest.skip(str(reason))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _JOB_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env.update(PYTHONPATH=os.pathsep.join([str(_SRC), str(_TESTS)]), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", **extra)
    return env


def _finish(*processes: subprocess.Popen[str], timeout: float) -> list[tuple[int, str]]:
    """Wait for every process (killing those still running at the deadline)."""
    deadline = time.monotonic() + timeout
    done = []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate(timeout=20)
            output += f"\n[killed by the test after {timeout:g} s]"
        done.append((process.returncode, output))
    return done


def _result(output: str) -> dict[str, Any]:
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert lines, output[-3000:]
    return json.loads(lines[-1][len("RESULT "):])  # type: ignore[no-any-return]


def _rank(hosts: TwoHosts, host: Host, rank: int, mode: str, **extra: str) -> subprocess.Popen[str]:
    env = _env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR=hosts.a.name, MASTER_PORT=_PORT, **extra)
    return hosts.popen(host, [sys.executable, "-m", "helpers.multihost_jobs", mode], env=env)


def _torchrun(hosts: TwoHosts, node_rank: int, *train: str) -> list[str]:
    """The README's torchrun line for machine ``node_rank`` of two (one worker each)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
            str(node_rank), "--nproc-per-node", "1", "--master-addr", hosts.a.name,
            "--master-port", _PORT, "-m", "pipetrain", "train", "--stages", "2", *train]


def test_the_readme_command_trains_across_hosts_whose_names_resolve_to_loopback(
        hosts: TwoHosts, tmp_path: Path) -> None:
    """The README's torchrun line, unchanged, on both hosts: each rank finds that gloo
    would advertise 127.0.1.1, takes the interface that routes to the other host (and
    says so), and the job trains."""
    out = tmp_path / "run"
    train = [*_TINY, "--timeout", "60", "--out", str(out)]
    on_a = hosts.popen(hosts.a, _torchrun(hosts, 0, *train), env=_env(TMPDIR=str(tmp_path)))
    on_b = hosts.popen(hosts.b, _torchrun(hosts, 1, *train), env=_env(TMPDIR=str(tmp_path)))
    (status_a, text_a), (status_b, text_b) = _finish(on_a, on_b, timeout=150)
    assert status_a == 0 and status_b == 0, f"host a:\n{text_a[-4000:]}\nhost b:\n{text_b[-4000:]}"
    assert "trained 3 steps" in text_a + text_b
    for host, text in ((hosts.a, text_a), (hosts.b, text_b)):
        assert f"using interface {host.interface} ({host.address}" in text, text[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["world_size"] == 2 and len(metrics["steps"]) == 3


def test_a_peer_killed_on_the_other_host_is_named_by_the_survivor(hosts: TwoHosts) -> None:
    """Rank 1 (host b) SIGKILLs itself at the start of step 3; rank 0 (host a) must stop
    with an error naming rank 1 and its host, not gloo's raw ``[ip]:port``."""
    survivor = _rank(hosts, hosts.a, 0, "kill", VICTIM="1", JOB_TIMEOUT="60")
    victim = _rank(hosts, hosts.b, 1, "kill", VICTIM="1", JOB_TIMEOUT="60")
    (status, text), (victim_status, _) = _finish(survivor, victim, timeout=120)
    assert victim_status == -9  # SIGKILL
    result = _result(text)
    assert status == 3 and not result["ok"], text[-3000:]
    message = result["message"]
    assert f"rank 1 (on host {hosts.b.name}) died" in message, message
    assert message.startswith(f"rank 0 (on host {hosts.a.name}): pipeline stopped"), message
    assert hosts.b.address not in message, message
    assert result["dead"] == [1]
    assert result["seconds"] < 30, f"the survivor took {result['seconds']:.0f} s to notice"


def test_a_loopback_interface_chosen_by_the_user_is_refused_with_the_fix(hosts: TwoHosts) -> None:
    """GLOO_SOCKET_IFNAME=lo is the user's choice, so it is kept, and every rank stops at
    once saying what to set instead of gloo timing out."""
    ranks = [_rank(hosts, host, rank, "init", GLOO_SOCKET_IFNAME="lo", JOB_TIMEOUT="60")
             for rank, host in enumerate((hosts.a, hosts.b))]
    finished = _finish(*ranks, timeout=90)
    for status, text in finished:
        result = _result(text)
        assert status == 3 and result["kind"] == "HostAddressError", text[-3000:]
        message = result["message"]
        assert (f"ranks 0, 1 (on hosts {hosts.a.name}, {hosts.b.name}) would advertise a loopback "
                "address to gloo, which the ranks on other hosts cannot reach") in message
        for rank, host in enumerate((hosts.a, hosts.b)):
            assert f"rank {rank} on {host.name}: 127.0.0.1 from GLOO_SOCKET_IFNAME=lo" in message
        assert "Fix: on every host set GLOO_SOCKET_IFNAME to the network interface" in message
        assert "/etc/hosts" not in message  # the user chose the interface: the hosts file is not it
        assert result["seconds"] < 30  # at once, not after the 60 s timeout


def _steps_recorded(out: Path) -> int:
    """Steps recorded so far (steps.jsonl gets each step's line as it ends)."""
    try:
        return (out / "steps.jsonl").read_text().count("\n")
    except OSError:
        return 0


def test_a_network_partition_ends_both_sides_in_time_and_keeps_the_history(
        hosts: TwoHosts, tmp_path: Path) -> None:
    """The link between the hosts goes down in the middle of training. Host a (rank 0 and
    the store) finds rank 1 silent; host b finds the store silent (its calls would block
    for good). Both end within --timeout + 15 s with an error that names the cause, and
    metrics.json keeps every step that finished, with how the run stopped."""
    timeout = 10
    out = tmp_path / "run"
    train = [*_TINY, "--steps", "100000", "--timeout", str(timeout), "--out", str(out)]
    sides = {"a": hosts.popen(hosts.a, _torchrun(hosts, 0, *train), env=_env(TMPDIR=str(tmp_path))),
             "b": hosts.popen(hosts.b, _torchrun(hosts, 1, *train), env=_env(TMPDIR=str(tmp_path)))}
    link = ["ip", "-n", hosts.b.netns, "link", "set", hosts.b.interface]
    try:
        deadline = time.monotonic() + 120
        while _steps_recorded(out) < 5 and time.monotonic() < deadline:
            assert all(p.poll() is None for p in sides.values()), "a side ended before the cut"
            time.sleep(0.5)
        before = _steps_recorded(out)
        assert before >= 5, "the job never got going"
        subprocess.run([*link, "down"], check=True, timeout=20)
        cut = time.monotonic()
        ended: dict[str, float] = {}
        while len(ended) < 2 and time.monotonic() - cut < timeout + 60:
            for name, process in sides.items():
                if name not in ended and process.poll() is not None:
                    ended[name] = time.monotonic() - cut
            time.sleep(0.2)
    finally:
        subprocess.run([*link, "up"], check=False, timeout=20)
    (status_a, text_a), (status_b, text_b) = _finish(sides["a"], sides["b"], timeout=30)
    shown = f"host a:\n{text_a[-3000:]}\nhost b:\n{text_b[-3000:]}"
    assert set(ended) == {"a", "b"}, f"still running after {timeout + 60} s: {shown}"
    assert max(ended.values()) <= timeout + 15, f"ended after {ended} s: {shown}"
    assert status_a != 0 and status_b != 0, shown
    assert f"rank 1 (on host {hosts.b.name}) stopped answering" in text_a, shown
    assert f"the job's store at {hosts.a.name}:{_PORT} is unreachable" in text_b, shown
    metrics = json.loads((out / "metrics.json").read_text())
    steps = [s["step"] for s in metrics["steps"]]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= before
    stopped = metrics["stopped"]
    assert stopped["reason"] == "error" and len(steps) <= stopped["at_step"] <= len(steps) + 1
    assert "stopped answering" in stopped["message"]

"""Start-up is bounded by its timeout and names what it waited for."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from pipetrain.launch import free_port
from pipetrain.runtime.errors import StartupTimeout
from pipetrain.runtime.process_group import init_distributed

pytestmark = pytest.mark.distributed


def test_the_store_host_names_the_ranks_that_never_arrive() -> None:
    started = time.monotonic()
    with pytest.raises(StartupTimeout) as caught:
        init_distributed(backend="gloo", rank=0, world_size=3, master_addr="127.0.0.1",
                         master_port=free_port(), timeout=2)
    assert time.monotonic() - started < 2 + 5  # the timeout, not c10d's 300 s default
    message = str(caught.value)
    assert f"rank 0 (on host {socket.gethostname()}) waited 2 s (the timeout) for ranks 1, 2 of 3 to join" in message
    assert f"(arrived: rank 0 on {socket.gethostname()})" in message


def test_a_rank_whose_store_never_comes_names_the_store() -> None:
    port = free_port()  # nobody listens there
    started = time.monotonic()
    with pytest.raises(StartupTimeout) as caught:
        init_distributed(backend="gloo", rank=1, world_size=2, master_addr="127.0.0.1",
                         master_port=port, timeout=2)
    assert time.monotonic() - started < 2 + 5
    message = str(caught.value)
    assert f"could not reach the job's store at 127.0.0.1:{port} within 2 s (the timeout" in message
    assert "'127.0.0.1' resolves here to 127.0.0.1" in message
    assert "check that rank 0, which hosts the store, is running" in message


def test_a_bad_timeout_is_named() -> None:
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, got 0"):
        init_distributed(rank=0, world_size=1, master_port=1, timeout=0)


def test_train_timeout_bounds_start_up() -> None:
    """A worker of `pipetrain train` whose peer never starts fails after --timeout, saying
    which rank it waited for (not after c10d's defaults)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(PYTHONPATH=os.pathsep.join(sys.path), RANK="0", WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "pipetrain", "train", "--timeout", "3",
                           "--steps", "1", "--sample-bytes", "0"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode != 0
    assert "StartupTimeout: rank 0 (on host" in done.stderr, done.stderr[-3000:]
    assert "waited 3 s (the timeout) for rank 1 of 2 to join the job" in done.stderr


def test_a_hosted_store_listens_on_its_address_only() -> None:
    import os

    from helpers.listeners import listening_addresses
    from pipetrain.runtime.process_group import hosted_store

    store = hosted_store("127.0.0.1", 0, timeout=5)
    assert ("127.0.0.1", store.port) in listening_addresses([os.getpid()])
    assert all(address == "127.0.0.1" for address, port in listening_addresses([os.getpid()])
               if port == store.port)

"""Joining a torch.distributed job: the process group, its store and the device.

:func:`init_distributed` works the same under ``torchrun`` / torch.distributed.elastic
(which export ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``)
and for processes started by hand; it keeps the c10d store, which the peer monitor
uses for heartbeats.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]
from torch.distributed.distributed_c10d import Store

__all__ = ["DistContext", "init_distributed"]


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job, as :func:`init_distributed` set it up."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    store: Store
    store_host_rank: int | None
    """The rank whose process hosts the store (``None``: an elastic agent hosts it)."""


def init_distributed(
    *,
    backend: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout: float = 300.0,
) -> DistContext:
    """Initialize the default process group (gloo on CPU, NCCL when CUDA is available).

    Arguments default to the environment that ``torchrun`` and
    torch.distributed.elastic export.

    Example (in each of the job's processes)::

        ctx = init_distributed()           # under torchrun
        ctx = init_distributed(rank=r, world_size=2, master_addr="127.0.0.1",
                               master_port=29500)   # started by hand
    """
    env = os.environ
    rank = int(env.get("RANK", 0)) if rank is None else rank
    world_size = int(env.get("WORLD_SIZE", 1)) if world_size is None else world_size
    local_rank = int(env.get("LOCAL_RANK", rank))
    master_addr = env.get("MASTER_ADDR", "127.0.0.1") if master_addr is None else master_addr
    if master_port is None:
        if "MASTER_PORT" not in env:
            raise ValueError(
                "no master_port given and MASTER_PORT is not set; fix: launch with torchrun "
                "(or `pipetrain train`), or pass master_port=29500 (the same on every rank)"
            )
        master_port = int(env["MASTER_PORT"])
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    is_host = rank == 0 and not agent_store
    store = TCPStore(
        master_addr,
        master_port,
        world_size,
        is_master=is_host,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    dist.init_process_group(
        backend,
        store=PrefixStore(f"pipetrain/pg/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )
    return DistContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        backend=backend,
        device=device,
        store=store,
        store_host_rank=None if agent_store else 0,
    )

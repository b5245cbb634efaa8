"""Joining a torch.distributed job: the process group, its store and the device.

:func:`init_distributed` works the same under ``torchrun`` / torch.distributed.elastic
(which export ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``)
and for processes started by hand; it keeps the c10d store, which the peer monitor
uses for heartbeats. Start-up has three waits, each bounded by ``timeout`` and each
failing with a :class:`~pipetrain.runtime.errors.StartupError` that names what it waited
for: reaching the store, every rank arriving (with where it runs, see :mod:`.roster`),
and gloo connecting the ranks, which starts only once every rank has arrived and every
rank's address has been checked (see :mod:`.reachability`).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]
from torch.distributed.distributed_c10d import Store

from pipetrain.runtime.errors import HostAddressError, StartupError, StartupTimeout, brief
from pipetrain.runtime.host_address import is_loopback
from pipetrain.runtime.reachability import address_problems, local_place, settle_address
from pipetrain.runtime.roster import RankPlace, exchange_places, name_addresses, wait_until_read

__all__ = ["DistContext", "hosted_store", "init_distributed"]

logger = logging.getLogger(__name__)

_LINGER = 10.0
"""Seconds the store's host waits, before failing, for the others to read the roster."""


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
    roster: tuple[RankPlace, ...] = ()
    """Where every rank runs (host, gloo address), by rank; empty if not exchanged."""


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
    torch.distributed.elastic export. ``timeout`` (seconds) bounds each wait of
    start-up and is the process group's timeout afterwards.

    In a job that spans hosts, a rank whose hostname resolves to a loopback address
    (gloo would advertise it, and the other hosts cannot reach it) uses the network
    interface that routes to the other hosts: it sets ``GLOO_SOCKET_IFNAME`` in its own
    process and logs a warning, unless ``GLOO_SOCKET_IFNAME`` is set already.

    Raises:
        StartupTimeout: the store or some ranks did not answer within ``timeout``; the
            message names them.
        HostAddressError: some rank's address cannot be reached from the other hosts;
            the message says what to set.
        StartupError: gloo could not connect the ranks.

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
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    deadline = time.monotonic() + timeout
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    is_host = rank == 0 and not agent_store
    where = f"{master_addr}:{master_port}"
    if not is_host:
        _reach_store(master_addr, master_port, rank=rank, deadline=deadline, timeout=timeout,
                     host_rank=None if agent_store else 0)
    try:
        loopback = _loopback_only(master_addr) if is_host else None
        if loopback is not None:
            store = hosted_store(loopback, master_port, world_size=world_size, timeout=timeout)
        else:
            store = TCPStore(master_addr, master_port, world_size, is_master=is_host,
                             timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    except (RuntimeError, OSError) as error:
        action = f"host the job's store on port {master_port}" if is_host else f"connect to the store at {where}"
        raise StartupError(
            f"rank {rank} could not {action}: {brief(error)}. Fix: "
            + ("choose a free port (MASTER_PORT, or --rdzv-endpoint under torchrun)" if is_host
               else "check that the store's host is up and that this host reaches it")
        ) from error
    job_store = PrefixStore(f"pipetrain/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    roster = _join(job_store, rank=rank, world_size=world_size, master_addr=master_addr,
                   master_port=master_port, deadline=deadline, timeout=timeout, hosts_store=is_host)
    try:
        dist.init_process_group(backend, store=PrefixStore("pg", job_store), rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as error:
        raise StartupError(_connect_failure(error, rank=rank, roster=roster, timeout=timeout)) from error
    return DistContext(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        backend=backend,
        device=device,
        store=job_store,
        store_host_rank=None if agent_store else 0,
        roster=tuple(roster[r] for r in range(world_size)),
    )


def hosted_store(address: str, port: int, *, timeout: float,
                 world_size: int | None = None) -> TCPStore:
    """A store hosted in this process that listens on ``address`` only (a ``TCPStore``
    alone binds every interface, whatever host it is given); ``port`` 0 picks a free one
    (``store.port`` says which).

    Example:
        >>> store = hosted_store("127.0.0.1", 0, timeout=5)
        >>> store.set("k", "v"); store.get("k")
        b'v'
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.create_server((address, port), family=family, backlog=128)
    port = int(listener.getsockname()[1])
    return TCPStore(address, port, world_size, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout),
                    master_listen_fd=listener.detach())  # the store owns the socket now


def _loopback_only(master_addr: str) -> str | None:
    """The loopback address to host the store on when ``master_addr`` can only mean this
    machine (a loopback address, or ``localhost``); None otherwise. A host *name* that
    resolves to loopback here (Debian's 127.0.1.1 for the machine's own name) may still
    be how the other hosts reach this one, so its store listens everywhere."""
    if is_loopback(master_addr):
        return master_addr
    if master_addr.lower() not in ("localhost", "localhost.localdomain"):
        return None
    try:
        address = str(socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError):
        return None
    return address if is_loopback(address) else None


def _reach_store(host: str, port: int, *, rank: int, deadline: float, timeout: float,
                 host_rank: int | None) -> None:
    """Wait until the store's port answers (c10d's own connect can run past its timeout)."""
    last: OSError | None = None
    pause = 0.05
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            with socket.create_connection((host, port), timeout=min(remaining, 5.0)):
                return
        except OSError as error:
            last = error
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(1.0, pause * 2)
    try:
        resolved = sorted({str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})
        resolves = f"{host!r} resolves here to {', '.join(resolved)}"
    except OSError as error:
        resolves = f"{host!r} does not resolve here ({error})"
    owner = f"rank {host_rank}" if host_rank is not None else "the elastic agent (torchrun) of the first host"
    raise StartupTimeout(
        f"rank {rank} (on host {socket.gethostname()}) could not reach the job's store at "
        f"{host}:{port} within {timeout:g} s (the timeout; last error: {last}); {resolves}. "
        f"Fix: check that {owner}, which hosts the store, is running, that this address is "
        "the store host's network address as seen from here, and that the port is open "
        "between the hosts; or raise the timeout (--timeout)"
    )


def _join(store: Store, *, rank: int, world_size: int, master_addr: str, master_port: int,
          deadline: float, timeout: float, hosts_store: bool) -> dict[int, RankPlace]:
    """Wait for every rank, settle this rank's gloo address, and check everyone's."""
    where = f"{master_addr}:{master_port}"
    mine = local_place(rank, master_addr=master_addr, master_port=master_port)
    places = exchange_places(store, mine, world_size=world_size, round_name="join",
                             deadline=deadline, timeout=timeout, where=where)
    mine = settle_address(mine, places)
    places = exchange_places(store, mine, world_size=world_size, round_name="ready",
                             deadline=deadline, timeout=timeout, where=where)
    logger.debug("rank %d: every rank arrived: %s", rank,
                 ", ".join(f"{p.rank} on {p.host} at {p.address}" for p in places.values()))
    problems = address_problems(places)
    if problems:
        if hosts_store:  # stay until the others have read the places: they fail the same way
            wait_until_read(store, round_name="ready", world_size=world_size,
                            deadline=min(deadline, time.monotonic() + _LINGER))
        raise HostAddressError(
            f"rank {rank}: the job's ranks cannot connect to each other: " + "; ".join(problems)
        )
    return places


def _connect_failure(error: BaseException, *, rank: int, roster: dict[int, RankPlace], timeout: float) -> str:
    listed = ", ".join(f"rank {p.rank} on {p.host} at {p.address} ({p.source})" for p in roster.values())
    return (
        f"rank {rank}: gloo could not connect the ranks (timeout {timeout:g} s): "
        f"{name_addresses(brief(error), roster)}. The ranks advertised: {listed}. Fix: make "
        "these addresses reachable between the hosts (routes, firewall), or set "
        "GLOO_SOCKET_IFNAME on every host to the interface that reaches the others"
    )

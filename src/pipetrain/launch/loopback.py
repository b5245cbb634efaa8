"""The rendezvous of a job on this machine alone: one store, listening on loopback only.

torch.distributed.elastic's c10d rendezvous hosts its stores on every interface (a
``TCPStore`` binds the wildcard address whatever host it is given), so any host that
reaches this machine could read and write a local job's keys. A local job has no
other host to wait for: :class:`LoopbackRendezvous` is a one-node rendezvous handler,
registered with elastic's handler registry as :data:`BACKEND`, whose single store (the
agent's, which the workers join) listens on ``127.0.0.1`` through a socket bound there
(:func:`~pipetrain.runtime.process_group.hosted_store`). Multi-host jobs run under torchrun, which binds
where its own options say (docs/multi-node.md).
"""

from __future__ import annotations

from torch.distributed.distributed_c10d import Store
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from pipetrain.runtime.process_group import hosted_store

__all__ = ["BACKEND", "LOOPBACK", "LoopbackRendezvous", "register"]

BACKEND = "pipetrain-loopback"
"""The rendezvous backend name of a local job (``LaunchConfig(rdzv_backend=BACKEND)``)."""
LOOPBACK = "127.0.0.1"


class LoopbackRendezvous(RendezvousHandler):
    """A rendezvous of one node whose store listens on loopback (see the module).

    Example::

        register()
        elastic_launch(LaunchConfig(..., rdzv_backend=BACKEND, rdzv_endpoint=""), ...)
    """

    def __init__(self, run_id: str, *, timeout: float = 300.0) -> None:
        self._run_id = run_id
        self._store = hosted_store(LOOPBACK, 0, timeout=timeout)
        self._port = int(self._store.port)
        self._closed = False

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers join this store: it is the only one

    def next_rendezvous(self) -> RendezvousInfo:
        store: Store = self._store
        return RendezvousInfo(store, 0, 1, RendezvousStoreInfo(LOOPBACK, self._port))

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        self._closed = True
        return True


def _create(params: RendezvousParameters) -> LoopbackRendezvous:
    timeout = params.get_as_int("join_timeout", 300) or 300
    return LoopbackRendezvous(params.run_id, timeout=float(timeout))


def register() -> None:
    """Make :data:`BACKEND` known to torch.distributed.elastic (idempotent)."""
    rendezvous_handler_registry.register(BACKEND, _create)

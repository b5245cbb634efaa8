"""Reachable gloo addresses: check that ranks on other hosts can reach each rank, or fix it.

gloo advertises the address this host's name resolves to, which on many VMs and
containers is a loopback address: ranks on other hosts then try to connect to their own
loopback and start-up hangs. At start-up every rank publishes where it runs (see
:mod:`.roster`); in a job that spans hosts a rank whose address is loopback takes the
interface that routes to the other hosts instead, by setting ``GLOO_SOCKET_IFNAME`` in
its own process (logged as a warning; never where the user set it), and every rank checks
every address before gloo connects, so that a bad one is named with its fix at once.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Mapping

from pipetrain.runtime.host_address import (
    GLOO_INTERFACE_VARIABLE,
    gloo_address,
    interface_address,
    interface_of,
    is_loopback,
    network_id,
    route_address,
)
from pipetrain.runtime.roster import RankPlace, spans_networks

__all__ = ["address_problems", "local_place", "settle_address"]

logger = logging.getLogger(__name__)

_ANY_PORT = 9  # route look-ups send nothing; any port will do


def local_place(rank: int, *, master_addr: str, master_port: int) -> RankPlace:
    """Where this process runs, as start-up first publishes it.

    Example:
        >>> local_place(0, master_addr="127.0.0.1", master_port=29500).route
        '127.0.0.1'
    """
    advertised = gloo_address()
    return RankPlace(
        rank=rank,
        host=socket.gethostname(),
        network=network_id(),
        address=advertised.address,
        source=advertised.source,
        route=route_address(master_addr, master_port),
    )


_MAX_LISTED = 8


def _listing(items: list[str]) -> str:
    shown = items[:_MAX_LISTED]
    more = len(items) - len(shown)
    return "; ".join(shown) + (f"; and {more} more" if more else "")


def _hosts(places: list[RankPlace]) -> str:
    return ", ".join(sorted({p.host for p in places}))


def _route_to(others: list[RankPlace], me: RankPlace) -> str | None:
    """A non-loopback local address that routes to the store's host or another host."""
    targets = [t for p in others for t in (p.route, p.address) if t and not is_loopback(t)]
    for candidate in [me.route, *(route_address(t, _ANY_PORT) for t in targets)]:
        if candidate and not is_loopback(candidate):
            return candidate
    return None


def settle_address(me: RankPlace, places: Mapping[int, RankPlace]) -> RankPlace:
    """This rank's place once its gloo address is one the other hosts can reach.

    Changes nothing in a job on one host, or where the address is not loopback. Where it
    is loopback and ``GLOO_SOCKET_IFNAME`` is unset, sets ``GLOO_SOCKET_IFNAME`` (in this
    process, logged) to the interface that routes to the other hosts; where that cannot
    be done, returns the place with its ``problem`` said (:func:`address_problems` then
    reports it).

    Example (at start-up, after the first exchange of places)::

        mine = settle_address(mine, places)
    """
    others = [p for p in places.values() if p.network != me.network]
    if not others or not is_loopback(me.address):
        return me
    if os.environ.get(GLOO_INTERFACE_VARIABLE):
        return me.with_changes(problem=f"kept: {GLOO_INTERFACE_VARIABLE} is the user's choice")
    route = _route_to(others, me)
    if route is None:
        return me.with_changes(problem="no other local address routes to the other hosts")
    interface = interface_of(route)
    address = interface_address(interface) if interface is not None else None
    if interface is None or address is None or is_loopback(address):
        return me.with_changes(
            problem=f"{route} routes to the other hosts, but no interface gloo can name holds it")
    os.environ[GLOO_INTERFACE_VARIABLE] = interface
    logger.warning(
        "rank %d (on host %s): gloo would advertise the loopback address %s (from %s), which "
        "the ranks on %s cannot reach; using interface %s (%s, the route to them) instead: "
        "set %s=%s in this process. Set %s yourself, or map %r to its network address in "
        "/etc/hosts, to choose the interface.",
        me.rank, me.host, me.address, me.source, _hosts(others), interface, address,
        GLOO_INTERFACE_VARIABLE, interface, GLOO_INTERFACE_VARIABLE, me.host,
    )
    return me.with_changes(address=address, source=f"{GLOO_INTERFACE_VARIABLE}={interface}")


def address_problems(places: Mapping[int, RankPlace]) -> list[str]:
    """Every reason some ranks cannot connect to each other, from their places (or none).

    Example:
        >>> a = RankPlace(0, "a", "n1", "127.0.1.1", "hostname 'a'", "127.0.0.1")
        >>> b = RankPlace(1, "b", "n2", "10.0.0.2", "hostname 'b'", "10.0.0.2")
        >>> address_problems({0: a, 1: b})[0].split(":")[0]
        'rank 0 (on host a) would advertise a loopback address to gloo, which the ranks on other hosts cannot reach'
    """
    problems = []
    if sys.platform.startswith("linux"):  # elsewhere interfaces are not looked up
        missing = [p for p in places.values() if p.address is None]
        if missing:
            problems.append(
                f"{_who(missing)} {'has' if len(missing) == 1 else 'have'} no address for gloo ("
                + _listing([f"rank {p.rank} on {p.host}: {p.source}" for p in missing])
                + f") because {GLOO_INTERFACE_VARIABLE} names no interface with an address "
                "there. Fix: set it to an interface that `ip -o addr` lists on that host, or unset it"
            )
    if not spans_networks(places):
        return problems
    loopback = [p for p in places.values() if is_loopback(p.address)]
    if loopback:
        chosen = any(p.source.startswith(GLOO_INTERFACE_VARIABLE) for p in loopback)
        details = [f"rank {p.rank} on {p.host}: {p.address} from {p.source}"
                   + (f" ({p.problem})" if p.problem else "") for p in loopback]
        problems.append(
            f"{_who(loopback)} would advertise a loopback address to gloo, which the ranks on "
            f"other hosts cannot reach: {_listing(details)}. Fix: on every host set "
            f"{GLOO_INTERFACE_VARIABLE} to the network interface that reaches the other hosts "
            "(`ip -o addr` lists them) before starting the job"
            + ("" if chosen else ", or map each host's name to its network address in /etc/hosts")
        )
    by_address: dict[str, list[RankPlace]] = {}
    for p in places.values():
        if p.address and not is_loopback(p.address):
            by_address.setdefault(p.address, []).append(p)
    for address, sharing in by_address.items():
        if len({p.network for p in sharing}) > 1:
            problems.append(
                f"{_who(sharing)} all advertise {address} to gloo but run on different hosts "
                f"({_hosts(sharing)}), so they cannot reach each other there (containers on "
                "bridge networks often do this). Fix: give each host's ranks an address the "
                f"other hosts can reach (host networking), or set {GLOO_INTERFACE_VARIABLE} to "
                "an interface whose address is unique to its host"
            )
    return problems


def _who(places: list[RankPlace]) -> str:
    if len(places) == 1:
        return f"rank {places[0].rank} (on host {places[0].host})"
    shown = ", ".join(str(p.rank) for p in places[:_MAX_LISTED * 4])
    more = len(places) - min(len(places), _MAX_LISTED * 4)
    return f"ranks {shown}{f' and {more} more' if more else ''} (on hosts {_hosts(places)})"

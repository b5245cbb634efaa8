"""The job's roster: where every rank runs (host, network, gloo address), shared at start-up.

Every rank publishes a :class:`RankPlace` in the job's c10d store and waits, with a
deadline, until all ranks have published theirs. A rank that never arrives is named (with
the ranks that did and their hosts) instead of leaving the others waiting in
``init_process_group``. The roster stays in the store, so that later errors can name a
peer by rank and host (``rank 1 (on host node-b)``) rather than by a raw ``ip:port``.
"""

from __future__ import annotations

import ipaddress
import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

from torch.distributed.distributed_c10d import Store

from pipetrain.runtime.errors import StartupError, StartupTimeout, brief

__all__ = [
    "RankPlace",
    "describe_rank",
    "exchange_places",
    "name_addresses",
    "rank_of_error",
    "read_roster",
    "spans_networks",
    "wait_until_read",
]

_PREFIX = "pipetrain/roster"
_FINAL_ROUND = "ready"
_ADDRESS_IN_ERROR = re.compile(r"\[([0-9A-Fa-f:.%a-zA-Z]+)\]:(\d+)")


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs.

    ``host`` is the hostname (for messages); ``network`` tells network stacks apart
    (see :func:`pipetrain.runtime.host_address.network_id`); ``address`` is what gloo
    advertises and ``source`` where that comes from; ``route`` is the local address that
    reaches the job's store; ``problem`` says why the rank cannot take part ("" if none).

    Example:
        >>> RankPlace(rank=1, host="node-b", network="n2", address="10.0.0.2",
        ...           source="hostname 'node-b'", route="10.0.0.2").host
        'node-b'
    """

    rank: int
    host: str
    network: str
    address: str | None
    source: str
    route: str | None
    problem: str = ""

    def with_changes(self, **changes: object) -> RankPlace:
        """A copy with ``changes`` applied."""
        return replace(self, **changes)  # type: ignore[arg-type]

    def to_json(self) -> str:
        """The place as a JSON object (what the store holds)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> RankPlace:
        """The place a :meth:`to_json` text describes."""
        return cls(**json.loads(text))


def _normal(address: str | None) -> str | None:
    """``address`` without an IPv4-mapped IPv6 prefix (``::ffff:10.0.0.1`` -> ``10.0.0.1``)."""
    if address is None:
        return None
    try:
        parsed = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address
    mapped = getattr(parsed, "ipv4_mapped", None)
    return str(mapped if mapped is not None else parsed)


def _ranks_at(address: str, roster: Mapping[int, RankPlace]) -> list[int]:
    wanted = _normal(address)
    return [r for r, p in roster.items() if _normal(p.address) == wanted]


def _key(round_name: str, rank: int | str) -> str:
    return f"{_PREFIX}/{round_name}/{rank}"


def spans_networks(roster: Mapping[int, RankPlace] | Sequence[RankPlace]) -> bool:
    """Whether the ranks run in more than one network stack (several hosts).

    Example:
        >>> a = RankPlace(0, "a", "n1", "10.0.0.1", "", None)
        >>> spans_networks([a, a.with_changes(rank=1)]), spans_networks([a, a.with_changes(network="n2")])
        (False, True)
    """
    places = roster.values() if isinstance(roster, Mapping) else roster
    return len({p.network for p in places}) > 1


def describe_rank(rank: int, roster: Mapping[int, RankPlace]) -> str:
    """``"rank 1 (on host node-b)"`` in a job that spans hosts, else ``"rank 1"``.

    Example:
        >>> a = RankPlace(0, "node-a", "n1", "10.0.0.1", "", None)
        >>> describe_rank(1, {0: a, 1: a.with_changes(rank=1, host="node-b", network="n2")})
        'rank 1 (on host node-b)'
    """
    place = roster.get(rank)
    if place is None or not spans_networks(roster):
        return f"rank {rank}"
    return f"rank {rank} (on host {place.host})"


def rank_of_error(error: BaseException | str, roster: Mapping[int, RankPlace],
                  *, candidates: Sequence[int] = ()) -> int | None:
    """The rank whose gloo address appears in ``error``'s text (``[ip]:port``).

    Several ranks share a host's address: then ``candidates`` (the ranks it may be)
    decide, and without them the answer is ``None``.

    Example:
        >>> a = RankPlace(0, "a", "n1", "10.0.0.1", "", None)
        >>> roster = {0: a, 1: a.with_changes(rank=1, network="n2", address="10.0.0.2")}
        >>> rank_of_error("Connection closed by peer [10.0.0.2]:4711", roster)
        1
    """
    for match in _ADDRESS_IN_ERROR.finditer(str(error)):
        ranks = _ranks_at(match.group(1), roster)
        narrowed = [r for r in ranks if r in candidates] if candidates else ranks
        if len(narrowed) == 1:
            return narrowed[0]
    return None


def name_addresses(text: str, roster: Mapping[int, RankPlace], *,
                   candidates: Sequence[int] = ()) -> str:
    """``text`` with every ``[ip]:port`` of a rank's gloo address replaced by the rank
    (where several ranks share the address, the ``candidates`` among them).

    Example:
        >>> a = RankPlace(0, "a", "n1", "10.0.0.1", "", None)
        >>> roster = {0: a, 1: a.with_changes(rank=1, host="b", network="n2", address="10.0.0.2")}
        >>> name_addresses("Read error [10.0.0.2]:4711: Connection reset by peer", roster)
        'Read error rank 1 (on host b): Connection reset by peer'
    """

    def name(match: re.Match[str]) -> str:
        ranks = _ranks_at(match.group(1), roster)
        if len(ranks) > 1 and candidates:
            ranks = [r for r in ranks if r in candidates] or ranks
        if len(ranks) == 1:
            return describe_rank(ranks[0], roster)
        if ranks:
            host = roster[ranks[0]].host
            return f"one of ranks {', '.join(map(str, ranks))} (on host {host})"
        return match.group(0)

    return _ADDRESS_IN_ERROR.sub(name, text)


def read_roster(store: Store, world_size: int) -> dict[int, RankPlace]:
    """The roster that start-up left in ``store`` (empty where there is none). Never waits.

    Example (inside a job started by :func:`pipetrain.init_distributed`)::

        roster = read_roster(ctx.store, ctx.world_size)
        roster[1].host        # 'node-b'
    """
    keys = [_key(_FINAL_ROUND, r) for r in range(world_size)]
    try:
        if not all(store.check([k]) for k in keys):
            return {}
        return {r: RankPlace.from_json(v) for r, v in enumerate(store.multi_get(keys))}
    except Exception:  # the store may be gone; a roster only improves messages
        return {}


def exchange_places(store: Store, place: RankPlace, *, world_size: int, round_name: str,
                    deadline: float, timeout: float, where: str) -> dict[int, RankPlace]:
    """Publish ``place`` and return every rank's, waiting until ``deadline`` (monotonic).

    ``round_name`` keeps rounds apart (``"ready"`` is the roster that stays); ``where``
    names the store in messages.

    Raises:
        StartupTimeout: not every rank published in time; names the missing ranks.

    Example (in every rank, with the job's store)::

        places = exchange_places(store, mine, world_size=4, round_name="join",
                                 deadline=time.monotonic() + 60, timeout=60,
                                 where="node-a:29500")
    """
    try:
        store.set(_key(round_name, place.rank), place.to_json())
        count_key = _key(round_name, "count")
        arrived = store.add(count_key, 1)
        pause = 0.02
        while arrived < world_size:
            if time.monotonic() >= deadline:
                raise StartupTimeout(_missing_message(store, place, world_size=world_size,
                                                      round_name=round_name, timeout=timeout,
                                                      where=where))
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(0.5, pause * 1.5)
            arrived = store.add(count_key, 0)
        values = store.multi_get([_key(round_name, r) for r in range(world_size)])
        store.add(_key(round_name, "read"), 1)
    except StartupError:
        raise
    except RuntimeError as error:  # c10d's DistError: the store went away
        raise StartupError(
            f"rank {place.rank} (on host {place.host}) lost the job's store at {where} while "
            f"waiting for the other ranks ({brief(error)}): the process that hosts it has "
            "exited; its own error says why"
        ) from error
    return {r: RankPlace.from_json(v) for r, v in enumerate(values)}


def wait_until_read(store: Store, *, round_name: str, world_size: int, deadline: float) -> None:
    """Wait (until ``deadline`` at most) until every rank has read ``round_name``'s places.

    The rank that hosts the store calls it before leaving on an error that every rank
    finds from the places, so that the others read them and report it too, rather than
    losing the store.

    Example (in the rank that hosts the store)::

        wait_until_read(store, round_name="ready", world_size=4, deadline=time.monotonic() + 5)
    """
    key = _key(round_name, "read")
    try:
        while store.add(key, 0) < world_size and time.monotonic() < deadline:
            time.sleep(0.05)
    except RuntimeError:
        pass


def _missing_message(store: Store, place: RankPlace, *, world_size: int, round_name: str,
                     timeout: float, where: str) -> str:
    present: dict[int, RankPlace] = {}
    missing: list[int] = []
    for r in range(world_size):
        key = _key(round_name, r)
        if store.check([key]):
            present[r] = RankPlace.from_json(store.get(key))
        else:
            missing.append(r)
    hosts: dict[str, list[int]] = {}
    for r, p in present.items():
        hosts.setdefault(p.host, []).append(r)
    joined = "; ".join(f"{_ranks(rs)} on {host}" for host, rs in hosts.items())
    what = "to join the job" if round_name != _FINAL_ROUND else "to check their addresses"
    return (
        f"rank {place.rank} (on host {place.host}) waited {timeout:g} s (the timeout) for "
        f"{_ranks(missing)} of {world_size} {what} at the store {where} (arrived: {joined}). "
        "Fix: start every worker (under torchrun: the same command on each of the --nnodes "
        "hosts, with --nnodes x --nproc-per-node = the job's ranks), check that each host "
        "reaches the store's address, or raise the timeout (--timeout)"
    )


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks))

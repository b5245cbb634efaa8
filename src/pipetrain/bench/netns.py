"""Two hosts on one machine joined by a link of chosen bandwidth: network namespaces, a veth pair, tc.

Each host is a network namespace with its own hostname and hosts file (its own name
mapped to its link address, or with ``loopback_hostname`` to 127.0.1.1, the common VM and
container default that breaks gloo across hosts); the two reach each other only over a
veth pair, whose two ends can be shaped with a token bucket
(``tc qdisc add dev IFACE root tbf rate 100mbit burst 32kbit latency 50ms``, one per
direction). Needs Linux, root, iproute2 (``ip``, ``tc``) and util-linux (``unshare``,
``hostname``); :func:`shaped_link` raises :class:`LinkUnavailable` with the reason where
they are missing. Everything made is removed afterwards, the processes started in the
namespaces included.

Example (as root)::

    with shaped_link(rate_mbit=100) as link:
        a = link.popen(link.a, [sys.executable, "-m", "my.worker"], env=env_a)
        b = link.popen(link.b, [sys.executable, "-m", "my.worker"], env=env_b)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["Host", "LinkUnavailable", "ShapedLink", "link_unavailable_reason", "shaped_link"]

_NETNS_ETC = "/etc/netns"
_SUBNET = "10.213.9"  # private to the namespaces' own veth link
_TOOLS = ("ip", "tc", "unshare", "hostname")


class LinkUnavailable(RuntimeError):
    """The namespaces or the shaping cannot be made here (not root, tools missing, refused)."""


@dataclass(frozen=True)
class Host:
    """One end of the link: its namespace, hostname, address and interface."""

    netns: str
    name: str
    address: str
    interface: str


def _run(*argv: str, timeout: float = 20) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=timeout)


def link_unavailable_reason() -> str | None:
    """Why :func:`shaped_link` cannot work here, or None when it may.

    Example:
        >>> reason = link_unavailable_reason()
        >>> reason is None or isinstance(reason, str)
        True
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux-only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "creating network namespaces and shaping their link needs root"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"missing tools: {', '.join(missing)} (install iproute2 and util-linux)"
    return None


class ShapedLink:
    """Host ``a`` and host ``b`` and the link between them; :meth:`popen` starts a
    process on one of them."""

    def __init__(self, *, rate_mbit: float | None, loopback_hostname: bool = False) -> None:
        if rate_mbit is not None and not rate_mbit > 0:
            raise ValueError(f"rate_mbit={rate_mbit!r} must be a number > 0 (or None: unshaped)")
        tag = uuid.uuid4().hex[:6]
        self.rate_mbit = rate_mbit
        self.loopback_hostname = loopback_hostname
        self.a = Host(f"pipetrain-{tag}-a", f"node-{tag}-a", f"{_SUBNET}.1", f"pl{tag}a")
        self.b = Host(f"pipetrain-{tag}-b", f"node-{tag}-b", f"{_SUBNET}.2", f"pl{tag}b")
        self._made: list[str] = []
        self._processes: list[subprocess.Popen[str]] = []

    @property
    def bytes_per_second(self) -> float | None:
        """The shaped rate in bytes per second, each direction (None: unshaped)."""
        return None if self.rate_mbit is None else self.rate_mbit * 1e6 / 8

    def create(self) -> None:
        """Make the namespaces, the veth pair, the hosts files, and shape both ends."""
        for host in (self.a, self.b):
            _run("ip", "netns", "add", host.netns)
            self._made.append(host.netns)
        _run("ip", "link", "add", self.a.interface, "netns", self.a.netns, "type", "veth",
             "peer", "name", self.b.interface, "netns", self.b.netns)
        for host, other in ((self.a, self.b), (self.b, self.a)):
            _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _run("ip", "-n", host.netns, "link", "set", host.interface, "up")
            _run("ip", "-n", host.netns, "link", "set", "lo", "up")
            if self.rate_mbit is not None:  # egress of each end: one bucket per direction
                _run("tc", "-n", host.netns, "qdisc", "add", "dev", host.interface, "root",
                     "tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", "32kbit",
                     "latency", "50ms")
            etc = os.path.join(_NETNS_ETC, host.netns)
            os.makedirs(etc, exist_ok=True)
            with open(os.path.join(etc, "hosts"), "w") as f:
                own = "127.0.1.1" if self.loopback_hostname else host.address
                f.write(f"127.0.0.1 localhost\n{own} {host.name}\n"
                        f"{other.address} {other.name}\n")
            with open(os.path.join(etc, "resolv.conf"), "w") as f:  # no DNS: fail at once
                f.write("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        for host in self.a, self.b:  # the namespaces must be able to take their hostnames
            _run(*self._prefix(host), "true")

    def _prefix(self, host: Host) -> list[str]:
        # ip netns exec mounts /etc/netns/NAME/* over /etc; unshare --uts gives the host its
        # own hostname; both exec, so the process started is the program itself
        return ["ip", "netns", "exec", host.netns, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', host.name]

    def popen(self, host: Host, argv: Sequence[str], *, env: dict[str, str]) -> subprocess.Popen[str]:
        """Start ``argv`` on ``host`` (stdout and stderr together, as text)."""
        process = subprocess.Popen([*self._prefix(host), *argv], env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._processes.append(process)
        return process

    def delete(self) -> None:
        """Kill every process in the namespaces, then remove them and their files."""
        for netns in self._made:
            found = subprocess.run(["ip", "netns", "pids", netns], capture_output=True,
                                   text=True, timeout=20)
            for pid in found.stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        for process in self._processes:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.communicate(timeout=20)
        for netns in self._made:  # deleting a namespace deletes its end of the veth pair
            subprocess.run(["ip", "netns", "delete", netns], capture_output=True, timeout=20)
            shutil.rmtree(os.path.join(_NETNS_ETC, netns), ignore_errors=True)
        self._made.clear()


@contextlib.contextmanager
def shaped_link(*, rate_mbit: float | None,
                loopback_hostname: bool = False) -> Iterator[ShapedLink]:
    """Make two hosts joined by a link of ``rate_mbit`` megabits per second each way
    (None: unshaped), and remove them afterwards, whatever happens. With
    ``loopback_hostname`` each host's own name resolves to 127.0.1.1 (see above).

    Raises:
        LinkUnavailable: not Linux, not root, a tool missing, or the kernel refused
            (the message says which).
    """
    reason = link_unavailable_reason()
    if reason is not None:
        raise LinkUnavailable(reason)
    link = ShapedLink(rate_mbit=rate_mbit, loopback_hostname=loopback_hostname)
    try:
        try:
            link.create()
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as error:
            detail = getattr(error, "stderr", "") or str(error)
            raise LinkUnavailable(f"cannot create the shaped link: {str(detail).strip()}") from error
        yield link
    finally:
        link.delete()

"""Two "hosts" on one machine: network namespaces joined by a veth pair, each with its own
hostname and hosts file, for multi-host tests.

Each host sees only its own addresses and loopback. Its hosts file maps its own name to
127.0.1.1 (the common VM and container default that breaks gloo across hosts) and the
other host's name to that host's address. Needs root and iproute2; :func:`two_hosts`
raises :class:`NamespacesUnavailable` with the reason where they cannot be made.
Everything made is removed by :meth:`TwoHosts.delete`, processes included.
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

__all__ = ["Host", "NamespacesUnavailable", "TwoHosts", "two_hosts"]

_NETNS_ETC = "/etc/netns"
_SUBNET = "10.213.7"  # private to the namespaces' own veth link: no clash with anything


class NamespacesUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no iproute2, not permitted)."""


@dataclass(frozen=True)
class Host:
    netns: str
    name: str
    address: str
    interface: str


def _run(*argv: str, timeout: float = 20) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=timeout)


class TwoHosts:
    """Host ``a`` and host ``b``; :meth:`popen` starts a process on one of them."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.a = Host(f"pipetrain-{tag}-a", f"node-{tag}-a", f"{_SUBNET}.1", f"pt{tag}a")
        self.b = Host(f"pipetrain-{tag}-b", f"node-{tag}-b", f"{_SUBNET}.2", f"pt{tag}b")
        self._made: list[str] = []
        self._processes: list[subprocess.Popen[str]] = []

    def create(self) -> None:
        for host in (self.a, self.b):
            _run("ip", "netns", "add", host.netns)
            self._made.append(host.netns)
        _run("ip", "link", "add", self.a.interface, "netns", self.a.netns, "type", "veth",
             "peer", "name", self.b.interface, "netns", self.b.netns)
        for host, other in ((self.a, self.b), (self.b, self.a)):
            _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _run("ip", "-n", host.netns, "link", "set", host.interface, "up")
            _run("ip", "-n", host.netns, "link", "set", "lo", "up")
            etc = os.path.join(_NETNS_ETC, host.netns)
            os.makedirs(etc, exist_ok=True)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(f"127.0.0.1 localhost\n127.0.1.1 {host.name}\n{other.address} {other.name}\n")
            with open(os.path.join(etc, "resolv.conf"), "w") as f:  # no DNS: fail at once
                f.write("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        # the namespaces must also be able to take their own hostnames
        for host in (self.a, self.b):
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
            found = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True,
                                   timeout=20)
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
def two_hosts() -> Iterator[TwoHosts]:
    """Make two hosts, and remove them afterwards, whatever happens."""
    if not sys.platform.startswith("linux"):
        raise NamespacesUnavailable(f"network namespaces are Linux-only (this is {sys.platform})")
    if os.geteuid() != 0:
        raise NamespacesUnavailable("creating network namespaces needs root")
    missing = [tool for tool in ("ip", "unshare", "hostname") if shutil.which(tool) is None]
    if missing:
        raise NamespacesUnavailable(f"missing tools: {', '.join(missing)} (iproute2, util-linux)")
    hosts = TwoHosts()
    try:
        try:
            hosts.create()
        except (subprocess.CalledProcessError, OSError) as error:
            detail = getattr(error, "stderr", "") or str(error)
            raise NamespacesUnavailable(f"cannot create network namespaces: {detail.strip()}") from error
        yield hosts
    finally:
        hosts.delete()

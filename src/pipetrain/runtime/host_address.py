"""This host's network addresses: what gloo advertises, loopback, the route to a peer.

gloo picks the address it advertises to the other ranks itself: the first address of the
interfaces named by ``GLOO_SOCKET_IFNAME`` if that is set, else the first address this
host's *name* resolves to that it can bind. Many VM and container images map the
hostname to a loopback address (``127.0.1.1 myhost`` in ``/etc/hosts``), which ranks on
other hosts cannot reach. The functions here find out what gloo will advertise, whether
that is a loopback address, and which local address (and interface) routes to a peer, so
that start-up can say so, or use that interface, instead of hanging. Standard library
only; the interface look-up is Linux-only (elsewhere it finds nothing).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

__all__ = [
    "GLOO_INTERFACE_VARIABLE",
    "AdvertisedAddress",
    "gloo_address",
    "interface_address",
    "interface_of",
    "is_loopback",
    "network_id",
    "route_address",
]

GLOO_INTERFACE_VARIABLE = "GLOO_SOCKET_IFNAME"
"""The environment variable that names the interfaces gloo uses (comma-separated)."""

_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B
_IPV6_ADDRESSES = "/proc/net/if_inet6"


@dataclass(frozen=True)
class AdvertisedAddress:
    """The address gloo will advertise from this process, and where it comes from.

    ``address`` is ``None`` where it cannot be found out (gloo then fails on its own).
    ``source`` says why, for messages: ``"hostname 'node-a'"`` or
    ``"GLOO_SOCKET_IFNAME=eth0"``.
    """

    address: str | None
    source: str


def is_loopback(address: str | None) -> bool:
    """Whether ``address`` is a loopback address (127.0.0.0/8, ::1).

    Example:
        >>> is_loopback("127.0.1.1"), is_loopback("10.0.0.2"), is_loopback("::1")
        (True, False, True)
    """
    if not address:
        return False
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _bindable(family: int, sockaddr: tuple[object, ...]) -> bool:
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind(sockaddr)
        return True
    except OSError:
        return False


def _resolve_bindable(hostname: str) -> str | None:
    """The first address ``hostname`` resolves to that this process can bind (gloo's rule)."""
    try:
        infos = socket.getaddrinfo(hostname, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for family, _, _, _, sockaddr in infos:
        if family in (socket.AF_INET, socket.AF_INET6) and _bindable(family, (sockaddr[0], 0, *sockaddr[2:])):
            return str(sockaddr[0])
    return None


def gloo_address() -> AdvertisedAddress:
    """The address gloo will advertise from this process (see the module's docstring).

    Example:
        >>> isinstance(gloo_address().source, str)
        True
    """
    interfaces = os.environ.get(GLOO_INTERFACE_VARIABLE, "")
    if len(interfaces) > 1:  # torch ignores a one-character value
        first = interfaces.split(",")[0].strip()
        return AdvertisedAddress(interface_address(first),
                                 f"{GLOO_INTERFACE_VARIABLE}={interfaces}")
    hostname = socket.gethostname()
    address = _resolve_bindable(hostname)
    if address is None:  # torch falls back to the loopback address
        return AdvertisedAddress("127.0.0.1", f"hostname {hostname!r} (which resolves to no usable address)")
    return AdvertisedAddress(address, f"hostname {hostname!r}")


def route_address(host: str, port: int) -> str | None:
    """The local address this host uses to reach ``host`` (``None``: no route, or unknown).

    Sends nothing: connecting a UDP socket only asks the kernel for the route.

    Example:
        >>> route_address("127.0.0.1", 9)
        '127.0.0.1'
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(sockaddr)
                return str(s.getsockname()[0])
        except OSError:
            continue
    return None


def _ipv4_ioctl(name: str, request: int) -> str | None:
    packed = struct.pack("256s", name.encode()[:15])
    try:
        import fcntl  # POSIX only

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            answer = fcntl.ioctl(s.fileno(), request, packed)
    except (ImportError, OSError):
        return None
    return socket.inet_ntoa(answer[20:24])


def _ipv6_addresses() -> list[tuple[str, str]]:
    """(interface, address) of every IPv6 address, from /proc (Linux)."""
    try:
        with open(_IPV6_ADDRESSES) as f:
            lines = f.read().split("\n")
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split()
        if len(fields) == 6:
            raw = fields[0]
            text = ":".join(raw[i:i + 4] for i in range(0, 32, 4))
            found.append((fields[5], str(ipaddress.ip_address(text))))
    return found


def interface_address(name: str) -> str | None:
    """The address gloo takes from interface ``name`` (its IPv4 address, else IPv6).

    ``None`` where it has none, there is no such interface, or off Linux.

    Example:
        >>> interface_address("lo") in (None, "127.0.0.1")
        True
    """
    address = _ipv4_ioctl(name, _SIOCGIFADDR)
    if address is not None:
        return address
    for interface, v6 in _ipv6_addresses():
        if interface == name and not ipaddress.ip_address(v6).is_link_local:
            return v6
    return None


def interface_of(address: str) -> str | None:
    """The network interface whose address gloo would take to be ``address`` (or its subnet).

    ``None`` where no interface holds it, or off Linux.

    Example:
        >>> interface_of("127.0.0.1") in (None, "lo")
        True
    """
    try:
        wanted = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return None
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    if wanted.version == 6:
        for interface, v6 in _ipv6_addresses():
            if ipaddress.ip_address(v6) == wanted and interface_address(interface) == v6:
                return interface
        return None
    in_subnet = None
    for name in names:
        own = _ipv4_ioctl(name, _SIOCGIFADDR)
        if own is None:
            continue
        if ipaddress.ip_address(own) == wanted:
            return name
        mask = _ipv4_ioctl(name, _SIOCGIFNETMASK)
        if mask is not None and in_subnet is None and not is_loopback(own):
            if wanted in ipaddress.ip_network(f"{own}/{mask}", strict=False):
                in_subnet = name  # a secondary address: gloo would take the primary one
    return in_subnet


def network_id() -> str:
    """Which network stack this process is in: processes with the same id can reach each
    other over loopback, processes with different ids (other hosts, containers, network
    namespaces) cannot.

    Example:
        >>> network_id() == network_id()
        True
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net")
        return f"{boot}/{netns.st_dev}:{netns.st_ino}"
    except OSError:
        return socket.gethostname()

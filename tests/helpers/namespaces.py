"""Two "hosts" on one machine for multi-host tests: :mod:`pipetrain.bench.netns`'s link,
unshaped, with each host's own name on 127.0.1.1 (the common VM and container default
that breaks gloo across hosts) and the other host's name on that host's address."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from pipetrain.bench.netns import Host, LinkUnavailable, ShapedLink, shaped_link

__all__ = ["Host", "NamespacesUnavailable", "TwoHosts", "two_hosts"]

NamespacesUnavailable = LinkUnavailable
TwoHosts = ShapedLink


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """Make two hosts, and remove them afterwards, whatever happens."""
    with shaped_link(rate_mbit=None, loopback_hostname=True) as link:
        yield link

"""What ``linkemu`` builds, as plain data: namespaces, links, rates and the commands.

Flat (one "node"): every rank has its own network namespace, joined by a veth pair to a
bridge in a hub namespace; the rank's link is rate-limited with ``tc tbf`` on both ends
(the rank side shapes what it sends, the hub side what it receives). Two levels
(``nodes`` > 1): ranks are split into consecutive groups, one hub bridge per node (links
inside a node fast or at ``rate``), and every node hub joins a core bridge through a trunk
limited to ``inter_rate`` on both ends, so traffic between nodes shares that trunk.
Everything lives inside namespaces named ``{prefix}-...``; nothing touches the host's own
interfaces. Addresses are 10.213.0.0/16 inside those namespaces only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from commpress.errors import ConfigError

__all__ = ["Link", "LinkLayout", "burst_for", "parse_rate"]

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$", re.IGNORECASE)
_UNIT = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
IFACE = "eth0"  # the rank's interface inside its namespace (GLOO_SOCKET_IFNAME)
BRIDGE = "br0"


def parse_rate(text: str | None, what: str = "rate") -> int | None:
    """``"100mbit"`` -> 100_000_000 bits/s; ``None``, ``"none"`` or ``"0"`` -> unlimited (None)."""
    if text is None or text.strip().lower() in ("none", "0", ""):
        return None
    m = _RATE.match(text.strip())
    if not m:
        raise ConfigError(f"{what} = {text!r} is not accepted; expected a tc rate like 100mbit, 1gbit, 500kbit, or none")
    bits = int(float(m.group(1)) * _UNIT[m.group(2).lower()])
    if bits < 8000:
        raise ConfigError(f"{what} = {text!r} is not accepted; expected at least 8kbit")
    return bits


def burst_for(bits: int) -> int:
    """tbf bucket size in bytes: 4 ms of traffic, at least 128 KiB (measured on this kernel:
    512 KiB at 1 Gbit/s and 128 KiB at 100 Mbit/s hold the rate without starving TCP)."""
    return max(bits // 8 // 250, 128 * 1024)


@dataclass(frozen=True)
class Link:
    """A veth pair: ``a`` in namespace ``ns_a``, ``b`` in ``ns_b`` (enslaved to its bridge),
    rate-limited to ``rate`` bits/s on both ends (None: unlimited); a ``trunk`` joins two
    bridges (``a`` is enslaved too)."""

    ns_a: str
    a: str
    ns_b: str
    b: str
    rate: int | None
    trunk: bool = False


@dataclass(frozen=True)
class LinkLayout:
    """``world_size`` ranks, ``rates[r]`` the link of rank r, in ``nodes`` groups."""

    prefix: str
    world_size: int
    rates: tuple[int | None, ...]
    nodes: int = 1
    inter_rate: int | None = None

    @classmethod
    def build(
        cls,
        prefix: str,
        world_size: int,
        rate: str | None = None,
        nodes: int = 1,
        inter_rate: str | None = None,
    ) -> LinkLayout:
        """Validate the command-line form: ``rate`` is one tc rate for every rank or one per
        rank, comma-separated."""
        if world_size < 1 or world_size > 1000:
            raise ConfigError(f"ranks = {world_size} is not accepted; expected 1 to 1000")
        if nodes < 1 or world_size % nodes:
            raise ConfigError(f"nodes = {nodes} is not accepted; expected a divisor of ranks = {world_size}")
        parts = [p.strip() for p in rate.split(",")] if rate else [None]
        if len(parts) not in (1, world_size):
            raise ConfigError(f"rate = {rate!r} is not accepted; expected one rate or {world_size} comma-separated rates")
        rates = tuple(parse_rate(p, "rate") for p in parts) * (world_size if len(parts) == 1 else 1)
        if nodes == 1 and inter_rate is not None:
            raise ConfigError("inter_rate needs nodes > 1 (the link between nodes)")
        return cls(prefix, world_size, rates, nodes, parse_rate(inter_rate, "inter_rate"))

    # names -----------------------------------------------------------------------------
    def rank_ns(self, rank: int) -> str:
        return f"{self.prefix}-r{rank}"

    def hub_ns(self, node: int) -> str:
        return f"{self.prefix}-hub{node}"

    @property
    def core_ns(self) -> str:
        return f"{self.prefix}-core"

    def node_of(self, rank: int) -> int:
        return rank // (self.world_size // self.nodes)

    def address(self, rank: int) -> str:
        return f"10.213.{rank // 250}.{rank % 250 + 1}"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace, in creation order."""
        hubs = [self.hub_ns(n) for n in range(self.nodes)]
        core = [self.core_ns] if self.nodes > 1 else []
        return [*core, *hubs, *(self.rank_ns(r) for r in range(self.world_size))]

    @property
    def links(self) -> list[Link]:
        out = [Link(self.rank_ns(r), IFACE, self.hub_ns(self.node_of(r)), f"r{r}", self.rates[r]) for r in range(self.world_size)]
        if self.nodes > 1:
            out += [Link(self.hub_ns(n), "uplink", self.core_ns, f"n{n}", self.inter_rate, trunk=True) for n in range(self.nodes)]
        return out

    # commands --------------------------------------------------------------------------
    def setup_commands(self) -> list[list[str]]:
        """``ip``/``tc`` commands that build the topology, in order (namespaces first)."""
        cmds = [["ip", "netns", "add", ns] for ns in self.namespaces]
        for ns in self.namespaces:
            cmds.append(["ip", "-n", ns, "link", "set", "lo", "up"])
        for ns in [*([self.core_ns] if self.nodes > 1 else []), *(self.hub_ns(n) for n in range(self.nodes))]:
            cmds.append(["ip", "-n", ns, "link", "add", BRIDGE, "type", "bridge"])
            cmds.append(["ip", "-n", ns, "link", "set", BRIDGE, "up"])
        for link in self.links:
            cmds.append(
                ["ip", "-n", link.ns_a, "link", "add", link.a, "type", "veth", "peer", "name", link.b, "netns", link.ns_b]
            )
            cmds.append(["ip", "-n", link.ns_b, "link", "set", link.b, "master", BRIDGE])
            if link.trunk:  # both ends on bridges
                cmds.append(["ip", "-n", link.ns_a, "link", "set", link.a, "master", BRIDGE])
            for ns, dev in ((link.ns_a, link.a), (link.ns_b, link.b)):
                cmds.append(["ip", "-n", ns, "link", "set", dev, "up"])
                if link.rate is not None:
                    rate = f"{link.rate}bit"
                    burst = str(burst_for(link.rate))
                    cmds.append(
                        [
                            "tc",
                            "-n",
                            ns,
                            "qdisc",
                            "add",
                            "dev",
                            dev,
                            "root",
                            "tbf",
                            "rate",
                            rate,
                            "burst",
                            burst,
                            "latency",
                            "100ms",
                        ]
                    )
        for r in range(self.world_size):
            cmds.append(["ip", "-n", self.rank_ns(r), "addr", "add", f"{self.address(r)}/16", "dev", IFACE])
        return cmds

    def rank_env(self, rank: int, port: int) -> dict[str, str]:
        """What a rank's command needs to join torch.distributed over its own link."""
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(self.world_size),  # all share this machine's cores
            "MASTER_ADDR": self.address(0),
            "MASTER_PORT": str(port),
            "COMMPRESS_LINKEMU_ADDR": self.address(rank),  # this rank's own address (a store others reach)
            "GLOO_SOCKET_IFNAME": IFACE,
            "COMMPRESS_LINKEMU_NODE": str(self.node_of(rank)),
            "COMMPRESS_LINK": self.label,
        }

    @property
    def label(self) -> str:
        """A short name of the links, e.g. ``100mbit``, ``unlimited``, ``2 nodes, 100mbit between``."""

        def short(rate: int | None) -> str:
            if rate is None:
                return "unlimited"
            for unit, size in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
                if rate >= size:
                    return f"{rate / size:g}{unit}"
            return f"{rate}bit"

        links = short(self.rates[0]) if len(set(self.rates)) == 1 else ",".join(short(r) for r in self.rates)
        if self.nodes == 1:
            return links
        return f"{self.nodes} nodes, {short(self.inter_rate)} between, {links} inside"

    def describe(self) -> str:
        """One line per link, for the log."""

        def show(rate: int | None) -> str:
            return "unlimited" if rate is None else f"{rate / 1e6:g} Mbit/s"

        lines = [f"rank {r} ({self.address(r)}, node {self.node_of(r)}): {show(self.rates[r])}" for r in range(self.world_size)]
        if self.nodes > 1:
            lines.append(f"between nodes: {show(self.inter_rate)} per node uplink")
        return "\n".join(lines)

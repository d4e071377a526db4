"""Real slow links on one machine: a network namespace per rank, ``tc tbf`` on every link.

See :class:`Topology` (what is built) and :class:`Network` (building it, running one
command per rank, always removing it). ``commpress linkemu`` is the command line.
"""

from commpress.linkemu.network import LinkEmuError, Network, check_can_run
from commpress.linkemu.topology import Topology, parse_rate

__all__ = ["LinkEmuError", "Network", "Topology", "check_can_run", "parse_rate"]

"""Real slow links on one machine: a network namespace per rank, ``tc tbf`` on every link.

See :class:`LinkLayout` (what is built) and :class:`Network` (building it, running one
command per rank, always removing it). ``commpress linkemu`` is the command line.
"""

from commpress.linkemu.layout import LinkLayout, parse_rate
from commpress.linkemu.network import LinkEmuError, Network, check_can_run

__all__ = ["LinkEmuError", "LinkLayout", "Network", "check_can_run", "parse_rate"]

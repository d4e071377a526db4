"""Run a command once per rank over real rate-limited links (network namespaces + tc tbf).

Needs root. Builds one network namespace per rank joined through a bridge, limits each
rank's link with ``tc tbf`` (``--rate``: one rate, or one per rank), optionally groups the
ranks into ``--nodes`` with fast links inside a node and ``--inter-rate`` between nodes,
runs the command (default: ``python -m commpress bench``) in every rank's namespace with
RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and GLOO_SOCKET_IFNAME set, and removes
everything it created when the command ends, fails or is interrupted. Example::

    sudo commpress linkemu --ranks 4 --rate 100mbit -- python -m commpress bench --scale 0.05
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from commpress.bench.arguments import integer, number

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=integer(1), default=2, help="ranks, one namespace each (default 2)")
    parser.add_argument(
        "--rate",
        help="tc rate of every rank's link (e.g. 100mbit, 1gbit; 'none' = unlimited), or one per rank, comma-separated "
        "(with --nodes: the links inside a node, default unlimited)",
    )
    parser.add_argument("--nodes", type=integer(1), default=1, help="group ranks into this many nodes (consecutive ranks)")
    parser.add_argument("--inter-rate", help="with --nodes: rate of each node's uplink to the others (e.g. 100mbit)")
    parser.add_argument("--port", type=integer(1, 65535), default=29500, help="MASTER_PORT (default 29500)")
    parser.add_argument("--timeout", type=number(0), help="stop the ranks after this many seconds")
    parser.add_argument("--logs", metavar="DIR", help="where ranks other than 0 write their output (default: a temp folder)")
    parser.add_argument("--remove-stale", action="store_true", help="only delete namespaces left by killed linkemu runs")
    parser.add_argument("cmd", metavar="command", nargs=argparse.REMAINDER, help="the command to run per rank, after --")


def _raise_on(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace) -> int:
    from commpress.linkemu import LinkEmuError, LinkLayout, Network
    from commpress.linkemu.network import remove_stale

    if args.remove_stale:
        try:
            gone = remove_stale()
        except LinkEmuError as exc:
            print(f"commpress linkemu: {exc}", file=sys.stderr)
            return 2
        print(f"commpress linkemu: removed {len(gone)} stale namespaces {' '.join(gone)}".rstrip(), file=sys.stderr)
        return 0

    command = list(args.cmd)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        command = [sys.executable, "-m", "commpress", "bench"]
    layout = LinkLayout.build(f"cpe{os.getpid()}", args.ranks, args.rate, args.nodes, args.inter_rate)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on)
    # a process started in the background by a shell inherits SIGINT ignored: restore
    # Ctrl-C explicitly so an interrupt always reaches the clean-up below
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with Network(layout) as net:
            print(f"commpress linkemu: {args.ranks} ranks\n{layout.describe()}", file=sys.stderr)
            return net.run(command, port=args.port, timeout=args.timeout, log_dir=args.logs)
    except LinkEmuError as exc:
        print(f"commpress linkemu: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("commpress linkemu: interrupted; namespaces removed", file=sys.stderr)
        return 130

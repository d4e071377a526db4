"""The ``commpress`` command: ``commpress demo``, ``commpress bench``, ..."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

#: Subcommand name -> module with ``add_arguments(parser)`` and ``run(args) -> int``.
COMMANDS = {
    "demo": "commpress.cli.demo",
    "bench": "commpress.cli.bench",
    "linkemu": "commpress.cli.linkemu",
    "bandwidth": "commpress.cli.bandwidth",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script and of ``python -m commpress``."""
    parser = argparse.ArgumentParser(prog="commpress", description="Communication compression for PyTorch DDP/FSDP.")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, path in COMMANDS.items():
        module = importlib.import_module(path)
        modules[name] = module
        module.add_arguments(sub.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__))
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""The ``commpress`` command: ``commpress demo``, ``commpress bench``, ...

Every command checks its whole command line before it starts a rank: a bad value ends the
command with one line on standard error, naming the option, and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import textwrap
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

from commpress.errors import ConfigError

__all__ = ["build_parser", "main", "plain", "summary"]

#: Subcommand name -> module with ``add_arguments(parser)`` and ``run(args) -> int``;
#: ``run`` raises :class:`ConfigError` for bad input before it starts any rank.
COMMANDS = {
    "demo": "commpress.cli.demo",
    "bench": "commpress.cli.bench",
    "race": "commpress.cli.race",
    "bench-fsdp": "commpress.cli.bench_fsdp",
    "linkemu": "commpress.cli.linkemu",
    "bandwidth": "commpress.cli.bandwidth",
    "quality": "commpress.cli.quality",
}


class UsageError(Exception):
    """The command line does not parse (unknown option, missing or malformed value)."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors become :class:`UsageError` (one line) instead of usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


#: reST roles (``:mod:`x```, ``:class:`~a.B```) and inline literals (````x````).
_MARKUP = re.compile(r":[a-z]+:`(~?)([^`]+)`|``([^`]+)``")


def plain(text: str) -> str:
    """``text`` without reST markup: roles and literals become their text (``~a.B`` -> ``B``),
    and a paragraph's closing ``::`` (a literal block follows) becomes ``:``."""

    def unmark(m: re.Match[str]) -> str:
        if m.group(3) is not None:
            return m.group(3)
        return m.group(2).rpartition(".")[2] if m.group(1) else m.group(2)

    return re.sub(r"::$", ":", _MARKUP.sub(unmark, text), flags=re.M)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Plain text: descriptions' paragraphs filled to the width, indented blocks (examples)
    kept line by line; nothing broken at a hyphen (``torch-powersgd``)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = [p.strip("\n") for p in re.split(r"\n\s*\n", plain(text)) if p.strip()]
        fill = textwrap.TextWrapper(width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False).fill
        return "\n\n".join(textwrap.indent(p, indent) if p[0].isspace() else fill(" ".join(p.split())) for p in paragraphs)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(plain(text).split()), width, break_on_hyphens=False)


def summary(doc: str | None) -> str:
    """The first sentence of a module docstring, on one line (a command's ``--help`` entry)."""
    paragraph = " ".join((doc or "").strip().split("\n\n")[0].split())
    head, dot, _ = paragraph.partition(". ")
    return head + "." if dot else paragraph


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, ModuleType], dict[str, argparse.ArgumentParser]]:
    """The ``commpress`` parser, each command's module and each command's parser. Loads no
    torch: a command module imports what it runs inside ``run``, so ``--help`` and a bad
    option answer at once."""
    parser = _Parser(prog="commpress", description=__doc__, formatter_class=_Formatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    modules, parsers = {}, {}
    for name, path in COMMANDS.items():
        modules[name] = importlib.import_module(path)
        parsers[name] = sub.add_parser(
            name, help=summary(modules[name].__doc__), description=modules[name].__doc__, formatter_class=_Formatter
        )
        modules[name].add_arguments(parsers[name])
    return parser, modules, parsers


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script and of ``python -m commpress``: the exit status."""
    parser, modules, parsers = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # named by the command they were given to
            parsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        return int(modules[args.command].run(args) or 0)
    except UsageError as exc:
        print(_one_line(str(exc)), file=sys.stderr)
    except ConfigError as exc:
        print(_one_line(f"commpress {args.command}: {exc}"), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

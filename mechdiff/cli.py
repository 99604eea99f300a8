"""The ``mechdiff`` command. Each subcommand lives in ``mechdiff/commands/<name>.py``
and registers itself with ``register(subparsers)``."""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys
from typing import Optional, Sequence

from . import commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mechdiff", description="Compare the mechanisms inside checkpoints of one language model.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what each stage does and skips")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{commands.__name__}.{info.name}").register(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, KeyError, FileNotFoundError) as err:
        if args.verbose:
            raise
        print(f"mechdiff {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

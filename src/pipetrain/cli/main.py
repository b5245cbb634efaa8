"""``pipetrain``: the command's entry point and its sub-command table."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

# sub-command -> module with ``add_parser(subparsers)`` and ``run(args) -> int``
_COMMANDS = {
    "train": "pipetrain.cli.train",
    "simulate": "pipetrain.cli.simulate",
    "sample": "pipetrain.cli.sample",
    "plan": "pipetrain.cli.plan",
    "profile": "pipetrain.cli.profile",
    "bench": "pipetrain.cli.bench",
}


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, one sub-parser per command."""
    parser = argparse.ArgumentParser(
        prog="pipetrain",
        description="Pipeline-parallel training in PyTorch: train, profile, plan, simulate "
                    "schedules, sample.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _COMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
            continue  # command not built yet
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``pipetrain`` command; returns the process exit status.

    Example:
        >>> main(["simulate", "--schedule", "gpipe", "--stages", "2", "--microbatches", "4"])  # doctest: +SKIP
    """
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.command is None:
        parser.print_help()
        return 2
    status: int = args.run(args)
    return status

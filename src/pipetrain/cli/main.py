"""``pipetrain``: the command's entry point and its sub-command table."""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import platform
import re
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any

import pipetrain

__all__ = ["build_parser", "closest_option", "main", "version_line"]

# sub-command -> module with ``add_parser(subparsers)`` and ``run(args) -> int``
_COMMANDS = {
    "train": "pipetrain.cli.train",
    "simulate": "pipetrain.cli.simulate",
    "sample": "pipetrain.cli.sample",
    "plan": "pipetrain.cli.plan",
    "profile": "pipetrain.cli.profile",
    "bench": "pipetrain.cli.bench",
}


class _CommandParser(argparse.ArgumentParser):
    """The top-level parser: an option no sub-command knows is reported by that
    sub-command's parser (its usage, not the top level's), with the closest option."""

    commands: Mapping[str, argparse.ArgumentParser] = {}

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self.commands.get(getattr(parsed, "command", None) or "")
            owner = command if command is not None else self
            message = f"unrecognized arguments: {' '.join(extras)}"
            unknown = next((extra for extra in extras if extra.startswith("-")), None)
            suggestion = None if unknown is None else closest_option(owner, unknown)
            if suggestion is not None:
                message += f"; did you mean {suggestion}?"
            owner.error(message)
        return parsed


def closest_option(parser: argparse.ArgumentParser, given: str) -> str | None:
    """The option of ``parser`` (as its usage lists it) closest to the mistyped ``given``,
    or None when none is close.

    Example:
        >>> closest_option(build_parser().commands["train"], "--stage=4")
        '--stages'
    """
    options = re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", parser.format_usage())
    name = given.split("=", 1)[0]
    found = difflib.get_close_matches(name, sorted(set(options)), n=1, cutoff=0.6)
    return found[0] if found else None


def version_line() -> str:
    """What ``pipetrain --version`` prints: pipetrain's version, torch's and Python's.

    Example:
        >>> version_line().startswith(f"pipetrain {pipetrain.__version__} (torch ")
        True
    """
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return (f"pipetrain {pipetrain.__version__} (torch {torch_version}, "
            f"Python {platform.python_version()})")


class _Version(argparse.Action):
    """``--version``: print :func:`version_line` and exit."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        sys.stdout.write(version_line() + "\n")
        parser.exit()


def build_parser() -> _CommandParser:
    """The full argument parser, one sub-parser per command (``.commands``: by name)."""
    parser = _CommandParser(
        prog="pipetrain",
        description="Pipeline-parallel training in PyTorch: train, profile, plan, simulate "
                    "schedules, sample.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--version", action=_Version,
                        help="print the versions of pipetrain, torch and Python, and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in _COMMANDS.values():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
            continue  # command not built yet
        module.add_parser(subparsers)
    parser.commands = subparsers.choices
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``pipetrain`` command; returns the process exit status (130 after a
    Ctrl-C that no command handles itself: one line, no traceback).

    Example:
        >>> main(["simulate", "--schedule", "gpipe", "--stages", "2", "--microbatches", "4"])  # doctest: +SKIP
    """
    try:
        return _main(argv)
    except KeyboardInterrupt:
        sys.stderr.write("pipetrain: interrupted by SIGINT\n")
        return 128 + 2


def _main(argv: Sequence[str] | None) -> int:
    from pipetrain.cli.interrupts import deferred_interrupt

    with deferred_interrupt():  # the commands' modules import torch, which could lose a Ctrl-C
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

"""``pipetrain train --config run.toml``: a run's options in a TOML file.

Every option of ``pipetrain train`` but ``--config`` itself may be set, by its name with
dashes or underscores (``batch-size`` or ``batch_size``), at the top level or in any
table (tables only group: ``[pipeline] stages = 4`` is ``stages = 4``)::

    # run.toml
    steps = 2000
    [pipeline]
    stages = 4
    schedule = "zb-h1"
    [model]
    layers = 8
    width = 256

Values are checked exactly as on the command line (the same conversions and limits);
flags given on the command line override the file. The file is read with the standard
library (``tomllib``; the ``tomli`` package on Python 3.10).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import Any, NoReturn

__all__ = ["read_config_file"]


def _toml() -> Any:
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    import tomli  # the tomllib of Python 3.10

    return tomli


def _flatten(table: dict[str, Any], where: str, out: dict[str, tuple[str, Any]],
             problems: list[str]) -> None:
    for key, value in table.items():
        shown = f"{where}.{key}" if where else key
        if isinstance(value, dict):
            _flatten(value, shown, out, problems)
            continue
        name = key.replace("-", "_")
        if name in out:
            problems.append(f"{shown} sets {key!r} a second time (first as {out[name][0]})")
        out[name] = (shown, value)


def _tokens(option: str, value: Any, *, flag: bool) -> list[str]:
    if flag:
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, got {value!r}")
        return [option] if value else []
    if isinstance(value, list) and value and all(
            isinstance(v, (int, float, str)) and not isinstance(v, bool) for v in value):
        return [option, *map(str, value)]  # an option of several values (betas = [0.9, 0.95])
    if isinstance(value, bool) or isinstance(value, (list, dict)):
        raise ValueError(f"must be a number or a string, got {value!r}")
    return [f"{option}={value}"]


class _Stop(Exception):
    """argparse's ``error()``, as an exception instead of an exit."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _Stop(message)


def read_config_file(path: str) -> tuple[argparse.Namespace | None, list[str]]:
    """The options set in the TOML file ``path`` (parsed as the command line's, so every
    value is checked the same way; ``given`` names them), and the problems, each naming
    the file, the key and the fix.

    Example::

        values, problems = read_config_file("run.toml")
        values.stages, values.given    # 4, {'stages', 'steps', ...}
    """
    from pipetrain.cli.run_config import RunConfig
    from pipetrain.cli.train_options import add_train_arguments

    names = set(RunConfig.option_names()) - {"stage_replicas"}
    try:
        with open(path, "rb") as file:
            data = _toml().load(file)
    except FileNotFoundError:
        return None, [f"--config {path!r}: no such file"]
    except OSError as error:
        return None, [f"--config {path!r}: {error.strerror or error}"]
    except Exception as error:  # tomllib.TOMLDecodeError
        return None, [f"--config {path!r} is not valid TOML: {error}"]
    settings: dict[str, tuple[str, Any]] = {}
    problems: list[str] = []
    _flatten(data, "", settings, problems)
    argv: list[str] = []
    for name, (shown, value) in settings.items():
        if name == "config":
            problems.append(f"{path}: {shown}: a config file cannot name another; fix: remove it")
            continue
        if name not in names:
            close = difflib.get_close_matches(name, sorted(names), n=2)
            hint = (f"; did you mean {' or '.join(repr(c.replace('_', '-')) for c in close)}?"
                    if close else "")
            problems.append(f"{path}: {shown} is not an option of pipetrain train{hint}")
            continue
        try:
            argv += _tokens("--" + name.replace("_", "-"), value, flag=name in _FLAGS)
        except ValueError as error:
            problems.append(f"{path}: {shown} {error}")
    if problems:
        return None, problems
    parser = _Parser(prog="pipetrain train", add_help=False)
    add_train_arguments(parser)
    try:
        return parser.parse_args(argv), []
    except _Stop as error:
        text = str(error).replace("argument --", "")
        return None, [f"{path}: {text}"]


_FLAGS = frozenset({"vertical_sync", "fsdp", "fsdp_reshard", "fsdp_reduce_each_microbatch",
                    "sequence_parallel"})
"""Options that are on/off switches (``true`` / ``false`` in the file)."""

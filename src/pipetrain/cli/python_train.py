"""``pipetrain.train(...)``: the whole of ``pipetrain train`` from Python, in one call.

For scripts and notebooks: the options of ``pipetrain train`` as keyword arguments
(``stages=2``, ``lr_schedule="linear"``, ``betas=(0.9, 0.95)``, ``compile=True``), and
``model`` as the function that builds it (defined at the top level of a file, as
``--model FILE.py:FUNCTION`` names it: it may return ``train_data``, an ``optimizer``...,
see ``docs/user-models.md``). It runs the very command a user would type, in a new
process that launches the workers, so everything the command does holds: the run folder
and its records, checkpoints, ``resume=``, the checks before any worker starts, a dead
worker named in bounded time, Ctrl-C saving at the next step. Its progress goes to this
process's stderr as it comes.

Models cannot be passed as objects: each worker builds its own stage (and only that), in
its own process, from the function.
"""

from __future__ import annotations

import difflib
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TrainFailed", "TrainedRun", "train"]


@dataclass(frozen=True)
class TrainedRun:
    """A finished run: its folder and what ``metrics.json`` records."""

    folder: str
    metrics: dict[str, Any] = field(repr=False)

    @property
    def losses(self) -> list[float | None]:
        """Each step's training loss, first step first (a resumed run's whole history)."""
        return [step.get("loss") for step in self.metrics.get("steps", [])]


class TrainFailed(RuntimeError):
    """``pipetrain train`` ended without finishing: ``status`` is its exit status (2: the
    options or the folder were refused), the message its last lines."""

    def __init__(self, message: str, *, status: int, folder: str | None) -> None:
        super().__init__(message)
        self.status, self.folder = status, folder


def _model_spec(model: str | Callable[..., Any]) -> str:
    """``model`` as ``--model`` takes it (a function as ``FILE.py:NAME``)."""
    if isinstance(model, str):
        return model
    if not callable(model):
        raise TypeError(f"model={model!r} must be a name (gpt, hf-gpt2, a folder) or the "
                        "function that builds the model")
    name = getattr(model, "__qualname__", "")
    path = inspect.getsourcefile(model) if inspect.isfunction(model) else None
    if path is None or not name.isidentifier() or not path.endswith(".py"):
        raise ValueError(f"model={model!r} must be a function defined at the top level of a .py "
                         "file (each worker imports it from there): not a lambda, a nested "
                         "function, a method or one typed into the interpreter; fix: move it "
                         "into a file, e.g. my_model.py, and pass my_model.build")
    return f"{os.path.abspath(path)}:{name}"


def _argv(options: dict[str, Any]) -> list[str]:
    """The command line of ``options`` (checked by name here, by value by the command)."""
    from pipetrain.cli.run_config import RunConfig

    known = [name for name in RunConfig.option_names() if name != "config"]
    argv: list[str] = []
    for name, value in options.items():
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            raise TypeError(f"train() got an option pipetrain train does not have: {name!r}"
                            + (f" (did you mean {close[0]!r}?)" if close else "")
                            + "; `pipetrain train --help` lists them (--lr-schedule is "
                            "lr_schedule=)")
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, Sequence) and not isinstance(value, str):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def train(model: str | Callable[..., Any] = "gpt", *, out: str | os.PathLike[str] | None = None,
          **options: Any) -> TrainedRun:
    """Run ``pipetrain train`` with these options; the finished run.

    Raises:
        TypeError: an option ``pipetrain train`` does not have.
        ValueError: ``model`` is a function that cannot be imported by name.
        TrainFailed: the command refused the options or the run failed (its message).

    Example::

        import pipetrain
        from my_model import build          # def build(vocab_size, context): ...

        run = pipetrain.train(build, stages=2, steps=200, lr_schedule="linear",
                              out="runs/first")
        print(run.losses[-1], run.folder)
        more = pipetrain.train(resume=run.folder, steps=400)   # continues it
    """
    argv = _argv(options)
    if "resume" not in options or model != "gpt":
        argv = ["--model", _model_spec(model), *argv]
    if out is not None:
        argv += ["--out", os.fspath(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    command = [sys.executable, "-m", "pipetrain", "train", *argv]
    tail: list[str] = []
    started = ""
    with subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env) as process:
        assert process.stderr is not None
        for line in process.stderr:  # shown as it comes, the last lines kept for an error
            sys.stderr.write(line)
            tail = [*tail, line.rstrip("\n")][-20:]
            if line.startswith("pipetrain train: starting "):
                started = line.rstrip("\n")
        status = process.wait()
    folder = _folder([started], out)
    if status != 0:
        errors = [line for line in tail if "error" in line.lower()] or tail[-3:]
        raise TrainFailed("\n".join(errors) or f"pipetrain train exited {status}",
                          status=status, folder=folder)
    assert folder is not None, "a finished run names its folder"
    with open(os.path.join(folder, "metrics.json")) as file:
        return TrainedRun(folder=folder, metrics=json.load(file))


def _folder(lines: list[str], out: str | os.PathLike[str] | None) -> str | None:
    """The run folder the launcher names (``... starting N workers (...) into DIR``),
    else ``out``."""
    for line in lines:
        if line.startswith("pipetrain train: starting ") and " into " in line:
            return line.rsplit(" into ", 1)[1]
    return None if out is None else os.fspath(out)

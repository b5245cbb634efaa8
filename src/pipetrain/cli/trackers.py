"""Experiment trackers beside TensorBoard: the same step scalars to Weights & Biases or MLflow.

``pipetrain train --log tensorboard,wandb,mlflow`` (any of them; ``none`` for none) sends
each step's scalars (``train/loss``, ``train/lr``... as TensorBoard's tags) and every
rank's peak memory to each tracker named, from rank 0. Nothing needs a network:

- ``wandb`` runs offline unless ``WANDB_MODE`` says otherwise, its files in the run folder
  (``wandb/``); ``wandb sync`` uploads them later. The run's options are its config.
- ``mlflow`` logs to ``MLFLOW_TRACKING_URI`` if set, else to ``mlruns/`` in the run folder
  (``mlflow ui --backend-store-uri RUN/mlruns``). The options are its parameters.

A resumed run continues the same tracker run (its id is kept in the run folder's
``trackers.json``). A tracker whose package is not installed is named once at start-up
(with the ``pip install`` that adds it) and the run trains without it; one that fails
while the run trains is warned about once and dropped, never stopping the run.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from pipetrain.cli.run_logs import TensorBoardLog, step_scalars

__all__ = ["TRACKERS", "MlflowLog", "WandbLog", "open_trackers", "tracker_problem"]

logger = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "wandb", "mlflow")
"""The trackers ``--log`` names (and ``none``)."""
_IDS = "trackers.json"
"""The run folder's file of tracker run ids (a resume continues those runs)."""


def tracker_problem(spec: str) -> str | None:
    """Why ``--log spec`` is not a list of trackers, or None.

    Example:
        >>> tracker_problem("tensorboard,wandb") is None
        True
        >>> print(tracker_problem("tensorbord"))
        --log 'tensorbord': 'tensorbord' is not a tracker; fix: a comma-separated list of tensorboard, wandb, mlflow (or none), e.g. --log tensorboard,mlflow
    """
    names = [name.strip() for name in spec.split(",")]
    unknown = [name for name in names if name not in (*TRACKERS, "none")]
    if unknown or ("none" in names and len(names) > 1):
        bad = unknown[0] if unknown else "none"
        why = f"{bad!r} is not a tracker" if unknown else "none goes alone"
        return (f"--log {spec!r}: {why}; fix: a comma-separated list of {', '.join(TRACKERS)} "
                "(or none), e.g. --log tensorboard,mlflow")
    return None


def _names(spec: str) -> list[str]:
    return [n for n in dict.fromkeys(name.strip() for name in spec.split(",")) if n != "none"]


class _Tracker:
    """A tracker behind one interface: ``step``, ``memory``, ``flush``, ``close``; a call
    that raises is warned about once and the tracker is dropped."""

    name = ""
    missing: str | None = None
    run_id: str | None = None

    def __init__(self) -> None:
        self.failed = False

    def _call(self, what: str, *args: Any, **kwargs: Any) -> None:
        if self.missing is not None or self.failed:
            return
        try:
            getattr(self, what)(*args, **kwargs)
        except Exception as error:  # a tracker's own failure: the run goes on without it
            self.failed = True
            logger.warning("%s stopped logging (%s: %s); the run goes on without it",
                           self.name, type(error).__name__, error)

    def step(self, record: dict[str, Any]) -> None:
        scalars = step_scalars(record)
        if scalars:
            self._call("_log", scalars, int(record["step"]))

    def memory(self, memory: list[dict[str, Any]], step: int) -> None:
        self._call("_log", {f"memory/peak_bytes/rank_{entry['rank']}":
                            float(entry["peak_memory_bytes"]) for entry in memory}, step)

    def flush(self) -> None:
        """Trackers write as they log."""

    def close(self) -> None:
        self._call("_finish")
        self.missing = self.missing or "closed"

    def _log(self, scalars: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError


class WandbLog(_Tracker):
    """Weights & Biases, offline unless ``WANDB_MODE`` says otherwise, files in ``folder``.

    Example::

        log = WandbLog("runs/a", options={"lr": 0.01}, run_id=None)
        log.step({"step": 1, "loss": 5.5})
        log.close()
    """

    name = "wandb"

    def __init__(self, folder: str, *, options: dict[str, Any], run_id: str | None) -> None:
        super().__init__()
        try:
            import wandb
        except ImportError:
            self.missing = "--log wandb needs the wandb package: pip install wandb"
            self.run_id = run_id
            return
        mode: Any = os.environ.get("WANDB_MODE", "offline")
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "pipetrain"),
                               name=os.path.basename(os.path.abspath(folder)), dir=folder,
                               mode=mode, config=options,
                               id=run_id, resume="allow" if run_id else None)
        self.run_id = str(self._run.id)

    def _log(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def _finish(self) -> None:
        self._run.finish()


class MlflowLog(_Tracker):
    """MLflow, to ``MLFLOW_TRACKING_URI`` or ``mlruns/`` in ``folder``.

    Example::

        log = MlflowLog("runs/a", options={"lr": 0.01}, run_id=None)
        log.step({"step": 1, "loss": 5.5})
        log.close()
    """

    name = "mlflow"

    def __init__(self, folder: str, *, options: dict[str, Any], run_id: str | None) -> None:
        super().__init__()
        try:
            import mlflow
        except ImportError:
            self.missing = "--log mlflow needs the mlflow package: pip install mlflow"
            self.run_id = run_id
            return
        self._mlflow = mlflow
        if "MLFLOW_TRACKING_URI" not in os.environ:
            # MLflow 3 keeps its file store for those who ask for it (it suggests a database)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri("file:" + os.path.join(os.path.abspath(folder), "mlruns"))
        run = mlflow.start_run(run_id=run_id,
                               run_name=None if run_id else os.path.basename(os.path.abspath(folder)))
        self.run_id = str(run.info.run_id)
        if run_id is None:
            mlflow.log_params({k: str(v)[:250] for k, v in options.items()})

    def _log(self, scalars: dict[str, float], step: int) -> None:
        self._mlflow.log_metrics({tag.replace("/", "."): value for tag, value in scalars.items()},
                                 step=step)

    def _finish(self) -> None:
        self._mlflow.end_run()


def open_trackers(spec: str, folder: str, *, options: dict[str, Any],
                  writes: Any = None) -> list[Any]:
    """The trackers ``--log spec`` names, opened for the run folder ``folder`` (rank 0),
    continuing the runs ``trackers.json`` names; the ids of those opened are written back.

    Example:
        >>> import tempfile
        >>> [type(t).__name__ for t in open_trackers("none", tempfile.mkdtemp(), options={})]
        []
    """
    path = os.path.join(folder, _IDS)
    try:
        with open(path) as file:
            ids = json.load(file)
    except (OSError, ValueError):
        ids = {}
    trackers: list[Any] = []
    for name in _names(spec):
        if name == "tensorboard":
            trackers.append(TensorBoardLog(folder, writes=writes))
            continue
        kind = WandbLog if name == "wandb" else MlflowLog
        tracker: _Tracker
        try:
            tracker = kind(folder, options=options, run_id=ids.get(name))
        except Exception as error:  # a tracker that cannot start never stops the run
            tracker = _Tracker()
            tracker.missing = (f"--log {name} could not start ({type(error).__name__}: "
                               f"{str(error).splitlines()[0][:300]}); the run trains without it")
        trackers.append(tracker)
        if tracker.run_id is not None and ids.get(name) != tracker.run_id:
            ids[name] = tracker.run_id
            os.makedirs(folder, exist_ok=True)
            with open(path, "w") as file:
                json.dump(ids, file, indent=1)
    return trackers

"""Fault injection for the CLI's fault tests: put this folder on ``PYTHONPATH`` and set
``PIPETRAIN_TEST_FAULT=WHERE:STEP:RANK`` to SIGKILL worker ``RANK`` at ``WHERE`` of the save
of step ``STEP``:

- ``manifest``: after the checkpoint's shards are written, before its manifest (inside
  the save's collectives: the other ranks must name the dead one);
- ``commit``: rank 0 with the checkpoint complete in ``checkpoint.partial``, before any
  rename (the window in which an older version lost that step's history).

Python imports ``sitecustomize`` at start-up, before the worker imports pipetrain, so the
patched functions are the ones pipetrain binds. Nothing happens without the variable.
"""

from __future__ import annotations

import json
import os
import signal

_FAULT = os.environ.get("PIPETRAIN_TEST_FAULT")

if _FAULT and os.environ.get("RANK") is not None:
    where, step, rank = _FAULT.split(":")
    if int(os.environ["RANK"]) == int(rank):
        from pipetrain.api import checkpoint_files

        def _die() -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        if where == "manifest":
            original_manifest = checkpoint_files.write_manifest

            def write_manifest(folder: str, *, step: int, group: object = None) -> None:
                if step == int(_FAULT.split(":")[1]):
                    _die()
                original_manifest(folder, step=step, group=group)

            checkpoint_files.write_manifest = write_manifest  # type: ignore[assignment]
        elif where == "commit":
            original_commit = checkpoint_files.commit

            def commit(partial: str, path: str, *, keep: int) -> None:
                with open(os.path.join(partial, checkpoint_files.MANIFEST)) as file:
                    if json.load(file)["step"] == int(step):
                        _die()
                original_commit(partial, path, keep=keep)

            checkpoint_files.commit = commit  # type: ignore[assignment]

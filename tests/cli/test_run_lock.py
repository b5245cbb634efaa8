"""The run folder's lock: owner-only, and a refusal names the process that really holds it."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipetrain.cli.run_lock import LOCK_NAME, RunFolderBusy, RunLock


def test_the_lock_file_is_the_owners_alone(tmp_path: Path) -> None:
    previous = os.umask(0o022)
    try:
        with RunLock(str(tmp_path / "new")):
            pass
        old = tmp_path / "old"
        old.mkdir()
        (old / LOCK_NAME).write_text("{}")
        os.chmod(old / LOCK_NAME, 0o644)  # as an earlier version made it
        with RunLock(str(old)):
            pass
    finally:
        os.umask(previous)
    for folder in ("new", "old"):
        assert stat.S_IMODE(os.stat(tmp_path / folder / LOCK_NAME).st_mode) == 0o600


def test_a_refusal_names_the_real_holder_not_stale_details(tmp_path: Path) -> None:
    """The file names a job that ended long ago; another process holds a lock on it
    without writing anything: the refusal names that process."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "2020",
                                                "command": "pipetrain train --steps 10"}))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
         "fcntl.lockf(fd, fcntl.LOCK_SH); print('held', flush=True); time.sleep(60)",
         str(folder / LOCK_NAME)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderBusy) as refused:
            RunLock(str(folder)).acquire()
        busy = RunLock(str(folder)).busy()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    message = str(refused.value)
    assert f"the lock is held by pid {holder.pid} of user " in message, message
    assert "fcntl.lockf" in message and "elsewhere" not in message
    assert busy == message
    deadline = time.monotonic() + 10
    while RunLock(str(folder)).busy() is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    with RunLock(str(folder)):  # the holder gone, the lock is free again
        pass

"""How a worker ends on an error (pipetrain.cli.worker_errors): one line a user can act on."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any

import pytest

from pipetrain.cli.worker_errors import report_failure


def test_a_full_disk_names_the_free_space_of_the_files_own_file_system(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Bug: a write that failed without a file name reported the free space of the
    working directory's file system ("72260.7 MiB free"), another disk than the run's."""
    asked: list[str] = []
    disk_usage = shutil.disk_usage

    def watched(path: Any) -> Any:
        asked.append(str(path))
        return disk_usage(path)

    monkeypatch.setattr(shutil, "disk_usage", watched)
    monkeypatch.delenv("PIPETRAIN_LAUNCHED", raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    named = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "x.distcp"))
    assert report_failure(named, rank=0, verbose=False) == 1
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"pipetrain train: error: writing {str(tmp_path / 'run' / 'x.distcp')!r} "
                           "failed: no space left on the device (") and "MiB free there)" in line
    assert set(asked) == {str(tmp_path)}  # the nearest folder that exists, on the file's disk
    report_failure(OSError(errno.ENOSPC, "No space left on device"), rank=0, verbose=False)
    line = capsys.readouterr().err.strip()
    assert "writing 'the run folder' failed: no space left on the device;" in line
    assert set(asked) == {str(tmp_path)}  # no guess at another disk

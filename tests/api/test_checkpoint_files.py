"""Which checkpoints are kept, and telling an intact checkpoint from a damaged one."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from pipetrain.api.checkpoint_files import (
    MANIFEST,
    checkpoint_problem,
    commit,
    find_intact,
    kept_checkpoints,
    read_meta,
    write_manifest,
)


def _save(folder: Path, step: int) -> str:
    """A checkpoint of ``step`` as a pipeline writes it (one process: DCP warns, fine)."""
    import pickle

    state = {"model": {"w": torch.full((64, 64), float(step))}, "meta": pickle.dumps({"step": step})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp_save(state, checkpoint_id=str(folder))
    write_manifest(str(folder), step=step)
    return str(folder)


def _shard(folder: str) -> str:
    return next(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".distcp"))


def test_an_intact_checkpoint_has_no_problem(tmp_path: Path) -> None:
    folder = _save(tmp_path / "ck", 3)
    assert checkpoint_problem(folder) is None
    assert read_meta(folder)["step"] == 3


@pytest.mark.parametrize("damage, phrase", [
    ("truncate", "bytes but the checkpoint's index needs"),
    ("remove", "is missing"),
    ("garbage metadata", ".metadata is unreadable"),
    ("flip a byte", "does not match its checksum"),
    ("no metadata", "no .metadata (an unfinished save)"),
])
def test_each_kind_of_damage_is_named_with_its_file(tmp_path: Path, damage: str, phrase: str) -> None:
    folder = _save(tmp_path / "ck", 3)
    shard = _shard(folder)
    if damage == "truncate":
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
    elif damage == "remove":
        os.remove(shard)
    elif damage == "garbage metadata":
        Path(folder, ".metadata").write_bytes(b"\x00garbage" * 10)
    elif damage == "flip a byte":
        data = bytearray(Path(shard).read_bytes())
        data[len(data) // 2] ^= 0xFF
        Path(shard).write_bytes(bytes(data))
    else:
        os.remove(os.path.join(folder, ".metadata"))
    problem = checkpoint_problem(folder)
    assert problem is not None and phrase in problem, problem
    if damage in ("truncate", "remove", "flip a byte"):
        assert os.path.basename(shard) in problem
    if damage == "flip a byte":  # only the checksum tells; without it the sizes pass
        assert checkpoint_problem(folder, checksums=False) is None


def test_commit_keeps_the_newest_checkpoints_and_names_older_ones_by_step(tmp_path: Path) -> None:
    path = str(tmp_path / "checkpoint")
    for step in (1, 2, 3, 4):
        _save(Path(path + ".partial"), step)
        commit(path + ".partial", path, keep=3)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "checkpoint.step-2", "checkpoint.step-3"]
    assert [(os.path.basename(c.path), c.step) for c in kept_checkpoints(path)] == [
        ("checkpoint", 4), ("checkpoint.step-3", 3), ("checkpoint.step-2", 2)]
    _save(Path(path + ".partial"), 5)
    commit(path + ".partial", path, keep=1)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint"]
    with pytest.raises(ValueError, match="keep=0 must be at least 1"):
        commit(path, path, keep=0)


def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path: Path) -> None:
    path = str(tmp_path / "checkpoint")
    for step in (10, 20, 30):
        _save(Path(path + ".partial"), step)
        commit(path + ".partial", path, keep=3)
    for folder in (path, path + ".step-20"):
        shard = _shard(folder)
        with open(shard, "r+b") as f:
            f.truncate(10)
    found, damaged = find_intact(path)
    assert found is not None and found.path == path + ".step-10" and found.step == 10
    assert [(os.path.basename(c.path), c.step) for c, _ in damaged] == [
        ("checkpoint", 30), ("checkpoint.step-20", 20)]
    assert all("(truncated)" in problem for _, problem in damaged)
    os.remove(os.path.join(path, ".metadata"))  # an unfinished newest one is damage too
    found, damaged = find_intact(path)
    assert found is not None and found.step == 10
    assert damaged[0][1] == "no .metadata (an unfinished save)" and damaged[0][0].step == 30


def test_a_complete_partial_newer_than_the_checkpoint_is_found_first(tmp_path: Path) -> None:
    """Killed between writing the new checkpoint and renaming it: the new one counts."""
    path = str(tmp_path / "checkpoint")
    _save(Path(path), 1)
    _save(Path(path + ".partial"), 2)
    found, damaged = find_intact(path)
    assert found is not None and found.path == path + ".partial" and not damaged
    assert os.path.isfile(os.path.join(path + ".partial", MANIFEST))

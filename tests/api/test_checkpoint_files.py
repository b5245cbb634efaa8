"""Which checkpoints are kept, and telling an intact checkpoint from a damaged one."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from pipetrain.api.checkpoint_files import (
    MANIFEST,
    Candidate,
    checkpoint_problem,
    commit,
    find_intact,
    kept_checkpoints,
    read_meta,
    set_aside,
    write_manifest,
)
from pipetrain.api.checkpoint_reader import encode_meta


def _save(folder: Path, step: int, *, meta: bytes | None = None) -> str:
    """A checkpoint of ``step`` as a pipeline writes it (one process: DCP warns, fine)."""
    state = {"model": {"w": torch.full((64, 64), float(step))},
             "meta": encode_meta({"step": step}) if meta is None else meta}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp_save(state, checkpoint_id=str(folder))
    write_manifest(str(folder), step=step)
    return str(folder)


def _edit_manifest(folder: str, **changes: object) -> None:
    manifest = json.loads(Path(folder, MANIFEST).read_text())
    manifest.update(changes)
    Path(folder, MANIFEST).write_text(json.dumps(manifest))


def _shard(folder: str) -> str:
    return next(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".distcp"))


def test_an_intact_checkpoint_has_no_problem(tmp_path: Path) -> None:
    folder = _save(tmp_path / "ck", 3)
    assert checkpoint_problem(folder) is None
    assert read_meta(folder)["step"] == 3


@pytest.mark.parametrize("damage, phrase", [
    ("truncate", "bytes, saved as"),
    ("remove", "is missing"),
    ("garbage metadata", ".metadata does not match its checksum"),
    ("flip a byte", "does not match its checksum"),
    ("no metadata", "no .metadata (an unfinished save)"),
    ("no manifest", f"no {MANIFEST} (the save stopped before its checksums were written)"),
    ("manifest not JSON", f"{MANIFEST} is not valid (not JSON"),
    ("manifest step edited", f"{MANIFEST} says step 999 but the checkpoint holds step 3"),
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
        size = os.path.getsize(os.path.join(folder, ".metadata"))
        Path(folder, ".metadata").write_bytes(b"\x00" * size)
    elif damage == "no manifest":
        os.remove(os.path.join(folder, MANIFEST))
    elif damage == "manifest not JSON":
        Path(folder, MANIFEST).write_text('{"step": 3, "files": {')
    elif damage == "manifest step edited":
        _edit_manifest(folder, step=999)
    elif damage == "flip a byte":
        data = bytearray(Path(shard).read_bytes())
        data[len(data) // 2] ^= 0xFF
        Path(shard).write_bytes(bytes(data))
    elif damage == "no metadata":
        os.remove(os.path.join(folder, ".metadata"))
    problem = checkpoint_problem(folder)
    assert problem is not None and phrase in problem, problem
    if damage in ("truncate", "remove", "flip a byte"):
        assert os.path.basename(shard) in problem
    if damage == "flip a byte":  # only the checksum tells; without it the sizes pass
        assert checkpoint_problem(folder, checksums=False) is None
    if damage == "garbage metadata":  # without checksums, the index itself is unreadable
        assert ".metadata is unreadable" in str(checkpoint_problem(folder, checksums=False))


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


def test_a_checkpoint_without_its_manifest_is_never_loaded_or_committed(tmp_path: Path) -> None:
    """Killed after DCP wrote .metadata, before the manifest: the folder is not a checkpoint."""
    path = str(tmp_path / "checkpoint")
    _save(Path(path), 10)
    _save(Path(path + ".partial"), 20)
    os.remove(os.path.join(path + ".partial", MANIFEST))
    found, damaged = find_intact(path)
    assert found is not None and found.step == 10 and not damaged  # the partial is no candidate
    os.remove(os.path.join(path, MANIFEST))
    found, damaged = find_intact(path)
    assert found is None and "no pipetrain-manifest.json" in damaged[0][1]


def test_a_crafted_index_is_refused_without_running_it(tmp_path: Path) -> None:
    """A .metadata whose pickle calls os.system, listed in a manifest with its true
    checksum (whoever crafted one crafted both): refused, and nothing runs."""
    folder = _save(tmp_path / "ck", 3)
    marker = tmp_path / "ran"

    class Crafted:
        def __reduce__(self) -> tuple[object, ...]:
            return (os.system, (f"touch {marker}",))

    Path(folder, ".metadata").write_bytes(pickle.dumps(Crafted()))
    write_manifest(folder, step=3)
    problem = checkpoint_problem(folder)
    assert problem is not None and "posix.system is not a class a checkpoint's index holds" in problem
    assert not marker.exists()


def test_meta_of_earlier_versions_is_read_as_plain_data_only(tmp_path: Path) -> None:
    old = _save(tmp_path / "old", 4, meta=pickle.dumps({"step": 4, "extra": {"data_step": 4}}))
    assert read_meta(old) == {"step": 4, "extra": {"data_step": 4}}
    crafted = _save(tmp_path / "crafted", 4, meta=pickle.dumps({"step": 4, "x": os.system}))
    assert "is not plain data" in str(checkpoint_problem(crafted))


def test_commit_sets_a_damaged_older_checkpoint_aside_and_never_counts_it(tmp_path: Path) -> None:
    path = str(tmp_path / "checkpoint")
    for step in (10, 20, 30):
        _save(Path(path + ".partial"), step)
        commit(path + ".partial", path, keep=3)
    with open(_shard(path), "r+b") as f:  # the newest (30) is damaged, then a save at 40
        f.truncate(10)
    _save(Path(path + ".partial"), 40)
    commit(path + ".partial", path, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "checkpoint.damaged-step-30",
                                            "checkpoint.step-20"]
    assert [c.step for c in kept_checkpoints(path)] == [40, 20]


def test_set_aside_never_overwrites_an_earlier_one(tmp_path: Path) -> None:
    path = str(tmp_path / "checkpoint")
    names = []
    for _ in range(3):
        _save(Path(path), 30)
        names.append(os.path.basename(set_aside(path, Candidate(path, 30))))
    assert names == ["checkpoint.damaged-step-30", "checkpoint.damaged-step-30-2",
                     "checkpoint.damaged-step-30-3"]
    assert kept_checkpoints(path) == []


def test_a_complete_partial_newer_than_the_checkpoint_is_found_first(tmp_path: Path) -> None:
    """Killed between writing the new checkpoint and renaming it: the new one counts."""
    path = str(tmp_path / "checkpoint")
    _save(Path(path), 1)
    _save(Path(path + ".partial"), 2)
    found, damaged = find_intact(path)
    assert found is not None and found.path == path + ".partial" and not damaged
    assert os.path.isfile(os.path.join(path + ".partial", MANIFEST))


def test_a_checkpoint_follows_the_users_umask(tmp_path: Path) -> None:
    path = str(tmp_path / "checkpoint")
    previous = os.umask(0o077)
    try:
        for step in (1, 2):
            _save(Path(path + ".partial"), step)
            commit(path + ".partial", path, keep=2)
    finally:
        os.umask(previous)
    for folder in (path, path + ".step-1"):
        assert os.stat(folder).st_mode & 0o077 == 0
        assert all(os.stat(os.path.join(folder, name)).st_mode & 0o077 == 0 for name in os.listdir(folder))


def test_an_older_checkpoint_that_lost_its_index_is_damage_not_an_error(tmp_path: Path) -> None:
    """An interrupted clean-up left checkpoint.step-10 without .metadata."""
    path = str(tmp_path / "checkpoint")
    for step in (10, 20):
        _save(Path(path + ".partial"), step)
        commit(path + ".partial", path, keep=2)
    os.remove(os.path.join(path + ".step-10", ".metadata"))
    assert [(os.path.basename(c.path), c.step) for c in kept_checkpoints(path)] == [
        ("checkpoint", 20), ("checkpoint.step-10", 10)]
    found, damaged = find_intact(path)
    assert found is not None and found.step == 20 and not damaged
    _save(Path(path + ".partial"), 30)
    commit(path + ".partial", path, keep=3)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "checkpoint.damaged-step-10", "checkpoint.step-20"]


def test_a_resume_is_resolved_without_reading_the_checksums(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug: the launcher and every worker read the whole checkpoint for its CRCs on resume
    (world + 1 full reads); resolving checks files and index only, and the job's rank 0
    verifies the checksums once, when it loads."""
    from pipetrain.api import checkpoint_files
    from pipetrain.cli.main import build_parser
    from pipetrain.cli.train_checks import prepare

    path = tmp_path / "checkpoint"
    _save(path, 7)
    reads: list[str] = []
    real = checkpoint_files._crc32
    monkeypatch.setattr(checkpoint_files, "_crc32", lambda name: reads.append(name) or real(name))
    _, resume, _ = prepare(build_parser().parse_args(
        ["train", "--resume", str(path), "--steps", "10", "--layers", "1", "--width", "16",
         "--heads", "2", "--context", "16", "--batch-size", "4", "--microbatches", "2"]))
    assert resume is not None and resume.step == 7 and reads == []
    assert checkpoint_problem(path) is None and len(reads) == len(os.listdir(path)) - 1

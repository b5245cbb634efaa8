"""The ``vs_torch_fsdp`` case's table, goals and picture, from figures given to it; and the
cut both runners share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipetrain.bench.cases import vs_torch_fsdp
from pipetrain.bench.cases._fsdp_runs import Sizes

SIZES = Sizes(blocks=4, width=64, heads=2, seq=32, batch=8, microbatches=2, reps=2)


def _raw(torch_ms: float, torch_peak: float) -> dict[str, Any]:
    labels = [f"{lib} {s}" for s in ("gpipe", "1f1b")
              for lib in ("pipetrain", "pipetrain-lean", "torch")]
    step_ms = dict(zip(labels, [100.0, 120.0, torch_ms, 90.0, 110.0, torch_ms]))
    peaks = {label: [30.0, 40.0, 20.0, 25.0] for label in labels}
    for s in ("gpipe", "1f1b"):
        peaks[f"torch {s}"] = [torch_peak, 10.0, 10.0, 10.0]
    return {"schedules": ["gpipe", "1f1b"], "step_ms": step_ms, "peak_mib": peaks,
            "losses": {label: [5.5, 5.4] for label in labels},
            "load": {"wall_s": 1.0, "our_cores": 1.9, "other_cores": 0.05}}


def test_the_goals_compare_pipetrain_at_the_anchors_policy_with_torch() -> None:
    table = vs_torch_fsdp.table(_raw(torch_ms=95.0, torch_peak=40.0), SIZES)
    by_name = {g.name: g for g in table.goals}
    # gpipe: 95 / 100 slower; 1f1b: 95 / 90 faster; the largest peak 40 vs torch's 40
    assert by_name["gpipe: pipetrain / torch throughput"].met is False
    assert by_name["gpipe: pipetrain / torch throughput"].value == "0.95x"
    assert by_name["1f1b: pipetrain / torch throughput"].met is True
    assert by_name["1f1b: pipetrain / torch largest peak per rank"].met is True
    smaller = vs_torch_fsdp.table(_raw(torch_ms=95.0, torch_peak=39.0), SIZES)
    assert {g.name: g.met for g in smaller.goals}[
        "gpipe: pipetrain / torch largest peak per rank"] is False
    lean = next(row for row in table.rows if row[:2] == ["1f1b", "pipetrain-lean"])
    assert lean[3] == f"{95 / 110:.2f}x" and lean[5] == 40.0 and lean[6] == "1.00x"
    assert "ranks 0-3" in table.columns[4] and lean[4] == "30.0 / 40.0 / 20.0 / 25.0"


def test_the_cut_gives_the_embedding_and_head_to_the_end_stages() -> None:
    assert SIZES.cut() == [3, 3]
    assert Sizes(blocks=5, width=8, heads=1, seq=4, batch=4, microbatches=1, reps=1).cut() \
        == [4, 3]
    assert sum(vs_torch_fsdp.SIZES["full"].cut()) == vs_torch_fsdp.SIZES["full"].blocks + 2


def test_the_picture_shows_each_runners_largest_peak(tmp_path: Path) -> None:
    table = vs_torch_fsdp.table(_raw(torch_ms=95.0, torch_peak=50.0), SIZES)
    names = vs_torch_fsdp.draw([table], {}, tmp_path)
    assert names == ["vs_torch_fsdp_memory.png"]
    assert (tmp_path / names[0]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert vs_torch_fsdp.draw([], {}, tmp_path) == []

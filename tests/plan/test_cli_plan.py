"""``pipetrain plan`` (``pipetrain/cli/plan.py``), run in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipetrain.cli.main import main
from pipetrain.plan.plan_file import Plan

from .helpers import chain

# A small PipeDream profile: an Input, a chain of three layers, an unused tuple item.
GRAPH = "\n".join([
    "node1 -- Input -- forward_compute_time=50.0, backward_compute_time=0.000, activation_size=100.0, parameter_size=0.000",
    "node2 -- Conv2d(3, 64) -- forward_compute_time=100.0, backward_compute_time=200.0, activation_size=1000000000.0, parameter_size=1000.000",
    "node3 -- Linear(64, 64) -- forward_compute_time=50.0, backward_compute_time=50.0, activation_size=[1000.0; 1000.0], parameter_size=400000000.000",
    "node4 -- Linear(64, 10) -- forward_compute_time=50.0, backward_compute_time=50.0, activation_size=10.0, parameter_size=1000.000",
    "node5 -- __getitem__(1) -- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=10.0, parameter_size=0.000",
    "\tnode1 -- node2",
    "\tnode2 -- node3",
    "\tnode3 -- node4",
    "\tnode3 -- node5",
])


@pytest.fixture
def graph_file(tmp_path: Path) -> Path:
    path = tmp_path / "graph.txt"
    path.write_text(GRAPH + "\n")
    return path


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(["plan", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one JSON object
    data: dict[str, object] = json.loads(out)
    return data


def test_json_for_a_pipedream_profile(graph_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, "--profile", str(graph_file), "--workers", "4", "--bandwidth", "1e9",
                 "--cost-model", "pipedream")
    # node2 and node3 on one worker: 0.3 + 0.1 s. Replicating them costs more than it saves
    # (node3's 400 MB all-reduce), and cutting after node2 sends 1 GB (2 s); the 3 other
    # workers, all of which must be used, go to node4.
    assert data["time_per_step"] == pytest.approx(0.4)
    stages = data["stages"]
    assert isinstance(stages, list)
    assert [(s["nodes"], s["replicas"]) for s in stages] == [(["node2", "node3"], 1),
                                                            (["node4"], 3)]
    assert data["cost_model"] == "pipedream" and data["num_workers"] == 4
    assert data["single_worker_time"] == pytest.approx(0.5)


def test_straight_json_matches_hand_computation(
    graph_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 3 stages of one layer: node3 receives 1 GB (2 s at 1 GB/s), the slowest term
    data = _json(capsys, "--profile", str(graph_file), "--workers", "3", "--bandwidth", "1e9",
                 "--straight", "--cost-model", "pipedream")
    assert [s["nodes"] for s in data["stages"]] == [["node2"], ["node3"], ["node4"]]  # type: ignore[union-attr]
    assert data["time_per_step"] == pytest.approx(2.0)


def test_table_and_plan_file(
    graph_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(graph_file), "--workers", "2", "2",
                 "--bandwidth", "1e10", "1e9", "--out", str(out), "--cost-model", "pipedream"]) == 0
    text = capsys.readouterr().out
    assert "2 x 2 workers" in text and "predicted time per step:" in text
    assert "speedup:" in text and f"plan written to {out}" in text
    plan = Plan.load(out)
    assert plan.num_workers == 4 and plan.topology["levels"][1]["num_workers"] == 2
    assert sum(s.replicas for s in plan.stages) == 4


def test_json_profile_of_a_layer_sequence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "profile.json"
    chain([1, 2, 3, 4]).save(path)
    data = _json(capsys, "--profile", str(path), "--workers", "2", "--bandwidth", "1e9",
                 "--straight", "--cost-model", "pipedream")
    assert [s["nodes"] for s in data["stages"]] == [[0, 1, 2], [3]]  # type: ignore[union-attr]
    assert data["time_per_step"] == 6.0


@pytest.mark.parametrize(("extra", "expected"), [
    (["--cost-model", "fastest"], "unknown cost model 'fastest'; known: pipedream, pipetrain"),
    (["--straight", "--workers", "5"], "a straight pipeline on 5 workers needs 5 stages"),
    (["--memory", "1e6"], "the smallest limit that fits is"),
    (["--workers", "2", "2"], "--workers has 2 value(s) [2, 2] but --bandwidth has 1"),
])
def test_bad_input_exits_2_with_the_fix(
    graph_file: Path, capsys: pytest.CaptureFixture[str], extra: list[str], expected: str
) -> None:
    argv = ["plan", "--profile", str(graph_file), "--workers", "2", "--bandwidth", "1e9"]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipetrain plan: error: ") and expected in err


def test_profile_with_a_missing_field_names_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "graph.txt"
    path.write_text(GRAPH.replace(", parameter_size=400000000.000", ""))
    assert main(["plan", "--profile", str(path), "--workers", "2", "--bandwidth", "1e9"]) == 2
    err = capsys.readouterr().err
    assert "line 3" in err and "missing field(s) parameter_size" in err


def test_missing_profile_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "nope.txt"
    assert main(["plan", "--profile", str(path), "--workers", "2", "--bandwidth", "1e9"]) == 2
    assert "cannot read --profile" in capsys.readouterr().err


def _gpt_like(path: Path) -> Path:
    """A heavy first and last layer, a thin middle; 8 samples."""
    from pipetrain.plan.profile import LayerProfile, Profile

    compute = [3.0, 1.0, 1.0, 1.0, 1.0, 6.0]
    layers = tuple(LayerProfile(name=str(k), forward_s=c, backward_s=2 * c, parameter_bytes=4000,
                                output_bytes=8000, saved_bytes=80_000)
                   for k, c in enumerate(compute))
    Profile(layers=layers, batch_size=8).save(path)
    return path


def test_pipetrain_cost_model_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _gpt_like(tmp_path / "profile.json")
    data = _json(capsys, "--profile", str(path), "--workers", "2", "--bandwidth", "1e9",
                 "--cost-model", "pipetrain")
    assert data["cost_model"] == "pipetrain"
    assert data["schedule"] in ("gpipe", "1f1b", "zb-h1")
    assert data["checkpoint"] == "never" and data["num_microbatches"] in (1, 2, 4, 8)
    stages = data["stages"]
    assert isinstance(stages, list) and sum(s["replicas"] for s in stages) == 2
    assert [n for s in stages for n in s["nodes"]] == list(range(6))
    # the default cost model is the same one, and the step is what the simulator predicts
    default = _json(capsys, "--profile", str(path), "--workers", "2", "--bandwidth", "1e9")
    assert default == data
    assert isinstance(data["time_per_step"], float) and data["time_per_step"] > 0
    # fixing the choices: GPipe with the whole batch as one micro-batch runs the model's
    # 13 s of forwards and 26 s of backwards one after the other, and two 8 kB messages
    fixed = _json(capsys, "--profile", str(path), "--workers", "2", "--bandwidth", "1e9",
                  "--schedule", "gpipe", "--microbatches", "1", "--straight")
    assert (fixed["schedule"], fixed["num_microbatches"]) == ("gpipe", 1)
    assert len(fixed["stages"]) == 2  # type: ignore[arg-type]
    assert fixed["time_per_step"] == pytest.approx(39 + 2 * 8000 / 1e9, rel=1e-12)


def test_pipetrain_table_shows_its_choices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _gpt_like(tmp_path / "profile.json")
    assert main(["plan", "--profile", str(path), "--workers", "2", "--bandwidth", "1e9",
                 "--memory", "90000", "--microbatches", "4"]) == 0
    text = capsys.readouterr().out
    assert "predicted time per step:" in text and "the simulated step" in text
    assert "memory per worker:" in text and "(limit 90.0 kB)" in text
    assert "4 micro-batches" in text and "chosen by the pipetrain cost model" in text
    # --memory-per-worker is the same option under its longer name
    assert main(["plan", "--profile", str(path), "--workers", "2", "--bandwidth", "1e9",
                 "--memory-per-worker", "90000", "--microbatches", "4"]) == 0
    assert capsys.readouterr().out == text
    assert main(["plan", "--profile", str(path), "--workers", "2", "--bandwidth", "1e9",
                 "--schedule", "interleaved-1f1b"]) == 2
    assert "schedule 'interleaved-1f1b' cannot be planned" in capsys.readouterr().err


def test_a_hierarchical_topology_is_planned_by_default(graph_file: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Bug: the README's `--workers 8 4 --bandwidth 300e9 25e9` failed with the default cost
    model ('plans one-level topologies'); the default now plans it with PipeDream's
    hierarchical planner, and says so."""
    assert main(["plan", "--profile", str(graph_file), "--workers", "2", "2", "--bandwidth",
                 "300e9", "25e9", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["cost_model"] == "pipedream"
    assert "planned with the pipedream cost model" in captured.err
    # a pipetrain-only choice keeps the pipetrain model, which names the problem
    assert main(["plan", "--profile", str(graph_file), "--workers", "2", "2", "--bandwidth",
                 "300e9", "25e9", "--schedule", "1f1b"]) == 2
    assert "plans one-level topologies" in capsys.readouterr().err


@pytest.mark.parametrize("per_replica", [1, 2, 3])
def test_microbatches_count_per_replica_of_the_first_stage_as_train_does(
    per_replica: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bug: plan's --microbatches counted all replicas together, train's one replica: a
    plan asked for 2 came back with 1 (2 over 2 replicas), and train --microbatches 2
    meant 2 per replica."""
    from pipetrain.plan.profile import LayerProfile, Profile

    layers = tuple(LayerProfile(name=str(k), forward_s=f, backward_s=2 * f, parameter_bytes=10)
                   for k, f in enumerate((3.0, 1.0)))
    path = tmp_path / "profile.json"
    Profile(layers=layers, batch_size=12).save(str(path))
    data = _json(capsys, "--profile", str(path), "--workers", "4", "--bandwidth", "1e12",
                 "--microbatches", str(per_replica), "--out", str(tmp_path / "plan.json"))
    plan = Plan.load(str(tmp_path / "plan.json"))
    assert data["num_microbatches"] == plan.num_microbatches == per_replica
    first = plan.stages[0].replicas
    assert first > 1  # replicated: per replica and per step differ
    assert sum(stage.replicas for stage in plan.stages) == 4

"""The planner's bounded work: plans no worker count can have refused before any search,
searches too large refused with the limit and the fix, progress lines while it works."""

from __future__ import annotations

import doctest
import importlib
import json
import math
import random
from pathlib import Path

import pytest

from pipetrain.cli.main import main
from pipetrain.plan import effort as effort_module
from pipetrain.plan import schedule_choice
from pipetrain.plan.costs import LevelContext, StageLoad
from pipetrain.plan.costs_pipetrain import Candidate, PipetrainCostModel
from pipetrain.plan.effort import Effort, PlanTooLarge
from pipetrain.plan.exact_dp import exact_dp
from pipetrain.plan.graph import CutGraph
from pipetrain.plan.optimizer import make_plan
from pipetrain.plan.planner_config import PLANNED_SCHEDULES, PlannerConfig
from pipetrain.plan.profile import LayerProfile, Profile
from pipetrain.plan.search import FlatSearch
from pipetrain.plan.simulated_step import one_stage_step, predicted_step
from pipetrain.plan.topology import Topology


def _profile(path: Path, num_layers: int, batch_size: int) -> Path:
    rng = random.Random(num_layers)
    layers = tuple(LayerProfile(name=str(k), forward_s=rng.uniform(0.5, 2.0),
                                backward_s=rng.uniform(1.0, 4.0), parameter_bytes=4000,
                                output_bytes=8000, saved_bytes=80_000)
                   for k in range(num_layers))
    Profile(layers=layers, batch_size=batch_size).save(path)
    return path


@pytest.mark.parametrize("module", ["pipetrain.plan.effort"])
def test_doctests(module: str) -> None:
    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0


def test_too_many_workers_is_refused_before_any_search(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 6 layers, a batch of 8: at most 6 stages of 8 replicas. This used to search every
    # micro-batch count's program over 100,000 worker counts (minutes for 4,096).
    path = _profile(tmp_path / "p.json", 6, 8)

    def no_search(*args: object, **kwargs: object) -> None:
        raise AssertionError("searched although no plan can use the workers")

    monkeypatch.setattr(schedule_choice, "searches", no_search)
    argv = ["plan", "--profile", str(path), "--workers", "100000", "--bandwidth", "1e9"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipetrain plan: error: no plan on 100000 workers runs with "
                          "[1, 2, 4, 8] micro-batches per step")
    assert "so a plan uses at most 48 workers" in err
    assert "fix: --workers 48 or fewer, --fewer-workers" in err
    assert "--microbatches 16667 or more" in err  # 6 stages x 16,667 >= 100,000


def test_the_suggested_worker_count_plans(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = _profile(tmp_path / "p.json", 6, 8)
    for extra in (["--workers", "48"], ["--workers", "100000", "--fewer-workers"]):
        assert main(["plan", "--profile", str(path), "--bandwidth", "1e9", "--json",
                     *extra]) == 0
        data = json.loads(capsys.readouterr().out)
        used = sum(stage["replicas"] for stage in data["stages"])
        assert used <= 48 and data["num_workers"] == int(extra[1])
        if "--fewer-workers" not in extra:
            assert used == 48


def test_a_search_too_large_is_refused_at_once_with_the_limit_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # PipeDream's hierarchical program over 100 layers on 1,000 x 100 workers: ~1e10 steps
    path = _profile(tmp_path / "p.json", 100, 64)
    assert main(["plan", "--profile", str(path), "--workers", "1000", "100",
                 "--bandwidth", "1e9", "1e8", "--cost-model", "pipedream"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipetrain plan: error: the hierarchical program over 101 cuts and "
                          "2 levels needs about ")
    assert "more than the planner's limit of 200,000,000 steps" in err
    assert "fix: fewer workers per level (--workers), a flat topology" in err


def test_the_work_limit_holds_for_the_pipetrain_planner() -> None:
    layers = tuple(LayerProfile(name=str(k), forward_s=1.0 + k % 3, backward_s=2.0)
                   for k in range(12))
    profile = Profile(layers=layers, batch_size=64)
    config = PlannerConfig(topology=Topology.flat(64, 1e9), max_work=1000)
    with pytest.raises(PlanTooLarge, match=r"more than the planner's limit of 1,000 steps; "
                                           r"fix: --fewer-workers"):
        make_plan(profile, config)
    unlimited = make_plan(profile, PlannerConfig(topology=Topology.flat(64, 1e9), max_work=None))
    assert sum(stage.replicas for stage in unlimited.stages) == 64
    with pytest.raises(ValueError, match=r"max_work=0 must be a whole number of steps >= 1"):
        PlannerConfig(topology=Topology.flat(2, 1e9), max_work=0)


def test_a_long_search_reports_progress_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(effort_module, "PROGRESS_EVERY_S", 0.0)  # a line at every tick
    path = _profile(tmp_path / "p.json", 12, 64)
    assert main(["plan", "--profile", str(path), "--workers", "64", "--bandwidth", "1e9",
                 "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("\n") == 1  # the plan alone on stdout
    lines = captured.err.splitlines()
    assert lines and all(line.startswith("pipetrain plan: ") for line in lines)
    assert any("search 1 of " in line and "micro-batches" in line for line in lines)
    assert any("probing a slowest stage of" in line for line in lines)


def test_effort_reports_only_every_few_seconds() -> None:
    now = [0.0]
    lines: list[str] = []
    effort = Effort(limit=None, report=lines.append, every_s=5.0, clock=lambda: now[0])
    for step in range(100):  # ticks every 0.1 s for 10 s
        now[0] = step * 0.1
        effort.tick(f"tick {step}")
    assert lines == ["5 s: tick 50"]


def test_one_stage_step_is_the_simulated_step() -> None:
    rng = random.Random(0)
    for _ in range(300):
        f, bi, bw = rng.uniform(0, 2), rng.uniform(0, 2), rng.uniform(0, 2)
        load = StageLoad(compute_s=f + bi + bw, forward_s=f, backward_input_s=bi,
                         backward_weight_s=bw, parameter_bytes=0.0, activation_bytes=0.0,
                         input_bytes=rng.choice([0.0, 1e9]), output_bytes=0.0, is_first=True,
                         is_last=True, optimizer_step_s=rng.uniform(0, 1),
                         gradient_bytes=rng.choice([0.0, 1e9]))
        replicas = rng.randint(1, 6)
        candidate = Candidate(schedule=rng.choice(PLANNED_SCHEDULES),
                              num_microbatches=replicas * rng.randint(1, 3),
                              checkpoint=rng.choice(["never", "always", "except_last"]))
        assert one_stage_step(load, replicas, candidate, bandwidth=1e9) == pytest.approx(
            predicted_step([load], [replicas], candidate, bandwidth=1e9), rel=1e-12)


def test_the_program_over_worker_counts_tries_no_unrunnable_replica_count() -> None:
    # the pipetrain model runs a stage on at most N replicas: the program asks no more
    layers = tuple(LayerProfile(name=str(k), forward_s=1.0, backward_s=2.0) for k in range(3))
    asked: list[int] = []
    model = PipetrainCostModel(Candidate(num_microbatches=4), num_workers=12)
    original = model.stage_time

    def stage_time(load: StageLoad, *, replicas: int, level: LevelContext) -> float:
        asked.append(replicas)
        return original(load, replicas=replicas, level=level)

    model.stage_time = stage_time  # type: ignore[method-assign]
    search = FlatSearch(CutGraph(Profile(layers=layers)), model=model,
                        level=LevelContext(bandwidth=1e9), num_workers=12)
    stages, time = exact_dp(search) or ([], math.inf)
    assert max(asked) == 4
    assert [r for _, _, r in stages] == [4, 4, 4] and time == pytest.approx(3.0)

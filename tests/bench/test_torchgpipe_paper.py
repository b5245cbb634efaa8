"""Tests of the case ``torchgpipe_paper`` (pipetrain.bench.cases.torchgpipe_paper*) at
tiny sizes: the workloads in both GPipes, the runner processes, and the tables."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from multiprocessing import Pipe

import pytest
import torch

from pipetrain.bench.cases.torchgpipe_paper import CASE, MODES, Plan, measure
from pipetrain.bench.cases.torchgpipe_paper import _record as _paper_record
from pipetrain.bench.cases.torchgpipe_paper_figures import AMOEBANET_SPEED, UNET_SPEED
from pipetrain.bench.cases.torchgpipe_paper_models import Workload, profile_balance, wrap
from pipetrain.bench.cases.torchgpipe_paper_runs import Setting, serve
from pipetrain.bench.cases.torchgpipe_paper_tables import measured_tables

pytest.importorskip("torchgpipe")

TINY = {"amoebanet": Workload(model="amoebanet", size=(3, 8), image=32, batch=4),
        "unet": Workload(model="unet", size=(2, 4), image=16, batch=4)}
BALANCE = {"amoebanet": [3, 3, 3], "unet": [4, 4, 3]}


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: tiny models run hundreds of small ops, and several OpenMP
    threads stall each other on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_case_is_declared_for_the_suite() -> None:
    assert CASE.name == "torchgpipe_paper" and CASE.needs == ("torchgpipe",)
    assert CASE.quick_seconds <= 25 and CASE.full_seconds <= 1500  # 1369 s in the last run


@pytest.mark.parametrize("model", ["amoebanet", "unet"])
@pytest.mark.parametrize("runner", ["pipetrain", "torchgpipe"])
@pytest.mark.usefixtures("one_thread")
def test_each_gpipe_computes_the_unpipelined_model_in_every_checkpoint_mode(
        model: str, runner: str) -> None:
    work = TINY[model]
    inputs, target = work.inputs()
    plain = work.build()
    with torch.no_grad():
        expected = plain.eval()(inputs)
    plain.train()
    work.loss(plain(inputs), target).backward()  # one micro-batch: batch norm as plain
    # float sums in another order: tolerances relative to the largest gradient (a conv
    # bias before batch norm has a gradient of rounding errors only)
    scale = max(p.grad.abs().max().item() for p in plain.parameters())
    for mode in MODES:
        micro = wrap(runner, work.build(), balance=BALANCE[model], chunks=2, checkpoint=mode)
        with torch.no_grad():
            torch.testing.assert_close(micro.eval()(inputs), expected, rtol=1e-5, atol=1e-6)
        whole = wrap(runner, work.build(), balance=BALANCE[model], chunks=1, checkpoint=mode)
        work.loss(whole(inputs), target).backward()
        for (name, a), b in zip(plain.named_parameters(), whole.parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5 * scale,
                                       msg=f"{runner} {mode} {name}")


@pytest.mark.usefixtures("one_thread")
def test_balances_cover_the_model() -> None:
    balances = profile_balance(TINY["unet"], [1, 2, 4], passes=1)
    assert [len(b) for b in balances.values()] == [1, 2, 4]
    assert all(sum(b) == 11 and min(b) >= 1 for b in balances.values())


def test_a_runner_reports_its_failure_instead_of_hanging() -> None:
    parent, child = Pipe()
    thread = threading.Thread(target=serve, args=("pipetrain", child), daemon=True)
    thread.start()
    bad = Setting(workload=TINY["unet"], balance=(4, 4), chunks=2, checkpoint="never")
    parent.send(("setup", bad))
    assert parent.poll(60)
    status, message = parent.recv()
    assert status == "error" and "balance" in message and "11" in message
    parent.send(None)
    thread.join(timeout=10)
    assert not thread.is_alive()


@pytest.mark.usefixtures("one_thread")
def test_a_tiny_run_measures_every_runner_and_fills_the_tables(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """... and its memory in processes of their own whose glibc mmap threshold is fixed
    (their resident set follows the live tensors, whatever an earlier setting of the
    process freed), the timed ones with the default heap, as users run them."""
    from pipetrain.bench.cases.torchgpipe_paper_runs import Runners
    from pipetrain.bench.harness import EXACT_MALLOC

    started: list[tuple[str, dict[str, str | None]]] = []
    start = Runners._start

    def spy(self: Runners, threads: int | None, suffix: str) -> None:
        started.append((suffix, {name: os.environ.get(name) for name in EXACT_MALLOC}))
        start(self, threads, suffix)

    monkeypatch.setattr(Runners, "_start", spy)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    plan = Plan(workloads={"unet": TINY["unet"]}, partitions=(2,), chunks={"unet": (2,)},
                warmup=0, rounds=1, block=1, processes_per_group=False, threads=1)
    lines: list[str] = []
    records, balances = measure(plan, lines.append)
    assert started == [("", {name: None for name in EXACT_MALLOC}), ("-memory", EXACT_MALLOC)]
    assert [(r["partitions"], r["checkpoint"]) for r in records] == [(2, m) for m in MODES]
    assert len(lines) == len(records) and sum(balances["unet"][2]) == 11
    for record in records:
        assert all(rate > 0 for rate in record["samples_per_s"].values())
        assert all(len(s) == 1 for s in record["step_s"].values())
        assert set(record["torch_threads"].values()) == {1}
        runs = record["torchgpipe_runs"]  # torchgpipe also ran at one thread; the faster counts
        assert set(runs) == {"torchgpipe", "torchgpipe@1"}
        chosen = [run for run in runs.values() if run["chosen"]]
        assert len(chosen) == 1 and chosen[0]["samples_per_s"] == max(
            run["samples_per_s"] for run in runs.values())
        assert record["samples_per_s"]["torchgpipe"] == pytest.approx(chosen[0]["samples_per_s"])
        assert record["run_peak_mib"]["torchgpipe"] == chosen[0]["run_peak_mib"]
        assert record["load"]["wall_s"] > 0 and "other_cores" in record["load"]
        mib = record["run_peak_mib"]
        assert all(v is None or v >= 0 for v in mib.values())
    tables = {t.key: t for t in measured_tables(records, {"unet": TINY["unet"].label})}
    speed = tables["unet_speed"]
    assert [row[:3] for row in speed.rows] == [[2, 2, mode] for mode in MODES]
    assert all(row[3] != "-" and row[6].endswith("x") for row in speed.rows)
    versus = tables["unet_vs_paper"]
    assert [row[0] for row in versus.rows] == ["baseline (plain)", "pipeline-1",
                                                "pipeline-2", "pipeline-4", "pipeline-8"]
    assert versus.rows[2][3] == 2 and versus.rows[2][4].endswith("x")  # measured here
    assert versus.rows[1][3:] == versus.rows[3][3:] == ["-", "-", "-"]  # not measured


def test_each_setting_takes_torchgpipes_faster_thread_count_and_the_notes_say_so() -> None:
    setting = Setting(workload=TINY["unet"], balance=(6, 5), chunks=2, checkpoint="never")
    seconds = {"pipetrain": [0.1, 0.1], "torchgpipe": [0.4, 0.4], "plain": [0.1, 0.1],
               "torchgpipe@1": [0.2, 0.2]}
    setup = {"pipetrain": (5.0, 2), "torchgpipe": (7.0, 2), "plain": (4.0, 2),
             "torchgpipe@1": (6.0, 1)}
    mib = {"pipetrain": 10.0, "torchgpipe": 21.0, "plain": 9.0, "torchgpipe@1": 20.0}
    record = _paper_record(setting, setup, seconds, {"other_cores": None}, mib)
    assert record["samples_per_s"]["torchgpipe"] == pytest.approx(4 / 0.2)  # one thread won
    assert record["run_peak_mib"]["torchgpipe"] == 20.0
    assert record["torch_threads"] == {"pipetrain": 2, "torchgpipe": 1, "plain": 2}
    assert set(record["step_s"]) == {"pipetrain", "torchgpipe", "plain"}
    assert record["torchgpipe_runs"]["torchgpipe"]["chosen"] is False
    assert record["torchgpipe_runs"]["torchgpipe@1"]["samples_per_s"] == pytest.approx(20.0)
    record["model"] = "unet"
    speed = {t.key: t for t in measured_tables([record], {"unet": "tiny"})}["unet_speed"]
    assert speed.rows[0][3:6] == ["40.0", "20.0", "40.0"]
    assert "each row shows its faster run: one thread in 1 of 1 rows" in speed.notes


def _record(model: str, k: int, m: int, mode: str, rate: float,
            other_cores: float = 0.5) -> dict[str, object]:
    rates = {"pipetrain": rate, "torchgpipe": rate / 2, "plain": 100.0}
    return {"model": model, "partitions": k, "chunks": m, "checkpoint": mode,
            "samples_per_s": rates, "run_peak_mib": {"pipetrain": 10.0, "torchgpipe": 20.0,
                                                     "plain": None},
            "load": {"wall_s": 1.0, "our_cores": 1.0, "other_cores": other_cores},
            "torch_threads": {"pipetrain": 2, "torchgpipe": 2, "plain": 2}}


def test_the_amoebanet_table_puts_the_papers_speed_ups_beside_this_runs() -> None:
    records = [_record("amoebanet", 2, 1, "always", 40.0),
               _record("amoebanet", 2, 4, "except_last", 60.0),
               _record("amoebanet", 2, 4, "never", 99.0, 1.25)]  # not the paper's m=4 mode
    tables = {t.key: t for t in measured_tables(records, {"amoebanet": "tiny"})}
    rows = tables["amoebanet_vs_paper"].rows
    assert [(row[0], row[1]) for row in rows] == [(n, m) for n, m, _, _ in AMOEBANET_SPEED]
    assert rows[1] == [2, 4, "except_last", "1.54x", "1.07x", "1.50x", "1.50x"]
    assert rows[8][3:] == ["4.95x", "3.48x", "-", "-"]
    notes = tables["amoebanet_speed"].notes
    assert "ran 2 intra-op threads." in notes and "other processes used 0.5 to 1.2 of" in notes
    memory = tables["amoebanet_memory"].rows
    assert memory[0][3:] == ["10.0", "20.0", "-", "0.50x"]
    # every row holds pipetrain to torchgpipe's speed and memory (+3%)
    speed_goals = tables["amoebanet_speed"].goals
    assert (speed_goals[0].name, speed_goals[0].met) == (
        "AmoebaNet-D K=2 m=1 always: pipetrain / torchgpipe throughput", True)
    assert len(speed_goals) == len(tables["amoebanet_memory"].goals) == len(records)
    slow = measured_tables([_record("amoebanet", 2, 1, "never", 40.0)], {"amoebanet": "x"})
    assert all(g.met for t in slow for g in t.goals)
    heavy = _record("amoebanet", 2, 1, "never", 40.0)
    heavy["run_peak_mib"] = {"pipetrain": 20.8, "torchgpipe": 20.0, "plain": None}
    missed = [g for t in measured_tables([heavy], {"amoebanet": "x"}) for g in t.missed()]
    assert [g.text() for g in missed] == [
        "AmoebaNet-D K=2 m=1 never: pipetrain / torchgpipe peak memory 1.04x (goal <= 1.03x): "
        "MISSED"]
    assert {t.key for t in tables.values()} >= {"paper_amoebanet_speed", "paper_unet_speed",
                                                "paper_amoebanet_memory", "paper_unet_memory"}


def test_the_papers_speed_ups_are_its_throughputs_ratios() -> None:
    # docs/benchmarks.rst of torchgpipe gives these speed-ups beside the throughputs
    published = [1.0, 1.539, 1.773, 1.004, 1.666, 2.709, 0.932, 2.621, 4.953]
    base = AMOEBANET_SPEED[0][2]
    assert [round(rate / base, 3) for _, _, rate, _ in AMOEBANET_SPEED] == published
    unet_base = UNET_SPEED[0][4]
    assert [round(rate / unet_base, 3) for *_, rate in UNET_SPEED] == [
        1.0, 0.858, 1.246, 2.352, 3.105]


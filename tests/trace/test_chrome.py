from __future__ import annotations

import gzip
import itertools
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from pipetrain.schedule import (
    Costs,
    TimedAction,
    add_fsdp_actions,
    build_schedule,
    parse_action,
    simulate,
)
from pipetrain.trace import CATEGORIES, chrome_trace, measure_step, write_chrome_trace

METADATA_NAMES = {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}
TOLERANCE_US = 1e-6


def check_trace(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Check what Perfetto / chrome://tracing need of a trace; return its X events."""
    trace = json.loads(json.dumps(trace))  # JSON-ready, and checked as read back
    assert isinstance(trace["traceEvents"], list)
    assert trace["displayTimeUnit"] in ("ms", "ns")
    process_names: dict[int, str] = {}
    thread_names: dict[tuple[int, int], str] = {}
    complete = []
    for event in trace["traceEvents"]:
        assert {"name", "ph", "pid", "tid"} <= set(event), event
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        assert isinstance(event["name"], str) and event["name"]
        if event["ph"] == "M":
            assert event["name"] in METADATA_NAMES
            assert isinstance(event["args"], dict)
            if event["name"] == "process_name":
                process_names[event["pid"]] = event["args"]["name"]
            elif event["name"] == "thread_name":
                thread_names[(event["pid"], event["tid"])] = event["args"]["name"]
            else:
                assert isinstance(event["args"]["sort_index"], int)
        else:
            assert event["ph"] == "X", event
            assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0
            assert isinstance(event["dur"], (int, float)) and event["dur"] >= 0
            assert isinstance(event["cat"], str) and event["cat"]
            assert isinstance(event["args"]["step"], int)
            complete.append(event)
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for event in complete:
        tracks[(event["pid"], event["tid"])].append(event)
    for (pid, tid), events in tracks.items():
        assert pid in process_names and (pid, tid) in thread_names
        for before, after in itertools.pairwise(events):
            assert before["ts"] <= after["ts"], "timestamps go back on one track"
            # complete events on one track must not overlap (nesting would need it)
            assert before["ts"] + before["dur"] <= after["ts"] + TOLERANCE_US, (before, after)
    return complete


def _step(*, fsdp: bool = False, **options: Any) -> tuple[TimedAction, ...]:
    schedule = build_schedule("interleaved-1f1b", num_ranks=2, num_microbatches=4, **options)
    if fsdp:
        schedule = add_fsdp_actions(schedule)
    costs = Costs(reduce=0.5, step=0.25, communication=0.1, unshard=0.3)
    return simulate(schedule, costs).timeline


def test_structure_of_two_simulated_steps() -> None:
    step = _step(stages_per_rank=2, optimizer_step=True, reduce=True, fsdp=True)
    trace = chrome_trace([step, step])
    complete = check_trace(trace)
    actions = [e for e in complete if e["cat"] != "step"]
    assert len(actions) == 2 * len(step)
    # names, tracks and args
    first = {(e["name"], e["args"]["step"]): e for e in actions}
    t = next(t for t in step if str(t.action) == "2F1")
    event = first[("2F1", 1)]
    assert (event["pid"], event["tid"], event["cat"]) == (t.rank, 2, "forward")
    assert event["args"] == {"step": 1, "stage": 2, "op": "F", "microbatch": 1}
    assert first[("1STEP", 0)]["args"] == {"step": 0, "stage": 1, "op": "STEP"}
    unsplit = set(CATEGORIES.values()) - {"backward_input", "backward_weight"}
    assert {e["cat"] for e in actions} == unsplit
    # microseconds: the durations are the simulated ones (1 time unit = 1 s)
    assert event["dur"] == pytest.approx((t.end - t.start) * 1e6)
    names = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["name"] == "thread_name"
    }
    assert names[(0, 2)] == "stage 2" and names[(1, 3)] == "stage 3"
    # FSDP's gathers run beside the stage's work: a track of their own
    assert names[(0, 10_002)] == "stage 2 FSDP gathers"
    assert {e["tid"] for e in actions if e["cat"] == "gather" and e["pid"] == 0} == {10_000, 10_002}
    processes = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    assert processes == {0: "rank 0", 1: "rank 1", 2: "steps"}


def test_steps_are_laid_end_to_end_with_their_measures() -> None:
    step = _step(stages_per_rank=2)
    makespan = measure_step(step).makespan
    steps = [e for e in check_trace(chrome_trace([step, step, step])) if e["cat"] == "step"]
    assert [e["name"] for e in steps] == ["step 0", "step 1", "step 2"]
    assert [e["ts"] for e in steps] == pytest.approx([0, makespan * 1e6, 2 * makespan * 1e6])
    assert steps[1]["dur"] == pytest.approx(makespan * 1e6)
    assert steps[1]["args"]["makespan_ms"] == pytest.approx(makespan * 1e3)
    assert steps[1]["args"]["bubble_fraction"] == pytest.approx(measure_step(step).bubble_fraction)


def test_step_offsets_place_the_steps() -> None:
    # each step recorded from its own origin; their origins on the wall clock
    step = [TimedAction(0, parse_action("0F0"), 0.001, 0.003)]
    offsets = [1_700_000_000.0, 1_700_000_000.5]
    trace = chrome_trace([step, step], step_offsets=offsets)
    forwards = [e for e in check_trace(trace) if e["name"] == "0F0"]
    assert [e["ts"] for e in forwards] == pytest.approx([0.0, 500_000.0])
    assert [e["dur"] for e in forwards] == pytest.approx([2000.0, 2000.0])
    with pytest.raises(ValueError, match="step_offsets has 1 values for 2 steps"):
        chrome_trace([step, step], step_offsets=[0.0])


def test_measured_times_do_not_overlap_after_rounding() -> None:
    # back-to-back actions of a real clock: ends and starts a nanosecond apart or equal
    times = [5321.000123456789 + k * 0.0001234567 for k in range(40)]
    step = [
        TimedAction(0, parse_action(f"0F{k}"), start, end)
        for k, (start, end) in enumerate(itertools.pairwise(times))
    ]
    complete = check_trace(chrome_trace([step]))
    assert len(complete) == len(step) + 1


def test_names_metadata_and_mistakes() -> None:
    step = _step(stages_per_rank=2)
    trace = chrome_trace([step], rank_names=["host-a:0", "host-b:0"], metadata={"run": "x"})
    check_trace(trace)
    processes = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    assert processes[0] == "host-a:0" and processes[1] == "host-b:0"
    assert trace["otherData"] == {"run": "x"}
    with pytest.raises(ValueError, match="rank_names has 1 names but the steps have 2 ranks"):
        chrome_trace([step], rank_names=["only-one"])
    with pytest.raises(TypeError, match=r"wrap it, chrome_trace\(\[timeline\]\)"):
        chrome_trace(step)


def test_no_steps_and_empty_steps() -> None:
    assert check_trace(chrome_trace([])) == []
    step: Sequence[TimedAction] = [TimedAction(1, parse_action("1F0"), 0.0, 1.0)]
    complete = check_trace(chrome_trace([[], step]))
    assert [e["args"]["step"] for e in complete] == [1, 1]


@pytest.mark.parametrize("name", ["trace.json", "trace.json.gz"])
def test_write(tmp_path: Path, name: str) -> None:
    step = _step(stages_per_rank=2)
    path = tmp_path / name
    write_chrome_trace([step], path, metadata={"schedule": "interleaved-1f1b"})
    data = gzip.decompress(path.read_bytes()) if name.endswith(".gz") else path.read_bytes()
    trace = json.loads(data)
    assert trace == json.loads(json.dumps(chrome_trace([step], metadata=trace["otherData"])))
    assert len(check_trace(trace)) == len(step) + 1

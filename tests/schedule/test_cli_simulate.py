"""``pipetrain simulate`` (``pipetrain/cli/simulate.py``), run in-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipetrain.cli.main import main


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(["simulate", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one JSON object
    data: dict[str, object] = json.loads(out)
    return data


def test_json_fields_and_values(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, "--schedule", "1f1b", "--stages", "4", "--microbatches", "8")
    assert data["schedule"] == "1f1b"
    assert (data["stages"], data["microbatches"], data["virtual"]) == (4, 8, 1)
    assert data["makespan"] == 33.0
    assert data["bubble_fraction"] == pytest.approx(3 / 11)
    assert data["peak_activations"] == [4, 3, 2, 1]
    assert data["busy"] == [24.0] * 4 and data["idle"] == [9.0] * 4


def test_json_interleaved_defaults_to_two_stages_per_rank(
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = _json(capsys, "--schedule", "interleaved", "--stages", "2", "--microbatches", "5")
    assert data["schedule"] == "interleaved-1f1b"
    assert data["virtual"] == 2 and data["num_stages"] == 4


def test_json_with_costs(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(
        capsys,
        "--schedule",
        "zero-bubble",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--cost",
        "forward=1,backward_input=1,backward_weight=1",
    )
    assert data["schedule"] == "zb-h1"
    assert data["makespan"] == 27.0 and data["idle"] == [3.0] * 4
    data = _json(
        capsys,
        "--schedule",
        "gpipe",
        "--stages",
        "2",
        "--microbatches",
        "1",
        "--cost",
        "forward=1:3",
    )
    assert data["makespan"] == 12.0


def test_text_output_is_grid_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--schedule", "gpipe", "--stages", "2", "--microbatches", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("rank 0: F0 F1 .  .  B0 B1\nrank 1: .  F0 F1 B0 B1\n\n")
    assert "gpipe on 2 ranks (2 stages), 2 micro-batches: makespan 9, bubble 33.3%" in out


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "timeline.png"
    argv = [
        "simulate",
        "--schedule",
        "1f1b",
        "--stages",
        "8",
        "--microbatches",
        "16",
        "--plot",
        str(path),
    ]
    assert main(argv) == 0
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert f"Timeline written to {path}." in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--schedule", "gpip", "--stages", "2", "--microbatches", "2"], "unknown schedule 'gpip'"),
        (
            ["--schedule", "gpipe", "--stages", "0", "--microbatches", "2"],
            "--stages must be at least 1, got 0",
        ),
        (
            ["--schedule", "interleaved", "--stages", "4", "--microbatches", "3"],
            "use --microbatches 4",
        ),
        (
            ["--schedule", "gpipe", "--stages", "2", "--microbatches", "2", "--virtual", "2"],
            "--virtual 2",
        ),
        (
            ["--schedule", "gpipe", "--stages", "2", "--microbatches", "2", "--cost", "fwd=1"],
            "unknown cost 'fwd'",
        ),
        (
            [
                "--schedule",
                "gpipe",
                "--stages",
                "2",
                "--microbatches",
                "2",
                "--cost",
                "forward=1:2:3",
            ],
            "forward has 3 values",
        ),
    ],
)
def test_bad_input_exits_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("pipetrain simulate: error: ")
    assert message in captured.err and "Traceback" not in captured.err


def test_unwritable_plot_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "missing-dir" / "t.png"
    argv = [
        "simulate",
        "--schedule",
        "gpipe",
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--plot",
        str(target),
    ]
    assert main(argv) == 2
    assert "cannot write --plot" in capsys.readouterr().err


def test_argparse_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["simulate", "--schedule", "gpipe", "--stages", "two", "--microbatches", "2"])
    assert caught.value.code == 2
    assert "argument --stages: invalid int value: 'two'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, virtual, num_stages", [("zb-v", 2, 4), ("dualpipev", 2, 4), ("looped-bfs", 2, 4), ("zb-h2", 1, 2)]
)
def test_json_new_schedules_default_stages_per_rank(
    name: str, virtual: int, num_stages: int, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _json(capsys, "--schedule", name, "--stages", "2", "--microbatches", "4")
    assert (data["virtual"], data["num_stages"]) == (virtual, num_stages)


def test_a_schedule_file_sets_stages_and_microbatches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mine.txt"
    path.write_text("rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1B0 1F1 1B1\n")
    data = _json(capsys, "--schedule", str(path))
    assert (data["schedule"], data["stages"], data["microbatches"], data["virtual"]) == ("mine", 2, 2, 1)
    assert data["makespan"] == 9.0


def test_a_schedule_name_needs_stages_and_microbatches(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--schedule", "1f1b"]) == 2
    assert "--stages and --microbatches needed with schedule '1f1b'" in capsys.readouterr().err


def test_a_deadlocking_schedule_file_exits_2_with_the_grid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "stuck.txt"
    path.write_text("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F1 1B1 1F0 1B0\n")
    assert main(["simulate", "--schedule", str(path)]) == 2
    err = capsys.readouterr().err
    assert "deadlock: rank 0, position 1: 0B0 waits for 1B0, which rank 1 runs only at position 3" in err
    assert "what it runs" in err


@pytest.mark.parametrize("steps", ["1", "2", "8"])
def test_an_asynchronous_steady_state_never_looks_slower_than_the_synchronized_steps(
    steps: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bug: with --steps 1 the 'steady state' was read off one step of 4 micro-batches
    (all fill and drain), slower than Pipeline.train_step's synchronized steps."""
    data = _json(capsys, "--schedule", "pipedream", "--stages", "2", "--microbatches", "4",
                 "--steps", steps)
    assert data["steady_per_microbatch"] == 3.0  # forward 1 + backward 2 at the bottleneck
    assert data["steady_per_microbatch"] <= data["per_microbatch_in_steps"]  # type: ignore[operator]
    assert data["average_per_microbatch"] == data["makespan"] / (4 * int(steps))  # type: ignore[operator]
    assert main(["simulate", "--schedule", "pipedream", "--stages", "2", "--microbatches", "4",
                 "--steps", steps]) == 0
    text = capsys.readouterr().out
    assert (f"the {steps} step of 4 above" if steps == "1" else f"the {steps} steps of 4 above") in text
    assert "1 steps" not in text


@pytest.mark.parametrize("argv, fix", [
    (["--schedule", "zb-h1", "--stages", "4", "--microbatches", "8", "--virtual", "2"],
     "got --virtual 2; use --virtual 1"),
    (["--schedule", "interleaved-1f1b", "--stages", "4", "--microbatches", "2", "--virtual", "2"],
     "got --microbatches 2 for --stages 4; use --microbatches 4"),
])
def test_schedule_errors_name_the_commands_flags(argv: list[str], fix: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert fix in err
    assert "stages_per_rank" not in err and "num_microbatches" not in err and "num_ranks" not in err


def test_every_schedule_of_the_same_ranks_prices_the_same_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Bug: every stage cost forward=1 whatever it held, so a schedule with two stages per
    rank ran twice the model and looked slower than 1F1B."""
    argv = ["--stages", "4", "--microbatches", "8"]
    one_f_one_b = _json(capsys, "--schedule", "1f1b", *argv)
    for name in ("interleaved-1f1b", "looped-bfs", "zb-v", "dualpipe-v"):
        data = _json(capsys, "--schedule", name, *argv)
        assert data["busy"] == one_f_one_b["busy"] == [24.0] * 4, name  # a rank's work
        assert data["stage_layers"] == [1] * 8 and data["layers"] == 8
        assert data["stage_costs"]["forward"] == [0.5] * 8  # type: ignore[index]
    assert _json(capsys, "--schedule", "zb-v", *argv)["makespan"] == 25.5 < 33.0
    assert one_f_one_b["makespan"] == 33.0 and one_f_one_b["stage_layers"] == [1] * 4


def test_layers_price_the_stages_by_what_they_hold(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, "--schedule", "1f1b", "--stages", "4", "--microbatches", "8",
                 "--layers", "6", "--cost", "forward=1,communication=0.5")
    assert data["stage_layers"] == [2, 2, 1, 1]
    assert data["stage_costs"]["forward"] == pytest.approx([4 / 3, 4 / 3, 2 / 3, 2 / 3])  # type: ignore[index]
    assert data["stage_costs"]["communication"] == [0.5] * 4  # type: ignore[index]
    assert main(["simulate", "--schedule", "1f1b", "--stages", "4", "--microbatches", "8",
                 "--layers", "6"]) == 0
    text = capsys.readouterr().out
    assert ("the figures assume a model of 6 equal layers, per stage 2, 2, 1, 1, whose share per "
            "rank (1/4) costs forward=1, backward=2 (I and W 1 each); a stage: forward 0.666667 "
            "to 1.33333, backward 1.33333 to 2.66667; no communication latency.") in text
    assert main(["simulate", "--schedule", "zb-v", "--stages", "4", "--microbatches", "8",
                 "--layers", "6"]) == 2
    assert ("--layers 6 cannot fill the 8 stages of zb-v on 4 ranks (each stage holds at least "
            "one layer); fix: --layers 8 or more") in capsys.readouterr().err


def test_counts_of_one_are_singular(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--schedule", "1f1b", "--stages", "1", "--microbatches", "1"]) == 0
    text = capsys.readouterr().out
    assert "1f1b on 1 rank (1 stage), 1 micro-batch: makespan 3" in text
    assert "a model of 1 equal layer," in text
    assert not any(f"1 {noun}s" in text for noun in ("rank", "stage", "layer", "micro-batche"))


def test_activation_bytes_per_rank_and_stage_under_modes_and_offload(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """8 layers of 1 MB saved each, 10 kB inputs, 1F1B on 4 ranks (keeping 4, 3, 2, 1)."""
    base = ["--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--layers", "8",
            "--activations", "1e6:1e4"]
    kept = _json(capsys, *base)
    assert kept["activation_bytes_per_rank"] == [k * 2.01e6 for k in (4, 3, 2, 1)]
    mixed = _json(capsys, *base, "--checkpoint", "always,never,never,never",
                  "--offload", "none,none,1e6,none")
    # stage 0: 4 inputs and one rebuilt micro-batch; stage 2: 1 MB and the one in backward
    assert mixed["activation_bytes_per_stage"] == [4e4 + 2e6, 3 * 2.01e6, 1e6 + 2.01e6, 2.01e6]
    # per layer: each kept micro-batch holds its 2 layers' inputs, a backward one layer rebuilt
    layered = _json(capsys, *base, "--checkpoint", "per_layer")
    assert layered["activation_bytes_per_rank"] == [k * 2e4 + 1e6 for k in (4, 3, 2, 1)]
    # V-Half on the same layers (one per half stage, no inputs counted): half of 1F1B's 8 MB
    v = _json(capsys, "--schedule", "v-half", "--stages", "4", "--microbatches", "8",
              "--layers", "8", "--activations", "1e6")
    assert v["activation_bytes_per_rank"] == [4e6] * 4


def test_memory_options_need_the_activation_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--schedule", "1f1b", "--stages", "2", "--microbatches", "2",
                 "--checkpoint", "always"]) == 2
    assert "give --activations too" in capsys.readouterr().err


def test_jitter_plays_both_orders(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--schedule", "gpipe", "--stages", "4", "--microbatches", "8"]
    plain = _json(capsys, *argv)
    data = _json(capsys, *argv, "--jitter", "delay=0.5,ranks=1:2,seed=3")
    jitter = data["jitter"]
    assert isinstance(jitter, dict)
    assert jitter["spec"] == {"delay": 0.5, "ranks": [1, 2], "link": 0.0, "seed": 3}
    assert plain["makespan"] < jitter["ready_makespan"] <= jitter["fixed_makespan"]
    assert plain["makespan"] * 1.5 >= jitter["fixed_makespan"]
    assert main(["simulate", *argv, "--jitter", "delay=0.5"]) == 0
    assert "in the fixed order" in capsys.readouterr().out
    assert main(["simulate", "--schedule", "2bw", "--stages", "2", "--microbatches", "2",
                 "--jitter", "delay=1"]) == 2
    assert "synchronous schedules" in capsys.readouterr().err


def test_fsdp_prices_each_stages_gather_and_reduce_scatter(capsys: pytest.CaptureFixture[str]) -> None:
    shape = ["--stages", "2", "--microbatches", "4"]
    plain = _json(capsys, "--schedule", "1f1b", *shape)
    fsdp = _json(capsys, "--schedule", "1f1b", *shape, "--fsdp", "--cost", "unshard=0.5,reduce=0.25")
    # rank 0's first forward waits for its gather; rank 0's reduce-scatter ends the step
    assert fsdp["makespan"] == plain["makespan"] + 0.5 + 0.25
    assert fsdp["stage_costs"]["unshard"] == [0.5, 0.5]  # type: ignore[index]
    assert main(["simulate", "--schedule", "1f1b", *shape, "--fsdp"]) == 0
    grid = capsys.readouterr().out
    assert f"makespan {plain['makespan']:g}," in grid  # free gathers and reductions cost nothing
    for schedule, why in (("pipedream", "not pipedream"), ("forward", "not forward")):
        assert main(["simulate", "--schedule", schedule, *shape, "--fsdp"]) == 2
        assert why in capsys.readouterr().err


def test_fsdp_options_move_the_gathers_and_reduce_scatters_into_every_pass(
        capsys: pytest.CaptureFixture[str]) -> None:
    shape = ["--schedule", "1f1b", "--stages", "2", "--microbatches", "4", "--fsdp",
             "--cost", "forward=1,backward=2,unshard=0.5,reduce=0.25"]
    gathered = _json(capsys, *shape)
    reshard = _json(capsys, *shape, "--fsdp-reshard")
    each = _json(capsys, *shape, "--fsdp-reduce-each-microbatch")
    lean = _json(capsys, *shape, "--fsdp-reshard", "--fsdp-reduce-each-microbatch")
    costs = {name: run["stage_costs"] for name, run in  # type: ignore[misc]
             (("reshard", reshard), ("each", each), ("lean", lean))}
    assert costs["reshard"]["forward"] == [1.5, 1.5] and costs["reshard"]["unshard"] == [0, 0]
    assert costs["each"]["backward"] == [2.25, 2.25] and costs["each"]["reduce"] == [0, 0]
    assert costs["lean"]["backward"] == [2.75, 2.75]
    # 1F1B on 2 ranks and 4 micro-batches: 4 (F + B) of rank 0 and the bubble of one (F + B)
    assert gathered["makespan"] == 5 * 3 + 0.5 + 0.25
    assert reshard["makespan"] == 5 * 4 + 0.25
    assert each["makespan"] == 5 * 3.25 + 0.5
    assert lean["makespan"] == 5 * 4.25
    assert main(["simulate", *shape[:-3], "--fsdp-reshard"]) == 2
    assert "--fsdp-reshard sets where the FSDP stages gather and reduce; add --fsdp" in \
        capsys.readouterr().err

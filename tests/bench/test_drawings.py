"""pipetrain.bench.drawings (reading figures out of tables) and every case's ``draw``: the
series each picture shows equal the figures of the tables it was given, and the files it
names are PNGs in the output folder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipetrain.bench import drawings, plots, registry
from pipetrain.bench.case import Table
from pipetrain.bench.cases import gpipe_table2

DRAWN = ("vs_torch_pipelining", "gpipe_vs_torchgpipe", "torchgpipe_paper", "gpipe_table1",
         "gpipe_table2", "pipedream_claims", "planner_vs_pipedream", "planner", "transport",
         "frontend_meta_memory", "vs_torch_frontend", "vs_torch_fsdp")
"""The cases that draw pictures."""


@pytest.mark.parametrize(("cell", "figure"), [
    ("1.23x", 1.23), ("39.7 ms", 39.7), ("-18.7%", -18.7), ("+7.7%", 7.7), ("84.2%", 84.2),
    ("0.434 MB", 0.434), ("18.6", 18.6), ("282.2M", 282.2e6), ("1.3B", 1.3e9),
    ("1.000x", 1.0), (" 2 ", 2.0), ("1e+09", 1e9), (3, 3.0), (0.25, 0.25),
    ("-", None), ("", None), (None, None), ("not run (full run only)", None),
    ("67.1 / 135.4 ms", None), ("2.94x (9-3-2-1-1, 64)", None), ("up to 95% less", None),
    ("12-2-1-1", None), ("1.5 parsecs", None), (True, None), (float("nan"), None),
    ([1.0], None)])
def test_number_reads_figures_and_nothing_else(cell: Any, figure: float | None) -> None:
    assert drawings.number(cell) == figure


def _table(columns: list[str], rows: list[list[Any]], key: str = "", title: str = "t") -> Table:
    return Table(title=title, columns=columns, rows=rows, key=key)


def test_series_keeps_rows_with_a_figure_and_those_where_selects() -> None:
    table = _table(["model", "mode", "ours", "theirs"],
                   [["MLP", "never", "10 MiB", 12], ["MLP", "always", "-", "-"],
                    ["GPT", "never", 30, "31.5"], ["GPT", "always", 20, None]])
    assert drawings.series(table, "mode", {"a": "ours", "b": "theirs"},
                           where={"model": "GPT"}) == (
        ["never", "always"], {"a": [30.0, 20.0], "b": [31.5, None]})
    assert drawings.series(table, ["model", "mode"], {"a": "ours"}, form="{}/{}",
                           where={"mode": ("never", "always")})[0] == [
        "MLP/never", "GPT/never", "GPT/always"]
    assert drawings.series(table, "mode", {"given": [1.0, 2.0, None, None]}) == (
        ["never", "always"], {"given": [1.0, 2.0]})
    with pytest.raises(ValueError, match=r"has no column 'nope'; its columns are \['model'"):
        drawings.series(table, "nope", {"a": "ours"})
    with pytest.raises(ValueError, match="series 'given' has 1 figures for the 4 rows"):
        drawings.series(table, "mode", {"given": [1.0]})


def test_find_table_by_key_then_by_title() -> None:
    first, second = _table([], [], key="time", title="Step time"), _table([], [], title="Bytes")
    assert drawings.find_table([first, second], "time") is first
    assert drawings.find_table([first, second], "Bytes") is second
    assert drawings.find_table([first, second], "memory") is None
    assert drawings.quotient([4.0, 1.0, None], [2.0, None, 3.0]) == [2.0, None, None]


Charts = list[dict[str, Any]]


@pytest.fixture
def charts(monkeypatch: pytest.MonkeyPatch) -> Charts:
    """Every chart drawn (its file name and arguments), still written as a PNG."""
    calls: Charts = []

    def recording(original: Callable[..., str]) -> Callable[..., str]:
        def chart(path: Path, **options: Any) -> str:
            calls.append({"file": path.name, **options})
            return original(path, **options)
        return chart

    monkeypatch.setattr(drawings, "bar_chart", recording(plots.bar_chart))
    monkeypatch.setattr(gpipe_table2, "line_chart", recording(plots.line_chart))
    return calls


def _draw(name: str, tables: list[Table], out: Path, data: dict[str, Any] | None = None,
          ) -> list[str]:
    """Case ``name``'s pictures of ``tables``: the names it returns are PNGs in ``out``."""
    draw = registry.load_case(name).draw
    assert draw is not None
    names = draw(tables, data or {}, out)
    assert names and len(set(names)) == len(names)
    for file in names:
        assert file.startswith(f"{name}_") and file.endswith(".png")
        assert (out / file).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return names


def test_every_reproduction_draws() -> None:
    drawn = {n for n in registry.case_names() if registry.load_case(n).draw is not None}
    assert set(DRAWN) <= drawn


def test_vs_torch_pipelining(tmp_path: Path, charts: Charts) -> None:
    mlp = _table(["schedule", "pipetrain ms", "torch ms", "pipetrain / torch throughput",
                  "bound"], [["gpipe", 83.3, 103.6, "1.24x", "1.29x"],
                             ["zb-v", 83.4, 141.3, "1.69x", "1.88x"]], key="mlp")
    transformer = _table(["schedule", "pipetrain ms", "torch ms", "pipetrain / torch throughput",
                          "ideal ms"], [["gpipe", 60.0, 58.0, "0.97x", 50.0],
                                        ["1f1b", 62.5, 60.0, "0.96x", 48.0]], key="transformer")
    names = _draw("vs_torch_pipelining", [mlp, transformer], tmp_path)
    assert names == ["vs_torch_pipelining_mlp.png", "vs_torch_pipelining_transformer.png"]
    assert charts[0]["categories"] == ["gpipe", "zb-v"]
    assert list(charts[0]["series"].values()) == [[1.24, 1.69], [1.29, 1.88]]
    assert list(charts[1]["series"].values()) == [[0.97, 0.96], [58.0 / 50.0, 60.0 / 48.0]]
    assert charts[0]["reference"] == 1.0


def test_gpipe_vs_torchgpipe(tmp_path: Path, charts: Charts) -> None:
    time = _table(["pipetrain options", "pipetrain / torchgpipe throughput",
                   "pipetrain / plain throughput"],
                  [["defaults", 1.06, 0.47], ["all three opt-ins", 1.26, 0.64]], key="time")
    columns = ["model", "checkpoint", "pipetrain MiB", "torchgpipe MiB", "plain MiB"]
    memory = _table(columns, [["MLP", "never", 353, 319, 309], ["MLP", "always", 212, 222, 300],
                              ["GPT", "never", 642, 617, 644]], key="memory")
    names = _draw("gpipe_vs_torchgpipe", [time, memory], tmp_path)
    assert len(names) == 3
    assert charts[0]["series"] == {"pipetrain / torchgpipe": [1.06, 1.26],
                                   "pipetrain / plain": [0.47, 0.64]}
    assert charts[1]["categories"] == ["never", "always"]
    assert charts[1]["series"]["torchgpipe MiB"] == [319.0, 222.0]
    assert charts[2]["series"] == {"pipetrain MiB": [642.0], "torchgpipe MiB": [617.0],
                                   "plain MiB": [644.0]}
    assert "GPT" in charts[2]["title"]


def test_torchgpipe_paper(tmp_path: Path, charts: Charts) -> None:
    here = ["here: torchgpipe", "here: pipetrain"]
    amoebanet = _table(["partitions n", "micro-batches m", "paper: torchgpipe (P40s)",
                        "paper: Huang et al. (TPUs)", *here],
                       [[2, 1, "1.00x", "1.00x", "1.00x", "1.00x"],
                        [2, 4, "1.54x", "1.07x", "0.46x", "0.62x"],
                        [8, 32, "4.95x", "3.48x", "-", "-"]], key="amoebanet_vs_paper")
    unet = _table(["experiment", "paper: torchgpipe (P40s)", *here],
                  [["baseline (plain)", "1.00x", "1.00x", "1.00x"],
                   ["pipeline-2", "1.25x", "0.34x", "0.72x"]], key="unet_vs_paper")
    memory = ["partitions K", "chunks m", "checkpoint", "pipetrain MiB", "torchgpipe MiB",
              "plain MiB"]
    tables = [amoebanet, unet,
              _table(memory, [[2, 1, "never", "18.6", "22.0", "17.3"]], key="amoebanet_memory"),
              _table(memory, [[2, 4, "always", "8.3", "8.3", "11.8"]], key="unet_memory")]
    assert len(_draw("torchgpipe_paper", tables, tmp_path)) == 4
    assert charts[0]["categories"] == ["n=2, m=1", "n=2, m=4", "n=8, m=32"]
    assert charts[0]["series"]["paper: torchgpipe (P40s)"] == [1.0, 1.54, 4.95]
    assert charts[0]["series"]["here: pipetrain"] == [1.0, 0.62, None]
    assert charts[1]["series"]["here: torchgpipe"] == [1.0, 0.34]
    assert charts[2]["categories"] == ["K=2, m=1, never"]
    assert charts[3]["series"]["plain MiB"] == [11.8]


def test_gpipe_table1(tmp_path: Path, charts: Charts) -> None:
    table = _table(["configuration", "x naive-1", "paper x naive-1",
                    "paper x naive-1 (AmoebaNet)"],
                   [["naive-1", "1.00x", "1.00x", "1.00x"], ["pipeline-2", "3.69x", "4.61x",
                                                             "6.61x"],
                    ["pipeline-1 (Pipeline)", "1.90x", "-", "-"],
                    ["pipeline-8", "-", "18.78x", "21.95x"]], key="sizes")
    _draw("gpipe_table1", [table], tmp_path)
    assert charts[0]["series"] == {"pipetrain (GPT)": [1.0, 3.69, 1.9, None],
                                   "paper (Transformer-L)": [1.0, 4.61, None, 18.78],
                                   "paper (AmoebaNet-D)": [1.0, 6.61, None, 21.95]}


def test_gpipe_table2(tmp_path: Path, charts: Charts) -> None:
    columns = ["model", "K", "M", "pipetrain measured", "pipetrain simulated", "paper"]
    table = _table(columns, [["GPT", 2, 1, 1.0, 1.0, 1.0], ["GPT", 2, 32, 0.25, 0.19, 1.8],
                             ["GPT", 4, 1, None, 1.07, 1.07], ["GPT", 4, 32, None, 0.33, 3.4],
                             ["ResNet", 2, 4, 0.53, 0.55, 1.07]], key="throughput")
    assert _draw("gpipe_table2", [table], tmp_path) == ["gpipe_table2_gpt.png",
                                                         "gpipe_table2_resnet.png"]
    assert charts[0]["x"] == [1.0, 32.0]
    assert charts[0]["series"] == {"K=2 measured": [1.0, 0.25], "K=2 simulated": [1.0, 0.19],
                                   "K=2 paper": [1.0, 1.8], "K=4 simulated": [1.07, 0.33],
                                   "K=4 paper": [1.07, 3.4]}
    assert charts[0]["styles"]["K=4 paper"] == {"color": "C1", "linestyle": ":"}
    assert charts[1]["x"] == [4.0] and charts[1]["series"]["K=2 measured"] == [0.53]


def test_pipedream_claims(tmp_path: Path, charts: Charts) -> None:
    speedups = _table(["model", "servers x GPUs (cluster)", "paper speedup (epoch)",
                       "paper speedup (TTA)", "predicted speedup"],
                      [["VGG-16", "4x4 (A)", "5.28x", "5.28x", "2.02x"],
                       ["GNMT-16", "1x4 (A)", "1.46x", "2.20x", "-"]],
                      title="PipeDream vs data parallelism: the paper's measured speedups")
    traffic = _table(["model", "servers x GPUs (cluster)", "less than data parallel",
                      "less between servers"],
                     [["VGG-16", "4x4 (A)", "84.2%", "78.2%"],
                      ["ResNet-50", "4x4 (A)", "-1159.4%", "-300.0%"],
                      ["paper (all models)", "-", "up to 95% less", "-"]],
                     title="Bytes sent per sample: PipeDream's plan vs data parallelism's")
    link = _table(["runner", "measured step (median)", "predicted (pipetrain model)",
                   "predicted (PipeDream model)"],
                  [["Pipeline, 2 stages, 1f1b", "76.9 ms", "45.8 ms", "41.9 ms"],
                   ["torch DDP, 2 replicas", "1516.1 ms", "-", "1352.2 ms"]],
                  title="A 2-stage pipeline vs data parallelism over a 100 Mbit/s link")
    data = {"claims": {"communication": {"value": 0.95}}}
    assert len(_draw("pipedream_claims", [speedups, traffic, link], tmp_path, data)) == 3
    assert charts[0]["categories"] == ["VGG-16 4x4 (A)", "ResNet-50 4x4 (A)"]
    assert charts[0]["series"] == {"all bytes": [84.2, -1159.4],
                                   "between servers": [78.2, -300.0]}
    assert charts[0]["reference"] == pytest.approx(95.0) and charts[0]["floor"] == -100.0
    assert charts[1]["series"]["pipetrain's planner (predicted)"] == [2.02, None]
    assert charts[1]["series"]["paper, to accuracy (measured)"] == [5.28, 2.2]
    assert charts[2]["series"] == {"measured (median)": [76.9, 1516.1],
                                   "predicted, pipetrain's model": [45.8, None],
                                   "predicted, PipeDream's model": [41.9, 1352.2]}


def test_planner_vs_pipedream_draws_only_with_pipedreams_figures(
        tmp_path: Path, charts: Charts) -> None:
    columns = ["model", "cluster", "pipetrain / PipeDream"]
    without = _table(columns, [["alexnet", "4 @ 1e+09", "-"]], key="plans")
    draw = registry.load_case("planner_vs_pipedream").draw
    assert draw is not None and draw([without], {}, tmp_path) == [] and not charts
    assert not list(tmp_path.iterdir())
    ratios = _table(columns, [["alexnet", "4 @ 1e+09", "0.9876"], ["vgg16", "8 @ 1e+10", "-"],
                              ["gnmt", "4 @ 1e+10", "1.0000"]], key="plans")
    _draw("planner_vs_pipedream", [ratios], tmp_path)
    assert charts[0]["categories"] == ["alexnet 4 @ 1e+09", "gnmt 4 @ 1e+10"]
    assert charts[0]["series"] == {"pipetrain / PipeDream": [0.9876, 1.0]}


def test_planner(tmp_path: Path, charts: Charts) -> None:
    table = _table(["layout", "measured ms", "predicted ms", "simulated on measured costs ms"],
                   [["plan", 112.7, 109.4, 112.2], ["even", 184.7, 150.2, 180.4],
                    ["speedup of the plan", "1.64x", "1.37x", ""]], key="plan_vs_even")
    _draw("planner", [table], tmp_path)
    assert charts[0]["categories"] == ["plan", "even"]
    assert charts[0]["series"] == {"measured": [112.7, 184.7], "predicted": [109.4, 150.2],
                                   "simulated on measured costs": [112.2, 180.4]}
    assert "measured 1.64x, predicted 1.37x" in charts[0]["title"]


def test_transport_frontends(tmp_path: Path, charts: Charts) -> None:
    ratios = ["inline / raw", "inline+thread / raw", "apart / raw", "apart+thread / raw"]
    transport = _table(["message", *ratios], [["32 KiB", 2.87, 3.68, 4.75, 6.77],
                                              ["4096 KiB", 2.46, 2.77, 2.43, 2.32]],
                       key="round_trip")
    _draw("transport", [transport], tmp_path)
    assert charts[0]["categories"] == ["32 KiB", "4096 KiB"]
    assert charts[0]["series"]["apart+thread"] == [6.77, 2.32]

    peaks = _table(["weights", "rank", "peak RSS after step 1 MiB",
                    "peak RSS after 3 steps MiB"],
                   [["init", 0, 398, 400], ["safetensors", 1, 396, 398]], key="peaks")
    _draw("frontend_meta_memory", [peaks], tmp_path, {"cap_bytes": 6 * 2**20})
    assert charts[1]["categories"] == ["init, rank 0", "safetensors, rank 1"]
    assert charts[1]["series"] == {"peak RSS after step 1": [398.0, 396.0],
                                   "peak RSS after 3 steps": [400.0, 398.0]}
    assert charts[1]["reference"] == 6.0

    frontend = _table(["framework", "median step ms"], [["pipetrain", 32.0], ["torch", 27.6]],
                      key="frontend")
    _draw("vs_torch_frontend", [frontend], tmp_path)
    assert charts[2]["series"] == {"median step": [32.0, 27.6]}


def test_a_table_a_quick_run_left_empty_draws_nothing(tmp_path: Path) -> None:
    for name in DRAWN:
        draw = registry.load_case(name).draw
        assert draw is not None
        assert draw([], {}, tmp_path) == [], name
    assert not list(tmp_path.iterdir())

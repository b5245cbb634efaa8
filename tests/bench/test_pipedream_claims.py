"""The ``pipedream_claims`` case: byte counts against hand computations, PipeDream's
profiles, the paper's figures in the tables, the predictions of the shaped-link run, and
the shaped link itself (where root and iproute2 allow it)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipetrain.bench.case import BenchContext
from pipetrain.bench.cases import pipedream_claims
from pipetrain.bench.cases.pipedream_link import pipedream_predictions, pipetrain_predictions
from pipetrain.bench.cases.pipedream_paper import CLAIMS, TABLE1
from pipetrain.bench.cases.pipedream_traffic import (
    PROFILE_BATCH_SIZES,
    between_servers,
    data_parallel_between_servers,
    data_parallel_bytes,
    find_profiles,
    load_profile,
    plan_traffic,
    shown_folder,
)
from pipetrain.bench.netns import ShapedLink, link_unavailable_reason, shaped_link
from pipetrain.plan import LayerProfile, Plan, PlanStage, Profile

# a -> b, a -> c, b -> d, c -> d (a diamond); outputs 8, 4, 2, 1 bytes; weights 100..400
_DIAMOND = Profile(
    layers=tuple(LayerProfile(name=n, forward_s=1.0, backward_s=1.0, output_bytes=out,
                              parameter_bytes=w)
                 for n, out, w in (("a", 8, 100), ("b", 4, 200), ("c", 2, 300), ("d", 1, 400))),
    edges=((0, 1), (0, 2), (1, 3), (2, 3)), batch_size=2)


def test_diamond_traffic_equals_hand_count() -> None:
    traffic = plan_traffic(_DIAMOND, [(("a",), 2), (("b", "c"), 1), (("d",), 1)])
    # cut 1: a feeds b and c -> 8; cut 2: b and c feed d -> 6 (a's consumers are inside)
    assert traffic.activation_bytes == 2 * (8 + 6)
    assert traffic.allreduce_bytes == 2 * (2 - 1) / 2 * 100  # stage 0 on 2 replicas
    assert traffic.per_sample == (28 + 100) / 2
    assert data_parallel_bytes(_DIAMOND, num_workers=4) == 2 * 3 / 4 * 1000


def test_a_value_skipping_a_stage_crosses_every_cut_it_spans() -> None:
    skip = Profile(layers=_DIAMOND.layers[:3], edges=((0, 1), (1, 2), (0, 2)), batch_size=1)
    traffic = plan_traffic(skip, [(("a",), 1), (("b",), 1), (("c",), 1)])
    assert traffic.activation_bytes == 2 * (8 + (8 + 4))  # a reaches c across both cuts
    assert traffic.allreduce_bytes == 0


def test_traffic_refuses_stages_that_do_not_partition_the_nodes() -> None:
    with pytest.raises(ValueError, match="'a' is unknown or in two stages"):
        plan_traffic(_DIAMOND, [(("a", "b"), 1), (("a", "c", "d"), 1)])
    with pytest.raises(ValueError, match="hold 3 of the profile's 4 nodes"):
        plan_traffic(_DIAMOND, [(("a", "b"), 1), (("c",), 1)])


def test_between_servers_counts_cross_server_cuts_and_hierarchical_allreduce() -> None:
    plan = Plan(stages=(
        PlanStage(nodes=("a",), replicas=6, replicas_per_level=(2, 3), outer_stage=(0,)),
        PlanStage(nodes=("b", "c"), replicas=1, replicas_per_level=(1, 1), outer_stage=(1,)),
        PlanStage(nodes=("d",), replicas=1, replicas_per_level=(1, 1), outer_stage=(1,))),
        cost_model="pipedream", time_per_step=1.0, num_workers=8)
    across = between_servers(_DIAMOND, plan)
    assert across.activation_bytes == 2 * 8  # only the cut between outer stages 0 and 1
    assert across.allreduce_bytes == 2 * (3 - 1) * 100 / 6  # a ring over 3 servers per 6
    assert data_parallel_between_servers(_DIAMOND, num_servers=2, gpus_per_server=4) == \
        2 * 1 * 1000 / 8


def _write_graph(folder: Path, name: str) -> None:
    """A tiny PipeDream graph.txt: an input, two heavy layers and a light head."""
    lines = ["node1 -- Input -- forward_compute_time=1.0, backward_compute_time=0.0, "
             "activation_size=1000.0, parameter_size=0.0"]
    for k, (ms, act, par) in enumerate(((20.0, 4e5, 4e8), (20.0, 2e5, 4e8), (2.0, 1e3, 1e6))):
        lines.append(f"node{k + 2} -- Layer{k} -- forward_compute_time={ms}, "
                     f"backward_compute_time={2 * ms}, activation_size={act}, parameter_size={par}")
    lines += ["\tnode1 -- node2", "\tnode2 -- node3", "\tnode3 -- node4"]
    (folder / name).mkdir()
    (folder / name / "graph.txt").write_text("\n".join(lines) + "\n")


def test_quick_case_tables_carry_the_papers_figures(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROFILE_BATCH_SIZES:
        _write_graph(tmp_path, name)
    monkeypatch.setenv("PIPETRAIN_PIPEDREAM_PROFILES", str(tmp_path))
    lines: list[str] = []
    result = pipedream_claims.run(BenchContext(quick=True, out=tmp_path, progress=lines.append))
    speedups, traffic, link = result.tables
    vgg = [row for row in speedups.rows if row[:2] == ["VGG-16", "4x4 (A)"]]
    assert vgg and vgg[0][2:5] == ["15-1", "5.28x", "5.28x"] and vgg[0][5] != "-"
    assert vgg[0][8].endswith(", 64)")  # also planned at the paper's minibatch of 64
    alexnet = [row for row in speedups.rows if row[:2] == ["AlexNet", "4x4 (A)"]]
    assert alexnet[0][8] == "(the profile's, 256)"  # the paper's minibatch is the profile's
    assert len(speedups.rows) == len(TABLE1)
    assert ["GNMT-8", "3x4 (A)", "Straight", "2.95x", "2.95x", "-", "-", "-", "-"] in speedups.rows
    assert traffic.rows[-1][-4] == "up to 95% less" and "arXiv:1806.03377" in traffic.anchor
    assert len(traffic.rows) == len(pipedream_claims.QUICK_ROWS) + 1
    assert result.data["profiles"] == "profiles from $PIPETRAIN_PIPEDREAM_PROFILES"
    assert str(tmp_path) not in str(result.data) + str([t.anchor for t in result.tables])
    assert link.rows == [] and "--quick" in link.notes
    assert len(lines) == len(pipedream_claims.QUICK_ROWS)
    plans = result.data["plans"]
    assert {p["cluster"] for p in plans} == {shape for _, shape in pipedream_claims.QUICK_ROWS}
    for p in plans:  # the quick profile's two heavy layers: a reduction a hand can check
        assert 0 < p["bytes_per_sample"] and p["data_parallel_bytes_per_sample"] > 0
        assert p["reduction"] == pytest.approx(
            1 - p["bytes_per_sample"] / p["data_parallel_bytes_per_sample"])
    assert result.data["claims"]["communication"]["value"] == CLAIMS["communication"].value


def test_without_profiles_the_speedup_table_still_shows_the_paper(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipedream_claims, "find_profiles", lambda: None)
    result = pipedream_claims.run(BenchContext(quick=True, out=tmp_path, progress=lambda _: None))
    assert len(result.tables) == 2  # the paper's speedups, and the skipped link
    assert ["AlexNet", "4x4 (A)", "15-1", "4.92x", "-", "-", "-", "-", "-"] in result.tables[0].rows
    assert "PIPETRAIN_PIPEDREAM_PROFILES" in result.data["profiles"]


def _image_batch(text: str) -> int:
    line = next(line for line in text.splitlines() if " -- Input -- " in line)
    size = float(line.rpartition("activation_size=")[2].partition(",")[0])
    return round(size / (3 * 224 * 224 * 4))


def test_published_profiles_are_found_beside_the_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    """PipeDream's published profiles are in ../shared/pipedream beside every checkout
    (and in CI): the cases that need them find them there, and records show that path
    relative to the checkout, not this machine's (it read /work/shared/pipedream)."""
    monkeypatch.delenv("PIPETRAIN_PIPEDREAM_PROFILES", raising=False)
    folder = find_profiles()
    root = Path(__file__).resolve().parents[2]
    assert folder is not None, f"no PipeDream profiles in {root.parent / 'shared' / 'pipedream'}"
    assert folder.resolve() == (root.parent / "shared" / "pipedream").resolve()
    assert shown_folder(folder) == "../shared/pipedream"


def test_published_profiles_load_at_the_batch_their_sizes_say() -> None:
    folder = find_profiles()
    assert folder is not None
    nodes = {"vgg16": 40, "alexnet": 22, "resnet50": 176, "gnmt": 37}
    for name, (batch, _) in PROFILE_BATCH_SIZES.items():
        profile = load_profile(folder, name)
        assert profile.num_layers == nodes[name] and profile.batch_size == batch
        text = (folder / name / "graph.txt").read_text()
        if name == "gnmt":  # the LSTMs' state: 1 x batch x 1024 float32
            assert "131072.0" in text and 131072 == 1 * batch * 1024 * 4
        else:
            assert _image_batch(text) == batch


def test_link_predictions_equal_hand_computations() -> None:
    layers = tuple(LayerProfile(name=str(k), forward_s=0.01, backward_s=0.02, output_bytes=1000,
                                parameter_bytes=10**6) for k in range(4))
    profile = Profile(layers=layers, batch_size=64)
    ours = pipetrain_predictions(profile, bandwidth=1e7, num_microbatches=8,
                                 schedules=("1f1b", "pipedream"))
    # data parallel: each replica half the batch (0.12 s / 2), then a ring of 4 MB at 1e7 B/s
    assert ours["data_parallel_s"] == pytest.approx(0.06 + 4e6 / 1e7)
    assert "two_stage_pipedream_s" not in ours  # asynchronous: not in the pipetrain model
    assert 0.06 < ours["two_stage_1f1b_s"] < ours["data_parallel_s"]
    dream = pipedream_predictions(profile, bandwidth=1e7)
    # 2 stages of 0.06 s; the last receives 2 x 1000 B; DP: (0.12 + 4 (2-1) 4e6 / (1e7 2)) / 2
    assert dream == {"two_stage_s": pytest.approx(0.06),
                     "data_parallel_s": pytest.approx((0.12 + 4 * 4e6 / 2e7) / 2)}


def test_shaped_link_refuses_a_bad_rate() -> None:
    with pytest.raises(ValueError, match="rate_mbit=0 must be a number > 0"):
        ShapedLink(rate_mbit=0)


_REASON = link_unavailable_reason()


@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_shaped_link_shapes_both_ends_and_carries_traffic() -> None:
    server = ("import socket; s = socket.socket(); s.bind(('{a}', 29511)); s.listen(1); "
              "c, _ = s.accept(); n = 0\nwhile (d := c.recv(65536)): n += len(d)\nprint(n)")
    client = "import socket; c = socket.create_connection(('{a}', 29511), timeout=20); " \
             "c.sendall(b'x' * 100000); c.close()"
    with shaped_link(rate_mbit=50) as link:
        names = (link.a.netns, link.b.netns)
        for host in (link.a, link.b):
            shown = subprocess.run(["tc", "-n", host.netns, "qdisc", "show", "dev", host.interface],
                                   capture_output=True, text=True, timeout=20, check=True).stdout
            assert "tbf" in shown and "rate 50Mbit" in shown
        receiver = link.popen(link.a, [sys.executable, "-c", server.format(a=link.a.address)],
                              env={"PATH": "/usr/bin:/bin"})
        for _ in range(100):  # until the listener is up
            sent = subprocess.run(["ip", "netns", "exec", link.b.netns, sys.executable, "-c",
                                   client.format(a=link.a.address)], capture_output=True,
                                  timeout=30)
            if sent.returncode == 0:
                break
            time.sleep(0.1)
        output, _ = receiver.communicate(timeout=30)
        assert output.strip() == "100000"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    assert not any(name in listed.stdout for name in names)

"""A user's samples of any length: SampleDataset's packing (with or without the documents'
boundaries) and padding, resumable by the step, and a Pipeline trained on them
(loss_per="token") equal to one process."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.distributed import run_workers
from helpers.sample_jobs import (
    GPT,
    documents,
    hf_documents_job,
    hf_documents_reference,
    samples_job,
    samples_reference,
    samples_resume_job,
)
from pipetrain.api.config import PipelineConfig
from pipetrain.api.step_batches import StepSplitter
from pipetrain.data import IGNORE_INDEX, SampleDataset
from pipetrain.models import build_gpt

TOLERANCE = 1e-5


class Stream(torch.utils.data.IterableDataset):  # type: ignore[misc]
    def __init__(self, docs: list[torch.Tensor]) -> None:
        self.docs = docs

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.docs)


def _pairs(docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([d[:-1] for d in docs]), torch.cat([d[1:] for d in docs])


def test_packing_gives_every_prediction_of_an_epoch_once_and_none_across_documents() -> None:
    docs = documents(12)
    data = SampleDataset(docs, context=16, seed=3, val_fraction=0)
    positions = sum(len(d) - 1 for d in docs)
    rows = positions // 16
    x, y = data.batch(0, rows)
    assert x.shape == (rows, 16)
    # the epoch's order is a permutation of the documents; its pairs, end to end, are the rows
    order = data._order("train")(0, len(docs))
    want_x, want_y = _pairs([docs[int(i)] for i in order])
    assert torch.equal(x.flatten(), want_x[:rows * 16]) and torch.equal(y.flatten(), want_y[:rows * 16])
    # the next epoch is shuffled anew and starts where the first ends
    later_x, _ = data.batch(1, rows)
    assert not torch.equal(later_x, x)
    # no target crosses into another document: each is the next token of its own
    assert (y != IGNORE_INDEX).all()


def test_padding_varies_the_length_by_step_and_ignores_the_padding() -> None:
    docs = [torch.arange(n) for n in (3, 9, 40, 5, 17, 70)]
    data = SampleDataset(docs, context=32, seed=0, pack=False, val_fraction=0)
    lengths = set()
    for step in range(6):
        x, y = data.batch(step, 2)
        lengths.add(x.shape[1])
        real = y != IGNORE_INDEX
        assert x.shape == y.shape and x.shape[1] <= 32
        assert torch.equal(y[real], x[real] + 1)  # targets are each document's next token
        assert int(real.sum(1).max()) == x.shape[1]  # the step's longest row sets its length
    assert len(lengths) >= 3


@pytest.mark.parametrize(("pack", "boundaries"), [(True, False), (True, True), (False, False)])
def test_a_step_is_the_same_however_the_dataset_got_there(pack: bool, boundaries: bool) -> None:
    docs = documents(15)
    for make in (lambda: docs, lambda: Stream(docs)):
        straight = SampleDataset(make(), context=24, seed=2, pack=pack, boundaries=boundaries,
                                 val_fraction=0)
        run = [straight.batch(step, 3) for step in range(9)]
        resumed = SampleDataset(make(), context=24, seed=2, pack=pack, boundaries=boundaries,
                                val_fraction=0)
        for step in (5, 6, 7, 8, 2):  # a resume at step 5, then back to an earlier step
            x, y = resumed.batch(step, 3)
            for got, want in ((x, run[step][0]), (y, run[step][1])):
                if isinstance(want, dict):
                    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
                else:
                    assert torch.equal(got, want)


def test_an_iterable_is_read_in_its_own_order_epoch_after_epoch() -> None:
    docs = documents(4)
    data = SampleDataset(Stream(docs), context=8, seed=0)
    positions = sum(len(d) - 1 for d in docs)
    rows = 2 * positions // 8
    x, y = data.batch(0, rows)
    want_x, want_y = _pairs(docs + docs)
    assert torch.equal(x.flatten(), want_x[:rows * 8]) and torch.equal(y.flatten(), want_y[:rows * 8])
    with pytest.raises(ValueError, match="split='val' is empty"):
        data.batch(0, 1, split="val")


def test_a_map_style_dataset_holds_out_its_last_samples_or_takes_val_data() -> None:
    docs = documents(20)
    held = SampleDataset(docs, context=8, seed=0, val_fraction=0.1)
    assert held.num_val_tokens == sum(len(d) - 1 for d in docs[18:])
    given = SampleDataset(docs, context=8, seed=0, val_data=[torch.arange(30)])
    assert given.num_train_tokens == sum(len(d) - 1 for d in docs)
    x, y = given.batch(0, 2, split="val")
    assert torch.equal(y, x + 1)


def test_pairs_keep_the_users_targets() -> None:
    pairs = [(torch.arange(5), torch.arange(5) * 10), (torch.arange(3), -torch.arange(3))]
    x, y = SampleDataset(pairs, context=4, seed=0, pack=False, val_fraction=0).batch(0, 2)
    for row in range(2):
        real = y[row] != IGNORE_INDEX
        assert torch.equal(y[row][real], x[row][real] * 10) or torch.equal(y[row][real], -x[row][real])


@pytest.mark.parametrize("bad, message", [
    ([torch.tensor([7])], "at least 2 token ids"),
    ([torch.rand(5)], "token ids must be integers"),
    ([(torch.arange(3), torch.arange(4))], "two 1-D tensors of one length"),
    ([], "no samples"),
    ((torch.arange(4) for _ in range(3)), "a generator or iterator can be read once only"),
])
def test_bad_samples_are_named(bad: Any, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        SampleDataset(bad, context=4, val_fraction=0).batch(0, 1)


def test_token_weights_are_each_micro_batchs_share_of_the_real_tokens() -> None:
    targets = torch.tensor([[1, 2, 3], [4, IGNORE_INDEX, IGNORE_INDEX],
                            [5, 6, IGNORE_INDEX], [7, 8, 9]])
    cut = StepSplitter(num_microbatches=2, per_token=True)
    assert cut.train(torch.zeros(4, 3), targets).scales == [4 / 9, 5 / 9]
    assert StepSplitter(num_microbatches=2).train(torch.zeros(4, 3), targets).scales == [0.5, 0.5]
    empty = torch.tensor([[IGNORE_INDEX] * 3, [1, 2, 3]])
    with pytest.raises(ValueError, match=r"hold \[0, 3\] real tokens"):
        StepSplitter(num_microbatches=2, per_token=True).train(torch.zeros(2, 3), empty)
    with pytest.raises(ValueError, match="loss_per='tokens' must be one of sample, token"):
        PipelineConfig(loss_per="tokens")


def test_kept_boundaries_make_each_document_of_a_row_predict_as_it_does_alone() -> None:
    """Packed rows with boundaries=True through the GPT in one process: every piece of a
    document gives the logits it gives alone (from position 0), to 1e-5; the same rows
    packed without boundaries do not (attention crosses documents)."""
    model = build_gpt(GPT, seed=3).eval()
    kept = SampleDataset(documents(), context=GPT.context, seed=1, boundaries=True, val_fraction=0)
    joined = SampleDataset(documents(), context=GPT.context, seed=1, val_fraction=0)
    inputs, targets = kept.batch(2, 4)
    tokens, positions = inputs["input_ids"], inputs["position_ids"]
    assert torch.equal(tokens, joined.batch(2, 4)[0]) and torch.equal(targets, joined.batch(2, 4)[1])
    with torch.no_grad():
        packed, crossing = model(inputs), model(tokens)
        pieces = 0
        for row in range(len(tokens)):
            starts = [0, *(t for t in range(1, GPT.context) if positions[row, t] == 0), GPT.context]
            for a, b in itertools.pairwise(starts):
                alone = model(tokens[row:row + 1, a:b])[0]
                assert torch.equal(positions[row, a:b], torch.arange(b - a))
                assert torch.allclose(packed[row, a:b], alone, atol=TOLERANCE, rtol=0)
                pieces += 1
        assert pieces > 2 * len(tokens)  # the rows hold several documents each
        assert float((packed - crossing).abs().max()) > 1e-3


def test_boundaries_need_packing_and_the_gpt_names_a_bad_input() -> None:
    with pytest.raises(ValueError, match="boundaries=True keeps the documents of packed rows apart"):
        SampleDataset(documents(2), context=8, pack=False, boundaries=True)
    embedding = build_gpt(GPT, seed=0)[0]
    tokens = torch.zeros(1, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"position_ids must lie in \[0, 64\)"):
        embedding({"input_ids": tokens, "position_ids": torch.full((1, 4), 64)})
    with pytest.raises(ValueError, match=r"got keys \['input_ids', 'positions'\]"):
        embedding({"input_ids": tokens, "positions": tokens})


@pytest.mark.distributed
def test_packed_and_padded_documents_train_as_one_process() -> None:
    """2 stages x 2 replicas (1f1b) and 4 stages (gpipe, zb-h1) on packed documents (their
    boundaries kept or not) and on padded documents of 16-128 tokens: the per-step losses
    and the weights equal one process's. Weighing padded micro-batches by their samples
    instead would not."""
    runs = []
    for layout in ("packed", "padded"):
        runs += [(layout, {"num_stages": 2, "replicas": 2, "num_microbatches": 3,
                           "schedule": "1f1b", "loss_per": "token"}),
                 (layout, {"num_stages": 4, "num_microbatches": 3, "schedule": "gpipe",
                           "loss_per": "token", "checkpoint": "except_last"}),
                 (layout, {"num_stages": 4, "num_microbatches": 6, "schedule": "zb-h1",
                           "loss_per": "token"})]
    runs += [("documents", {"num_stages": 2, "replicas": 2, "num_microbatches": 3,
                            "schedule": "1f1b", "loss_per": "token"}),
             ("documents", {"num_stages": 4, "num_microbatches": 6, "schedule": "zb-h1",
                            "loss_per": "token", "checkpoint": "except_last"})]
    runs.append(("padded", {"num_stages": 4, "num_microbatches": 6, "schedule": "1f1b"}))
    results = run_workers(samples_job, 4, runs, 3, timeout=300)
    references = {layout: samples_reference(layout, 3) for layout in ("packed", "padded", "documents")}
    assert abs(references["packed"][1][0] - references["documents"][1][0]) > 1e-4
    for index, (layout, config) in enumerate(runs):
        params = {k: v for rank in results for k, v in rank[index][0].items()}
        ref_params, ref_losses = references[layout]
        losses = results[0][index][1]
        worst = max(float((params[k] - ref_params[k]).abs().max()) for k in ref_params)
        loss_error = max(abs(a - b) for a, b in zip(losses, ref_losses))
        if config.get("loss_per") == "token":
            assert worst < TOLERANCE and loss_error < TOLERANCE, (layout, config, worst, loss_error)
        else:
            assert loss_error > 1e-4, "weighing by samples matched: the test shows nothing"


@pytest.mark.distributed
def test_a_resume_mid_epoch_gives_the_uninterrupted_losses_bit_for_bit(tmp_path: Path) -> None:
    """2 stages x 2 replicas on padded documents: 3 steps straight, and 1 step, a save, a
    new Pipeline that loads it and trains steps 2-3 on a new dataset: the same losses."""
    config = {"num_stages": 2, "replicas": 2, "num_microbatches": 3, "schedule": "1f1b",
              "loss_per": "token"}
    results = run_workers(samples_resume_job, 4, config, "padded", str(tmp_path / "ckpt"), 3,
                          timeout=300)
    whole, resumed = results[0]
    assert len(whole) == len(resumed) == 3 and whole == resumed


@pytest.mark.parametrize("module", ["pipetrain.data.samples", "pipetrain.api.step_batches"])
def test_the_examples_run_as_written(module: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.distributed
def test_a_hugging_face_model_keeps_the_boundaries_through_a_pipeline() -> None:
    """GPT-2 captured on packed documents with their boundaries (``position_ids``, which it
    reads as packed sequences), 2 stages: the losses and weights of one process on the same
    batches, which differ from the same rows packed without boundaries."""
    pytest.importorskip("transformers")
    config = {"num_stages": 2, "num_microbatches": 3, "schedule": "1f1b", "loss_per": "token"}
    results = run_workers(hf_documents_job, 2, config, 2, timeout=300)
    params, losses = hf_documents_reference("documents", 2)
    assert abs(hf_documents_reference("packed", 1)[1][0] - losses[0]) > 1e-4
    merged = {k: v for rank in results for k, v in rank[0].items()}
    assert set(merged) == set(params)
    assert max(abs(a - b) for a, b in zip(results[0][1], losses, strict=True)) < TOLERANCE
    assert max(float((merged[k] - params[k]).abs().max()) for k in params) < TOLERANCE

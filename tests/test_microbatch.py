"""Tests for pipetrain.microbatch: split / merge of nested batches."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch

from pipetrain.microbatch import batch_size, map_tensors, merge_batches, split_batch

Pair = namedtuple("Pair", ["image", "label"])


def nested_batch(rows: int) -> dict[str, object]:
    return {
        "x": torch.randn(rows, 3),
        "pair": Pair(torch.arange(rows), torch.ones(rows, 2, 2)),
        "extra": [torch.zeros(rows), "tag", None, 0.5],
        "temperature": torch.tensor(2.0),  # 0-dim: shared
        "ordered": OrderedDict(a=torch.arange(rows) * 2),
    }


def assert_same(a: object, b: object) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b or a is b


@pytest.mark.parametrize(
    ("rows", "num_chunks", "sizes"),
    [(10, 4, [3, 3, 2, 2]), (8, 4, [2, 2, 2, 2]), (8, 1, [8]), (3, 5, [1, 1, 1]), (7, 7, [1] * 7)],
)
def test_split_sizes_are_balanced_and_merge_round_trips(rows, num_chunks, sizes):
    batch = nested_batch(rows)
    chunks = split_batch(batch, num_chunks)
    assert [len(c["x"]) for c in chunks] == sizes
    assert [len(c["pair"].label) for c in chunks] == sizes
    assert [len(c["extra"][0]) for c in chunks] == sizes
    assert_same(merge_batches(chunks), batch)


def test_chunks_keep_structure_and_share_non_tensor_leaves():
    batch = nested_batch(6)
    chunks = split_batch(batch, 3)
    for i, chunk in enumerate(chunks):
        assert isinstance(chunk["pair"], Pair)
        assert isinstance(chunk["ordered"], OrderedDict)
        assert chunk["extra"][1:] == ["tag", None, 0.5]
        assert chunk["temperature"] is batch["temperature"]
        assert torch.equal(chunk["x"], batch["x"][2 * i : 2 * i + 2])


def test_split_returns_views_not_copies():
    x = torch.randn(6, 4)
    chunks = split_batch((x,), 3)
    chunks[1][0][0, 0] = 123.0
    assert x[2, 0].item() == 123.0


def test_single_tensor_and_tuple_batches():
    x = torch.arange(10.0)
    chunks = split_batch(x, 3)
    assert all(isinstance(c, torch.Tensor) for c in chunks)
    assert torch.equal(merge_batches(chunks), x)
    pair = (torch.arange(4), torch.arange(4) * 10)
    merged = merge_batches(split_batch(pair, 2))
    assert isinstance(merged, tuple) and torch.equal(merged[1], pair[1])


def test_one_chunk_and_empty_batch_are_returned_whole():
    batch = {"x": torch.randn(5, 2)}
    assert split_batch(batch, 1)[0] is batch
    empty = torch.zeros(0, 3)
    assert [c.shape for c in split_batch(empty, 4)] == [torch.Size([0, 3])]


def test_merge_of_one_chunk_is_identity():
    chunk = {"x": torch.randn(2)}
    assert merge_batches([chunk]) is chunk


def test_merge_takes_shared_leaves_from_first_chunk():
    chunks = [{"x": torch.ones(1), "step": 1}, {"x": torch.zeros(1), "step": 2}]
    merged = merge_batches(chunks)
    assert merged["step"] == 1 and merged["x"].tolist() == [1.0, 0.0]


def test_gradient_flows_through_split_and_merge():
    x = torch.randn(5, 3, requires_grad=True)
    merged = merge_batches([c * (i + 1) for i, c in enumerate(split_batch(x, 2))])
    merged.sum().backward()
    assert x.grad[:, 0].tolist() == [1.0, 1.0, 1.0, 2.0, 2.0]


def test_batch_size():
    assert batch_size(nested_batch(7)) == 7
    assert batch_size([1, torch.tensor(3.0), torch.zeros(4, 2)]) == 4


def test_mismatched_dim0_names_both_paths_and_sizes():
    batch = {"x": torch.zeros(8, 3), "mask": torch.zeros(6)}
    with pytest.raises(ValueError, match=r"batch\['x'\] has 8 rows and batch\['mask'\] has 6"):
        split_batch(batch, 2)
    with pytest.raises(ValueError, match=r"batch\[1\]\.label has 3"):
        batch_size((torch.zeros(2), Pair(torch.zeros(2), torch.zeros(3))))


def test_batch_without_tensors_is_rejected():
    with pytest.raises(ValueError, match=r"no tensor with a batch dimension.*got list"):
        split_batch([1, 2, "a"], 2)
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        batch_size(torch.tensor(1.0))


@pytest.mark.parametrize("num_chunks", [0, -1, 2.5, True])
def test_bad_num_chunks(num_chunks):
    with pytest.raises(ValueError, match=rf"num_chunks must be a positive integer, got {num_chunks!r}.*fix"):
        split_batch(torch.zeros(4), num_chunks)


def test_merge_errors_name_the_problem():
    with pytest.raises(ValueError, match="at least one micro-batch"):
        merge_batches([])
    with pytest.raises(ValueError, match=r"batch\['y'\] is a tensor .* in micro-batch 1"):
        merge_batches([{"y": torch.zeros(1)}, {"y": None}])
    with pytest.raises(ValueError, match=r"batch is \{'a'.*micro-batch 1"):
        merge_batches([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}])


def test_map_tensors_keeps_structure():
    batch = nested_batch(2)
    doubled = map_tensors(lambda t: t * 2, batch)
    assert isinstance(doubled["pair"], Pair)
    assert doubled["extra"][1] == "tag"
    assert torch.equal(doubled["x"], batch["x"] * 2)

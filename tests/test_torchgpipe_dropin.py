"""torchgpipe drop-in: code written for torchgpipe 0.0.7 runs unchanged with pipetrain,
including code that matches torchgpipe's errors.

Each check runs the same call under both libraries (on the CPU, where torchgpipe runs)
and compares what happens: the value, or the exception's type (ours is the same type or
a subclass) and torchgpipe's phrase (ours contains it, then adds the value and a fix).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import pipetrain

torchgpipe = pytest.importorskip("torchgpipe")

PACKAGES = {"torchgpipe": torchgpipe, "pipetrain": pipetrain}


def outcome(call: Callable[[Any], Any], package: Any) -> tuple[str, Any]:
    """``('ok', value)`` or ``('raised', exception)`` of ``call(package)``."""
    try:
        return "ok", call(package)
    except Exception as error:  # comparing whatever each library raises
        return "raised", error


def assert_same_error(call: Callable[[Any], Any], *, phrase: str | None = None) -> str:
    """Both raise; ours is an instance of torchgpipe's exception type and contains its
    message (or ``phrase``, the part of it that does not name torchgpipe); returns ours."""
    their_kind, theirs = outcome(call, torchgpipe)
    our_kind, ours = outcome(call, pipetrain)
    assert their_kind == "raised", f"torchgpipe did not raise: {theirs!r}"
    assert our_kind == "raised", f"pipetrain did not raise: {ours!r}"
    assert isinstance(ours, type(theirs)), (type(ours), type(theirs))
    expected = str(theirs) if phrase is None else phrase
    assert phrase is None or phrase in str(theirs), "the phrase is not torchgpipe's"
    assert expected in str(ours), f"{expected!r} not in {str(ours)!r}"
    return str(ours)


def three() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))


# -- GPipe(nn.Sequential(), []) ---------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [torch.ones(3), (torch.ones(2), torch.zeros(1, 2)), (torch.ones(1), (torch.ones(2),)), ()],
    ids=["tensor", "tuple", "nested-tuple", "empty-tuple"],
)
def test_an_empty_gpipe_is_the_identity(value):
    for package in PACKAGES.values():
        gpipe = package.GPipe(nn.Sequential(), [])
        assert gpipe(value) is value, package.__name__
        assert gpipe.balance == [] and gpipe.devices == [] and len(gpipe.partitions) == 0
        assert len(gpipe) == 0 and list(gpipe) == []


@pytest.mark.parametrize(
    "value", [42, None, [torch.ones(1)], {"x": torch.ones(1)}, (torch.ones(1), 3)],
    ids=["int", "none", "list", "dict", "tuple-with-int"],
)
def test_an_empty_gpipe_rejects_what_torchgpipe_rejects(value):
    message = assert_same_error(lambda p: p.GPipe(nn.Sequential(), [])(value))
    assert "fix:" in message


def test_an_empty_gpipe_with_devices_or_deferred_batch_norm():
    for package in PACKAGES.values():
        gpipe = package.GPipe(nn.Sequential(), [], devices=["cpu"], chunks=2,
                              deferred_batch_norm=True)
        assert gpipe.devices == [] and gpipe(torch.ones(2)).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("balance", [[1], None], ids=["one", "none"])
def test_an_empty_module_with_a_wrong_balance(balance):
    assert_same_error(lambda p: p.GPipe(nn.Sequential(), balance),
                      phrase=("balance is required" if balance is None else
                              "module and sum of balance have different length "
                              "(module: 0, sum of balance: 1)"))


@pytest.mark.parametrize("value", [42, None, "batch"])
def test_a_batch_without_tensors_is_a_type_error(value):
    message = assert_same_error(lambda p: p.GPipe(three(), [2, 1], devices=["cpu"] * 2)(value))
    assert "fix: pass a tensor" in message


# -- chunks and checkpoint are converted like torchgpipe's int(chunks), str(checkpoint) ---


class Mode(enum.Enum):
    NEVER = "never"

    def __str__(self) -> str:
        return self.value


class ModeName(str):
    """A str subclass, e.g. from a configuration library."""


@pytest.mark.parametrize(
    ("chunks", "checkpoint"),
    [(2.0, "always"), ("3", ModeName("except_last")), (torch.tensor(4), Mode.NEVER)],
    ids=["float", "str", "tensor-enum"],
)
def test_chunks_and_checkpoint_are_stored_as_int_and_str(chunks, checkpoint):
    stored = {}
    for name, package in PACKAGES.items():
        gpipe = package.GPipe(three(), [2, 1], devices=["cpu"] * 2, chunks=chunks,
                              checkpoint=checkpoint)
        assert type(gpipe.chunks) is int and type(gpipe.checkpoint) is str
        stored[name] = (gpipe.chunks, gpipe.checkpoint)
        gpipe(torch.randn(6, 2)).sum().backward()
    assert stored["pipetrain"] == stored["torchgpipe"]


@pytest.mark.parametrize("chunks", [0, -1, "0", "many", None, object()])
def test_bad_chunks_raise_torchgpipes_error_type(chunks):
    def wrap(package):
        return package.GPipe(three(), [2, 1], devices=["cpu"] * 2, chunks=chunks)

    _, theirs = outcome(wrap, torchgpipe)
    # torchgpipe's own check ('number of chunks ...') or int()'s TypeError / ValueError
    own = "number of chunks must be positive integer" in str(theirs)
    message = assert_same_error(wrap, phrase=str(theirs) if own else "")
    assert "number of chunks must be positive integer" in message
    assert repr(chunks) in message and "fix: chunks=4" in message


@pytest.mark.parametrize("chunks", [2.5, True])
def test_chunks_that_torchgpipe_would_truncate_are_refused(chunks):
    # torchgpipe's int() makes 2.5 -> 2 and True -> 1 silently; pipetrain names them
    with pytest.raises(ValueError, match=rf"positive integer, got {chunks!r}; fix"):
        pipetrain.GPipe(three(), [2, 1], chunks=chunks)


@pytest.mark.parametrize("checkpoint", ["sometimes", "Always", None])
def test_bad_checkpoint_mode_has_torchgpipes_phrase(checkpoint):
    message = assert_same_error(
        lambda p: p.GPipe(three(), [2, 1], devices=["cpu"] * 2, checkpoint=checkpoint)
    )
    assert repr(checkpoint) in message and "fix: checkpoint='except_last'" in message


# -- balance, devices and module errors --------------------------------------------------


def their_recommendation(message: str) -> bool:
    return "'torchgpipe.balance'" in message


@pytest.mark.parametrize(
    "balance",
    [None, [1, 1], [0, 3], [4, -1], [1, 1, 1, 1], [], [2.0, 2.0]],
    ids=["none", "short", "zero", "negative", "too-many", "empty", "float-sum"],
)
def test_balance_errors_contain_torchgpipes_phrase_and_recommend_pipetrain_balance(balance):
    _, theirs = outcome(lambda p: p.GPipe(three(), balance, devices=["cpu"] * 4), torchgpipe)
    phrase = str(theirs).split("\n\n")[0]  # the problem, before the recommendation
    message = assert_same_error(lambda p: p.GPipe(three(), balance, devices=["cpu"] * 4),
                                phrase=phrase)
    assert their_recommendation(str(theirs))
    assert "'pipetrain.balance'" in message and "torchgpipe" not in message
    assert "from pipetrain.balance import balance_by_time" in message


def test_whole_float_balances_work_as_in_torchgpipe():
    for package in PACKAGES.values():
        gpipe = package.GPipe(three(), [1.0, 2.0], devices=["cpu"] * 2, chunks=2)
        assert [len(p) for p in gpipe.partitions] == [1, 2]
        assert gpipe(torch.randn(4, 2)).shape == (4, 2)
    assert pipetrain.GPipe(three(), [1.0, 2.0]).balance == [1, 2]


def test_too_few_devices_has_torchgpipes_phrase():
    message = assert_same_error(lambda p: p.GPipe(three(), [1, 1, 1], devices=["cpu"]))
    assert "fix: pass one device per partition" in message


def test_module_errors_have_torchgpipes_phrases():
    layer = nn.Linear(2, 2)
    assert_same_error(lambda p: p.GPipe(nn.ModuleList([layer]), [1], devices=["cpu"]))
    assert_same_error(
        lambda p: p.GPipe(nn.Sequential(layer, nn.ReLU(), layer), [2, 1], devices=["cpu"] * 2)
    )
    first, last = nn.Linear(2, 2), nn.Linear(2, 2)
    last.weight = first.weight
    message = assert_same_error(
        lambda p: p.GPipe(nn.Sequential(first, nn.ReLU(), last), [2, 1], devices=["cpu"] * 2)
    )
    assert "parameter '2.weight' is shared with '0.weight'" in message


@pytest.mark.parametrize(
    "move",
    [lambda g: g.cpu(), lambda g: g.cuda(), lambda g: g.to("cpu"), lambda g: g.to(device="cpu"),
     lambda g: g.to(torch.zeros(1))],
    ids=["cpu", "cuda", "to-str", "to-device", "to-tensor"],
)
def test_moving_has_torchgpipes_phrase(move):
    assert_same_error(lambda p: move(p.GPipe(three(), [2, 1], devices=["cpu"] * 2)))

"""Tests for pipetrain.partition.split: verify_module, verify_balance, split_module."""

from __future__ import annotations

import re
from collections import OrderedDict

import pytest
import torch
from torch import nn

from pipetrain.partition import BalanceError, split_module, verify_balance, verify_module


def layers(n: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


def test_verify_module_requires_a_sequential():
    with pytest.raises(TypeError, match=r"module must be nn\.Sequential to be partitioned, got "
                                        r"ModuleList; fix: .*nn\.Sequential\(layer1, layer2"):
        verify_module(nn.ModuleList([nn.ReLU()]))


def test_verify_module_rejects_empty_duplicates_and_shared_parameters_at_once():
    with pytest.raises(ValueError, match=r"empty nn\.Sequential"):
        verify_module(nn.Sequential())
    shared = nn.Linear(4, 4)
    tied = nn.Linear(4, 4)
    tied.weight = shared.weight
    model = nn.Sequential(OrderedDict(a=shared, b=nn.ReLU(), c=shared, d=tied))
    with pytest.raises(ValueError) as info:
        verify_module(model)
    message = str(info.value)
    # torchgpipe's wording first, then which layers and parameters
    assert ("* module with duplicate children is not supported: layer 'c' is the same "
            "module object as layer 'a'") in message
    assert ("* module with duplicate parameters in distinct children is not supported: "
            "parameter 'd.weight' is shared with 'a.weight'") in message
    assert "copy.deepcopy(layer)" in message


def test_verify_balance_accepts_and_normalizes():
    assert verify_balance((1, 2), 3) == [1, 2]
    assert verify_balance(iter([3]), 3) == [3]
    # whole numbers of other types, as torchgpipe's balance accepts them, become ints
    balance = verify_balance([1.0, torch.tensor(2)], 3)
    assert balance == [1, 2] and all(type(x) is int for x in balance)
    assert verify_balance([], 0) == []  # an empty module: no partition


@pytest.mark.parametrize(
    ("balance", "expected"),
    [
        (None, r"balance is required \(got None\)"),
        (2, r"must be a list of layer counts, one per partition, got 2"),
        ([], r"the balance is empty"),
        ([2, 1.5, "1"], r"not whole numbers: balance\[1\] = 1.5, balance\[2\] = '1'"),
        ([3, 0, 2], r"all balance numbers must be positive integer \(balance: \[3, 0, 2\]\); "
                    r"every partition needs at least one layer, got balance\[1\] = 0"),
        ([-1, 6], r"at least one layer, got balance\[0\] = -1"),
        ([2, 2], r"module and sum of balance have different length \(module: 5, sum of "
                 r"balance: 4\); the balance \[2, 2\] must add up to the module's 5 layers"),
        ([1] * 6, r"the balance has 6 partitions but the module has only 5 layers"),
    ],
)
def test_verify_balance_errors_quote_the_values_and_show_a_runnable_fix(balance, expected):
    with pytest.raises(BalanceError, match=expected) as info:
        verify_balance(balance, 5)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "summing to 5, e.g. balance = [" in message
    # The automatic-balancing snippet in the message runs as written.
    code = "\n".join(line.strip() for line in message.splitlines() if line.startswith("    "))
    assert code.startswith("from pipetrain.balance import balance_by_time")
    scope = {"model": layers(5), "sample": torch.randn(2, 4)}
    exec(code.replace("sample)", "sample, timeout=0.0, device='cpu')"), scope)
    assert sum(scope["balance"]) == 5 and all(n > 0 for n in scope["balance"])
    suggested = re.search(r"balance = (\[[\d, ]+\])", message).group(1)
    assert verify_balance(eval(suggested), 5)


def test_verify_balance_lists_every_problem():
    with pytest.raises(BalanceError) as info:
        verify_balance([0, 9], 5)
    lines = [line for line in str(info.value).splitlines() if line.startswith("* ")]
    assert len(lines) == 2


def test_split_module_keeps_names_objects_and_mode():
    model = nn.Sequential(OrderedDict(embed=nn.Linear(4, 4), act=nn.ReLU(), head=nn.Linear(4, 2)))
    model.eval()
    first, second = split_module(model, [2, 1])
    assert [name for name, _ in first.named_children()] == ["embed", "act"]
    assert second.head is model.head
    assert not first.training and not second.training
    x = torch.randn(3, 4)
    assert torch.equal(second(first(x)), model(x))


def test_split_module_validates():
    with pytest.raises(TypeError, match=r"must be nn\.Sequential"):
        split_module(nn.Linear(2, 2), [1])
    with pytest.raises(BalanceError, match=r"\(module: 3, sum of balance: 2\)"):
        split_module(layers(3), [1, 1])

"""A user's model file: mistakes named before any worker starts, the returned dict checked."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from pipetrain.cli.run_config import RunConfig
from pipetrain.cli.user_models import build_user_model, user_model_problems

_GOOD = """
from torch import nn
def build(vocab_size, context):
    return {RETURN}
"""


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / f"model_{abs(hash(text))}.py"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(("text", "phrase"), [
    ("def build(vocab_size):\n    return nn.Sequential(\n        nn.Linear(2, 2)\n        nn.ReLU())\n",
     "SyntaxError at line 3"),
    ("import not_a_module_anywhere\ndef build(vocab_size): pass\n",
     "ModuleNotFoundError at line 1: No module named 'not_a_module_anywhere'"),
    ("raise RuntimeError('top-level failure')\n", "RuntimeError at line 1: top-level failure"),
    ("build = 3\n", "defines no function 'build'"),
])
def test_a_model_file_that_cannot_be_imported_is_named_with_its_line(tmp_path: Path, text: str,
                                                                       phrase: str) -> None:
    spec = f"{_file(tmp_path, text)}:build"
    problems = user_model_problems(RunConfig(model=spec))
    assert len(problems) == 1 and phrase in problems[0], problems
    assert problems[0].startswith(f"--model {spec!r}")


def test_unknown_keys_of_the_returned_dict_are_refused_with_the_known_ones(tmp_path: Path) -> None:
    model = "nn.Sequential(nn.Embedding(vocab_size, 8), nn.Linear(8, vocab_size))"
    spec = _file(tmp_path, _GOOD.replace("{RETURN}", f'{{"model": {model}, "optimiser": None, '
                                                      '"splitpoints": ["1"]}'))
    with pytest.raises(ValueError) as refused:
        build_user_model(RunConfig(model=f"{spec}:build", context=8), vocab_size=256)
    message = str(refused.value)
    assert ("'optimiser' (did you mean 'optimizer'?), 'splitpoints' (did you mean "
            "'split_points'?)") in message, message
    assert "the keys it reads are model, loss, split_points, optimizer, lr_scheduler" in message
    not_callable = _file(tmp_path, _GOOD.replace("{RETURN}", f'{{"model": {model}, '
                                                               '"optimizer": 0.1}'))
    with pytest.raises(ValueError, match=r"'optimizer': 0\.1, which is not callable; fix: a factory"):
        build_user_model(RunConfig(model=f"{not_callable}:build", context=8), vocab_size=256)
    good = _file(tmp_path, _GOOD.replace("{RETURN}", f'{{"model": {model}, "split_points": ["1"]}}'))
    built = build_user_model(RunConfig(model=f"{good}:build", context=8), vocab_size=256)
    assert isinstance(built.model, nn.Sequential) and built.split_points == ["1"]

"""``pipetrain train``'s options become the pipeline's configuration (no workers started)."""

from __future__ import annotations

import pytest

from pipetrain.cli.main import build_parser
from pipetrain.cli.train_options import pipeline_config


@pytest.mark.parametrize(("option", "expected"), [([], None), (["--precision", "fp32"], None),
                                                  (["--precision", "bf16"], "bf16"),
                                                  (["--precision", "fp16"], "fp16")])
def test_precision_sets_mixed_precision(option: list[str], expected: str | None) -> None:
    config = pipeline_config(build_parser().parse_args(["train", *option]))
    assert config.mixed_precision == expected
    assert config.exit_when_stuck == 20.0  # the command's workers end when stuck after a failure


def test_an_unknown_precision_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--precision", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err

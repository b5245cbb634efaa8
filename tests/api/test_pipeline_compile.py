"""``PipelineConfig(compile=True)``: each layer compiled with torch.compile trains as one
eager process does; what it cannot run with yet is refused."""

from __future__ import annotations

import pytest

from helpers.distributed import run_workers
from helpers.pipeline_jobs import compiled_gpt_job, gpt_reference
from pipetrain.api.config import PipelineConfig

pytestmark = pytest.mark.distributed


def test_compiled_stages_train_as_one_eager_process() -> None:
    """2 stages, 1F1B, the GPT with tied embeddings and two sequence lengths (the second
    recompiles with dynamic dims): losses and weights of plain eager training (inductor's
    fp32 kernels may order sums differently: within 1e-5)."""
    results = run_workers(compiled_gpt_job, 2, {"num_stages": 2, "num_microbatches": 2}, 2,
                          timeout=600)
    params, losses = gpt_reference(2)
    merged = {k: v for rank in results for k, v in rank[0].items()}
    assert max(abs(a - b) for a, b in zip(results[0][1], losses)) < 1e-5
    assert max(float((merged[k] - params[k]).abs().max()) for k in params) < 1e-5
    assert all(graphs >= 2 for _, _, graphs in results), [r[2] for r in results]


@pytest.mark.parametrize(("values", "expected"), [
    ({"schedule": "zb-h1"}, "schedule 'zb-h1' (it splits backwards)"),
    ({"schedule": "pipedream"}, "schedule 'pipedream'"),
    ({"replicas": 2, "data_parallel": "fsdp"}, "data_parallel='fsdp'"),
    ({"tensor_parallel": 2}, "tensor_parallel=2"),
])
def test_what_compile_cannot_run_yet_is_refused(values: dict[str, object], expected: str) -> None:
    with pytest.raises(ValueError, match="compile=True with") as refused:
        PipelineConfig(num_stages=2, compile=True, **values)
    assert expected in str(refused.value) and "is not available yet" in str(refused.value)


def test_the_command_line_asks_for_it_and_hears_what_it_cannot_run() -> None:
    from pipetrain.cli.main import build_parser
    from pipetrain.cli.train_checks import prepare
    from pipetrain.cli.train_options import pipeline_fields

    small = ["train", "--layers", "2", "--width", "32", "--heads", "2", "--context", "32",
             "--batch-size", "8", "--compile"]
    config, _, problems = prepare(build_parser().parse_args(small))
    assert problems == [] and pipeline_fields(config)["compile"] is True
    problems = prepare(build_parser().parse_args([*small, "--schedule", "zb-h1"]))[2]
    assert any("--compile with schedule 'zb-h1' (it splits backwards) is not available yet"
               in p for p in problems), problems

"""``PipelineConfig(compile=True)``: each layer compiled with torch.compile trains as one
eager process does; what it cannot run with yet is refused."""

from __future__ import annotations

import pytest

from helpers.distributed import run_workers
from helpers.pipeline_jobs import compiled_jobs, gpt_reference
from pipetrain.api.config import PipelineConfig

pytestmark = pytest.mark.distributed


def test_compiled_stages_train_as_one_eager_process() -> None:
    """2 stages, 1F1B, compiled, in the same two workers, one step each: the GPT with tied
    embeddings on 7 sequences (micro-batches of 4 and 3: the second shape recompiles with
    dynamic dims), then Hugging Face GPT-2 (captured, tied embeddings) on 8. Each has the
    losses and weights of plain eager training in one process (inductor's fp32 kernels may
    order sums differently: within 1e-5), every rank compiled graphs for it, and none
    reached the recompile limit (after which torch.compile would run eager without a
    word)."""
    pytest.importorskip("transformers")
    from helpers.frontend_jobs import lm_reference

    hf_config = {"kind": "gpt2", "split": True, "schedule": "1f1b", "num_stages": 2,
                 "num_microbatches": 2, "checkpoint": "except_last", "batch": 8}
    results = run_workers(compiled_jobs, 2, {"num_stages": 2, "num_microbatches": 2}, 1,
                          hf_config, 1, timeout=900)
    references = {"gpt": gpt_reference(1), "hf": lm_reference("gpt2", 1, batch=8)[:2]}
    for model, (params, losses) in references.items():
        merged = {k: v for rank in results for k, v in rank[model][0].items()}
        assert set(merged) == set(params), (model, set(merged) ^ set(params))
        assert max(abs(a - b) for a, b in zip(results[0][model][1], losses, strict=True)) < 1e-5, model
        assert max(float((merged[k] - params[k]).abs().max()) for k in params) < 1e-5, model
        assert all(rank[model][2] >= 2 for rank in results), [r[model][2] for r in results]


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

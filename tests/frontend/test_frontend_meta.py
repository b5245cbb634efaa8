"""A model built on the meta device: every rank materializes only its own stage.

Loaded from a safetensors file (a tied weight saved once, as Hugging Face saves it),
each rank reads only its stage's tensors, leaves the rest of the model on the meta
device, and 3 steps equal single-process training from the same weights. Initialized
by the model's own ``_init_weights`` instead, norms start at 1 / 0, weights at
std ``initializer_range`` (0.02), and the tied weight agrees on every rank.
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers.distributed import run_workers
from helpers.frontend_jobs import hf_model, lm_reference, meta_job, save_safetensors

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("kind,split", [("gpt2", True), ("llama", False)])
def test_meta_model_materializes_only_each_ranks_stage(tmp_path: os.PathLike[str], kind: str,
                                                       split: bool) -> None:
    path = os.path.join(tmp_path, "model.safetensors")
    save_safetensors(hf_model(kind), path)
    results = run_workers(meta_job, 2, kind, path, 3, split, timeout=600)
    ref_state, ref_losses, _ = lm_reference(kind, 3)
    merged = {k: v for r in results for k, v in r["state"].items()}
    assert set(merged) == set(ref_state)
    assert max(float((merged[k] - ref_state[k]).abs().max()) for k in ref_state) < 1e-5
    assert max(abs(a - b) for a, b in zip(results[0]["losses"], ref_losses)) < 1e-5
    everything = set(ref_state)
    for rank, result in enumerate(results):
        own = {n for u in result["local"] for n in result["unit_names"][u]}
        real = set(result["real"])
        # only this rank's tensors left the meta device (and the other names of its ties)
        assert real & everything <= own | {"lm_head.weight", "transformer.wte.weight",
                                            "model.embed_tokens.weight"}, rank
        assert len(real) < len(everything)
        assert set(result["read"]) <= own | {"transformer.wte.weight", "model.embed_tokens.weight"}
    # initialized by the model's own init: norms at 1 and 0, weights with std 0.02
    init = {k: v for r in results for k, v in r["init_state"].items()}
    norms = [k for k in init if ("ln_" in k or "norm" in k) and k.endswith("weight")]
    assert norms and all(torch.equal(init[k], torch.ones_like(init[k])) for k in norms)
    embedding = init["lm_head.weight"]
    assert 0.015 < float(embedding.std()) < 0.025
    tied = [r["init_state"]["lm_head.weight"] for r in results if "lm_head.weight" in r["init_state"]]
    assert len(tied) == 2 and torch.equal(tied[0], tied[1])
    assert all(torch.isfinite(torch.tensor(r["init_loss"])) for r in results)

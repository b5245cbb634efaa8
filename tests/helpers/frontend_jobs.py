"""Hugging Face models from tiny configs, batches, single-process references and the
worker functions of the frontend tests (importable by name in spawned processes).

No download ever: every model is built from a config (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipetrain.api.config import PipelineConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")

Params = dict[str, torch.Tensor]
VOCAB = 256
NUM_LAYERS = 4
SPLITS = {
    "gpt2": {1: [], 2: ["transformer.h.2"],
             4: ["transformer.h.1", "transformer.h.2", "transformer.h.3"]},
    "llama": {1: [], 2: ["model.layers.2"],
              4: ["model.layers.1", "model.layers.2", "model.layers.3"]},
}
"""Split points by the number of model stages."""


def hf_model(kind: str, *, seed: int = 0, meta: bool = False, width: int = 32,
             layers: int = NUM_LAYERS, dropout: bool = False) -> nn.Module:
    """A tiny GPT2LMHeadModel (tied embeddings; dropout off unless ``dropout``: its
    default 0.1 draws masks that plain training cannot reproduce) or LlamaForCausalLM
    (tie_word_embeddings=True)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind == "gpt2":
        config: Any = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=width, n_layer=layers,
                                 n_head=4, bos_token_id=0, eos_token_id=0,
                                 **({} if dropout else {"resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                                        "attn_pdrop": 0.0}))
        build: Any = GPT2LMHeadModel
    else:
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width,
                             num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=64,
                             tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
        build = LlamaForCausalLM
    if meta:
        with torch.device("meta"):
            return build(config)
    return build(config)


def lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def lm_batches(steps: int, *, batch: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches whose sequence length changes every step (16, 9, 12, ...)."""
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(500 + step)
        tokens = torch.randint(0, VOCAB, (batch, (16, 9, 12, 7)[step % 4] + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def lm_reference(kind: str, steps: int, *, batch: int = 7) -> tuple[Params, list[float], nn.Module]:
    """Plain single-process training: the state dict after ``steps`` steps, the losses,
    and the trained model."""
    model = hf_model(kind)
    opt = sgd(model.parameters())
    losses = []
    for x, y in lm_batches(steps, batch=batch):
        loss = lm_loss(model(x, use_cache=False), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, model


def _tied_names(kind: str) -> tuple[str, str]:
    return ("transformer.wte.weight", "lm_head.weight") if kind == "gpt2" else (
        "model.embed_tokens.weight", "lm_head.weight")


def hf_parity_job(ctx: Any, configs: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """Train each configuration (``kind``, ``split`` or ``None`` for the planner, and the
    PipelineConfig fields); per configuration: losses, this rank's state dict, the tied
    weight as this rank holds it after every step, and rank 0's full state dict."""
    from pipetrain.api.pipeline import Pipeline

    results = []
    for entry in configs:
        fields = dict(entry)
        kind, split = fields.pop("kind"), fields.pop("split")
        dropout = bool(fields.pop("dropout", False))
        batch = int(fields.pop("batch", 7))
        config = PipelineConfig(**fields)
        batches = lm_batches(steps, batch=batch)
        pipe = Pipeline(hf_model(kind, dropout=dropout), example_inputs=(batches[0][0],),
                        split_points=SPLITS[kind][config.num_model_stages] if split else None,
                        loss_fn=lm_loss, optimizer=sgd, config=config, context=ctx)
        tied: list[list[torch.Tensor]] = []
        losses = []
        for x, y in batches:
            losses.append(pipe.train_step(x, y))
            state = pipe.state_dict()
            tied.append([state[n].clone() for n in _tied_names(kind) if n in state])
        results.append({"losses": losses, "state": {k: v.clone() for k, v in pipe.state_dict().items()},
                        "tied": tied, "full": pipe.full_state_dict(),
                        "balance": list(pipe.config.balance or [])})
        pipe.close()
    return results


def fresh_logits(kind: str, state: Params, x: torch.Tensor) -> torch.Tensor:
    """Logits of a fresh model of ``kind`` loaded with ``state`` (strict)."""
    model = copy.deepcopy(hf_model(kind, seed=123))
    model.load_state_dict(state, strict=True)
    return model(x, use_cache=False).logits.detach()


def save_safetensors(model: nn.Module, path: str) -> None:
    """Save ``model``'s state as Hugging Face does: a tied weight once (its first name)."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    tensors = {}
    for name, tensor in model.state_dict().items():
        if id(tensor) in seen or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.contiguous()
    save_file(tensors, path)


def meta_job(ctx: Any, kind: str, path: str, steps: int, split: bool) -> dict[str, Any]:
    """A meta-device model materialized per rank: loaded from ``path`` (then trained
    ``steps`` steps) and, separately, initialized by the model's own init."""
    from pipetrain.api.pipeline import Pipeline

    batches = lm_batches(steps)
    config = PipelineConfig(schedule="1f1b", num_stages=ctx.world_size, num_microbatches=3)
    splits = SPLITS[kind][config.num_stages] if split else None
    model = hf_model(kind, meta=True)
    pipe = Pipeline(model, example_inputs=(batches[0][0],), split_points=splits, weights=path,
                    loss_fn=lm_loss, optimizer=sgd, config=config, context=ctx)
    assert pipe.captured is not None
    real = sorted(n for n, t in [*model.named_parameters(remove_duplicate=False),
                                 *model.named_buffers(remove_duplicate=False)] if not t.is_meta)
    read = sorted(set(pipe.captured.materializer.weights.read))  # type: ignore[union-attr]
    losses = [pipe.train_step(x, y) for x, y in batches]
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    pipe.close()
    init_model = hf_model(kind, meta=True)
    fresh = Pipeline(init_model, example_inputs=(batches[0][0],), split_points=splits,
                     loss_fn=lm_loss, optimizer=sgd, config=config, context=ctx)
    init_state = {k: v.clone() for k, v in fresh.state_dict().items()}
    first_loss = fresh.train_step(*batches[0])
    fresh.close()
    return {"real": real, "read": read, "losses": losses, "state": state,
            "init_state": init_state, "init_loss": first_loss,
            "unit_names": [sorted(set(names)) for names in pipe.captured.plan.attributes],
            "local": [u for j in pipe.local_stages for u in pipe.layout.layer_ranges[j]],
            "balance": list(pipe.config.balance or [])}


def resume_job(ctx: Any, kind: str, path: str, steps: range, save: bool) -> dict[str, Any]:
    """Train ``steps`` of :func:`lm_batches` with ``ctx.world_size`` stages, loading the
    checkpoint at ``path`` first unless ``save`` (then saving it at the end)."""
    from pipetrain.api.pipeline import Pipeline

    batches = lm_batches(steps.stop)
    config = PipelineConfig(schedule="1f1b", num_stages=ctx.world_size, num_microbatches=2)
    pipe = Pipeline(hf_model(kind, seed=99 if not save else 0), example_inputs=(batches[0][0],),
                    split_points=SPLITS[kind][ctx.world_size], loss_fn=lm_loss,
                    optimizer=sgd, config=config, context=ctx)
    if not save:
        pipe.load(path)
    losses = [pipe.train_step(*batches[step]) for step in steps]
    if save:
        pipe.save(path)
    result = {"losses": losses, "state": {k: v.clone() for k, v in pipe.state_dict().items()},
              "step": pipe.step}
    pipe.close()
    return result


# -- encoders (BERT, RoBERTa, DistilBERT): batch-dependent buffers, uneven micro-batches ----

ENCODER_VOCAB = 64
ENCODER_SPLITS = {"bert-mlm": ["bert.encoder.layer.1"], "bert-cls": ["bert.encoder.layer.1"],
                  "roberta-mlm": ["roberta.encoder.layer.1"],
                  "distilbert-mlm": ["distilbert.transformer.layer.1"]}
"""The split point of each encoder (2 stages)."""
NUM_LABELS = 3


def encoder_model(kind: str, *, seed: int = 0) -> nn.Module:
    """A tiny encoder (2 layers of width 32, dropout off) from a config: ``bert-mlm``
    (BertForMaskedLM), ``bert-cls`` (BertForSequenceClassification, 3 labels),
    ``roberta-mlm`` or ``distilbert-mlm``."""
    import transformers as hf

    torch.manual_seed(seed)
    sizes = {"vocab_size": ENCODER_VOCAB, "max_position_embeddings": 64}
    bert = {**sizes, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 64, "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0}
    if kind == "bert-mlm":
        return hf.BertForMaskedLM(hf.BertConfig(**bert))
    if kind == "bert-cls":
        return hf.BertForSequenceClassification(hf.BertConfig(**bert, num_labels=NUM_LABELS))
    if kind == "roberta-mlm":
        return hf.RobertaForMaskedLM(hf.RobertaConfig(**bert, pad_token_id=1))
    assert kind == "distilbert-mlm", kind
    return hf.DistilBertForMaskedLM(hf.DistilBertConfig(
        **sizes, dim=32, n_layers=2, n_heads=2, hidden_dim=64, dropout=0.0,
        attention_dropout=0.0))


def encoder_batches(kind: str, steps: int, *, masked: bool = False,
                    sizes: tuple[int, ...] = (8, 7, 5)) -> list[tuple[Any, torch.Tensor]]:
    """Batches of ``sizes[step]`` rows (8, then 7 and 5: uneven micro-batches, a last one
    of 1 row) and 10, 7, 12 tokens; inputs as a tensor, or with ``masked`` a dict with an
    attention mask (the last 3 tokens of every other row padded). Targets: a token per
    position (masked LM) or a label per row (classification)."""
    out: list[tuple[Any, torch.Tensor]] = []
    for step in range(steps):
        g = torch.Generator().manual_seed(700 + step)
        rows, length = sizes[step % len(sizes)], (10, 7, 12)[step % 3]
        ids = torch.randint(2, ENCODER_VOCAB, (rows, length), generator=g)
        target = (torch.randint(0, NUM_LABELS, (rows,), generator=g) if kind == "bert-cls"
                  else torch.randint(0, ENCODER_VOCAB, (rows, length), generator=g))
        if not masked:
            out.append((ids, target))
            continue
        mask = torch.ones(rows, length, dtype=torch.long)
        mask[::2, -3:] = 0
        out.append(({"input_ids": ids, "attention_mask": mask}, target))
    return out


def encoder_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits (per token for a masked LM, per row for a classifier)."""
    logits = output.logits
    return F.cross_entropy(logits.flatten(0, -2) if target.dim() > 1 else logits, target.flatten())


def encoder_reference(kind: str, steps: int, *, masked: bool = False) -> tuple[Params, list[float]]:
    """Plain single-process training of :func:`encoder_model` on :func:`encoder_batches`:
    the state dict after ``steps`` steps and the losses."""
    model = encoder_model(kind)
    opt = sgd(model.parameters())
    losses = []
    for x, y in encoder_batches(kind, steps, masked=masked):
        loss = encoder_loss(model(**x) if isinstance(x, dict) else model(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def encoder_parity_job(ctx: Any, configs: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """Train each configuration (``kind``, ``masked``, and PipelineConfig fields) for
    ``steps`` steps cut at :data:`ENCODER_SPLITS`; per configuration: the losses, this
    rank's state dict, and how many captures beyond the example's each unit's model made."""
    from pipetrain.api.pipeline import Pipeline

    results = []
    for entry in configs:
        fields = dict(entry)
        kind, masked = fields.pop("kind"), bool(fields.pop("masked", False))
        batches = encoder_batches(kind, steps, masked=masked)
        first = batches[0][0]
        pipe = Pipeline(encoder_model(kind), example_inputs=None if masked else (first,),
                        example_kwargs=first if masked else None,
                        split_points=ENCODER_SPLITS[kind], loss_fn=encoder_loss,
                        optimizer=sgd, config=PipelineConfig(**fields), context=ctx)
        losses = [pipe.train_step(x, y) for x, y in batches]
        assert pipe.captured is not None
        results.append({"losses": losses,
                        "state": {k: v.clone() for k, v in pipe.state_dict().items()},
                        "captures": sorted(pipe.captured.plans)})
        pipe.close()
    return results

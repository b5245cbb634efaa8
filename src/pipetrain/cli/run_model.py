"""The model and data of a run, whatever ``--model`` names: what ``pipetrain train``,
``profile`` and ``sample`` build from a :class:`~.run_config.RunConfig`.

- ``gpt``: pipetrain's GPT as layer factories (each rank builds only its layers);
- ``hf-gpt2`` / ``hf-llama``: a Hugging Face model sized by the options (:mod:`.hf_models`);
- ``FILE.py:FUNCTION`` / ``FOLDER``: a user's model (:mod:`.user_models`).

Every model but ``gpt`` is captured into a graph on a batch of the run's data and cut
into units by the frontend. The data is the whole corpus (``--data``, or the standard
library's source), a byte per token (a file memory-mapped), or tokenized with a model
folder's tokenizer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.cli.hf_models import HF_MODELS, block_split_points, build_hf_model, hf_loss
from pipetrain.cli.run_config import RunConfig
from pipetrain.cli.user_models import (
    BYTE_VOCAB,
    build_user_model,
    is_user_model,
    load_tokenizer,
    user_data,
)
from pipetrain.data import (
    ByteTokenizer,
    SampleDataset,
    TextDataset,
    corpus_size,
    corpus_tokens,
    describe_corpus,
    load_corpus,
)
from pipetrain.models import GPTConfig, gpt_layer_factories, gpt_loss, gpt_ties

__all__ = ["RunDataset", "RunTokenizer", "data_line", "data_record", "pipeline_model", "profile_inputs", "run_dataset",
           "sample_text"]


class RunTokenizer:
    """Text to token ids and back: bytes, or a Hugging Face tokenizer.

    Example:
        >>> tokenizer = RunTokenizer(None)
        >>> tokenizer.decode(tokenizer.encode("def ")), tokenizer.vocab_size
        ('def ', 256)
    """

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        self.vocab_size = BYTE_VOCAB if hf_tokenizer is None else len(hf_tokenizer)

    def encode(self, text: str | bytes) -> torch.Tensor:
        """Token ids (int64, 1-D)."""
        if self.hf is None:
            return ByteTokenizer().encode(text)
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return torch.tensor(self.hf(text)["input_ids"], dtype=torch.int64)

    def decode(self, ids: torch.Tensor) -> str:
        """The text of ``ids``."""
        if self.hf is None:
            return ByteTokenizer().decode(ids)
        return str(self.hf.decode(ids.tolist()))


RunDataset = TextDataset | SampleDataset
"""What a run trains on: the corpus's windows, or a model file's samples."""


def run_dataset(config: RunConfig) -> tuple[RunDataset, RunTokenizer]:
    """The run's dataset (a pure function of the step) and its tokenizer: a model file's
    ``train_data`` (and ``val_data``) if it returns them, else the corpus."""
    train, val = user_data(config, vocab_size=BYTE_VOCAB)
    if train is not None:
        if isinstance(train, SampleDataset):
            if val is not None:
                raise ValueError(f"--model {config.model!r} returned a SampleDataset as "
                                 "train_data and a val_data: give the SampleDataset its "
                                 "val_data=..., and return no val_data beside it")
            if train.context > config.context:
                raise ValueError(f"--model {config.model!r}: its SampleDataset has context="
                                 f"{train.context}, longer than --context {config.context}; fix: "
                                 "build it with the context the function is given")
            return train, RunTokenizer(None)
        return (SampleDataset(train, context=config.context, seed=config.seed, val_data=val),
                RunTokenizer(None))
    if val is not None:
        raise ValueError(f"--model {config.model!r} returned val_data without train_data; fix: "
                         "return both, or neither to train on --data")
    tokenizer = RunTokenizer(load_tokenizer(config) if is_user_model(config.model) else None)
    if tokenizer.hf is None:
        data = corpus_tokens(config.data)
    else:
        data = tokenizer.encode(load_corpus(config.data))
    return TextDataset(data, context=config.context, seed=config.seed), tokenizer


def data_record(config: RunConfig, dataset: RunDataset, tokenizer: RunTokenizer) -> dict[str, Any]:
    """What the run trains on (its start-up line and ``config.json`` say it): the corpus,
    its size, and the tokens of each split.

    Example:
        >>> config = RunConfig(context=16)
        >>> record = data_record(config, *run_dataset(config))
        >>> record["train_tokens"] + record["val_tokens"] == 4 * 2**20, record["tokens"]
        (True, 'bytes')
    """
    if isinstance(dataset, SampleDataset):
        return {"corpus": f"{config.model}: train_data", "description": repr(dataset),
                "tokens": "the model file's", "packed": dataset.pack,
                "boundaries": dataset.boundaries,
                "train_tokens": dataset.num_train_tokens, "val_tokens": dataset.num_val_tokens}
    num_tokens = dataset.num_train_tokens + dataset.num_val_tokens
    size = num_tokens if tokenizer.hf is None else corpus_size(config.data)
    return {"corpus": config.data, "description": describe_corpus(config.data, size),
            "bytes": size, "tokens": "bytes" if tokenizer.hf is None else "model tokenizer",
            "train_tokens": dataset.num_train_tokens, "val_tokens": dataset.num_val_tokens}


def data_line(record: dict[str, Any]) -> str:
    """The start-up line that says what a run trains on (from :func:`data_record`).

    Example:
        >>> data_line({"description": "notes.txt (2 MiB)", "train_tokens": 1900,
        ...            "val_tokens": 100})
        'data: notes.txt (2 MiB): 1,900 tokens to train on, the last 100 to validate on'
    """
    def tokens(count: int | None) -> str:
        return "an unknown number of" if count is None else f"{count:,}"

    line = f"data: {record['description']}: {tokens(record['train_tokens'])} tokens to train on"
    if "packed" in record:
        layout = ", padded per step" if not record["packed"] else (
            ", packed, each document attending to itself only" if record.get("boundaries")
            else ", packed")
        return line + layout + (
            f"; {tokens(record['val_tokens'])} to validate on" if record["val_tokens"] else
            "; no validation split")
    return line + f", the last {tokens(record['val_tokens'])} to validate on"


def pipeline_model(config: RunConfig, model_config: GPTConfig, dataset: RunDataset, *,
                   vocab_size: int = BYTE_VOCAB, num_stages: int | None = None,
                   ) -> tuple[Any, dict[str, Any]]:
    """``Pipeline``'s model and its model arguments (``num_stages``: the model stages to
    cut into; default: the run's). Captured models are captured on a micro-batch of the
    run's data and cut at split points (theirs, or a Hugging Face model's blocks), by
    ``--balance`` / ``--plan`` (in units), or by the planner. A model file's
    ``optimizer`` and ``lr_scheduler`` factories come with the arguments, under those
    names."""
    if config.model == "gpt":
        return gpt_layer_factories(model_config, seed=config.seed), {
            "loss_fn": gpt_loss, "ties": gpt_ties(model_config)}
    stages = config.stages * config.stages_per_rank if num_stages is None else num_stages
    tokens, _ = dataset.batch(0, max(2, config.batch_size // config.microbatches))
    if config.model in HF_MODELS:
        splits = None if config.balance == "auto" else block_split_points(config, stages)
        model = build_hf_model(config)
        return model, {"loss_fn": hf_loss, **_example(model, tokens), "split_points": splits}
    user = build_user_model(config, vocab_size=vocab_size)
    cut = config.balance not in (None, "auto") or config.plan is not None
    arguments = {"loss_fn": user.loss_fn, **_example(user.model, tokens),
                 "split_points": None if cut or num_stages == 1 else user.split_points,
                 "weights": user.weights}
    return user.model, arguments | {k: v for k, v in (("optimizer", user.optimizer),
                                                       ("lr_scheduler", user.lr_scheduler))
                                    if v is not None}


def _example(model: Any, inputs: Any) -> dict[str, Any]:
    """A batch's inputs as the example ``model`` is captured on (a dict of packed
    documents' ``input_ids`` and ``position_ids`` by name where its forward names them)."""
    from pipetrain.frontend.inputs import as_call

    args, kwargs = as_call(model, inputs)
    return {"example_inputs": args, "example_kwargs": kwargs or None}


def profile_inputs(config: RunConfig, model_config: GPTConfig, dataset: RunDataset, *,
                   vocab_size: int = BYTE_VOCAB) -> tuple[list[Any], Any, Any, Any]:
    """What the profiler takes for the run's model: its layers (the GPT's factories, or a
    captured model's units), the batch they run on, the loss and its targets."""
    rows = max(1, config.batch_size // config.replicas)
    tokens, targets = dataset.batch(0, rows)
    if config.model == "gpt":
        return list(gpt_layer_factories(model_config, seed=config.seed)), tokens, gpt_loss, targets
    from pipetrain.frontend import CapturedModel

    model, arguments = pipeline_model(config, model_config, dataset, vocab_size=vocab_size,
                                      num_stages=1)
    captured = CapturedModel.create(model, arguments["example_inputs"], arguments["example_kwargs"],
                                    split_points=None, num_stages=1,
                                    weights=arguments.get("weights"))
    units = [captured.build(u, torch.device("cpu")) for u in range(len(captured))]
    return units, captured.sample, arguments["loss_fn"], targets


def sample_text(pipe: Any, tokenizer: RunTokenizer, *, prompt: str, num_tokens: int,
                temperature: float, top_k: int, seed: int, context: int,
                positions: bool = False) -> str:
    """``prompt`` continued by ``num_tokens`` tokens sampled from the pipeline's model
    (every rank calls it; each gets the text). ``positions``: the model was trained on
    packed documents with their boundaries and takes ``{"input_ids", "position_ids"}`` (the
    prompt is one document)."""
    from pipetrain.models import generate

    last_logits = _last_logits(pipe)

    def logits(ids: torch.Tensor) -> torch.Tensor:
        batch: Any = ids if not positions else {
            "input_ids": ids, "position_ids": torch.arange(ids.size(1)).expand_as(ids)}
        last = last_logits(batch, ids.size(0))  # (B, V): all the sampler reads
        return last.unsqueeze(1).expand(ids.size(0), ids.size(1), last.size(-1))

    tokens = generate(logits, tokenizer.encode(prompt), num_tokens=num_tokens,
                      temperature=temperature, top_k=top_k,
                      generator=torch.Generator().manual_seed(seed), context=context)
    return tokenizer.decode(tokens.reshape(-1))


def _last_logits(pipe: Any) -> Callable[[Any, int], torch.Tensor]:
    """A function of a batch of ``B`` sequences: the pipeline's logits at their last
    position, ``(B, V)``, on every rank. The last stage's first rank broadcasts only those
    (one tensor; the vocabulary size and dtype once), not the whole output as an object."""
    layout = dataclasses.replace(pipe.layout, tp_index=0)  # tp index 0 holds the output
    source = layout.ranks_of_stage(len(layout.stage_to_rank) - 1)[0]
    alone = not dist.is_initialized() or dist.get_world_size() == 1
    spec: list[tuple[int, torch.dtype]] = []  # (V, dtype), learnt from the first call

    def last_logits(batch: Any, size: int) -> torch.Tensor:
        output = pipe.eval_step(batch)
        mine = None
        if output is not None:
            output = getattr(output, "logits", output)  # a Hugging Face model's output
            assert isinstance(output, torch.Tensor)
            mine = output[:, -1].contiguous()
        if alone:
            assert mine is not None
            return mine
        with pipe.guard():
            if not spec:
                box: list[Any] = [None if mine is None else (mine.size(-1), mine.dtype)]
                dist.broadcast_object_list(box, src=source)
                spec.append(box[0])
            vocab, dtype = spec[0]
            buffer = mine.to(pipe.device) if mine is not None else torch.empty(
                size, vocab, dtype=dtype, device=pipe.device)
            dist.broadcast(buffer, src=source)
        return buffer.cpu()

    return last_logits

"""A user's own model in ``pipetrain train``: ``--model FILE.py:FUNCTION`` or ``--model FOLDER``.

``--model my_model.py:build`` imports the file and calls ``build``, passing those of
``vocab_size`` (256: the corpus's bytes, unless a folder's tokenizer says otherwise),
``context`` (``--context``) and ``seed`` (``--seed``; torch's generator is seeded with it
first) that it takes. It returns the model: any ``nn.Module`` that maps token ids of shape
``(batch, context)`` to logits of shape ``(batch, context, vocab_size)`` (or an output
with ``.logits``, as Hugging Face models return), or a dict with the model under
``"model"`` and, optionally, ``"loss"`` (``loss(output, targets)``, the mean loss of a
micro-batch; default: cross-entropy of the logits), ``"split_points"`` (module names
where stages begin; default: the planner cuts), ``"optimizer"`` (``optimizer(params)``,
e.g. a ``torch.optim`` class with its settings bound; each stage gets its own; default:
``--optimizer``) and ``"lr_scheduler"`` (``lr_scheduler(optimizer)``, e.g. a
``torch.optim.lr_scheduler`` class bound; default: ``--warmup`` and ``--lr-schedule``),
``"train_data"`` and ``"val_data"`` (the samples to train and evaluate on in place of
``--data``: a dataset of 1-D token-id tensors of any length or of (input, target) pairs,
packed into rows of ``--context``, or a :class:`~pipetrain.data.SampleDataset` the function
made itself, e.g. with ``pack=False``; see ``docs/data.md``)::

    # my_model.py
    from torch import nn

    def build(vocab_size, context):
        return nn.Sequential(nn.Embedding(vocab_size, 64), nn.Linear(64, 64), nn.GELU(),
                             nn.Linear(64, vocab_size))

``--model FOLDER`` is a Hugging Face model folder on disk (``config.json``, the weights
as ``model.safetensors`` or sharded with an index, and its tokenizer files when it has
them): the model is built on the meta device from its config and each rank loads only its
stage's weights; with a tokenizer, ``--data`` is tokenized with it. Nothing is downloaded.
The model is captured and cut like ``--model hf-gpt2`` (see ``docs/frontend.md``).
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import os
import sys
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["UserModel", "build_user_model", "is_user_model", "lm_loss", "load_tokenizer",
           "user_data", "user_model_problems"]

BYTE_VOCAB = 256
"""The vocabulary of the byte-level corpus."""
_KEYS = ("model", "loss", "split_points", "optimizer", "lr_scheduler", "train_data", "val_data")
"""The keys of the dict a model file's function may return."""
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def is_user_model(spec: str) -> bool:
    """Whether ``--model`` names a user's model (a ``FILE.py:FUNCTION`` or a folder).

    Example:
        >>> is_user_model("gpt"), is_user_model("models/net.py:build")
        (False, True)
    """
    return _file_and_function(spec) is not None or os.path.isdir(spec)


def _file_and_function(spec: str) -> tuple[str, str] | None:
    path, colon, function = spec.rpartition(":")
    if colon and path.endswith(".py") and function.isidentifier():
        return path, function
    return None


def lm_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a language model's logits (``output`` itself or ``output.logits``)
    against the next tokens: the mean over the micro-batch's tokens."""
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


@dataclass
class UserModel:
    """A user's model and how to train it."""

    model: nn.Module
    loss_fn: Any
    split_points: list[str] | None = None
    weights: str | None = None
    """A folder to load the weights from, stage by stage (a meta-device model)."""
    optimizer: Any = None
    """``optimizer(params)`` from the model file (None: ``--optimizer``)."""
    lr_scheduler: Any = None
    """``lr_scheduler(optimizer)`` from the model file (None: ``--lr-schedule``)."""
    train_data: Any = None
    """The samples to train on from the model file (None: ``--data``)."""
    val_data: Any = None
    """The samples to evaluate on from the model file (None: held out of ``train_data``)."""


def user_model_problems(config: Any) -> list[str]:
    """What is wrong with ``--model`` naming a user's model (each with the fix), looking
    only at files: the file and its function exist, the folder holds a config."""
    spec = config.model
    problems = []
    found = _file_and_function(spec)
    if found is not None:
        path, function = found
        if not os.path.isfile(path):
            problems.append(f"--model {spec!r}: no file {path!r}; fix: the path of a Python file "
                            "and the function in it that builds the model, e.g. my_model.py:build")
        else:
            try:
                builder = getattr(_import(path), function, None)
            except Exception as error:  # the user's code: whatever it raises, named
                problems.append(f"--model {spec!r}: importing {path!r} failed: {_where(error, path)}; "
                                "fix: run `python " + path + "` to see the whole error")
            else:
                if not callable(builder):
                    problems.append(f"--model {spec!r}: {path!r} defines no function {function!r}; "
                                    f"fix: --model {path}:NAME with the function that builds the model")
    elif os.path.isdir(spec) and not os.path.isfile(os.path.join(spec, "config.json")):
        problems.append(f"--model {spec!r} is a folder without config.json; fix: the folder of a "
                        "Hugging Face model (config.json and its weights), or FILE.py:FUNCTION")
    for option in ("layers", "width", "heads", "dropout"):
        if config.given(option):
            problems.append(f"--{option} sets the shape of pipetrain's own models; --model {spec} "
                            f"defines its own; fix: leave out --{option}")
    return problems


def load_tokenizer(config: Any) -> Any:
    """The tokenizer of a model folder that has one, else None (the corpus's bytes)."""
    folder = config.model
    if not os.path.isdir(folder) or not any(
            os.path.isfile(os.path.join(folder, name)) for name in _TOKENIZER_FILES):
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _import(path: str) -> Any:
    """The module of the model file ``path``, imported once per process."""
    name = f"pipetrain_user_model_{abs(hash(os.path.abspath(path)))}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{path!r} cannot be imported as Python")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _where(error: BaseException, path: str) -> str:
    """``error`` in one line, with the line of ``path`` it comes from."""
    line = getattr(error, "lineno", None) if isinstance(error, SyntaxError) else None
    if line is None:
        frames = [f for f in traceback.extract_tb(error.__traceback__)
                  if os.path.abspath(f.filename) == os.path.abspath(path)]
        line = frames[-1].lineno if frames else None
    text = " ".join(str(getattr(error, "msg", None) or error).split())[:300]
    return f"{type(error).__name__}" + (f" at line {line}" if line else "") + f": {text}"


def _call_builder(spec: str, config: Any, vocab_size: int) -> Any:
    found = _file_and_function(spec)
    assert found is not None
    path, function = found
    builder = getattr(_import(path), function, None)
    if not callable(builder):
        raise ValueError(f"--model {spec!r}: {path!r} has no function {function!r}")
    offered = {"vocab_size": vocab_size, "context": config.context, "seed": config.seed}
    accepted = inspect.signature(builder).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    torch.manual_seed(config.seed)  # every rank builds the same weights
    return builder(**{k: v for k, v in offered.items() if takes_all or k in accepted})


_BUILT: dict[tuple[Any, ...], Any] = {}
"""What a model file's function returned, kept from :func:`user_data`'s call for the next
:func:`build_user_model` with the same arguments (the function runs once per process)."""


def _built_key(config: Any, vocab_size: int) -> tuple[Any, ...]:
    return (config.model, vocab_size, config.context, config.seed)


def user_data(config: Any, *, vocab_size: int) -> tuple[Any, Any]:
    """The ``train_data`` and ``val_data`` a model file's function returns (None, None
    without them, or for a folder); the model it built is kept for :func:`build_user_model`.

    Example:
        >>> user_data(type("Config", (), {"model": "gpt"})(), vocab_size=256)
        (None, None)
    """
    if _file_and_function(config.model) is None:
        return None, None
    built = _call_builder(config.model, config, vocab_size)
    _BUILT[_built_key(config, vocab_size)] = built
    parts = built if isinstance(built, dict) else {}
    return parts.get("train_data"), parts.get("val_data")


def build_user_model(config: Any, *, vocab_size: int) -> UserModel:
    """The model ``--model`` names, built alike on every rank.

    Raises:
        ValueError: the builder returned something else than a model (or a dict with one).
        RuntimeError: a folder needs transformers, which is not installed.
    """
    spec = config.model
    if os.path.isdir(spec):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            import transformers
        except ImportError:
            raise RuntimeError(f"--model {spec!r} is a Hugging Face folder, which needs "
                               "transformers; fix: pip install -c constraints.txt -e '.[hf]'") from None
        hf_config = transformers.AutoConfig.from_pretrained(spec, local_files_only=True)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf_config)  # type: ignore[no-untyped-call]
        has_weights = any(name.endswith(".safetensors") for name in os.listdir(spec))
        return UserModel(model=model, loss_fn=lm_loss, weights=spec if has_weights else None)
    built = _BUILT.pop(_built_key(config, vocab_size), None)
    if built is None:
        built = _call_builder(spec, config, vocab_size)
    parts = built if isinstance(built, dict) else {"model": built}
    unknown = sorted(set(parts) - set(_KEYS), key=str)
    if unknown:
        hints = [f"{key!r}" + (f" (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(
                 str(key), _KEYS, n=1)) else "") for key in unknown]
        raise ValueError(
            f"--model {spec!r} returned a dict with key(s) pipetrain does not read: {', '.join(hints)}; "
            f"the keys it reads are {', '.join(_KEYS)}; fix: rename or remove them")
    model = parts.get("model")
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"--model {spec!r} returned {type(model).__name__}, not an nn.Module; fix: return the "
            "model, or a dict {'model': model, 'loss': loss_fn, 'split_points': [...]}")
    for key in ("optimizer", "lr_scheduler"):
        if parts.get(key) is not None and not callable(parts[key]):
            raise ValueError(
                f"--model {spec!r} returned {key!r}: {parts[key]!r}, which is not callable; fix: "
                + ("a factory of the parameters, e.g. functools.partial(torch.optim.SGD, lr=0.1, "
                   "momentum=0.9)" if key == "optimizer" else "a factory of the optimizer, e.g. "
                   "functools.partial(torch.optim.lr_scheduler.StepLR, step_size=100)"))
    split_points = parts.get("split_points")
    return UserModel(model=model, loss_fn=parts.get("loss") or lm_loss,
                     split_points=None if split_points is None else list(split_points),
                     optimizer=parts.get("optimizer"), lr_scheduler=parts.get("lr_scheduler"),
                     train_data=parts.get("train_data"), val_data=parts.get("val_data"))

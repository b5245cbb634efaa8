"""What ``pipetrain train`` reads and writes, checked before any worker starts: the
``--out`` folder can be written, the ``--data`` corpus holds a window of ``--context``
bytes in both its training and validation parts, and ``--model hf-*`` finds Hugging
Face transformers.

Each check returns the problem as one line naming the flag and a fix in the command's
own flags, or None. They only look (the ``--out`` check creates and removes an empty
folder where ``--out`` would be created, the one way to know a place takes a folder).
"""

from __future__ import annotations

import inspect
import os
import tempfile

from pipetrain.cli.run_config import RunConfig

__all__ = ["corpus_problem", "hf_problem", "out_problem"]


def out_problem(out: str | None, *, resume: str | None = None) -> str | None:
    """Why the run folder ``out`` (None: the default ``runs/<date-time>``) cannot be
    written, or None.

    Example:
        >>> import tempfile
        >>> out_problem(os.path.join(tempfile.mkdtemp(), "run")) is None
        True
        >>> print(out_problem("/dev/null/run"))  # doctest: +ELLIPSIS
        --out '/dev/null/run' cannot be created: '/dev/null' is a file, not a folder; fix: ...
    """
    shown = f"--out {out!r}" if out is not None else "the default --out runs/<date-time>"
    path = os.path.abspath(out if out is not None else "runs")
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    fix = (f"fix: --out a folder in a place you can write to (e.g. --out "
           f"{os.path.join(os.path.expanduser('~'), 'runs', 'NAME')})")
    if existing == path:
        if not os.path.isdir(path):
            return None  # a file: the run folder's own check names it
        if not os.access(path, os.W_OK | os.X_OK):
            if resume is not None:
                fix = (f"fix: make {path!r} writable, or copy the run to a place you can "
                       "write to and --resume the copy")
            return f"{shown} is not writable: a run saves its checkpoint and records there; {fix}"
        return None
    if not os.path.isdir(existing):
        return f"{shown} cannot be created: {existing!r} is a file, not a folder; {fix}"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".pipetrain-", dir=existing))
    except OSError as error:
        why = error.strerror or str(error)
        return f"{shown} cannot be created: {existing!r} does not take a new folder ({why}); {fix}"
    return None


def _val_fraction() -> float:
    """The validation share of the corpus that ``pipetrain train``'s dataset keeps."""
    from pipetrain.data import TextDataset

    default = inspect.signature(TextDataset).parameters["val_fraction"].default
    return float(default)


def _parts(num_tokens: int, fraction: float) -> tuple[int, int]:
    """The training and validation tokens of a corpus of ``num_tokens``, as
    :class:`~pipetrain.data.TextDataset` splits it."""
    val = int(num_tokens * fraction)
    return num_tokens - val, val


def _holds(num_tokens: int, context: int, fraction: float) -> bool:
    """Whether both parts of a corpus of ``num_tokens`` hold a window of ``context + 1``."""
    train, val = _parts(num_tokens, fraction)
    return train >= context + 1 and (fraction == 0 or val >= context + 1)


def _smallest_corpus(context: int, fraction: float) -> int:
    """The fewest tokens whose training and validation parts both hold ``context + 1``."""
    size = max(context + 1, int((context + 1) / fraction) - 2) if fraction > 0 else context + 1
    while not _holds(size, context, fraction):
        size += 1
    return size


def corpus_problem(args: RunConfig, *, context_fixed: bool = False) -> str | None:
    """Why the corpus (``--data``, or the default one) is too short for ``--context``, or
    None; ``context_fixed``: a resume, which keeps the model's ``--context``.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "tiny.txt")
        >>> _ = open(path, "w").write("x" * 1000)
        >>> print(corpus_problem(RunConfig(data=path, context=128)))  # doctest: +ELLIPSIS
        --data '...tiny.txt' has 1,000 bytes, too few for --context 128: ...; fix: --context 49 or less, or a --data file of at least 2,580 bytes
    """
    from pipetrain.data import corpus_size

    fraction = _val_fraction()
    try:
        num_tokens = corpus_size(args.data)
    except (OSError, ValueError):
        return None  # the corpus's own check names it
    context = args.context
    if _holds(num_tokens, context, fraction):
        return None
    train, val = _parts(num_tokens, fraction)
    longest = (min(train, val) if fraction > 0 else train) - 1  # the longest context that fits
    fixes = []
    if longest >= 1 and not context_fixed:
        fixes.append(f"--context {longest} or less")
    fixes.append(f"a --data file of at least {_smallest_corpus(context, fraction):,} bytes")
    if args.data is None:
        what = f"the default corpus gives a run {num_tokens:,} bytes"
    else:
        what = f"--data {args.data!r} has {num_tokens:,} bytes"
    return (
        f"{what}, too few for --context {context}: training and validation (the last "
        f"{fraction:.0%} of the bytes) each need a window of context + 1 = {context + 1:,} "
        f"bytes, and get {train:,} and {val:,}; fix: {', or '.join(fixes)}"
    )


def hf_problem(args: RunConfig) -> str | None:
    """Why ``--model hf-gpt2|hf-llama`` cannot be built here (transformers cannot be
    imported), or None.

    Example:
        >>> hf_problem(RunConfig(model="gpt")) is None
        True
    """
    model = str(args.model)
    if not (model.startswith("hf-") or os.path.isdir(model)):
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # as the model's builder: never a download
    try:
        import transformers  # noqa: F401
    except ImportError as error:
        return (
            f"--model {args.model} needs Hugging Face transformers, which cannot be imported "
            f"here ({error}); fix: pip install -c constraints.txt -e '.[hf]' (the hf extra), "
            "or --model gpt"
        )
    return None

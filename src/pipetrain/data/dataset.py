"""The text dataset: random windows of a token sequence, a pure function of the step.

``batch(step, batch_size)`` draws ``batch_size`` windows of ``context + 1`` tokens at
offsets chosen by a random generator seeded from ``(seed, split, step)`` alone. No state
is carried from one call to the next, so a run resumed at step ``s``, in any process,
sees exactly the batches an uninterrupted run would have seen.

The last ``val_fraction`` of the tokens is the validation split; windows never cross
from one split into the other. The tokens are kept as given (bytes as uint8, a tensor in
its own integer type, a memory-mapped one still mapped); only the windows of a batch are
copied, as int64.
"""

from __future__ import annotations

import hashlib

import torch
from torch import Tensor

__all__ = ["SPLITS", "TextDataset"]

SPLITS = ("train", "val")
"""The split names: the first ``1 - val_fraction`` of the tokens, and the rest."""


class TextDataset:
    """Batches of (inputs, targets) token windows for next-token prediction.

    ``data`` is the corpus as bytes (each byte a token, as :class:`ByteTokenizer` does) or
    a 1-D integer tensor of token ids (e.g. :func:`~pipetrain.data.corpus_tokens`).

    Example:
        >>> dataset = TextDataset(b"hello world, " * 100, context=8, seed=0)
        >>> inputs, targets = dataset.batch(0, 4)
        >>> inputs.shape, targets.shape
        (torch.Size([4, 8]), torch.Size([4, 8]))
        >>> bool((inputs[:, 1:] == targets[:, :-1]).all())
        True
    """

    def __init__(
        self, data: bytes | Tensor, *, context: int, seed: int, val_fraction: float = 0.05
    ) -> None:
        tokens = _as_tokens(data)
        problems = []
        if isinstance(context, bool) or not isinstance(context, int) or context < 1:
            problems.append(f"context={context!r} must be a positive int, e.g. context=128")
        if not isinstance(val_fraction, (int, float)) or not 0.0 <= val_fraction < 1.0:
            problems.append(
                f"val_fraction={val_fraction!r} must be in [0, 1), e.g. val_fraction=0.05 "
                "(or 0 for no validation split)"
            )
        if problems:
            raise ValueError("invalid TextDataset: " + "; ".join(problems))
        num_tokens = len(tokens)
        num_val = int(num_tokens * val_fraction)
        self.context = context
        self.seed = seed
        self._splits = {
            "train": tokens[: num_tokens - num_val],
            "val": tokens[num_tokens - num_val :],
        }
        needed = context + 1
        for split, split_tokens in self._splits.items():
            if len(split_tokens) >= needed or (split == "val" and val_fraction == 0):
                continue
            fix = f"use a corpus of more than {needed} tokens or context <= {len(split_tokens) - 1}"
            if split == "val":
                fix = (
                    f"use val_fraction >= {needed / num_tokens:.3g}, val_fraction=0 for no "
                    f"validation split, or context <= {len(split_tokens) - 1}"
                )
            problems.append(
                f"the {split} split has {len(split_tokens)} tokens (of {num_tokens}) but "
                f"context={context} needs at least {needed}: {fix}"
            )
        if problems:
            raise ValueError("corpus too short for TextDataset: " + "; ".join(problems))

    @property
    def num_train_tokens(self) -> int:
        """Number of tokens in the training split."""
        return len(self._splits["train"])

    @property
    def num_val_tokens(self) -> int:
        """Number of tokens in the validation split (0 when ``val_fraction=0``)."""
        return len(self._splits["val"])

    def batch(self, step: int, batch_size: int, *, split: str = "train") -> tuple[Tensor, Tensor]:
        """Batch ``step`` of ``split``: int64 inputs (B, T) and targets (B, T), shifted by one.

        A pure function of ``(seed, step, split, batch_size, context)``.

        Example:
            >>> dataset = TextDataset(bytes(range(256)) * 4, context=4, seed=0)
            >>> a, _ = dataset.batch(7, 2)
            >>> b, _ = dataset.batch(7, 2)
            >>> torch.equal(a, b)
            True
        """
        problems = []
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            problems.append(f"step={step!r} must be an int >= 0")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            problems.append(f"batch_size={batch_size!r} must be a positive int, e.g. batch_size=32")
        if split not in SPLITS:
            problems.append(f"split={split!r} is not one of {list(SPLITS)}")
        elif split == "val" and self.num_val_tokens == 0:
            problems.append(
                "split='val' is empty because val_fraction=0: build the dataset with "
                "val_fraction=0.05 to get a validation split"
            )
        if problems:
            raise ValueError("TextDataset.batch: " + "; ".join(problems))
        tokens = self._splits[split]
        generator = torch.Generator().manual_seed(_batch_seed(self.seed, split, step))
        starts = torch.randint(0, len(tokens) - self.context, (batch_size,), generator=generator)
        rows = starts[:, None] + torch.arange(self.context + 1)  # (B, T + 1)
        windows = tokens[rows].to(torch.int64)  # (B, T + 1)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # (B, T) each

    def __repr__(self) -> str:
        return (
            f"TextDataset(num_train_tokens={self.num_train_tokens}, "
            f"num_val_tokens={self.num_val_tokens}, context={self.context}, seed={self.seed})"
        )


def _as_tokens(data: bytes | Tensor) -> Tensor:
    if isinstance(data, (bytes, bytearray, memoryview)):
        if not data:
            return torch.empty(0, dtype=torch.int64)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if isinstance(data, Tensor):
        if data.dim() != 1 or data.dtype.is_floating_point or data.dtype.is_complex:
            raise TypeError(
                f"TextDataset data must be bytes or a 1-D integer tensor of token ids, got a "
                f"{data.dtype} tensor of shape {tuple(data.shape)}: pass e.g. data.flatten().long()"
            )
        return data
    raise TypeError(
        f"TextDataset data must be bytes or a 1-D integer tensor, got {type(data).__name__}: "
        "pass e.g. load_corpus() or ByteTokenizer().encode(text)"
    )


def _batch_seed(seed: int, split: str, step: int) -> int:
    digest = hashlib.blake2b(f"{seed}\x1f{split}\x1f{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1

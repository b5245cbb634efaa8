"""A user's own samples as step batches: documents of any length, packed or padded.

:class:`SampleDataset` takes a map-style dataset (anything with ``len`` and indexing: a
``torch.utils.data.Dataset``, a list) or a re-iterable one (a
``torch.utils.data.IterableDataset``) whose samples are 1-D integer tensors of token ids
of any length (a document: the model predicts each token from the ones before it) or
``(input, target)`` pairs of equal length (the targets are the user's).

Each sample becomes an (input, target) pair; a document of ``n`` tokens gives ``n - 1``
predictions, so no target ever crosses from one document into the next.

- ``pack=True`` (the default): the pairs are joined end to end and cut into rows of
  ``context`` positions. Every row is full: no padding, no token wasted. The loss never
  crosses documents; attention within a row spans the documents it holds, unless
  ``boundaries=True``: then the inputs are ``{"input_ids": (B, T), "position_ids": (B, T)}``,
  each token's position within its document (0 where a document starts, and at the start
  of a row), and a model that takes them attends within each document only: the built-in
  GPT (:func:`~pipetrain.models.document_mask`) and Hugging Face models, which read a
  packed batch from ``position_ids`` the same way. Each document then trains as it would
  alone.
- ``pack=False``: one sample per row (its first ``context`` positions), the rows of a step
  padded to the longest of the step, so the sequence length changes from step to step.
  Padded positions have the target :data:`IGNORE_INDEX`, which the losses skip; use
  ``PipelineConfig(loss_per="token")`` so that the step's loss is the mean over its real
  tokens, as one process computes it.

A map-style dataset is read in an order shuffled anew each epoch (seeded by ``seed``); an
iterable one in its own order, from its start again each epoch. ``batch(step, ...)`` is a
pure function of the step, as :class:`~pipetrain.data.TextDataset`'s is: a run resumed at
step ``s`` trains on exactly the samples an uninterrupted run would have (an iterable
dataset is read from its start and the steps before ``s`` are skipped).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = ["IGNORE_INDEX", "SampleDataset", "real_tokens", "row_positions"]

IGNORE_INDEX = -100
"""The target of a padded position (``torch.nn.functional.cross_entropy`` skips it)."""


def real_tokens(targets: Any) -> int:
    """The targets of a batch that a loss counts (not :data:`IGNORE_INDEX`).

    Example:
        >>> real_tokens(torch.tensor([[1, 2, IGNORE_INDEX], [3, IGNORE_INDEX, IGNORE_INDEX]]))
        3
    """
    if not isinstance(targets, Tensor) or targets.dtype.is_floating_point:
        raise TypeError(f"counting the real tokens needs integer targets (a tensor of token ids), "
                        f"got {type(targets).__name__}"
                        + (f" of {targets.dtype}" if isinstance(targets, Tensor) else "")
                        + "; fix: loss_per='sample' for targets that are not token ids")
    return int((targets != IGNORE_INDEX).sum())


def row_positions(offsets: Tensor) -> Tensor:
    """Position ids of packed rows ``(B, T)`` from each token's offset in its document: a
    row that starts inside a document counts that piece from 0.

    Example:
        >>> row_positions(torch.tensor([[3, 4, 0, 1], [2, 0, 1, 2]]))
        tensor([[0, 1, 0, 1],
                [0, 0, 1, 2]])
    """
    piece = (offsets == 0).cumsum(dim=1) == 0  # before the row's first document start
    return offsets - torch.where(piece, offsets[:, :1], 0)


class SampleDataset:
    """Step batches of (inputs, targets) from a user's samples (see the module's text).

    ``val_data``: the validation samples (a dataset like ``data``); without it a map-style
    dataset keeps its last ``val_fraction`` of samples for validation, an iterable one has
    no validation split.

    Example:
        >>> docs = [torch.arange(n) for n in (5, 9, 3, 12, 7)]
        >>> packed = SampleDataset(docs, context=4, seed=0, val_fraction=0)
        >>> inputs, targets = packed.batch(0, 2)
        >>> inputs.shape, bool((targets != IGNORE_INDEX).all())
        (torch.Size([2, 4]), True)
        >>> padded = SampleDataset(docs, context=16, seed=0, pack=False, val_fraction=0)
        >>> [padded.batch(step, 2)[0].shape[1] for step in range(3)]
        [8, 11, 11]
        >>> kept = SampleDataset(docs, context=8, seed=0, boundaries=True, val_fraction=0)
        >>> kept.batch(0, 2)[0]["position_ids"]
        tensor([[0, 1, 2, 3, 4, 5, 6, 7],
                [0, 1, 0, 1, 2, 3, 4, 5]])
    """

    def __init__(self, data: Any, *, context: int, seed: int = 0, pack: bool = True,
                 boundaries: bool = False, val_data: Any = None,
                 val_fraction: float = 0.05) -> None:
        if isinstance(context, bool) or not isinstance(context, int) or context < 1:
            raise ValueError(f"context={context!r} must be a positive int, e.g. context=128")
        if not isinstance(val_fraction, (int, float)) or not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction!r} must be in [0, 1), e.g. 0.05 (or 0 "
                             "for no validation split)")
        if boundaries not in (True, False) or (boundaries and not pack):
            raise ValueError(f"boundaries={boundaries!r} (pack={pack!r}): boundaries=True keeps "
                             "the documents of packed rows apart and needs pack=True; padded "
                             "rows hold one document each")
        self.context, self.seed, self.pack = context, seed, bool(pack)
        self.boundaries = bool(boundaries)
        train = _source(data, "data")
        if val_data is not None:
            val = _source(val_data, "val_data")
        elif isinstance(train, _Indexed) and val_fraction > 0:
            held = int(len(train) * val_fraction)
            train, val = train.head(len(train) - held), train.tail(held)
        else:
            val = None
        self._splits: dict[str, _Indexed | _Streamed | None] = {"train": train, "val": val}

    @property
    def num_train_tokens(self) -> int | None:
        """Predicted positions of the training split (None: an iterable dataset's is unknown)."""
        train = self._splits["train"]
        return train.positions if isinstance(train, _Indexed) else None

    @property
    def num_val_tokens(self) -> int:
        """Predicted positions of the validation split (0 without one; None: iterable)."""
        val = self._splits["val"]
        if val is None:
            return 0
        return val.positions if isinstance(val, _Indexed) else None  # type: ignore[return-value]

    def batch(self, step: int, batch_size: int, *, split: str = "train") -> tuple[Any, Tensor]:
        """Batch ``step`` of ``split``: int64 inputs (B, T) and targets (B, T); ``T`` is
        ``context`` when packing, else the step's longest sample (up to ``context``). With
        ``boundaries`` the inputs are ``{"input_ids", "position_ids"}``.

        Example:
            >>> data = SampleDataset([torch.arange(6)] * 8, context=4, seed=0, val_fraction=0)
            >>> torch.equal(data.batch(3, 2)[0], data.batch(3, 2)[0])
            True
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be an int >= 0")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be a positive int, e.g. 32")
        if split not in self._splits:
            raise ValueError(f"split={split!r} is not one of {list(self._splits)}")
        source = self._splits[split]
        if source is None:
            raise ValueError(f"split={split!r} is empty: give val_data, or a map-style dataset "
                             "with val_fraction > 0, or run no evaluation")
        if self.pack:
            width = self.context
            first = step * batch_size * width
            inputs, targets, offsets = source.span(first, batch_size * width, self._order(split))
            rows = inputs.view(batch_size, width)
            if self.boundaries:
                return {"input_ids": rows, "position_ids": row_positions(
                    offsets.view(batch_size, width))}, targets.view(batch_size, width)
            return rows, targets.view(batch_size, width)
        pairs = [source.sample(step * batch_size + row, self._order(split))
                 for row in range(batch_size)]
        pairs = [(x[:self.context], y[:self.context]) for x, y in pairs]
        length = max(len(x) for x, _ in pairs)
        inputs = torch.zeros(batch_size, length, dtype=torch.int64)
        targets = torch.full((batch_size, length), IGNORE_INDEX, dtype=torch.int64)
        for row, (x, y) in enumerate(pairs):
            inputs[row, :len(x)], targets[row, :len(y)] = x, y
        return inputs, targets

    def _order(self, split: str) -> Any:
        """The epoch's sample order of a split: ``order(epoch, n)`` -> a permutation."""
        def order(epoch: int, count: int) -> Tensor:
            digest = hashlib.blake2b(f"{self.seed}\x1f{split}\x1f{epoch}".encode(),
                                     digest_size=8).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
            return torch.randperm(count, generator=generator)
        return order

    def __repr__(self) -> str:
        return (f"SampleDataset(train={self._splits['train']!r}, val={self._splits['val']!r}, "
                f"context={self.context}, pack={self.pack}"
                + (", boundaries=True" if self.boundaries else "") + f", seed={self.seed})")


def _pair(sample: Any, where: str) -> tuple[Tensor, Tensor]:
    """A sample as an (input, target) pair of 1-D int64 tensors of one length >= 1."""
    if isinstance(sample, (tuple, list)) and len(sample) == 2:
        x, y = (torch.as_tensor(part) for part in sample)
        if x.dim() != 1 or y.shape != x.shape or len(x) < 1:
            raise ValueError(f"{where}: an (input, target) pair must be two 1-D tensors of one "
                             f"length >= 1, got shapes {tuple(x.shape)} and {tuple(y.shape)}")
    else:
        tokens = torch.as_tensor(sample)
        if tokens.dim() != 1 or len(tokens) < 2:
            raise ValueError(f"{where}: a document must be a 1-D tensor of at least 2 token ids, "
                             f"got shape {tuple(tokens.shape)}; fix: drop shorter samples or "
                             "pass (input, target) pairs")
        x, y = tokens[:-1], tokens[1:]
    if x.dtype.is_floating_point or y.dtype.is_floating_point or x.dtype == torch.bool:
        raise ValueError(f"{where}: token ids must be integers, got {x.dtype} and {y.dtype}")
    return x.to(torch.int64), y.to(torch.int64)


def _source(data: Any, name: str) -> _Indexed | _Streamed:
    if hasattr(data, "__len__") and hasattr(data, "__getitem__") and not isinstance(data, Tensor):
        if len(data) == 0:
            raise ValueError(f"{name} has no samples; fix: a dataset of at least one sample")
        return _Indexed(data, range(len(data)), name)
    if isinstance(data, Iterable) and not isinstance(data, (Iterator, Tensor, str, bytes)):
        return _Streamed(data, name)
    raise TypeError(f"{name} must be a dataset with len() and indexing (a torch Dataset, a list) "
                    f"or a re-iterable one (a torch IterableDataset), got {type(data).__name__}"
                    + ("; a generator or iterator can be read once only: wrap it in an "
                       "IterableDataset whose __iter__ starts it anew" if isinstance(data, Iterator)
                       else ""))


class _Indexed:
    """A map-style split: samples ``indices`` of ``data``, their lengths read once."""

    def __init__(self, data: Any, indices: range, name: str) -> None:
        self.data, self.indices, self.name = data, indices, name
        self.lengths = torch.tensor([len(self._pair(i)[0]) for i in range(len(indices))],
                                    dtype=torch.int64)
        self.positions = int(self.lengths.sum())
        self._epoch: tuple[int, Tensor, Tensor] | None = None
        """The last epoch read: its number, order and the cumulative positions in it."""

    def __len__(self) -> int:
        return len(self.indices)

    def __repr__(self) -> str:
        return f"{len(self)} samples, {self.positions} positions"

    def head(self, count: int) -> _Indexed:
        return _Indexed(self.data, self.indices[:count], self.name)

    def tail(self, count: int) -> _Indexed:
        return _Indexed(self.data, self.indices[len(self.indices) - count:], self.name)

    def _pair(self, i: int) -> tuple[Tensor, Tensor]:
        index = self.indices[i]
        return _pair(self.data[index], f"{self.name}[{index}]")

    def sample(self, number: int, order: Any) -> tuple[Tensor, Tensor]:
        epoch, within = divmod(number, len(self))
        return self._pair(int(order(epoch, len(self))[within]))

    def span(self, first: int, count: int, order: Any) -> tuple[Tensor, Tensor, Tensor]:
        """Positions ``first .. first + count`` of the endless stream of epochs: inputs,
        targets and each one's offset in its sample."""
        xs, ys, offsets = [], [], []
        while count > 0:
            epoch, offset = divmod(first, self.positions)
            if self._epoch is None or self._epoch[0] != epoch:  # once per epoch, not per step
                permutation = order(epoch, len(self))
                self._epoch = (epoch, permutation, torch.cumsum(self.lengths[permutation], 0))
            _, permutation, ends = self._epoch
            slot = int(torch.searchsorted(ends, offset, right=True))
            start = offset - (int(ends[slot - 1]) if slot else 0)
            while count > 0 and slot < len(self):
                x, y = self._pair(int(permutation[slot]))
                take = min(count, len(x) - start)
                xs.append(x[start:start + take])
                ys.append(y[start:start + take])
                offsets.append(torch.arange(start, start + take))
                first, count, start, slot = first + take, count - take, 0, slot + 1
        return torch.cat(xs), torch.cat(ys), torch.cat(offsets)


class _Streamed:
    """An iterable split, read in order from its start each epoch. It remembers where its
    last read ended, so consecutive steps read on; an earlier step starts it over."""

    def __init__(self, data: Iterable[Any], name: str) -> None:
        self.data, self.name = data, name
        self._pairs: Iterator[tuple[Tensor, Tensor]] | None = None
        self._read = 0
        """Samples (pad mode) or positions (pack mode) read before ``_held``."""
        self._held: list[tuple[Tensor, Tensor, Tensor]] = []
        """Samples read and not used up yet: inputs, targets, offsets in their sample."""

    def __repr__(self) -> str:
        return f"an iterable {type(self.data).__name__}"

    def _epochs(self) -> Iterator[tuple[Tensor, Tensor]]:
        """The samples of every epoch, one after the other."""
        while True:
            empty = True
            for number, sample in enumerate(self.data):
                empty = False
                yield _pair(sample, f"{self.name} sample {number}")
            if empty:
                raise ValueError(f"{self.name} yielded no samples (an iterable dataset must "
                                 "start anew on each iter(); a generator cannot)")

    def _from(self, first: int) -> Iterator[tuple[Tensor, Tensor]]:
        if self._pairs is None or self._read > first:
            self._pairs, self._read, self._held = self._epochs(), 0, []
        return self._pairs

    def sample(self, number: int, order: Any) -> tuple[Tensor, Tensor]:
        pairs = self._from(number)
        while self._read < number:
            next(pairs)
            self._read += 1
        self._read += 1
        return next(pairs)

    def span(self, first: int, count: int, order: Any) -> tuple[Tensor, Tensor, Tensor]:
        pairs = self._from(first)
        held = sum(len(x) for x, _, _ in self._held)
        while self._read + held < first + count:  # read on until the span is held
            x, y = next(pairs)
            if self._read + held + len(x) <= first:  # wholly before the span: skipped
                self._read += len(x)
                continue
            self._held.append((x, y, torch.arange(len(x))))
            held += len(x)
        inputs, targets, offsets = (torch.cat(parts) for parts in zip(*self._held, strict=True))
        skip, end = first - self._read, first - self._read + count
        self._read, self._held = first + count, [(inputs[end:], targets[end:], offsets[end:])]
        return inputs[skip:end], targets[skip:end], offsets[skip:end]

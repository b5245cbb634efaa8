"""Training data: the corpus (a user's text, or the Python standard library's source), tokenizer,
the text dataset, and a user's own samples (:class:`SampleDataset`: packed or padded).

Example:
    >>> from pipetrain.data import TextDataset, load_corpus
    >>> dataset = TextDataset(load_corpus(max_bytes=100_000), context=64, seed=0)
    >>> dataset.batch(0, 8)[0].shape
    torch.Size([8, 64])
"""

from __future__ import annotations

from pipetrain.data.corpus import (
    DEFAULT_CORPUS_BYTES,
    corpus_size,
    corpus_tokens,
    describe_corpus,
    load_corpus,
    stdlib_source_files,
)
from pipetrain.data.dataset import SPLITS, TextDataset
from pipetrain.data.samples import IGNORE_INDEX, SampleDataset, real_tokens
from pipetrain.data.tokenizer import ByteTokenizer

__all__ = [
    "DEFAULT_CORPUS_BYTES",
    "IGNORE_INDEX",
    "SPLITS",
    "ByteTokenizer",
    "SampleDataset",
    "TextDataset",
    "corpus_size",
    "corpus_tokens",
    "describe_corpus",
    "load_corpus",
    "real_tokens",
    "stdlib_source_files",
]

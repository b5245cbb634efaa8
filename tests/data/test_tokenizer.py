"""Tests of pipetrain.data.tokenizer."""

from __future__ import annotations

import pytest
import torch

from pipetrain.data.tokenizer import ByteTokenizer


def test_round_trip_text_and_bytes() -> None:
    tokenizer = ByteTokenizer()
    text = "def f(x):\n    return 'héllo ☃'\n"
    tokens = tokenizer.encode(text)
    assert tokens.dtype == torch.int64 and tokens.shape == (len(text.encode()),)
    assert tokenizer.decode(tokens) == text
    assert torch.equal(tokenizer.encode(text.encode()), tokens)
    assert tokenizer.decode(tokens.tolist()) == text
    assert tokenizer.encode("").shape == (0,)
    assert ByteTokenizer.vocab_size == 256


def test_invalid_utf8_is_replaced() -> None:
    assert ByteTokenizer().decode(torch.tensor([0xE2, 0x98])) == "\ufffd"


def test_errors() -> None:
    tokenizer = ByteTokenizer()
    with pytest.raises(ValueError, match=r"must be bytes 0..255, got \[256, -1\]"):
        tokenizer.decode([104, 256, -1])
    with pytest.raises(ValueError, match=r"shape \(2, 3\).*decode\(tokens\[0\]\)"):
        tokenizer.decode(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="takes str or bytes, got int"):
        tokenizer.encode(5)  # type: ignore[arg-type]

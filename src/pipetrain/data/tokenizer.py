"""The byte tokenizer: text <-> int64 token ids 0..255, one per UTF-8 byte."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor

__all__ = ["ByteTokenizer"]


class ByteTokenizer:
    """Encodes text as its UTF-8 bytes; any byte sequence is valid, nothing is unknown.

    Example:
        >>> tokenizer = ByteTokenizer()
        >>> tokenizer.encode("hé")
        tensor([104, 195, 169])
        >>> tokenizer.decode(tokenizer.encode("hé"))
        'hé'
    """

    vocab_size: ClassVar[int] = 256
    """Number of distinct tokens: every byte value."""

    def encode(self, text: str | bytes) -> Tensor:
        """``text`` (UTF-8 encoded when a ``str``) -> int64 tensor of shape (num_bytes,)."""
        if isinstance(text, str):
            data = text.encode("utf-8")
        elif isinstance(text, (bytes, bytearray, memoryview)):
            data = bytes(text)
        else:
            raise TypeError(
                f"ByteTokenizer.encode takes str or bytes, got {type(text).__name__}: "
                "pass e.g. encode('hello') or encode(b'hello')"
            )
        if not data:
            return torch.empty(0, dtype=torch.int64)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)

    def decode(self, tokens: Tensor | Sequence[int]) -> str:
        """Token ids (a 1-D tensor or a sequence of ints) -> text; invalid UTF-8 becomes U+FFFD.

        Example:
            >>> ByteTokenizer().decode([104, 105, 255])
            'hi\\ufffd'
        """
        if isinstance(tokens, Tensor):
            if tokens.dim() > 1 or tokens.dtype.is_floating_point:
                raise ValueError(
                    f"ByteTokenizer.decode takes a 1-D integer tensor, got {tokens.dtype} of "
                    f"shape {tuple(tokens.shape)}: decode one row at a time, e.g. decode(tokens[0])"
                )
            values = [int(value) for value in tokens.tolist()]
        else:
            values = [int(value) for value in tokens]
        bad = [value for value in values if not 0 <= value < self.vocab_size]
        if bad:
            raise ValueError(
                f"token ids must be bytes 0..255, got {bad[:5]}"
                f"{' ...' if len(bad) > 5 else ''}: these did not come from ByteTokenizer.encode"
            )
        return bytes(values).decode("utf-8", errors="replace")

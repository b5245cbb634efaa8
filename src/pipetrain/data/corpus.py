"""The training corpus: a text file of the user's, or by default the Python standard library.

A user's file is used whole, however large: :func:`corpus_tokens` memory-maps it, so a
run reads only the windows its batches draw, and the workers of a machine share one copy
in the page cache. A folder is its text files joined by newlines (read into memory).

The default corpus is the first :data:`DEFAULT_CORPUS_BYTES` of the source code of the
standard library of the Python that runs (``sysconfig.get_paths()["stdlib"]``): every
installation has it, so nothing is downloaded. Its ``.py`` files are read in sorted
order of their relative paths, skipping ``site-packages``, test folders and generated
tables (``encodings``, ``pydoc_data``): the same bytes on every machine with the same
Python installation.
"""

from __future__ import annotations

import logging
import os
import sysconfig
from pathlib import Path

import torch

__all__ = [
    "DEFAULT_CORPUS_BYTES",
    "corpus_size",
    "corpus_tokens",
    "describe_corpus",
    "load_corpus",
    "stdlib_source_files",
]

logger = logging.getLogger(__name__)

DEFAULT_CORPUS_BYTES = 4 * 2**20
"""The default corpus's size: the first 4 MiB of the standard library's source (on
CPython 3.11: the first ~240 of ~600 files, of ~9.5 MiB). A user's corpus has no cap."""

_SNIFF_BYTES = 2**20
"""Whether a file is text is judged from its first MiB."""

# installed packages, tests, and generated data (codec tables, pydoc's topic strings)
_SKIPPED_FOLDERS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "__pycache__",
        "test",
        "tests",
        "idle_test",
        "encodings",
        "pydoc_data",
    }
)


def stdlib_source_files() -> list[Path]:
    """The standard library's ``.py`` files in corpus order (sorted by relative path).

    Example:
        >>> files = stdlib_source_files()
        >>> any(path.name == "argparse.py" for path in files)
        True
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in _SKIPPED_FOLDERS]
        files.extend(Path(folder, name) for name in names if name.endswith(".py"))
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def load_corpus(
    path: str | os.PathLike[str] | None = None, *, max_bytes: int | None = None
) -> bytes:
    """The corpus as bytes: all of it, or its first ``max_bytes``.

    ``path`` names a text file, or a folder whose text files (recursively, in path order,
    hidden ones skipped) are joined by newlines; without it the corpus is the default one
    (the first :data:`DEFAULT_CORPUS_BYTES` of the standard library's source). Training
    runs read a file through :func:`corpus_tokens` instead, which does not load it.

    Raises:
        FileNotFoundError: ``path`` does not exist (or, for the default corpus, this Python
            ships no ``.py`` sources).
        ValueError: ``max_bytes`` is not positive, or the file is empty, a folder without
            text files, or not text (a NUL byte, or over 10% of its first MiB neither
            printable nor UTF-8).

    Example:
        >>> corpus = load_corpus(max_bytes=1000)
        >>> len(corpus), len(load_corpus()) == DEFAULT_CORPUS_BYTES
        (1000, True)
    """
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1
    ):
        raise ValueError(
            f"max_bytes={max_bytes!r} must be a positive int, e.g. max_bytes=100_000, "
            "or None for the whole corpus"
        )
    if path is None:
        limit = DEFAULT_CORPUS_BYTES if max_bytes is None else min(max_bytes, DEFAULT_CORPUS_BYTES)
        return _load_default(max_bytes=limit)
    path = Path(path)
    if _checked_path(path).is_dir():
        return _load_folder(path, max_bytes=max_bytes)
    with path.open("rb") as file:
        return file.read(-1 if max_bytes is None else max_bytes)


def corpus_tokens(path: str | os.PathLike[str] | None = None) -> torch.Tensor:
    """The whole corpus as a 1-D uint8 tensor, one token per byte.

    A file is memory-mapped (read from disk as windows are taken from it, shared by the
    processes that map it); a folder and the default corpus are read into memory.

    Raises:
        FileNotFoundError, ValueError: as :func:`load_corpus`.

    Example:
        >>> tokens = corpus_tokens()
        >>> tokens.dtype, len(tokens) == DEFAULT_CORPUS_BYTES
        (torch.uint8, True)
    """
    if path is not None and not _checked_path(Path(path)).is_dir():
        size = os.path.getsize(path)
        return torch.from_file(os.fspath(path), shared=False, size=size, dtype=torch.uint8)
    return torch.frombuffer(bytearray(load_corpus(path)), dtype=torch.uint8)


def corpus_size(path: str | os.PathLike[str] | None = None) -> int:
    """The number of bytes in the corpus (a file's size; a folder's joined text files;
    :data:`DEFAULT_CORPUS_BYTES` or the whole standard library's source if smaller),
    without checking a file's content.

    Raises:
        FileNotFoundError, ValueError: as :func:`load_corpus`, for a folder.

    Example:
        >>> corpus_size() == DEFAULT_CORPUS_BYTES
        True
    """
    if path is None:
        total = sum(file.stat().st_size for file in stdlib_source_files())
        return min(total, DEFAULT_CORPUS_BYTES)
    if os.path.isdir(path):
        return len(load_corpus(path))
    return os.path.getsize(path)


def describe_corpus(path: str | os.PathLike[str] | None, num_bytes: int) -> str:
    """What a run trains on, in words (for its start-up line and records).

    Example:
        >>> describe_corpus("input.txt", 6_512_345)
        'input.txt (6,512,345 bytes, all of it)'
        >>> describe_corpus(None, DEFAULT_CORPUS_BYTES)
        "the default corpus (4,194,304 bytes: the first 4 MiB of this Python's standard library source)"
    """
    if path is None:
        return (f"the default corpus ({num_bytes:,} bytes: the first "
                f"{DEFAULT_CORPUS_BYTES // 2**20} MiB of this Python's standard library source)")
    what = "its text files joined" if os.path.isdir(path) else "all of it"
    return f"{os.fspath(path)} ({num_bytes:,} bytes, {what})"


def _load_default(*, max_bytes: int) -> bytes:
    """The first ``max_bytes`` of the standard library's source files, in corpus order."""
    files = stdlib_source_files()
    if not files:
        raise FileNotFoundError(
            f"this Python has no standard library sources under "
            f"{sysconfig.get_paths()['stdlib']!r} to build the default corpus from: "
            "pass the path of a text file instead, e.g. load_corpus('input.txt')"
        )
    chunks: list[bytes] = []
    size = 0
    for file in files:
        if size >= max_bytes:
            break
        data = file.read_bytes()
        chunks.append(data)
        size += len(data)
    corpus = b"".join(chunks)[:max_bytes]
    logger.debug(
        "default corpus: %d bytes from %d standard library files", len(corpus), len(chunks)
    )
    return corpus


def _checked_path(path: Path) -> Path:
    """``path`` once it is known to exist and, for a file, to be non-empty text."""
    if not path.exists():
        raise FileNotFoundError(
            f"corpus file {str(path)!r} does not exist: pass the path of an existing text file, "
            "or no path for the default corpus (the Python standard library's source)"
        )
    if path.is_dir():
        return path
    with path.open("rb") as file:
        head = file.read(_SNIFF_BYTES)
    if not head:
        raise ValueError(f"corpus file {str(path)!r} is empty: pass a file with some text in it")
    problem = _not_text(head)
    if problem is not None:
        raise ValueError(
            f"corpus file {str(path)!r} does not look like text ({problem}); the model learns "
            "to write text from UTF-8 or ASCII bytes: pass a text file (e.g. a .py, .txt or "
            ".md file)"
        )
    return path


def _load_folder(path: Path, *, max_bytes: int | None) -> bytes:
    """The text files under folder ``path`` (recursively, in path order; hidden files and
    files that are not text skipped), joined by newlines, up to ``max_bytes``."""
    parts: list[bytes] = []
    total = 0
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        if any(part.startswith(".") for part in file.relative_to(path).parts):
            continue
        with file.open("rb") as handle:
            data = handle.read(-1 if max_bytes is None else max_bytes - total)
        if not data or _not_text(data[:_SNIFF_BYTES]) is not None:
            continue
        parts.append(data)
        total += len(data) + 1
        if max_bytes is not None and total >= max_bytes:
            break
    if not parts:
        raise ValueError(
            f"corpus folder {str(path)!r} holds no text file: pass a folder of text files (e.g. "
            ".py, .txt or .md files) or one such file"
        )
    joined = b"\n".join(parts)
    return joined if max_bytes is None else joined[:max_bytes]


def _not_text(data: bytes) -> str | None:
    """Why ``data`` is not text, or None: a NUL byte, or more than 10% of its bytes
    neither printable ASCII, whitespace, nor part of valid UTF-8."""
    nul = data.find(b"\x00")
    if nul >= 0:
        return f"a NUL byte at offset {nul}"
    text = data.decode("utf-8", errors="replace")
    invalid = text.count("\ufffd") - data.decode("utf-8", errors="ignore").count("\ufffd")
    controls = sum(1 for c in text if c < " " and c not in "\t\n\r\f\v\x1b\b")
    odd = invalid + controls
    if odd > 0.1 * len(data):
        return f"{odd} of its first {len(data)} bytes are neither printable text nor UTF-8"
    return None

"""The training APIs: ``GPipe`` (single process, torchgpipe-compatible) and ``Pipeline``."""

__all__: list[str] = []

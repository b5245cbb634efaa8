"""The ``pipetrain`` command line."""

__all__: list[str] = []

"""The benchmark cases of ``pipetrain bench``, one module each (see :mod:`pipetrain.bench.registry`)."""

__all__: list[str] = []

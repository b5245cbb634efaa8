"""The benchmark cases of ``pipetrain bench``, one module each (see :mod:`pipetrain.bench.registry`)."""

"""The one-call GPU check: every figure pipetrain needs from a GPU, in one run of
``benchmarks/gpu/run.sh OUT_DIR``, written as JSON (one file per item, and
``summary.json``).

Each item runs in its own process with its own time budget (:mod:`gpu.items`), so a
failing or hanging item is recorded and the others still run; the same code runs on
the CPU (``--device cpu --quick``), where ``tests/test_gpu_check.py`` runs it. See
``docs/gpu.md``.
"""

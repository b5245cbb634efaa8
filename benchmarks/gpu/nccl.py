"""Item ``nccl``: the multi-process ``Pipeline`` over NCCL needs two GPUs.

NCCL refuses two ranks on one device, so on one GPU (or none) this item is skipped,
saying so. With two or more GPUs the tests that need them run in item ``cuda_tests``
(``tests/runtime/test_cuda_transport.py``, ``tests/api/test_cuda_precision.py``).
"""

from __future__ import annotations

from typing import Any

from gpu.common import ItemContext

__all__ = ["run"]


def run(ctx: ItemContext) -> dict[str, Any]:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        return {"status": "skipped", "cuda_devices": count,
                "reason": f"the multi-process NCCL path needs two GPUs ({count} here): NCCL "
                          "refuses two ranks on one device"}
    return {"status": "skipped", "cuda_devices": count,
            "reason": f"{count} GPUs: the NCCL tests run in item cuda_tests (see its results)"}

# tests/gpu/gpu_helpers.py
#
# Shared by the kernel-level GPU tests: torch (optional outside the GPU and reference tests),
# the skip mark for machines without a CUDA device or a CUDA build of dflash, and the test
# bindings of the kernels.
from __future__ import annotations

import pytest

try:
    import torch
except ImportError:  # torch is optional outside the reference and GPU tests
    torch = None


def cuda_ready() -> bool:
    if torch is None or not torch.cuda.is_available():
        return False
    try:
        import dflash

        return bool(dflash.built_with_cuda())
    except Exception:  # noqa: BLE001 - the extension is not built, or was built without CUDA
        return False


requires_cuda = pytest.mark.skipif(not cuda_ready(), reason="needs a CUDA device and dflash built with CUDA")


def kernel_ops():
    """dflash._core.testing: the cuda_* / triton_* test bindings."""
    from dflash._core import testing

    return testing

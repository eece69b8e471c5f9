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


def bf16_randn(*shape, seed, scale=1.0):
    """A seeded standard-normal bf16 CUDA tensor times `scale`."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)


def gpu_dflash2(tmp_path, target, name: str = "d2", **kw):
    """small_dflash2 with group 16 and rank 16 unless `kw` says otherwise (the GPU tests' drafter)."""
    from tests.runtime_helpers import small_dflash2

    kw.setdefault("conv_group_size", 16)
    kw.setdefault("selector_rank", 16)
    return small_dflash2(tmp_path, target, name, **kw)

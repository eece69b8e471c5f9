# tests/gpu/gpu_helpers.py
#
# Shared by the kernel-level GPU tests: torch (optional outside the GPU and reference tests),
# the skip mark for machines without a CUDA device or a CUDA build of dflash, the test
# bindings of the kernels, seeded bf16 inputs and the bf16 comparison with printed max errors.
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


DEV = "cuda"


def bf16(*shape, scale=1.0, offset=0.0, seed=0):
    """A seeded normal bf16 CUDA tensor: randn * scale + offset."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=g) * scale + offset).to(torch.bfloat16)


def report(name, got, want):
    """Prints (-s) and returns the absolute error of got against want."""
    err = (got.float() - want.float()).abs()
    rel = err / want.float().abs().clamp_min(1e-3)
    print(f"{name}: max abs err {err.max().item():.3g}, max rel err {rel.max().item():.3g}")
    return err


def assert_bf16_close(name, got, want, rtol=2 ** -7, atol=1e-3):
    """got (bf16) within rtol (2 bf16 ulps) relative plus atol of the fp32 reference."""
    report(name, got, want)
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)

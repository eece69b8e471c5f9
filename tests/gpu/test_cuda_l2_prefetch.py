# tests/gpu/test_cuda_l2_prefetch.py
#
# The L2 weight prefetch (cuda/l2_prefetch.cu; KernelOptions::l2_prefetch / DFLASH_L2_PREFETCH):
# - the kernel writes nothing: the tensor is unchanged after whole, partial and odd-sized
#   prefetches over one CTA or many;
# - bad arguments are refused (bytes past the end: ValueError; zero bytes, no CTAs or a pointer
#   that is not 16-byte aligned: the launcher's cudaErrorInvalidValue as dflash.DFlashError);
# - a session that prefetches every linear layer's weight decodes bit-identically to one that
#   prefetches none (AR and DFlash; graphs and programmatic launch on, so the prefetch kernels sit
#   between dependent kernels of the captured steps and must keep their order; one subprocess
#   each, the switch is read when a session opens), on a model whose weights are >= 8 MiB
#   (smaller ones are never prefetched), and a bad DFLASH_L2_PREFETCH value fails the session open with ValueError.
from __future__ import annotations

import json

import dflash
import pytest

from tests.gpu.gpu_helpers import DEV, bf16, kernel_ops, requires_cuda, torch
from tests.gpu.session_runs import session_process, tiny_drafter

pytestmark = requires_cuda


@pytest.mark.parametrize(
    "nbytes,bytes_,max_blocks",
    [
        (64 << 20, 64 << 20, 132),  # a whole O-projection-sized weight over the grid
        (64 << 20, 12 << 20, 132),  # a prefix
        (
            1 << 20,
            (1 << 20) - 7,
            1,
        ),  # odd size (the tail under 16 bytes is not prefetched), one CTA
        (4096, 16, 8),  # one 16-byte piece, more CTAs than work
    ],
)
def test_prefetch_writes_nothing(nbytes, bytes_, max_blocks):
    K = kernel_ops()
    w = bf16(nbytes // 2, seed=5)
    want = w.clone()
    K.cuda_l2_prefetch(w, bytes_, max_blocks)
    torch.cuda.synchronize()
    assert torch.equal(w, want)


def test_prefetch_bad_arguments():
    K = kernel_ops()
    w = torch.zeros(1 << 16, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="past the end"):
        K.cuda_l2_prefetch(w, (1 << 16) + 16, 4)
    with pytest.raises(dflash.DFlashError, match="l2_prefetch"):
        K.cuda_l2_prefetch(w, 0, 4)
    with pytest.raises(dflash.DFlashError, match="l2_prefetch"):
        K.cuda_l2_prefetch(w, 1024, 0)
    with pytest.raises(dflash.DFlashError, match="l2_prefetch"):
        K.cuda_l2_prefetch(w[1:], 1024, 4)  # not 16-byte aligned


def _run(target, draft, prefetch):
    return session_process(target, draft, {"DFLASH_L2_PREFETCH": prefetch})


@pytest.fixture(scope="module")
def prefetchable_model(tmp_path_factory):
    """A 2-layer bf16 Qwen3 whose four linear weights are all >= 8 MiB (O: 2048 x 2048)."""
    from tests.fixtures.tiny_models import write_tiny_model

    return write_tiny_model(
        tmp_path_factory.mktemp("prefetch") / "m",
        arch="qwen3",
        hidden_size=2048,
        num_layers=2,
        num_heads=16,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=2048,
        dtype="bfloat16",
        seed=11,
    )


@pytest.mark.parametrize("spec", [False, True])
def test_session_with_prefetch_is_bit_identical(spec, prefetchable_model, tmp_path):
    draft = tiny_drafter(tmp_path / "d", prefetchable_model) if spec else None
    runs = {}
    for mode in ("off", "all", "o,down"):
        p = _run(prefetchable_model, draft, mode)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[mode] = json.loads(p.stdout.strip().splitlines()[-1])
    assert runs["all"] == runs["off"]
    assert runs["o,down"] == runs["off"]


def test_bad_prefetch_value_is_refused(prefetchable_model):
    p = _run(prefetchable_model, None, "o,everything")
    assert p.returncode != 0
    assert "ValueError" in p.stderr and "DFLASH_L2_PREFETCH" in p.stderr

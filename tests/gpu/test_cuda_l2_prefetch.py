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
import os
import subprocess
import sys

import dflash
import pytest

from tests.gpu.gpu_helpers import DEV, bf16, kernel_ops, requires_cuda, torch

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


SCRIPT = r"""
import json, sys
import numpy as np
import dflash
target, draft = sys.argv[1], (sys.argv[2] or None)
sess = dflash.Session(target, draft=draft, device="cuda", kv_cache_tokens=4096, max_num_seqs=4)
rng = np.random.default_rng(5)
prompts = [[int(x) for x in rng.integers(3, 352, size=int(rng.integers(5, 40)))] for _ in range(3)]
outs = sess.generate(prompts, dflash.SamplingParams(max_tokens=20, ignore_eos=True))
res = {"tokens": [o.token_ids for o in outs]}
if draft is not None:
    ids, logits = sess.propose(prompts[0])
    res["logits"] = np.asarray(logits).ravel()[:4096].tolist()
print(json.dumps(res))
"""


def _run(target, draft, prefetch):
    env = dict(os.environ, DFLASH_L2_PREFETCH=prefetch)
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(target), str(draft or "")],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


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
    draft = None
    if spec:
        from dflash.drafter_format import write_dflash_drafter

        cfg = json.loads((prefetchable_model / "config.json").read_text())
        draft = write_dflash_drafter(
            tmp_path / "d",
            target_config=cfg,
            num_layers=2,
            target_layer_ids=[0, 1],
            block_size=8,
        )
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

# tests/gpu/test_cuda_scratch_arena.py
#
# The CUDA per-step scratch arena is sized for the largest step a session can take: a whole
# prefill chunk of max_num_batched_tokens rows through the target AND the drafter's context
# update over the same rows (fc, its norm, the K/V of every drafter layer), in one step. A
# geometry where that update is large next to the fixed headroom (wide K/V: 2 x kv_heads x
# head_dim > hidden) once overflowed the arena at a full chunk ("the CUDA scratch arena ... is
# too small for this step"); the same long prompt must run with and without a drafter and give
# the same greedy tokens.
from __future__ import annotations

import json

import pytest

import dflash
from dflash import _core

pytestmark = pytest.mark.skipif(not _core.cuda_usable(), reason="needs the CUDA backend and a Hopper GPU")

CHUNK = 16384


def test_a_full_prefill_chunk_with_a_drafter_fits_the_arena(tmp_path):
    from dflash.drafter_format import write_dflash_drafter
    from tests.fixtures.tiny_models import write_tiny_model

    target = write_tiny_model(tmp_path / "wide_kv", arch="qwen3", hidden_size=512, num_layers=1, num_heads=4,
                              num_kv_heads=4, head_dim=128, intermediate_size=512,
                              max_position_embeddings=CHUNK + 64)
    cfg = json.loads((target / "config.json").read_text())
    draft = write_dflash_drafter(tmp_path / "d", target_config=cfg, num_layers=1, target_layer_ids=[0], block_size=4)
    prompt = [3 + (7 * i) % (cfg["vocab_size"] - 3) for i in range(CHUNK)]
    params = dflash.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(device="cuda", max_model_len=CHUNK + 32, kv_cache_tokens=CHUNK + 256, max_num_batched_tokens=CHUNK,
              max_num_seqs=4)
    spec = dflash.Session(target, draft=str(draft), **kw)
    got = spec.generate([prompt], params)[0].token_ids
    ar = dflash.Session(target, **kw)
    want = ar.generate([prompt], params)[0].token_ids
    assert len(got) == 8 and got == want
    for s in (spec.stats(), ar.stats()):
        assert s["num_free_blocks"] == s["num_blocks"], s

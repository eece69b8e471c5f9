# tests/gpu/test_cuda_scheduling.py
#
# Preemption by recompute and chunked prefill on the CUDA backend: a KV cache too small for the
# batch's worst cases (block tables grow inside the padded decode graphs, requests are preempted
# and resumed by recomputing their prompt + generated tokens) and a small prefill budget (long
# prompts prefilled in chunks while others decode). Graph replays must give exactly the tokens of
# the same schedule run eagerly (cuda_graphs=False), for AR, DFlash and DFlash2, greedy and
# seeded T > 0; preemptions and chunks really happen; every KV block is free afterwards. (The
# outputs equal a run without preemption on the CPU's fp32, tests/test_preemption.py; in bf16 a
# recompute may round differently from the decode steps it replaces.) Skipped without a usable
# Hopper GPU.
from __future__ import annotations

import json

import numpy as np
import pytest

import dflash
from dflash import _core

pytestmark = pytest.mark.skipif(not _core.cuda_usable(), reason="needs the CUDA backend and a Hopper GPU")

# 192 slots in blocks of 16 (one request below fits alone: < 100 prompt + 30 new + a verify
# block), with a prefill budget of 24 tokens per step.
TIGHT = dict(kv_cache_tokens=192, block_size=16, max_num_seqs=8, max_num_batched_tokens=24)


def _prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 352, size=int(rng.integers(10, 100)))] for _ in range(n)]


def _params(n, temperature):
    return [dflash.SamplingParams(max_tokens=16 + 4 * (i % 4), temperature=temperature,
                                  top_p=0.9 if temperature else 1.0, seed=300 + i, ignore_eos=True) for i in range(n)]


def _drafter(tmp_path, target, kind):
    cfg = json.loads((target / "config.json").read_text())
    if kind == "dflash":
        from dflash.drafter_format import write_dflash_drafter

        return write_dflash_drafter(tmp_path / "d", target_config=cfg, num_layers=2, target_layer_ids=[0, 1],
                                    block_size=8)
    from tests.gpu.gpu_helpers import gpu_dflash2

    return gpu_dflash2(tmp_path, target, block_size=5, selector_top_k=16)


@pytest.mark.parametrize("draft", [None, "dflash", "dflash2"])
def test_preemption_and_chunked_prefill_graphs_equal_eager(draft, tiny_model_dirs, tmp_path):
    target = tiny_model_dirs["qwen3_hd128"]
    kw = dict(TIGHT, device="cuda", draft=str(_drafter(tmp_path, target, draft)) if draft else "none")
    on = dflash.Session(target, **kw)
    off = dflash.Session(target, cuda_graphs=False, **kw)
    prompts = _prompts(10, seed=5)
    for temperature in (0.0, 0.8):
        params = _params(len(prompts), temperature)
        got = [o.token_ids for o in on.generate(prompts, params)]
        want = [o.token_ids for o in off.generate(prompts, params)]
        assert got == want, f"{draft} T={temperature}: graphs and eager differ under preemption / chunking"
    s_on, s_off = on.stats(), off.stats()
    assert s_on["graph_steps"] > 0 and s_off["graph_steps"] == 0
    assert s_on["num_preemptions"] > 0 and s_on["num_preemptions"] == s_off["num_preemptions"]
    assert s_on["num_prefill_chunks"] > len(prompts) * 2
    for s in (s_on, s_off):
        assert s["num_free_blocks"] == s["num_blocks"], s


def test_long_prompt_in_chunks_with_others_decoding(tiny_model_dirs):
    """A prompt of 450 tokens in chunks of 64 while short requests decode in graphs: same tokens
    as eager, the prompt's chunks counted, no leaks."""
    target = tiny_model_dirs["llama_hd64"]
    kw = dict(device="cuda", kv_cache_tokens=8192, max_num_seqs=4, max_num_batched_tokens=64)
    on = dflash.Session(target, **kw)
    off = dflash.Session(target, cuda_graphs=False, **kw)
    prompts = _prompts(3, seed=6) + [[3 + (11 * i) % 340 for i in range(450)]]
    params = _params(len(prompts), 0.0)
    assert [o.token_ids for o in on.generate(prompts, params)] == [o.token_ids for o in off.generate(prompts, params)]
    s = on.stats()
    assert s["num_prefill_chunks"] >= 3 + 450 // 64 and s["graph_steps"] > 0
    assert s["num_free_blocks"] == s["num_blocks"]

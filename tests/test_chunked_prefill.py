# tests/test_chunked_prefill.py
#
# Chunked prefill (CPU, fp32): with a per-step budget of max_num_batched_tokens prefill tokens, a
# long prompt is prefilled chunk by chunk over several steps while running requests keep decoding
# in the same steps; with a drafter, its context K/V is filled chunk by chunk from each chunk's
# target taps; the first token is sampled only after the last chunk. Checked: chunked == unchunked
# output, greedy and seeded sampling, target-only and DFlash / DFlash2, several small budgets that
# force several chunks (counted in stats), also together with preemption; decoding requests emit a
# token in every step of a long prompt's prefill, which emits nothing before its last chunk;
# recorded prompt logits and taps equal a one-go prefill; enable_chunked_prefill=False prefills a
# prompt longer than the budget in one step; every KV block free afterwards.
from __future__ import annotations

import math

import numpy as np
import pytest

import dflash
from dflash import _core
from tests.runtime_helpers import assert_no_leaks, core_session, forced_run, small_drafter_pair

TARGET = "qwen3"


def _prompts(n, seed, lo=20, hi=90):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 352, size=int(rng.integers(lo, hi)))] for _ in range(n)]


def _params(n, temperature):
    return [dflash.SamplingParams(max_tokens=10 + 2 * (i % 4), temperature=temperature, top_k=40, seed=7 + i,
                                  ignore_eos=bool(i % 2)) for i in range(n)]


@pytest.fixture(scope="module")
def target(tiny_model_dirs):
    return tiny_model_dirs[TARGET]


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory):
    pair = small_drafter_pair(tmp_path_factory.mktemp("chunked_drafters"), target, dflash_layers=2, dflash_block_size=6,
                              dflash_seed=9, dflash2_block_size=4, dflash2_top_k=8)
    return {None: "none", **pair}


def _session(target, drafters, draft, **kw):
    return dflash.Session(target, draft=drafters[draft], device="cpu", num_threads=2, **kw)


def _ids(sess, prompts, params):
    return [o.token_ids for o in sess.generate(prompts, params)]


@pytest.mark.parametrize("draft", [None, "dflash", "dflash2"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_chunked_equals_unchunked(target, drafters, draft, temperature):
    prompts = _prompts(6, seed=1)
    params = _params(len(prompts), temperature)
    whole = _session(target, drafters, draft, enable_chunked_prefill=False)
    want = _ids(whole, prompts, params)
    assert whole.stats()["num_prefill_chunks"] == len(prompts)
    for budget in (1, 7, 16, 33):
        sess = _session(target, drafters, draft, max_num_batched_tokens=budget)
        assert _ids(sess, prompts, params) == want, budget
        st = sess.stats()
        # every prompt took at least ceil(len / budget) chunks
        assert st["num_prefill_chunks"] >= sum(math.ceil(len(p) / budget) for p in prompts) > len(prompts)
        assert st["num_preemptions"] == 0
        if draft:
            assert st["num_spec_steps"] > 0
        assert_no_leaks(sess)
    if temperature == 0.0:  # lossless: the drafters change nothing at T = 0
        assert want == _ids(_session(target, drafters, None), prompts, params)


@pytest.mark.parametrize("draft", [None, "dflash", "dflash2"])
def test_chunked_prefill_with_preemption(target, drafters, draft):
    """Small budgets and a cache that forces preemptions: partly prefilled requests are preempted
    too, and resumed requests recompute their prompt + generated tokens in chunks."""
    prompts = _prompts(8, seed=2, lo=5, hi=60)
    params = _params(len(prompts), 0.9)
    want = [_session(target, drafters, draft).generate([p], prm)[0].token_ids for p, prm in zip(prompts, params)]
    for budget in (5, 12):
        sess = _session(target, drafters, draft, kv_cache_tokens=96, block_size=4, max_num_batched_tokens=budget)
        assert _ids(sess, prompts, params) == want, budget
        st = sess.stats()
        assert st["num_preemptions"] > 0 and st["num_prefill_chunks"] > len(prompts) + st["num_preemptions"]
        assert_no_leaks(sess)


def test_decoding_continues_while_a_long_prompt_prefills(target, drafters):
    """One short request decoding, then a long prompt arrives: every step until its last chunk
    emits a token of the short request and nothing of the long one; its first token comes with the
    step of its last chunk."""
    for draft in (None, "dflash"):
        budget = 16
        sess = _session(target, drafters, draft, max_num_batched_tokens=budget)
        core = sess._core
        short = _core.RequestInput()
        short.prompt = [5, 6, 7, 8]
        short.sampling = sess._sampling_config(dflash.SamplingParams(max_tokens=200, ignore_eos=True))
        sid = core.add_request(short)
        core.step()  # its prefill and first token
        long = _core.RequestInput()
        long.prompt = _prompts(1, seed=3, lo=150, hi=151)[0]
        long.sampling = sess._sampling_config(dflash.SamplingParams(max_tokens=5, ignore_eos=True))
        lid = core.add_request(long)
        num_chunks = math.ceil(150 / budget)
        for i in range(num_chunks):
            out = {o.request_id: list(o.new_tokens) for o in core.step()}
            assert len(out.get(sid, [])) >= 1, i  # the short request decoded in this step
            if i < num_chunks - 1:
                assert lid not in out, i  # no token before the last chunk
            else:
                assert len(out[lid]) == 1  # the first token, sampled after the last chunk
        assert core.stats().engine.num_prefill_chunks == 1 + num_chunks
        core.abort(sid)
        while core.has_unfinished():
            core.step()
        long_out = core.take_result(lid).token_ids
        core.take_result(sid)
        alone = _session(target, drafters, draft, enable_chunked_prefill=False).generate(
            [list(long.prompt)], dflash.SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids
        assert list(long_out) == alone
        assert_no_leaks(sess)


def test_recorded_prompt_logits_and_taps_equal_a_one_go_prefill(target):
    prompt = _prompts(1, seed=4, lo=70, hi=71)[0]
    forced = [9, 10, 11, 12, 13]
    whole = core_session(target, tap_layers=[0, 1], enable_chunked_prefill=False)
    chunked = core_session(target, tap_layers=[0, 1], max_num_batched_tokens=9)
    lw, tw, _ = forced_run(whole, prompt, forced, taps=True)
    lc, tc, _ = forced_run(chunked, prompt, forced, taps=True)
    assert chunked._core.stats().engine.num_prefill_chunks == math.ceil(len(prompt) / 9)
    assert lc.shape == lw.shape == (len(prompt) + len(forced), whole.model_config.vocab_size)
    assert tc.shape == tw.shape
    # Equal up to fp32 rounding (chunks run through GEMMs of other shapes): 1e-5 of the scale.
    np.testing.assert_allclose(lc, lw, rtol=0, atol=1e-5 * float(np.max(np.abs(lw))))
    np.testing.assert_allclose(tc, tw, rtol=0, atol=1e-5 * float(np.max(np.abs(tw))))
    assert_no_leaks(chunked)


def test_unchunked_prompt_longer_than_the_budget_runs_in_one_step(target):
    prompts = _prompts(3, seed=5, lo=40, hi=60)
    params = _params(len(prompts), 0.0)
    sess = _session(target, {None: "none"}, None, max_num_batched_tokens=8, enable_chunked_prefill=False)
    want = _ids(_session(target, {None: "none"}, None), prompts, params)
    assert _ids(sess, prompts, params) == want
    st = sess.stats()
    assert st["num_prefill_chunks"] == len(prompts)
    assert_no_leaks(sess)


@pytest.mark.parametrize("value", ["yes", 1, 0.5])
def test_enable_chunked_prefill_must_be_a_bool(target, value):
    with pytest.raises(ValueError, match=r"enable_chunked_prefill must be True or False"):
        dflash.Session(target, device="cpu", enable_chunked_prefill=value)

# tests/test_preemption.py
#
# Admission by the KV blocks a request needs now, and preemption by recompute (CPU, fp32): a KV
# cache too small for the batch's worst cases forces the scheduler to preempt running requests
# (their blocks freed, target and drafter KV), which resume by prefilling their prompt and
# generated tokens again. Checked, for target-only decoding and DFlash (v1, probabilistic and
# greedy drafts) and DFlash2 drafters: seeded T > 0 outputs under preemption equal each request
# run alone and the same batch in a roomy cache (vLLM's batch-invariance pattern); greedy outputs
# under preemption equal those without (and target-only greedy: still lossless); preemptions
# really happened (stats and per-request metrics agree); the padded decode path (CUDA graphs'
# batch sizes, on the CPU) and pipelined decoding under preemption; recorded logits are not
# recorded twice by a recompute; a request that could never fit the cache is a ValueError that
# leaves other requests alone; every KV block is free after each workload.
from __future__ import annotations


import numpy as np
import pytest

import dflash
from dflash import _core
from tests.runtime_helpers import assert_no_leaks, core_session, forced_run, small_drafter_pair

TARGET = "llama_gqa"
# 80 slots in blocks of 4: one request of the workload below fits alone (at most 39 prompt + 29
# new tokens + a verify block of 4), the whole batch (up to ~480 slots) is far beyond it.
TINY = dict(kv_cache_tokens=80, block_size=4)
ROOMY = dict(kv_cache_tokens=4096, block_size=4)


def _prompts(n, seed, lo=5, hi=40):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 352, size=int(rng.integers(lo, hi)))] for _ in range(n)]


def _params(n, temperature, seed0=100):
    return [dflash.SamplingParams(max_tokens=14 + 3 * (i % 6), temperature=temperature, top_k=50, top_p=0.95,
                                  seed=seed0 + i, ignore_eos=bool(i % 2)) for i in range(n)]


@pytest.fixture(scope="module")
def target(tiny_model_dirs):
    return tiny_model_dirs[TARGET]


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory):
    pair = small_drafter_pair(tmp_path_factory.mktemp("preemption_drafters"), target, dflash_layers=1, dflash_block_size=4,
                              dflash_seed=5, dflash2_block_size=5, dflash2_top_k=16)
    return pair


DRAFT_CASES = [
    pytest.param(None, "auto", id="target_only"),
    pytest.param("dflash", "auto", id="dflash_probabilistic"),
    pytest.param("dflash", "greedy", id="dflash_greedy"),
    pytest.param("dflash2", "auto", id="dflash2_walk"),
]


def _session(target, drafters, draft, draft_sampling, **kw):
    d = drafters[draft] if draft else "none"
    return dflash.Session(target, draft=d, draft_sampling=draft_sampling, device="cpu", num_threads=2, **kw)


def _ids(sess, prompts, params):
    return [o.token_ids for o in sess.generate(prompts, params)]


@pytest.mark.parametrize("draft, draft_sampling", DRAFT_CASES)
def test_seeded_sampling_is_identical_under_preemption(target, drafters, draft, draft_sampling):
    prompts = _prompts(8, seed=1)
    params = _params(len(prompts), temperature=0.9)
    tiny = _session(target, drafters, draft, draft_sampling, **TINY)
    roomy = _session(target, drafters, draft, draft_sampling, **ROOMY)
    alone = [roomy.generate([p], prm)[0].token_ids for p, prm in zip(prompts, params)]
    assert _ids(roomy, prompts, params) == alone
    squeezed = _ids(tiny, prompts, params)
    st = tiny.stats()
    assert st["num_preemptions"] > 0, st
    assert roomy.stats()["num_preemptions"] == 0
    assert squeezed == alone
    # And again on the same session (state left by the preemptions changes nothing).
    assert _ids(tiny, prompts, params) == alone
    assert_no_leaks(tiny)
    assert_no_leaks(roomy)


@pytest.mark.parametrize("draft, draft_sampling", DRAFT_CASES)
def test_greedy_output_under_preemption_equals_without(target, drafters, draft, draft_sampling):
    prompts = _prompts(8, seed=2)
    params = _params(len(prompts), temperature=0.0)
    tiny = _session(target, drafters, draft, draft_sampling, **TINY)
    expected = _ids(dflash.Session(target, device="cpu", num_threads=2, **ROOMY), prompts, params)
    assert _ids(tiny, prompts, params) == expected  # target-only greedy: lossless under preemption
    assert tiny.stats()["num_preemptions"] > 0
    if draft:
        assert tiny.stats()["num_spec_steps"] > 0
    assert_no_leaks(tiny)


def _core_run(sess, prompts, temperature):
    """Runs the prompts through the core session `sess` (seeded as _params); returns the results."""
    ids = []
    for i, p in enumerate(prompts):
        req = _core.RequestInput()
        req.prompt = p
        s = _core.SamplingConfig()
        s.max_tokens, s.temperature, s.top_k, s.seed, s.ignore_eos = 14 + 3 * (i % 6), temperature, 50, 100 + i, True
        req.sampling = s
        ids.append(sess.add_request(req))
    while sess.has_unfinished():
        sess.step()
    return [sess.take_result(i) for i in ids]


@pytest.mark.parametrize("draft", [None, "dflash"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_padded_decode_batches_under_preemption(target, drafters, draft, temperature):
    """The CUDA graphs' path (decode rows padded to the graph batch sizes, padding rows writing the
    reserved blocks) with block tables that grow and requests preempted between steps."""
    def make(pad, **kw):
        cfg = _core.SessionConfig()
        cfg.num_threads = 2
        cfg.max_num_seqs = 8
        cfg.pad_decode_batches = pad
        for k, v in kw.items():
            setattr(cfg, k, v)
        if draft:
            cfg.draft_dir = str(drafters[draft])
        return _core.Session(str(target), cfg)

    prompts = _prompts(7, seed=3)
    padded = make(True, **TINY)
    got = _core_run(padded, prompts, temperature)
    want = _core_run(make(False, **ROOMY), prompts, temperature)
    assert [list(r.token_ids) for r in got] == [list(r.token_ids) for r in want]
    st = padded.stats()
    assert st.engine.num_preemptions > 0 and len(st.graph_batch_sizes) > 1
    # Per-request counts add up to the engine's.
    assert sum(r.metrics.num_preemptions for r in got) == st.engine.num_preemptions
    assert st.num_free_blocks == st.num_blocks


def test_async_decode_under_preemption(target):
    """Pipelined AR decoding grows block tables ahead of the step being read; when the blocks run
    out it stops pipelining and the scheduler preempts."""
    prompts = _prompts(8, seed=4)
    for temperature in (0.0, 0.9):
        params = _params(len(prompts), temperature)
        on = dflash.Session(target, device="cpu", num_threads=2, async_decode=True, **TINY)
        want = _ids(dflash.Session(target, device="cpu", num_threads=2, **ROOMY), prompts, params)
        assert _ids(on, prompts, params) == want
        st = on.stats()
        assert st["num_preemptions"] > 0 and st["pipelined_steps"] > 0
        assert_no_leaks(on)


def test_recordings_are_not_repeated_by_a_recompute(target):
    """Teacher-forced runs recording prompt logits and taps, squeezed so that they are preempted:
    each row is recorded once, with the values of a run that was never preempted."""
    prompts = _prompts(6, seed=5, lo=12, hi=30)
    forced = _prompts(6, seed=6, lo=10, hi=20)
    tiny = core_session(target, tap_layers=[0, 1], kv_cache_tokens=64, block_size=4)
    roomy = core_session(target, tap_layers=[0, 1], kv_cache_tokens=4096, block_size=4)

    def run(sess):
        core = sess._core
        ids = []
        for p, f in zip(prompts, forced):
            req = _core.RequestInput()
            req.prompt, req.forced_tokens = p, f + [0]
            req.record_logits = req.record_prompt_logits = req.record_taps = True
            s = _core.SamplingConfig()
            s.max_tokens, s.ignore_eos = len(f) + 1, True
            req.sampling = s
            ids.append(core.add_request(req))
        while core.has_unfinished():
            core.step()
        return [core.take_result(i) for i in ids]

    got, want = run(tiny), run(roomy)
    assert tiny._core.stats().engine.num_preemptions > 0
    vocab = tiny.model_config.vocab_size
    # Equal up to fp32 rounding (a recompute runs the rows through GEMMs of other shapes): within
    # 1e-5 of each array's scale.
    def close(a, b):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.max(np.abs(b))))

    for g, w, p, f in zip(got, want, prompts, forced):
        assert list(g.token_ids) == list(w.token_ids) == f + [0]
        lg, lw = g.logits(vocab), w.logits(vocab)
        assert lg.shape == lw.shape == (len(p) + len(f), vocab)
        close(lg, lw)
        tg, tw = g.taps(1).reshape(len(p) + len(f), -1), w.taps(1).reshape(len(p) + len(f), -1)
        close(tg, tw)
    # The same rows as the helper's single request (one prefill, then one decode step per token).
    logits, _, _ = forced_run(roomy, prompts[0], forced[0])
    close(want[0].logits(vocab), logits)
    assert_no_leaks(tiny)


@pytest.mark.parametrize("draft", [None, "dflash"])
def test_request_that_never_fits_is_value_error_and_disturbs_nothing(target, drafters, draft):
    sess = _session(target, drafters, draft, "auto", **TINY)
    big = list(range(3, 90))  # 87 tokens: more than the whole cache of 80
    with pytest.raises(ValueError, match=r"needs \d+ KV cache slots.*holds only 80 \(the prompt alone does not fit\)"):
        sess.generate([big], dflash.SamplingParams(max_tokens=1))
    assert_no_leaks(sess)
    # Prompt + max_tokens beyond the cache: it could not finish even alone.
    with pytest.raises(ValueError, match=r"needs \d+ KV cache slots \(prompt 40 \+ max_tokens 60.*raise kv_cache_tokens or lower max_tokens"):
        sess.generate([list(range(3, 43))], dflash.SamplingParams(max_tokens=60))
    assert_no_leaks(sess)
    # Submitted while other requests run (and are being preempted): they finish unchanged.
    prompts = _prompts(6, seed=7)
    params = _params(len(prompts), 0.9)
    want = _ids(_session(target, drafters, draft, "auto", **ROOMY), prompts, params)
    core = sess._core
    ids = []
    for p, prm in zip(prompts, params):
        req = _core.RequestInput()
        req.prompt, req.sampling = p, sess._sampling_config(prm)
        ids.append(core.add_request(req))
    for _ in range(3):
        core.step()
    req = _core.RequestInput()
    req.prompt = big
    with pytest.raises(ValueError, match=r"the prompt alone does not fit"):
        core.add_request(req)
    while core.has_unfinished():
        core.step()
    assert [list(core.take_result(i).token_ids) for i in ids] == want
    assert core.stats().engine.num_preemptions > 0
    assert_no_leaks(sess)


def test_abort_while_requests_are_preempted_frees_everything(target, drafters):
    sess = _session(target, drafters, "dflash", "auto", **TINY)
    core = sess._core
    prompts = _prompts(8, seed=8)
    ids = []
    for p, prm in zip(prompts, _params(len(prompts), 0.9)):
        req = _core.RequestInput()
        req.prompt, req.sampling = p, sess._sampling_config(prm)
        ids.append(core.add_request(req))
    while core.stats().engine.num_preemptions == 0:
        assert core.has_unfinished()
        core.step()
    for i in ids:
        core.abort(i)
    results = [core.take_result(i) for i in ids]
    # Preempted requests kept their generated tokens and return them when aborted.
    assert any(r.metrics.num_preemptions > 0 and len(r.token_ids) > 0 for r in results)
    assert all(r.finish_reason in ("abort", "length", "stop") for r in results)
    assert_no_leaks(sess)

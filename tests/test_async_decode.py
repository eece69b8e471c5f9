# tests/test_async_decode.py
#
# Pipelined target-only decoding (Session(..., async_decode=True), EngineOptions::async_decode)
# on the CPU backend, which runs the same engine and decode programs as CUDA (there the ops run
# as they are issued, so nothing overlaps, but every bookkeeping path is the same): each step
# launches the next one, whose anchors come from this step's tokens through the device-side
# feed, before its own tokens are read. The outputs must equal ordinary decoding exactly:
# greedy and seeded sampling; requests that end at a stop token the pipeline could not foresee
# (their extra row is dropped); max_tokens; continuous batching (arrivals stop the pipeline
# until they are admitted); stop strings and aborts (which drain the step in flight first); no KV
# block leaks. (Pipelined speculative decoding: tests/test_async_spec_decode.py; padded batches
# and graphs: tests/gpu.)
from __future__ import annotations

import numpy as np
import pytest

import dflash
from dflash import _core

NAMES = ["llama_gqa", "qwen3"]


def _prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 300, size=int(rng.integers(3, 25)))] for _ in range(n)]


def _sessions(target, **kw):
    base = dict(device="cpu", num_threads=2, kv_cache_tokens=4096, max_num_seqs=8)
    base.update(kw)
    return dflash.Session(target, async_decode=True, **base), dflash.Session(target, **base)


def _run(sess, prompts, params):
    return [(o.token_ids, o.finish_reason) for o in sess.generate(prompts, params)]


def _stop_tokens(sess, prompts):
    """Token ids that greedy decoding emits in the middle of some outputs (so requests end at an
    unforeseeable step)."""
    outs = sess.generate(prompts, dflash.SamplingParams(max_tokens=30, ignore_eos=True))
    mids = [o.token_ids[len(o.token_ids) // 2] for o in outs[:3]]
    return sorted(set(mids))


@pytest.mark.parametrize("name", NAMES)
def test_async_equals_sync(name, tiny_model_dirs):
    on, off = _sessions(tiny_model_dirs[name])
    prompts = _prompts(6, seed=1)
    stops = _stop_tokens(off, prompts)
    for temperature in (0.0, 0.8):
        params = [dflash.SamplingParams(max_tokens=10 + 7 * (i % 3), temperature=temperature, seed=50 + i,
                                        stop_token_ids=stops) for i in range(len(prompts))]
        assert _run(on, prompts, params) == _run(off, prompts, params), f"{name} T={temperature}"
    s_on, s_off = on.stats(), off.stats()
    print(f"{name}: pipelined steps {s_on['pipelined_steps']}, dropped rows {s_on['dropped_rows']}")
    assert s_on["pipelined_steps"] > 0 and s_on["dropped_rows"] > 0
    assert s_off["pipelined_steps"] == 0
    for s in (s_on, s_off):
        assert s["num_free_blocks"] == s["num_blocks"]


def test_async_with_arrivals(tiny_model_dirs):
    """max_num_seqs 2 with 5 prompts: requests are admitted while others decode (the pipeline
    stops for each arrival and starts again)."""
    on, off = _sessions(tiny_model_dirs["llama_gqa"], max_num_seqs=2)
    prompts = _prompts(5, seed=2)
    params = [dflash.SamplingParams(max_tokens=8 + 5 * i, temperature=0.7 * (i % 2), seed=9 + i, ignore_eos=True)
              for i in range(5)]
    assert _run(on, prompts, params) == _run(off, prompts, params)
    assert on.stats()["pipelined_steps"] > 0


def test_async_stop_strings_and_abort(tiny_model_dirs):
    target = tiny_model_dirs["qwen3"]
    on, off = _sessions(target)
    prompts = _prompts(4, seed=3)
    # stop strings: the Python side aborts the request while a step is in flight (drained first)
    texts = [o.text for o in off.generate(prompts, dflash.SamplingParams(max_tokens=24, ignore_eos=True))]
    stops = [t[len(t) // 2: len(t) // 2 + 2] for t in texts if len(t) > 4][:2]
    params = dflash.SamplingParams(max_tokens=24, ignore_eos=True, stop=stops)
    got = [(o.token_ids, o.text, o.finish_reason) for o in on.generate(prompts, params)]
    want = [(o.token_ids, o.text, o.finish_reason) for o in off.generate(prompts, params)]
    assert got == want
    # abort through the core API in the middle of pipelined decoding
    ids = []
    for p in prompts:
        req = _core.RequestInput()
        req.prompt = p
        sc = _core.SamplingConfig()
        sc.max_tokens, sc.ignore_eos = 20, True
        req.sampling = sc
        ids.append(on._core.add_request(req))
    seen = {i: [] for i in ids}
    steps = 0
    while on._core.has_unfinished():
        for out in on._core.step():
            seen[out.request_id].extend(out.new_tokens)
        steps += 1
        if steps == 4:
            assert on._core.abort(ids[1])
    results = {i: on._core.take_result(i) for i in ids}
    assert results[ids[1]].finish_reason == "abort"
    alone = off.generate([prompts[0], prompts[2], prompts[3]], dflash.SamplingParams(max_tokens=20, ignore_eos=True))
    for i, o in zip([ids[0], ids[2], ids[3]], alone):
        assert list(results[i].token_ids) == o.token_ids == seen[i]
    assert on.stats()["num_free_blocks"] == on.stats()["num_blocks"]


def test_async_decode_must_be_a_bool(tiny_model_dirs):
    with pytest.raises(ValueError, match="True or False"):
        dflash.Session(tiny_model_dirs["qwen3"], device="cpu", async_decode=1)


def test_async_with_padded_batches(tiny_model_dirs):
    """The CUDA path pads decode steps to the graph sizes (the CPU's pad_decode_batches test
    hook does the same): pipelined steps over padded batches (padding rows take no fed anchor)
    equal unpadded synchronous decoding while the batch shrinks (3 of 5 requests)."""
    target = tiny_model_dirs["qwen3"]

    def run(pad, async_decode):
        cfg = _core.SessionConfig()
        cfg.num_threads, cfg.max_num_seqs, cfg.kv_cache_tokens = 2, 8, 4096
        cfg.pad_decode_batches, cfg.async_decode = pad, async_decode
        sess = _core.Session(str(target), cfg)
        ids = []
        for i, p in enumerate(_prompts(5, seed=4)):
            req = _core.RequestInput()
            req.prompt = p
            sc = _core.SamplingConfig()
            sc.max_tokens, sc.temperature, sc.seed, sc.ignore_eos = 6 + 5 * i, 0.6 * (i % 2), 20 + i, True
            req.sampling = sc
            ids.append(sess.add_request(req))
        while sess.has_unfinished():
            sess.step()
        st = sess.stats()
        assert st.num_free_blocks == st.num_blocks
        return [list(sess.take_result(i).token_ids) for i in ids], st.engine.pipelined_steps

    want, _ = run(False, False)
    got, pipelined = run(True, True)
    assert got == want and pipelined > 0

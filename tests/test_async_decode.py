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
from tests.runtime_helpers import check_padded_pipelined_equals_sync, check_stop_strings_and_abort

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
    check_stop_strings_and_abort(on, off, prompts)


def test_async_decode_must_be_a_bool(tiny_model_dirs):
    with pytest.raises(ValueError, match="True or False"):
        dflash.Session(tiny_model_dirs["qwen3"], device="cpu", async_decode=1)


def test_async_with_padded_batches(tiny_model_dirs):
    """Pipelined steps over padded batches (padding rows take no fed anchor), as CUDA runs them."""
    check_padded_pipelined_equals_sync(tiny_model_dirs["qwen3"], _prompts(5, seed=4))

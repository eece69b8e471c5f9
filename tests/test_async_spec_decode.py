# tests/test_async_spec_decode.py
#
# Pipelined speculative decoding (Session(..., draft=..., async_decode=True)) on the CPU backend,
# which runs the same engine and decode programs as CUDA (nothing overlaps there, but every
# bookkeeping path is the same): each speculative step launches the next one before its own
# outputs are read; the next step was staged as if nothing had been accepted and is moved on, on
# the device, by the accepted count + 1 of the step before, its anchor that step's next token
# (Backend::feed_spec_inputs). The outputs must equal ordinary speculative decoding exactly, and
# so must the acceptance counters: DFlash (greedy and probabilistic drafts) and DFlash2 drafters,
# greedy and seeded sampling, requests that end at a stop token or at max_tokens inside a run of
# accepted drafts (their extra row is dropped), arrivals that stop the pipeline, aborts and stop
# strings (which drain the step in flight), padded batches, no KV block leaks; and with the
# shipped SmolLM2 pair, whose drafts are accepted (shifts of several positions). GPU and graphs:
# tests/gpu/test_cuda_async_decode.py.
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import dflash
from dflash import _core
from tests.runtime_helpers import (check_padded_pipelined_equals_sync, check_stop_strings_and_abort, core_generate,
                                   small_dflash2)

NAMES = ["llama_gqa", "qwen3"]


def _prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 300, size=int(rng.integers(3, 25)))] for _ in range(n)]


def _drafter(tmp_path, target, kind):
    if kind == "dflash2":
        return small_dflash2(tmp_path, target)
    from dflash.drafter_format import write_dflash_drafter

    cfg = json.loads((target / "config.json").read_text())
    return write_dflash_drafter(tmp_path / "d", target_config=cfg, num_layers=1, target_layer_ids=[0, 1],
                                block_size=4)


def _sessions(target, draft, **kw):
    base = {"device": "cpu", "num_threads": 2, "kv_cache_tokens": 4096, "max_num_seqs": 8, "draft": str(draft)}
    base.update(kw)
    return dflash.Session(target, async_decode=True, **base), dflash.Session(target, **base)


def _run(sess, prompts, params):
    return [(o.token_ids, o.finish_reason, o.metrics.num_spec_steps, o.metrics.num_accepted)
            for o in sess.generate(prompts, params)]


COUNTERS = ("num_spec_steps", "num_drafted", "num_accepted", "accepted_per_position", "num_generated_tokens",
            "num_forward_tokens")


def _assert_same_counters(on, off):
    s_on, s_off = on.stats(), off.stats()
    assert s_on["async_decode"] is True and s_off["async_decode"] is False
    assert {k: s_on[k] for k in COUNTERS} == {k: s_off[k] for k in COUNTERS}
    assert s_on["pipelined_steps"] > 0 and s_off["pipelined_steps"] == 0
    for s in (s_on, s_off):
        assert s["num_free_blocks"] == s["num_blocks"]
    return s_on


@pytest.mark.parametrize("kind,draft_sampling,n", [("dflash", "greedy", None), ("dflash", "probabilistic", None),
                                                   ("dflash", "auto", 1), ("dflash2", None, None),
                                                   ("dflash2", "greedy", 2)])
@pytest.mark.parametrize("name", NAMES)
def test_async_spec_equals_sync(name, kind, draft_sampling, n, tiny_model_dirs, tmp_path):
    """n: fewer drafts per step than the drafter's block (None: block_size - 1)."""
    target = tiny_model_dirs[name]
    extra = {"draft_sampling": draft_sampling} if draft_sampling else {}
    if n is not None:
        extra["num_speculative_tokens"] = n
    on, off = _sessions(target, _drafter(tmp_path, target, kind), **extra)
    prompts = _prompts(6, seed=1)
    probe = dflash.SamplingParams(max_tokens=30, ignore_eos=True)
    greedy = off.generate(prompts, probe)
    assert [o.token_ids for o in on.generate(prompts, probe)] == [o.token_ids for o in greedy]
    stops = sorted({o.token_ids[len(o.token_ids) // 2] for o in greedy[:3]})  # ends no step can foresee
    for temperature in (0.0, 0.8):
        params = [dflash.SamplingParams(max_tokens=10 + 7 * (i % 3), temperature=temperature, seed=50 + i,
                                        stop_token_ids=stops) for i in range(len(prompts))]
        assert _run(on, prompts, params) == _run(off, prompts, params), f"{name} {kind} T={temperature}"
    st = _assert_same_counters(on, off)
    assert st["dropped_rows"] > 0


DFLASH2_CANDIDATE = Path(__file__).resolve().parent.parent / "drafters" / "SmolLM2-135M-Instruct-DFlash2-candidate"


@pytest.mark.parametrize("drafter", ["shipped", "dflash2_candidate"])
def test_shipped_pair_accepts_and_matches(drafter):
    """SmolLM2-135M with the shipped drafter (and the repository's trained DFlash2 candidate):
    drafts are accepted (the device moves requests on by several positions a step), and the
    outputs, finish reasons and acceptance equal synchronous speculative decoding, greedy and
    sampled, with requests ending at EOS and at max_tokens."""
    from dflash.default_model import SHIPPED_DRAFTER_DIR, default_model_dir

    model = default_model_dir()
    tok = dflash.Session(model, device="cpu", draft="none").tokenizer
    questions = ["Tom has 3 boxes with 12 pencils each. He gives 7 pencils to his sister. How many are left?",
                 "Write the numbers from 1 to 20 separated by commas.",
                 "What is the capital of France? Answer in one sentence.", "List three colors of the rainbow."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True),
                          add_special_tokens=False) for q in questions]
    draft_dir = SHIPPED_DRAFTER_DIR if drafter == "shipped" else DFLASH2_CANDIDATE
    on, off = _sessions(model, draft_dir, max_model_len=1024, max_num_seqs=4)
    for temperature in (0.0, 0.8):
        params = [dflash.SamplingParams(max_tokens=20 + 9 * i, temperature=temperature, seed=7 + i)
                  for i in range(len(prompts))]
        got, want = _run(on, prompts, params), _run(off, prompts, params)
        assert got == want, f"T={temperature}"
        assert {r[1] for r in got} == {"stop", "length"}
    st = _assert_same_counters(on, off)
    assert st["acceptance_length"] > 1.5


def test_async_spec_near_max_model_len(tiny_model_dirs, tmp_path):
    """Requests that run into max_model_len (max_tokens capped by it): a pipelined step could
    reach past the decode programs' keys, so such a request gets a step of its own there; the
    outputs still equal synchronous decoding."""
    target = tiny_model_dirs["qwen3"]
    on, off = _sessions(target, _drafter(tmp_path, target, "dflash2"), max_model_len=48, block_size=4)
    prompts = _prompts(4, seed=6)
    params = [dflash.SamplingParams(max_tokens=100, temperature=0.5 * (i % 2), seed=3 + i, ignore_eos=True)
              for i in range(len(prompts))]
    got = _run(on, prompts, params)
    assert got == _run(off, prompts, params)
    assert all(len(p) + len(g[0]) == 48 and g[1] == "length" for p, g in zip(prompts, got))
    _assert_same_counters(on, off)


def test_shipped_pair_adaptive_schedule():
    """The shipped SmolLM2 pair under a forced adaptive schedule mixing AR steps (n = 0) and draft
    lengths 1 / 3 / 7, pipelined and not: the same outputs, greedy and sampled. Drafts are
    accepted here, so a step after an AR step moves on only if that step left its accepted count
    at zero (the random drafters of the other tests accept almost nothing)."""
    from dflash.default_model import SHIPPED_DRAFTER_DIR, default_model_dir

    model = default_model_dir()
    tok = dflash.Session(model, device="cpu", draft="none").tokenizer
    questions = ["Write the numbers from 1 to 30 separated by commas.",
                 "Tom has 3 boxes with 12 pencils each. He gives 7 pencils to his sister. How many are left?"]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True),
                          add_special_tokens=False) for q in questions]

    def run(async_decode, temperature):
        cfg = _core.SessionConfig()
        cfg.num_threads, cfg.max_num_seqs, cfg.kv_cache_tokens, cfg.max_model_len = 2, 4, 4096, 1024
        cfg.draft_dir, cfg.speculation, cfg.async_decode = str(SHIPPED_DRAFTER_DIR), "adaptive", async_decode
        cfg.spec_cost_table = [[1, 1.0, 1.0, 1.0, 1.0]]
        cfg.spec_length_schedule = [0, 7, 3, 0, 7, 1, 7, 7]
        sess = _core.Session(str(model), cfg)
        tokens = core_generate(sess, prompts, lambda i: {
            "max_tokens": 40, "temperature": temperature, "seed": 11 + i, "ignore_eos": True})
        return tokens, sess.stats().engine

    for temperature in (0.0, 0.8):
        (got, e_on), (want, e_off) = run(True, temperature), run(False, temperature)
        assert got == want, f"T={temperature}"
        assert e_on.pipelined_steps > 0 and e_on.num_accepted > 0 and e_on.num_accepted == e_off.num_accepted


def test_async_spec_with_arrivals(tiny_model_dirs, tmp_path):
    """max_num_seqs 2 with 5 prompts: requests are admitted while others decode (the pipeline
    stops for each arrival, whose prefill runs first, and starts again)."""
    target = tiny_model_dirs["llama_gqa"]
    on, off = _sessions(target, _drafter(tmp_path, target, "dflash"), max_num_seqs=2)
    prompts = _prompts(5, seed=2)
    params = [dflash.SamplingParams(max_tokens=8 + 5 * i, temperature=0.7 * (i % 2), seed=9 + i, ignore_eos=True)
              for i in range(5)]
    assert _run(on, prompts, params) == _run(off, prompts, params)
    _assert_same_counters(on, off)


def test_async_spec_stop_strings_and_abort(tiny_model_dirs, tmp_path):
    target = tiny_model_dirs["qwen3"]
    on, off = _sessions(target, _drafter(tmp_path, target, "dflash2"))
    prompts = _prompts(4, seed=3)
    check_stop_strings_and_abort(on, off, prompts)
    assert on.stats()["pipelined_steps"] > 0


def test_async_spec_with_padded_batches(tiny_model_dirs, tmp_path):
    """Pipelined speculative steps over padded batches (padding rows are not fed), as CUDA runs them."""
    target = tiny_model_dirs["qwen3"]
    check_padded_pipelined_equals_sync(target, _prompts(5, seed=4), _drafter(tmp_path, target, "dflash"))


def test_async_with_adaptive_speculation(tiny_model_dirs, tmp_path):
    """Adaptive speculation pipelined: with a forced draft-length schedule (AR steps, n = 0, among
    draft-verify steps of several lengths) the k-th decode step drafts the same length as without
    pipelining, so greedy and seeded outputs equal synchronous decoding; under the policy itself
    (whose choice for a pipelined step sees one step less of acceptance) greedy output still
    equals target-only decoding."""
    target = tiny_model_dirs["qwen3"]
    draft = _drafter(tmp_path, target, "dflash")  # block 4: lengths 0..3
    prompts = _prompts(6, seed=8)
    schedule = [0, 3, 1, 0, 2, 3, 3, 0]

    def core(async_decode):
        cfg = _core.SessionConfig()
        cfg.num_threads, cfg.max_num_seqs, cfg.kv_cache_tokens = 2, 8, 4096
        cfg.draft_dir, cfg.speculation, cfg.async_decode = str(draft), "adaptive", async_decode
        cfg.draft_lengths, cfg.spec_cost_table = [0, 1, 2, 3], [[1, 1.0, 1.0, 1.0, 1.0]]
        cfg.spec_length_schedule = schedule
        return _core.Session(str(target), cfg)

    for temperature in (0.0, 0.8):
        runs = []
        for async_decode in (True, False):
            sess = core(async_decode)
            runs.append(core_generate(sess, prompts, lambda i, t=temperature: {
                "max_tokens": 10 + 4 * i, "temperature": t, "seed": 30 + i, "ignore_eos": True}))
            if async_decode:
                e = sess.stats().engine
                assert e.pipelined_steps > 0 and e.spec_length_steps[0] > 0
        assert runs[0] == runs[1], f"T={temperature}"
    # the policy on a table where speculation pays for one request, not for three or more
    table = {"batch_sizes": [1, 3], "lengths": [0, 1, 3], "seconds": [[1.0, 1.0, 1.0], [1.0, 6.0, 6.0]]}
    on = dflash.Session(target, device="cpu", num_threads=2, kv_cache_tokens=4096, draft=str(draft),
                        speculation="adaptive", spec_cost_table=table, async_decode=True)
    plain = dflash.Session(target, device="cpu", num_threads=2, kv_cache_tokens=4096, draft="none")
    params = [dflash.SamplingParams(max_tokens=8 + 6 * i, ignore_eos=True) for i in range(len(prompts))]
    assert [o.token_ids for o in on.generate(prompts, params)] == [o.token_ids for o in plain.generate(prompts, params)]
    st = on.stats()
    assert st["pipelined_steps"] > 0 and st["num_free_blocks"] == st["num_blocks"]
    assert st["spec_length_steps"][0] > 0 and sum(st["spec_length_steps"].values()) > st["spec_length_steps"][0]

# tests/test_dflash_runtime.py
#
# DFlash speculative decoding in the C++ runtime (CPU, fp32):
# - Session.propose equals the plain-PyTorch reference (tests/reference) on random drafters,
#   Llama and Qwen3 targets, several target_layer_ids including the last layer;
# - lossless greedy: speculative output == target-only greedy output, batch 1 and 8;
# - high acceptance through the oracle-draft hook: full-block acceptance, KV truncation, a
#   stop token and EOS inside an accepted run, exact max_tokens;
# - the per-request and per-session metrics; seeded sampling alone vs in a batch;
# - every KV block returned after each test.
from __future__ import annotations

import json

import numpy as np
import pytest

import dflash
from dflash.drafter_format import write_dflash_drafter
from tests.fixtures.tiny_models import write_tiny_model, PRESETS
from tests.reference.dflash_reference import load_drafter, propose_ref, spec_generate_ref
from tests.runtime_helpers import assert_no_leaks, oracle_run


def _prompts(n, seed=0, lo=3, hi=20):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 352, size=int(rng.integers(lo, hi)))] for _ in range(n)]


def _drafter(tmp_path, target_dir, name="draft", **kw):
    cfg = json.loads((target_dir / "config.json").read_text())
    return write_dflash_drafter(tmp_path / name, target_config=cfg, **kw)


@pytest.mark.parametrize("preset,layer_ids,num_layers,block", [
    ("llama_gqa", [0, 1], 1, 8),        # the last target layer among the taps
    ("llama_gqa", [1], 2, 4),           # only the last layer
    ("qwen3", [0], 2, 6),
    ("qwen3", [1, 0], 1, 16),           # order matters: fc input follows the list
    ("llama_mqa_tied", [0, 1], 2, 8),
])
def test_propose_matches_reference(tmp_path, tiny_model_dirs, hf_model, preset, layer_ids, num_layers, block):
    target = tiny_model_dirs[preset]
    dr = _drafter(tmp_path, target, num_layers=num_layers, target_layer_ids=layer_ids, block_size=block, seed=3)
    sess = dflash.Session(target, draft=dr, device="cpu", num_threads=2)
    ref_drafter = load_drafter(dr)
    model = hf_model(target)
    for prompt in _prompts(3, seed=len(layer_ids) + block):
        ids, logits = sess.propose(prompt)
        ref_ids, ref_logits = propose_ref(model, ref_drafter, prompt)
        assert ids.shape == (block - 1,) and logits.shape == (block - 1, model.config.vocab_size)
        err = float(np.max(np.abs(logits - ref_logits.numpy())))
        assert err <= 1e-4, err
        assert ids.tolist() == ref_ids.tolist()
    assert_no_leaks(sess)


def test_propose_with_fewer_speculative_tokens(tmp_path, tiny_model_dirs, hf_model):
    target = tiny_model_dirs["qwen3"]
    dr = _drafter(tmp_path, target, num_layers=1, target_layer_ids=[0, 1], block_size=8)
    sess = dflash.Session(target, draft=dr, num_speculative_tokens=3, num_threads=2)
    ids, logits = sess.propose(_prompts(1, seed=9)[0])
    ref_ids, ref_logits = propose_ref(hf_model(target), load_drafter(dr), _prompts(1, seed=9)[0], num_spec=3)
    assert ids.tolist() == ref_ids.tolist()
    assert np.max(np.abs(logits - ref_logits.numpy())) <= 1e-4


@pytest.mark.parametrize("preset", ["llama_gqa", "qwen3", "llama3_rope"])
def test_greedy_speculative_equals_target_greedy(tmp_path, tiny_model_dirs, preset):
    target = tiny_model_dirs[preset]
    dr = _drafter(tmp_path, target, num_layers=2, target_layer_ids=[0, 1], block_size=6, seed=1)
    spec = dflash.Session(target, draft=dr, num_threads=2)
    ar = dflash.Session(target, num_threads=2)
    prompts = _prompts(8, seed=11)
    params = [dflash.SamplingParams(max_tokens=10 + 4 * i) for i in range(8)]
    batch = spec.generate(prompts, params)
    expect = ar.generate(prompts, params)
    assert [o.token_ids for o in batch] == [o.token_ids for o in expect]
    alone = spec.generate(prompts[:1], params[0])[0]
    assert alone.token_ids == expect[0].token_ids
    for o in batch:
        m = o.metrics
        assert m.num_spec_steps >= 1 and m.num_drafted == 5 * m.num_spec_steps
        assert len(m.accepted_per_position) == 5 and sum(m.accepted_per_position) == m.num_accepted
        assert m.acceptance_length >= 1.0
    assert_no_leaks(spec)


def test_matches_reference_loop(tmp_path, tiny_model_dirs, hf_model):
    target = tiny_model_dirs["llama_mha"]
    dr = _drafter(tmp_path, target, num_layers=1, target_layer_ids=[1], block_size=4, seed=2)
    sess = dflash.Session(target, draft=dr, num_threads=2)
    prompt = _prompts(1, seed=12)[0]
    out = sess.generate([prompt], dflash.SamplingParams(max_tokens=25))[0]
    ref_tokens, ref_steps = spec_generate_ref(hf_model(target), load_drafter(dr), prompt, 25,
                                              eos_ids=sess.model_config.eos_token_ids)
    assert out.token_ids == ref_tokens
    assert out.metrics.num_spec_steps == len(ref_steps)
    assert out.metrics.num_accepted >= sum(ref_steps)


def test_oracle_drafts_full_acceptance_and_exact_max_tokens(tmp_path, tiny_model_dirs):
    target = tiny_model_dirs["llama_gqa"]
    dr = _drafter(tmp_path, target, num_layers=1, target_layer_ids=[0, 1], block_size=8)
    spec = dflash.Session(target, draft=dr, num_threads=2, draft_sampling="greedy")
    ar = dflash.Session(target, num_threads=2)
    prompt = _prompts(1, seed=13)[0]
    full = ar.generate([prompt], dflash.SamplingParams(max_tokens=40, stop_token_ids=[]))[0].token_ids
    eos = set(spec.model_config.eos_token_ids)
    cut = next((i for i, t in enumerate(full) if t in eos), len(full) - 1) + 1
    for max_tokens in (1, 2, 8, 9, 17, min(cut, 40)):
        r = oracle_run(spec, [prompt], [full], max_tokens=max_tokens)[0]
        assert list(r.token_ids) == full[:min(max_tokens, cut)]
        m = r.metrics
        # Every step except possibly the last accepted the whole block of 7.
        if m.num_spec_steps > 1:
            assert m.num_accepted >= 7 * (m.num_spec_steps - 1)
        assert len(r.token_ids) == 1 + m.num_spec_emitted
    assert_no_leaks(spec)


def test_stop_token_and_eos_inside_an_accepted_run(tmp_path, tiny_model_dirs):
    # Build a target whose EOS is a token that its greedy continuation emits mid-way.
    base = tiny_model_dirs["qwen3"]
    ar = dflash.Session(base, num_threads=2)
    prompt = _prompts(1, seed=14)[0]
    full = ar.generate([prompt], dflash.SamplingParams(max_tokens=30, stop_token_ids=[]))[0].token_ids
    stop_at = 5
    stop_tok = full[stop_at]
    first = full.index(stop_tok)
    dr = _drafter(tmp_path, base, num_layers=1, target_layer_ids=[0, 1], block_size=8)
    spec = dflash.Session(base, draft=dr, num_threads=2, draft_sampling="greedy")
    # A stop token id inside a fully accepted block.
    r = oracle_run(spec, [prompt], [full], max_tokens=30, stop_token_ids=[stop_tok])[0]
    assert list(r.token_ids) == full[:first + 1] and r.finish_reason == "stop"

    # EOS from generation_config inside an accepted run: same weights, EOS = that token.
    spec_kw = dict(PRESETS["qwen3"])
    spec_kw["eos_token_id"] = stop_tok
    eos_target = write_tiny_model(tmp_path / "eos_target", **spec_kw)
    eos_ar = dflash.Session(eos_target, num_threads=2)
    eos_full = eos_ar.generate([prompt], dflash.SamplingParams(max_tokens=30))[0]
    assert eos_full.token_ids == full[:first + 1] and eos_full.finish_reason == "stop"
    dr2 = _drafter(tmp_path, eos_target, name="draft2", num_layers=1, target_layer_ids=[0, 1], block_size=8)
    eos_spec = dflash.Session(eos_target, draft=dr2, num_threads=2, draft_sampling="greedy")
    r = oracle_run(eos_spec, [prompt], [full], max_tokens=30)[0]
    assert list(r.token_ids) == full[:first + 1] and r.finish_reason == "stop"
    assert r.metrics.num_accepted >= min(first, 7)
    assert_no_leaks(spec)
    assert_no_leaks(eos_spec)


def test_partially_wrong_oracle_truncates_kv(tmp_path, tiny_model_dirs):
    # Drafts right except every 4th: ragged acceptance, rollback of the rejected K/V.
    target = tiny_model_dirs["llama_gqa"]
    dr = _drafter(tmp_path, target, num_layers=1, target_layer_ids=[0, 1], block_size=8)
    spec = dflash.Session(target, draft=dr, num_threads=2, draft_sampling="greedy")
    ar = dflash.Session(target, num_threads=2)
    prompts = _prompts(5, seed=15)
    expect = [o.token_ids for o in ar.generate(prompts, dflash.SamplingParams(max_tokens=32, stop_token_ids=[]))]
    wrong = [[t if (i + k) % 4 else (t + 1) % 352 for i, t in enumerate(full)] for k, full in enumerate(expect)]
    for r, full in zip(oracle_run(spec, prompts, wrong, max_tokens=32), expect):
        eos = set(spec.model_config.eos_token_ids)
        cut = next((i + 1 for i, t in enumerate(full) if t in eos), len(full))
        assert list(r.token_ids) == full[:cut]
        assert 0 < r.metrics.num_accepted < r.metrics.num_drafted
    assert_no_leaks(spec)


def test_seeded_sampling_same_alone_and_in_batch(tmp_path, tiny_model_dirs):
    target = tiny_model_dirs["llama_gqa"]
    dr = _drafter(tmp_path, target, num_layers=1, target_layer_ids=[0, 1], block_size=4)
    spec = dflash.Session(target, draft=dr, num_threads=2)
    prompts = _prompts(6, seed=16)
    params = [dflash.SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=50 + i) for i in range(6)]
    batch = spec.generate(prompts, params)
    assert [o.token_ids for o in batch] == [o.token_ids for o in spec.generate(prompts, params)]
    for p, prm, o in zip(prompts, params, batch):
        assert spec.generate([p], prm)[0].token_ids == o.token_ids
    assert_no_leaks(spec)


def test_session_metrics_and_stats(tmp_path, tiny_model_dirs):
    target = tiny_model_dirs["llama_gqa"]
    dr = _drafter(tmp_path, target, num_layers=1, target_layer_ids=[0, 1], block_size=5)
    spec = dflash.Session(target, draft=dr, num_threads=2)
    outs = spec.generate(_prompts(3, seed=17), dflash.SamplingParams(max_tokens=12))
    st = spec.stats()
    assert st["num_speculative_tokens"] == 4 and st["draft_weight_bytes"] > 0 and st["draft_kv_cache_bytes"] > 0
    assert st["num_spec_steps"] == sum(o.metrics.num_spec_steps for o in outs)
    assert st["num_drafted"] == 4 * st["num_spec_steps"]
    assert st["accepted_per_position"] == [sum(x) for x in zip(*(o.metrics.accepted_per_position for o in outs))]
    assert st["acceptance_length"] >= 1.0


def test_bf16_drafter_like_published_checkpoints(tmp_path, tiny_model_dirs, hf_model):
    # z-lab drafters are stored in bfloat16; the runtime reads them (fp32 on the CPU).
    target = tiny_model_dirs["qwen3"]
    dr = _drafter(tmp_path, target, num_layers=2, target_layer_ids=[0, 1], block_size=8, dtype="bfloat16")
    cfg = json.loads((dr / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and "dflash_config" in cfg
    sess = dflash.Session(target, draft=dr, num_threads=2)
    prompt = _prompts(1, seed=21)[0]
    ids, logits = sess.propose(prompt)
    ref_ids, ref_logits = propose_ref(hf_model(target), load_drafter(dr), prompt)
    assert ids.tolist() == ref_ids.tolist()
    assert np.max(np.abs(logits - ref_logits.numpy())) <= 1e-4


def test_default_target_layer_ids_rule(tmp_path, tiny_model_dirs, hf_model):
    # Without dflash_config.target_layer_ids the published rule picks them from num_target_layers.
    target = tiny_model_dirs["llama_gqa"]
    dr = _drafter(tmp_path, target, num_layers=1, block_size=4)  # rule for (2 layers, 1 draft layer) -> [1]
    cfg = json.loads((dr / "config.json").read_text())
    del cfg["dflash_config"]["target_layer_ids"]
    (dr / "config.json").write_text(json.dumps(cfg))
    sess = dflash.Session(target, draft=dr, num_threads=2)
    ref = load_drafter(dr)
    assert ref.target_layer_ids == [1]
    p = _prompts(1, seed=22)[0]
    ids, logits = sess.propose(p)
    ref_ids, ref_logits = propose_ref(hf_model(target), ref, p)
    assert ids.tolist() == ref_ids.tolist()
    assert np.max(np.abs(logits - ref_logits.numpy())) <= 1e-4


def test_sliding_window_layers_match_reference(tmp_path, tiny_model_dirs, hf_model):
    # layer_types / sliding_window are read and honoured: sliding layers attend causally within
    # the window (vLLM/SGLang semantics, as the reference implements them), full layers see all.
    target = tiny_model_dirs["qwen3"]
    dr = _drafter(tmp_path, target, num_layers=2, target_layer_ids=[0, 1], block_size=6,
                  layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    cfg = json.loads((dr / "config.json").read_text())
    assert cfg["layer_types"][0] == "sliding_attention" and cfg["sliding_window"] == 4
    sess = dflash.Session(target, draft=dr, num_threads=2)
    full = _drafter(tmp_path, target, name="full", num_layers=2, target_layer_ids=[0, 1], block_size=6)
    full_sess = dflash.Session(target, draft=full, num_threads=2)
    ref = load_drafter(dr)
    model = hf_model(target)
    for prompt in _prompts(3, seed=23, lo=8, hi=20):
        ids, logits = sess.propose(prompt)
        ref_ids, ref_logits = propose_ref(model, ref, prompt)
        assert np.max(np.abs(logits - ref_logits.numpy())) <= 1e-4
        assert ids.tolist() == ref_ids.tolist()
        # Same weights without the window give different logits: the window is really applied.
        _, logits_full = full_sess.propose(prompt)
        assert np.max(np.abs(logits - logits_full)) > 1e-3


def test_stop_string_inside_an_accepted_run_cuts_tokens_too(tmp_path, tiny_model_dirs):
    # With full acceptance a step emits many tokens; a stop string among them ends the text
    # before it and keeps only the tokens up to the one completing it.
    target = tiny_model_dirs["llama_gqa"]
    dr = _drafter(tmp_path, target, num_layers=1, target_layer_ids=[0, 1], block_size=8)
    spec = dflash.Session(target, draft=dr, num_threads=2, draft_sampling="greedy")
    ar = dflash.Session(target, num_threads=2)
    prompt = "the sea"
    params = dflash.SamplingParams(max_tokens=40, stop_token_ids=[])
    free = ar.generate(prompt, params)[0]
    # A stop string of plain characters from the middle of the output (random weights also emit
    # invalid UTF-8, which decodes to U+FFFD and is no stop string anyone writes).
    clean = [i for i in range(6, len(free.text) - 2) if all(c.isascii() and c.isprintable() for c in free.text[i:i + 2])]
    assert clean, free.text
    stop = free.text[clean[0]:clean[0] + 2]
    first = free.text.find(stop)
    want_text = free.text[:first]
    want = ar.generate(prompt, dflash.SamplingParams(max_tokens=40, stop_token_ids=[], stop=[stop]))[0]
    assert want.text == want_text

    def oracle(req):
        req.oracle_drafts = free.token_ids

    got = spec._generate(prompt, dflash.SamplingParams(max_tokens=40, stop_token_ids=[], stop=[stop]),
                         request_hooks=oracle)[0]
    assert got.text == want_text and got.finish_reason == "stop"
    assert got.token_ids == want.token_ids
    assert got.metrics.num_accepted > 0
    st = spec.stats()
    assert st["num_free_blocks"] == st["num_blocks"]

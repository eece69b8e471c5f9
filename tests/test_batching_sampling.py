# tests/test_batching_sampling.py
#
# Continuous batching and sampling on tiny models: a batch of different prompts equals each
# prompt alone (also when the KV cache or max_num_seqs forces requests to wait), seeded
# sampling is reproducible alone and in a batch, top-k / top-p restrict the support, the
# sampled distribution follows softmax(logits / T), and the allocator is full after each test.
from __future__ import annotations

import numpy as np
import pytest

import dflash
from tests.runtime_helpers import assert_no_leaks, forced_run


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 352, size=int(rng.integers(3, 20)))] for _ in range(n)]


@pytest.fixture(scope="module")
def sess(tiny_model_dirs):
    return dflash.Session(tiny_model_dirs["llama_gqa"], device="cpu", num_threads=2)


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3"])
def test_batch_of_different_prompts_equals_each_alone(name, tiny_model_dirs):
    s = dflash.Session(tiny_model_dirs[name], device="cpu", num_threads=2)
    prompts = _prompts(9, seed=1)
    params = [dflash.SamplingParams(max_tokens=5 + 3 * i) for i in range(len(prompts))]
    batched = s.generate(prompts, params)
    assert [o.prompt_token_ids for o in batched] == prompts
    for p, prm, out in zip(prompts, params, batched):
        alone = s.generate([p], prm)[0]
        assert alone.token_ids == out.token_ids
        assert alone.finish_reason == out.finish_reason
        assert len(out.token_ids) <= prm.max_tokens
    assert_no_leaks(s)


def test_continuous_batching_admits_waiting_requests(tiny_model_dirs):
    # A cache of 96 slots (6 blocks of 16) holds about two requests at a time; max_num_seqs 3.
    s = dflash.Session(tiny_model_dirs["llama_gqa"], device="cpu", kv_cache_tokens=96,
                       max_num_seqs=3, num_threads=2)
    big = dflash.Session(tiny_model_dirs["llama_gqa"], device="cpu", num_threads=2)
    prompts = _prompts(7, seed=2)
    params = dflash.SamplingParams(max_tokens=20)
    squeezed = s.generate(prompts, params)
    roomy = big.generate(prompts, params)
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in roomy]
    # Requests had to wait, so the squeezed session needed more steps.
    assert s.stats()["num_steps"] > big.stats()["num_steps"]
    assert_no_leaks(s)
    assert_no_leaks(big)


def test_max_tokens_is_exact_and_finish_reasons(sess):
    prompt = _prompts(1, seed=3)[0]
    for n in (1, 2, 7):
        out = sess.generate([prompt], dflash.SamplingParams(max_tokens=n, stop_token_ids=[]))[0]
        assert len(out.token_ids) <= n
        if out.finish_reason == "length":
            assert len(out.token_ids) == n
    # A stop token id: generation ends right after emitting it.
    free = sess.generate([prompt], dflash.SamplingParams(max_tokens=12))[0]
    target = free.token_ids[3]
    first = free.token_ids.index(target)
    out = sess.generate([prompt], dflash.SamplingParams(max_tokens=12, stop_token_ids=[target]))[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop"
    assert_no_leaks(sess)


def test_max_model_len_caps_generation(tiny_model_dirs):
    s = dflash.Session(tiny_model_dirs["llama_gqa"], device="cpu", max_model_len=16, num_threads=2)
    prompt = _prompts(1, seed=4)[0][:10]
    out = s.generate([prompt], dflash.SamplingParams(max_tokens=50, stop_token_ids=[]))[0]
    if out.finish_reason == "length":
        assert len(prompt) + len(out.token_ids) == 16
    assert_no_leaks(s)


def test_eos_from_generation_config_stops(tiny_model_dirs):
    # Teacher-force the EOS id (<|im_end|> = 2 in the fixtures) and check the engine stops on it.
    s = dflash.Session(tiny_model_dirs["llama_gqa"], device="cpu", num_threads=2)
    assert 2 in s.model_config.eos_token_ids
    from dflash import _core

    req = _core.RequestInput()
    req.prompt = [5, 6, 7]
    req.forced_tokens = [9, 2, 9, 9]
    sc = _core.SamplingConfig()
    sc.max_tokens = 10
    req.sampling = sc
    rid = s._core.add_request(req)
    while s._core.has_unfinished():
        s._core.step()
    r = s._core.take_result(rid)
    assert list(r.token_ids) == [9, 2] and r.finish_reason == "stop"
    assert_no_leaks(s)


def test_seeded_sampling_same_alone_and_in_batch(sess):
    prompts = _prompts(6, seed=5)
    params = [dflash.SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=100 + i)
              for i in range(len(prompts))]
    batched = sess.generate(prompts, params)
    again = sess.generate(prompts, params)
    assert [o.token_ids for o in batched] == [o.token_ids for o in again]
    for p, prm, out in zip(prompts, params, batched):
        assert sess.generate([p], prm)[0].token_ids == out.token_ids
    # Different seeds give different samples (overwhelmingly likely over 16 tokens at T=0.9).
    other = sess.generate(prompts[:1], dflash.SamplingParams(max_tokens=16, temperature=0.9, seed=7))[0]
    other2 = sess.generate(prompts[:1], dflash.SamplingParams(max_tokens=16, temperature=0.9, seed=8))[0]
    assert other.token_ids != other2.token_ids
    assert_no_leaks(sess)


def _next_token_probs(sess, prompt, temperature):
    logits, _, _ = forced_run(sess, prompt, [])
    z = logits[-1].astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return p / p.sum(), logits[-1]


def test_sampling_follows_softmax_and_filters(sess):
    prompt = _prompts(1, seed=6)[0]
    T = 1.3
    probs, logits = _next_token_probs(sess, prompt, T)
    n = 1500
    params = [dflash.SamplingParams(max_tokens=1, temperature=T, seed=s) for s in range(n)]
    firsts = np.array([o.token_ids[0] for o in sess.generate([prompt] * n, params)])
    # Chi-squared goodness of fit on the tokens with enough expected mass (the rest pooled).
    expected = probs * n
    big = expected >= 5
    obs = np.array([np.sum(firsts == t) for t in np.nonzero(big)[0]] + [np.sum(~big[firsts])])
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    chi2 = float(np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep]))
    dof = int(keep.sum()) - 1
    # 99.9 % quantile of chi-squared ~ dof + 3.1 * sqrt(2 dof) + 10 (generous, dof ~ 30-60)
    assert chi2 < dof + 3.1 * np.sqrt(2 * dof) + 10, (chi2, dof)

    top5 = set(np.argsort(-logits)[:5].tolist())
    params = [dflash.SamplingParams(max_tokens=1, temperature=T, top_k=5, seed=s) for s in range(300)]
    got = {o.token_ids[0] for o in sess.generate([prompt] * 300, params)}
    assert got <= top5 and len(got) >= 3

    order = np.argsort(-probs)
    cum = np.cumsum(probs[order])
    nucleus = set(order[: int(np.searchsorted(cum, 0.5) + 1)].tolist())
    params = [dflash.SamplingParams(max_tokens=1, temperature=T, top_p=0.5, seed=s) for s in range(300)]
    got = {o.token_ids[0] for o in sess.generate([prompt] * 300, params)}
    assert got <= nucleus
    assert_no_leaks(sess)

# tests/test_prefix_caching.py
#
# Prefix caching (CPU, fp32): full KV blocks are cached under the chain hash of their prefix and
# shared by later requests whose prompts start with them (the target's KV and the drafter's
# context KV, same block ids); unreferenced cached blocks are evicted least recently used first,
# only when the allocator needs blocks. Checked: the allocator's bookkeeping (reference counts,
# LRU order, evictable blocks counted as free, a hash cached once, lookups compare the key);
# outputs with hits equal outputs without caching, greedy and seeded T > 0, for target-only,
# DFlash (probabilistic and greedy drafts) and DFlash2, with the acceptance (tau, accepted drafts
# per position) unchanged: seeded T > 0 runs with probabilistic / walked drafts verify against
# the drafter's own distribution q, so a wrong or missing drafter context on a hit would change
# the sampled tokens even where few drafts are accepted; hits really happen (stats, per-request
# cached tokens); prefixes shared by concurrent requests (reference counts > 1); generated
# blocks cached; a prompt of exactly whole blocks (its last block computed into a fresh block);
# eviction in LRU order under a tiny cache, with preemption mixed in; chunked prefill with hits;
# recording requests compute every row; abort; every block free or evictable with reference
# count zero after each workload; the option. The real SmolLM2 drafter's tau with hits equals
# tau without (a drafter that lost its context on hits would drop towards 1).
from __future__ import annotations


import numpy as np
import pytest

import dflash
from dflash import _core
from dflash._core import testing
from tests.runtime_helpers import forced_run, small_drafter_pair

TARGET = "llama_gqa"
BS = 4  # block size of most sessions below: many blocks per prompt


@pytest.fixture(scope="module")
def target(tiny_model_dirs):
    return tiny_model_dirs[TARGET]


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory):
    pair = small_drafter_pair(tmp_path_factory.mktemp("prefix_drafters"), target, dflash_layers=1, dflash_block_size=4,
                              dflash_seed=5, dflash2_block_size=5, dflash2_top_k=16)
    return {None: "none", **pair}


DRAFT_CASES = [
    pytest.param(None, "auto", id="target_only"),
    pytest.param("dflash", "auto", id="dflash_probabilistic"),
    pytest.param("dflash", "greedy", id="dflash_greedy"),
    pytest.param("dflash2", "auto", id="dflash2_walk"),
]


def _session(target, drafters, draft=None, draft_sampling="auto", **kw):
    kw.setdefault("block_size", BS)
    return dflash.Session(target, draft=drafters[draft], draft_sampling=draft_sampling, device="cpu",
                          num_threads=2, **kw)


def _families(seed, n_families=3, per_family=3, prefix=(17, 30), suffix=(1, 9)):
    """Prompts in families that share a random prefix (lengths off the block boundaries)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_families):
        head = [int(x) for x in rng.integers(3, 352, size=int(rng.integers(*prefix)))]
        for _ in range(per_family):
            out.append(head + [int(x) for x in rng.integers(3, 352, size=int(rng.integers(*suffix)))])
    return out


def _params(n, temperature, seed0=40):
    return [dflash.SamplingParams(max_tokens=12 + 3 * (i % 4), temperature=temperature, top_k=50, top_p=0.95,
                                  seed=seed0 + i, ignore_eos=bool(i % 2)) for i in range(n)]


def _outs(sess, prompts, params):
    return [(o.token_ids, o.metrics.num_accepted, list(o.metrics.accepted_per_position), o.metrics.num_spec_steps)
            for o in sess.generate(prompts, params)]


def assert_all_released(sess):
    """Nothing queued, every KV block free or evictable, every reference count zero."""
    core = sess._core
    st = core.stats()
    assert not core.has_unfinished()
    assert st.num_free_blocks == st.num_blocks, (st.num_free_blocks, st.num_blocks)
    assert st.num_evictable_blocks == st.num_cached_blocks
    assert not any(core.block_ref_counts())


# ----------------------------------------------------------------------------------------------
# The allocator's bookkeeping


def test_allocator_reference_counts_lru_and_lookup():
    h = testing.prefix_block_hash
    root = testing.PREFIX_HASH_ROOT
    a = testing.BlockAllocator(6, prefix_caching=True)
    blocks = a.allocate(4)
    toks = [[1, 2], [3, 4], [5, 6], [7, 8]]
    hashes, parent = [], root
    for b, t in zip(blocks, toks):  # one chain: blocks 0..3 of one request
        hashes.append(h(parent, t))
        a.cache(b, hashes[-1], parent, t)
        parent = hashes[-1]
    assert a.num_cached == 4 and a.num_evictable == 0 and a.num_free == 2
    # Equal hashes mean equal prefixes: the chain differs as soon as one earlier token does.
    assert h(root, [1, 2]) == hashes[0] and h(hashes[0], [3, 4]) == hashes[1]
    assert h(root, [1, 3]) != hashes[0] and h(h(root, [1, 3]), [3, 4]) != hashes[1]
    assert a.lookup(hashes[1], hashes[0], [3, 4]) == blocks[1]
    assert a.lookup(hashes[1], hashes[0], [3, 5]) == -1  # the stored key is compared in full
    assert a.lookup(hashes[1], root, [3, 4]) == -1
    # A second block with an already cached hash is not registered (the first one keeps it).
    dup = a.allocate(1)
    a.cache(dup[0], hashes[0], root, [1, 2])
    assert not a.is_cached(dup[0]) and a.num_cached == 4
    a.free(dup)
    # Shared: two references; freed by both, it becomes evictable (still counted as free).
    a.share(blocks[0])
    assert a.ref_count(blocks[0]) == 2
    a.free(list(reversed(blocks)))  # a request's release: last block first
    assert a.ref_count(blocks[0]) == 1 and a.num_evictable == 3 and a.num_free == 5
    a.free([blocks[0]])
    assert a.num_evictable == 4 and a.num_free == 6 and a.num_cached == 4
    # A hit takes an evictable block back (out of the LRU list).
    a.share(blocks[1])
    assert a.ref_count(blocks[1]) == 1 and a.num_evictable == 3 and a.num_free == 5
    a.free([blocks[1]])  # now the most recently used
    # Allocation takes never-cached free blocks first, then evicts least recently used first:
    # LRU order now blocks[3], blocks[2], blocks[0], blocks[1].
    got = a.allocate(2)
    assert set(got).isdisjoint(blocks) and a.num_evictions == 0
    got += a.allocate(2)
    assert got[2:] == [blocks[3], blocks[2]] and a.num_evictions == 2
    assert a.lookup(hashes[3], hashes[2], [7, 8]) == -1 and not a.is_cached(blocks[3])
    assert a.lookup(hashes[0], root, [1, 2]) == blocks[0]
    got += a.allocate(2)
    assert got[4:] == [blocks[0], blocks[1]] and a.num_cached == 0 and a.num_free == 0
    with pytest.raises(dflash.DFlashError):
        a.allocate(1)
    a.free(got)
    assert a.num_free == 6 and a.num_evictable == 0
    with pytest.raises(dflash.DFlashError):
        a.free([got[0]])  # not allocated any more
    with pytest.raises(dflash.DFlashError):
        a.share(got[0])  # neither referenced nor cached


def test_allocator_without_prefix_caching_caches_nothing():
    a = testing.BlockAllocator(3)
    b = a.allocate(1)
    a.cache(b[0], 7, testing.PREFIX_HASH_ROOT, [1, 2])
    assert a.num_cached == 0 and a.lookup(7, testing.PREFIX_HASH_ROOT, [1, 2]) == -1
    a.free(b)
    assert a.num_free == 3


# ----------------------------------------------------------------------------------------------
# Hits change nothing


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("draft, draft_sampling", DRAFT_CASES)
def test_hits_equal_misses(target, drafters, draft, draft_sampling, temperature):
    prompts = _families(seed=1)
    params = _params(len(prompts), temperature)
    warm = prompts[::3]  # one prompt per family first: the rest hit its blocks
    on = _session(target, drafters, draft, draft_sampling)
    off = _session(target, drafters, draft, draft_sampling, enable_prefix_caching=False)
    assert on.stats()["prefix_caching"] and not off.stats()["prefix_caching"]
    for batch, prm in ((warm, params[::3]), (prompts, params), (prompts, params)):
        got, want = _outs(on, batch, prm), _outs(off, batch, prm)
        assert [g[0] for g in got] == [w[0] for w in want]
        # The drafter's context of the cached rows is there: the same drafts are accepted.
        assert got == want
    st, st_off = on.stats(), off.stats()
    assert st["prefix_cache_hit_tokens"] > 0 and st_off["prefix_cache_hit_tokens"] == 0
    assert st["num_forward_tokens"] < st_off["num_forward_tokens"]  # the hits were not computed
    assert st["acceptance_length"] == st_off["acceptance_length"]
    if draft:
        assert st["num_spec_steps"] > 0
    if temperature == 0.0 and draft:  # still lossless
        ar = _session(target, drafters, None, enable_prefix_caching=False)
        assert [g[0] for g in _outs(on, prompts, params)] == [g[0] for g in _outs(ar, prompts, params)]
    assert_all_released(on)
    assert_all_released(off)


def test_hit_tokens_and_per_request_cached_tokens(target, drafters):
    """Whole matched blocks, never the prefill's last token; stats and request metrics agree."""
    sess = _session(target, drafters, "dflash")
    core = sess._core
    head = list(range(10, 10 + 4 * BS + 2))  # 4 full blocks + 2
    first = core.generate([_request(head + [3, 4, 5])])[0]
    assert first.metrics.num_cached_tokens == 0
    st = core.stats()
    assert st.prefix_cache_hit_tokens == 0 and st.prefix_cache_query_tokens == len(head) + 3
    assert st.num_cached_blocks >= 5  # the prompt's 5 full blocks and the generated ones
    second = core.generate([_request(head + [7])])[0]
    assert second.metrics.num_cached_tokens == 4 * BS
    st = core.stats()
    assert st.prefix_cache_hit_tokens == 4 * BS
    assert st.prefix_cache_query_tokens == 2 * len(head) + 4
    assert_all_released(sess)


def test_python_outputs_carry_cached_tokens(target, drafters):
    """Session.generate's RequestOutput.metrics.num_cached_tokens: the matched whole blocks."""
    sess = _session(target, drafters, None)
    head = list(range(10, 10 + 3 * BS + 1))  # 3 full blocks + 1
    params = dflash.SamplingParams(max_tokens=4, ignore_eos=True)
    first = sess.generate([head + [3]], params)[0]
    second = sess.generate([head + [5, 6]], params)[0]
    assert first.metrics.num_cached_tokens == 0 and first.metrics.num_preemptions == 0
    assert second.metrics.num_cached_tokens == 3 * BS


def _request(prompt, max_tokens=8, temperature=0.0, seed=0):
    req = _core.RequestInput()
    req.prompt = list(prompt)
    s = _core.SamplingConfig()
    s.max_tokens, s.temperature, s.seed, s.ignore_eos = max_tokens, temperature, seed, True
    req.sampling = s
    return req


@pytest.mark.parametrize("draft", [None, "dflash", "dflash2"])
def test_prompt_of_exactly_whole_blocks(target, drafters, draft):
    """A prompt of N full blocks, all cached: N - 1 are shared, the last block is computed again
    into a block of the request's own (the shared ones are never written)."""
    on = _session(target, drafters, draft)
    off = _session(target, drafters, draft, enable_prefix_caching=False)
    prompt = [int(x) for x in np.random.default_rng(3).integers(3, 352, size=5 * BS)]
    params = [dflash.SamplingParams(max_tokens=10, temperature=t, seed=9, ignore_eos=True) for t in (0.0, 0.8)]
    for p in params:
        want = off.generate([prompt], p)[0]
        for _ in range(2):
            before = on.stats()["prefix_cache_hit_tokens"]
            got = on.generate([prompt], p)[0]
            assert got.token_ids == want.token_ids
            assert got.metrics.accepted_per_position == want.metrics.accepted_per_position
        assert on.stats()["prefix_cache_hit_tokens"] - before == 4 * BS
    # A prompt that is a cached prefix of whole blocks of a longer one (its last block shared by
    # the longer prompt's request, still running): computed into a fresh block, same output.
    core = on._core
    long_id = core.add_request(_request(prompt + [5, 6, 7], max_tokens=30))
    core.step()
    short = prompt[: 3 * BS]
    sid = core.add_request(_request(short, max_tokens=6))
    while core.has_unfinished():
        core.step()
    got_short, got_long = core.take_result(sid), core.take_result(long_id)
    assert got_short.metrics.num_cached_tokens == 2 * BS
    ref = off._core.generate([_request(short, max_tokens=6), _request(prompt + [5, 6, 7], max_tokens=30)])
    assert list(got_short.token_ids) == list(ref[0].token_ids)
    assert list(got_long.token_ids) == list(ref[1].token_ids)
    assert_all_released(on)


@pytest.mark.parametrize("draft", [None, "dflash"])
def test_prefix_shared_by_concurrent_requests(target, drafters, draft):
    """Requests arriving while the first one of their family decodes share its prompt blocks
    (reference counts above one) and produce the outputs of a session without caching."""
    prompts = _families(seed=4, n_families=1, per_family=4, prefix=(26, 27))
    params = _params(len(prompts), 0.9)
    on = _session(target, drafters, draft)
    off = _session(target, drafters, draft, enable_prefix_caching=False)
    core = on._core
    ids = [core.add_request(_req_from(on, prompts[0], params[0]))]
    core.step()  # its prefill: 6 full prompt blocks
    ids += [core.add_request(_req_from(on, p, prm)) for p, prm in zip(prompts[1:], params[1:])]
    core.step()  # the others admitted: they share the family's 6 blocks
    refs = np.asarray(core.block_ref_counts())
    assert (refs == 4).sum() == 26 // BS, refs
    while core.has_unfinished():
        core.step()
    got = [list(core.take_result(i).token_ids) for i in ids]
    assert got == [o.token_ids for o in off.generate(prompts, params)]
    assert core.stats().prefix_cache_hit_tokens == 3 * (26 // BS) * BS
    assert_all_released(on)


def _req_from(sess, prompt, params):
    req = _core.RequestInput()
    req.prompt = list(prompt)
    req.sampling = sess._sampling_config(params)
    return req


@pytest.mark.parametrize("draft", [None, "dflash", "dflash2"])
def test_generated_blocks_are_cached(target, drafters, draft):
    """A follow-up prompt = an earlier prompt + its answer (a chat turn) hits the answer's blocks
    too, which were filled by decode steps (verify blocks with a drafter)."""
    on = _session(target, drafters, draft)
    off = _session(target, drafters, draft, enable_prefix_caching=False)
    p0 = [int(x) for x in np.random.default_rng(5).integers(3, 352, size=13)]
    g = dflash.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    a0 = on.generate([p0], g)[0].token_ids
    p1 = p0 + a0 + [7, 8, 9]
    before = on.stats()["prefix_cache_hit_tokens"]
    got = on.generate([p1], g)[0]
    hit = on.stats()["prefix_cache_hit_tokens"] - before
    # The last generated token's K/V was never computed: everything before it, in whole blocks.
    assert hit == (len(p0) + len(a0) - 1) // BS * BS > len(p0)
    want = off.generate([p1], g)[0]
    assert got.token_ids == want.token_ids
    assert got.metrics.accepted_per_position == want.metrics.accepted_per_position
    assert_all_released(on)


# ----------------------------------------------------------------------------------------------
# Eviction, preemption, chunked prefill, recordings, abort


def test_eviction_is_least_recently_used_first(target, drafters):
    """Two cached prefixes, the older one used last a while ago: a request needing more blocks
    than are never-cached evicts the older prefix's tail first; the recent prefix stays whole."""
    sess = _session(target, drafters, None, kv_cache_tokens=24 * BS)
    core = sess._core
    rng = np.random.default_rng(6)
    old, recent = ([int(x) for x in rng.integers(3, 352, size=6 * BS + 1)] for _ in range(2))
    core.generate([_request(old, max_tokens=1)])     # 7 blocks, 6 of them full and cached
    core.generate([_request(recent, max_tokens=1)])  # the same, used later
    st = core.stats()
    assert st.num_cached_blocks == 12 and st.num_evictable_blocks == 12 and st.num_free_blocks == 24
    # 17 blocks over its lifetime: the 12 never-cached free blocks, then 5 evicted, least recently
    # used first: the old prefix's, its last block first; the recent prefix is newer.
    big = [int(x) for x in rng.integers(3, 352, size=15 * BS)]
    core.generate([_request(big, max_tokens=2 * BS)])
    assert core.stats().num_evicted_blocks == 5
    hits = []
    for p in (recent, old):
        before = core.stats().prefix_cache_hit_tokens
        core.generate([_request(p, max_tokens=1)])
        hits.append(core.stats().prefix_cache_hit_tokens - before)
    assert hits[0] == 6 * BS  # the recent prefix survived whole
    assert hits[1] == BS      # the old one kept only its first block
    assert_all_released(sess)


@pytest.mark.parametrize("draft, draft_sampling", DRAFT_CASES)
def test_tiny_cache_with_preemption_and_eviction(target, drafters, draft, draft_sampling):
    """A cache far smaller than the batch: requests are preempted (their blocks cached, then
    found again or evicted on re-admission) and cached blocks are evicted all the time; seeded
    outputs equal a roomy cache without prefix caching."""
    prompts = _families(seed=7, n_families=4, per_family=3, prefix=(10, 30), suffix=(2, 10))
    params = _params(len(prompts), 0.9)
    want = _outs(_session(target, drafters, draft, draft_sampling, enable_prefix_caching=False,
                          kv_cache_tokens=4096), prompts, params)
    tiny = _session(target, drafters, draft, draft_sampling, kv_cache_tokens=80)
    for _ in range(2):
        got = _outs(tiny, prompts, params)
        assert [g[0] for g in got] == [w[0] for w in want]
        assert got == want
    st = tiny.stats()
    assert st["num_preemptions"] > 0 and st["num_evicted_blocks"] > 0 and st["prefix_cache_hit_tokens"] > 0, st
    assert_all_released(tiny)


@pytest.mark.parametrize("draft", [None, "dflash", "dflash2"])
@pytest.mark.parametrize("budget", [3, 9])
def test_chunked_prefill_with_hits(target, drafters, draft, budget):
    """Budgets of a few tokens: the prefill after the cached blocks runs in chunks, and requests
    admitted while others are still prefilling in chunks hit the blocks those already filled."""
    prompts = _families(seed=8, n_families=2, per_family=3, prefix=(20, 35))
    params = _params(len(prompts), 0.9)
    want = _outs(_session(target, drafters, draft, enable_prefix_caching=False), prompts, params)
    on = _session(target, drafters, draft, max_num_batched_tokens=budget)
    for _ in range(2):
        assert _outs(on, prompts, params) == want
    st = on.stats()
    assert st["prefix_cache_hit_tokens"] > 0 and st["num_prefill_chunks"] > 2 * len(prompts)
    assert_all_released(on)


def test_recording_requests_compute_every_row(target):
    """Recorded prompt logits and taps with a cached prompt: the request matches nothing and
    records every row, equal to a session without caching."""
    from tests.runtime_helpers import core_session

    on = core_session(target, tap_layers=[0, 1], block_size=BS)
    off = core_session(target, tap_layers=[0, 1], block_size=BS, enable_prefix_caching=False)
    prompt = [int(x) for x in np.random.default_rng(9).integers(3, 352, size=23)]
    on._core.generate([_request(prompt)])  # cache the prompt's blocks
    assert on._core.stats().num_cached_blocks >= 5
    forced = [9, 10, 11]
    lg, tg, rg = forced_run(on, prompt, forced, taps=True)
    lw, tw, _ = forced_run(off, prompt, forced, taps=True)
    assert rg.metrics.num_cached_tokens == 0
    assert lg.shape == lw.shape == (len(prompt) + len(forced), on.model_config.vocab_size)
    np.testing.assert_allclose(lg, lw, rtol=0, atol=1e-5 * float(np.max(np.abs(lw))))
    np.testing.assert_allclose(tg, tw, rtol=0, atol=1e-5 * float(np.max(np.abs(tw))))
    assert_all_released(on)


def test_abort_releases_shared_blocks(target, drafters):
    sess = _session(target, drafters, "dflash", kv_cache_tokens=120)
    core = sess._core
    prompts = _families(seed=10, n_families=2, per_family=4)
    ids = [core.add_request(_req_from(sess, p, prm)) for p, prm in zip(prompts, _params(len(prompts), 0.9))]
    for _ in range(4):
        core.step()
    ids += [core.add_request(_req_from(sess, p, prm)) for p, prm in zip(prompts, _params(len(prompts), 0.9))]
    for _ in range(3):
        core.step()
    assert any(r > 1 for r in core.block_ref_counts())
    for i in ids:
        core.abort(i)
    for i in ids:
        core.take_result(i)
    assert_all_released(sess)
    # The cache still serves later requests.
    prm = _params(1, 0.0)
    out = sess.generate([prompts[0]], prm)[0].token_ids
    assert out == _session(target, drafters, "dflash", enable_prefix_caching=False).generate([prompts[0]], prm)[0].token_ids


@pytest.mark.parametrize("value", ["yes", 1, 0.5])
def test_enable_prefix_caching_must_be_a_bool(target, value):
    with pytest.raises(ValueError, match=r"enable_prefix_caching must be True or False"):
        dflash.Session(target, device="cpu", enable_prefix_caching=value)


def test_prefix_caching_is_on_by_default(target):
    assert dflash.Session(target, device="cpu", num_threads=2).stats()["prefix_caching"] is True
    assert _core.SessionConfig().enable_prefix_caching is True


# ----------------------------------------------------------------------------------------------
# A real drafter: tau with hits equals tau without


def test_shipped_drafters_keep_tau_on_hits():
    """SmolLM2-135M-Instruct with its shipped DFlash drafter and the DFlash2 candidate: two chat
    prompts sharing a system prompt run twice in one session, first computed, then found in the
    cache (all but their last block). The second run's tokens and accepted drafts per position
    equal the first's (greedy, fp32), and tau stays at the drafters' level, far above the 1.0 of a
    drafter whose context went missing on the hit."""
    from pathlib import Path

    from dflash.default_model import SHIPPED_DRAFTER_DIR, default_model_dir

    model = default_model_dir()
    candidate = Path(__file__).resolve().parent.parent / "drafters" / "SmolLM2-135M-Instruct-DFlash2-candidate"
    system = ("You are a careful math tutor. Explain each step of the solution in plain words, check the "
              "arithmetic twice, and put the final answer within \\boxed{}.")
    questions = ["A baker makes 24 muffins and sells 15. How many are left?",
                 "Tom has 3 boxes with 12 pencils each. How many pencils does he have?"]
    msgs = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
    params = dflash.SamplingParams(max_tokens=32)
    for drafter in (SHIPPED_DRAFTER_DIR, candidate):
        sess = dflash.Session(model, draft=str(drafter), device="cpu", kv_cache_tokens=4096, max_model_len=2048)
        miss = sess.generate(msgs, params)
        st_miss = sess.stats()
        hit = sess.generate(msgs, params)
        st = sess.stats()
        assert st_miss["prefix_cache_hit_tokens"] == 0
        assert st["prefix_cache_hit_tokens"] >= sum(len(o.prompt_token_ids) - sess.stats()["block_size"] for o in hit)
        assert [o.token_ids for o in hit] == [o.token_ids for o in miss]
        assert [o.metrics.accepted_per_position for o in hit] == [o.metrics.accepted_per_position for o in miss]
        tau_miss = st_miss["acceptance_length"]
        steps = st["num_spec_steps"] - st_miss["num_spec_steps"]
        emitted = sum(o.metrics.acceptance_length * o.metrics.num_spec_steps for o in hit)
        assert abs(emitted / steps - tau_miss) < 1e-9 and tau_miss > 1.8, (tau_miss, drafter)
        print(f"{drafter.name}: tau {tau_miss:.3f} computed and from the cache ({st['prefix_cache_hit_tokens']} hit tokens)")

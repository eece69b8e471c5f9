# tests/test_adaptive_spec.py
#
# Adaptive speculation (speculation="adaptive", CPU, fp32): each speculative decode step drafts one
# length for the whole batch, from a set with decode programs (0 = an AR step that keeps the
# drafter's context), chosen to maximise sum_i E_i[tokens] / cost(batch, L).
# - the policy (runtime/spec_policy.h through dflash._core.testing) on synthetic cost tables: a
#   step 5x the AR cost at batch 64 gives L = 0 with low acceptance there and the full length at
#   batch 1 with high acceptance; monotone in acceptance and in batch size; ties to the shorter
#   length; tokens left cap the gain; table lookups; the acceptance estimates (EWMA per position);
#   bad tables are ValueErrors;
# - end to end, with forced draft-length schedules (a test hook) and with the policy on injected
#   tables: greedy output equals target-only for DFlash (greedy and probabilistic drafts) and
#   DFlash2, alone and batched, on the padded decode path, under preemption and chunked prefill;
#   L = 0 steps sample exactly as target-only decoding (seeded T > 0 too); seeded T > 0 output is
#   deterministic for a fixed decision sequence (batched == alone under a forced schedule; two
#   fresh sessions with the same table agree); short drafts follow the target's distribution
#   (chi-squared);
# - the drafter's context stays exact across switches: with the shipped SmolLM2 drafter, every
#   speculative step of a schedule full of AR runs accepts exactly what a fresh drafter context
#   (Session.propose on the same prefix) predicts;
# - options, stats (the chosen lengths' histogram, the cost table) and no leaked KV blocks.
from __future__ import annotations


import numpy as np
import pytest

import dflash
from dflash import _core
from tests.runtime_helpers import small_drafter_pair
from tests.test_dflash_sampling import _chi2_ok, _target_probs

testing = _core.testing
TARGET = "llama_gqa"

# A synthetic table shaped like the H200 measurement of issue 15 (b16 drafter, ms per step): at
# batch 64 a 15-draft step costs 32.5 ms against 6.4 ms for an AR step.
LENGTHS = [0, 1, 3, 7, 15]
H200_ROWS = [
    [1, 5.0, 5.2, 5.3, 5.5, 6.0],
    [8, 5.1, 5.4, 5.8, 6.9, 9.0],
    [16, 5.3, 5.7, 6.6, 8.4, 13.0],
    [32, 5.7, 6.3, 8.0, 11.5, 20.0],
    [64, 6.4, 7.4, 10.5, 17.5, 32.5],
]


def _choose(batch, rate, n_req=None, remaining=1000, rows=H200_ROWS, lengths=LENGTHS):
    n_req = batch if n_req is None else n_req
    return testing.spec_choose_length(lengths, rows, batch, [[rate] * lengths[-1]] * n_req, [remaining] * n_req)


# ---------------------------------------------------------------------------------------------- policy


def test_policy_on_an_h200_like_table():
    # Only AR and the whole block: spec at 5.1x the AR cost needs E > 5.1 tokens at batch 64.
    two = [[r[0], r[1], r[5]] for r in H200_ROWS]
    assert _choose(64, 0.7, rows=two, lengths=[0, 15]) == 0  # E = 3.3: plain AR decoding under load
    assert _choose(1, 0.7, rows=two, lengths=[0, 15]) == 15  # alone the block is almost free
    assert _choose(64, 0.9, rows=two, lengths=[0, 15]) == 15  # E = 8.1 pays even at batch 64
    # With the intermediate lengths.
    assert _choose(64, 0.1) == 0  # low acceptance under load: plain AR decoding
    assert _choose(64, 0.6) == 1  # one cheap draft
    assert _choose(1, 0.9) == 15  # high acceptance alone: the whole block
    assert _choose(1, 0.02) == 0  # a drafter that (almost) never hits does not pay even alone
    assert _choose(64, 0.95) == 7 and _choose(64, 1.0) == 15
    # The rates are the expected tokens over the step's cost.
    e = {n: testing.spec_expected_tokens([0.6] * 15, n, 1000) for n in LENGTHS}
    rates = {n: 64 * e[n] / testing.spec_cost(LENGTHS, H200_ROWS, 64, n) for n in LENGTHS}
    assert _choose(64, 0.6) == max(LENGTHS, key=lambda n: (rates[n], -n))


def test_policy_is_monotone_in_acceptance_and_batch_size():
    for batch in (1, 3, 8, 20, 32, 50, 64, 100):
        chosen = [_choose(batch, r) for r in np.linspace(0.0, 1.0, 41)]
        assert chosen == sorted(chosen), (batch, chosen)
        assert chosen[0] == 0
    for rate in np.linspace(0.0, 1.0, 21):
        chosen = [_choose(b, float(rate)) for b in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96)]
        assert chosen == sorted(chosen, reverse=True), (rate, chosen)
    # A batch mixing acceptance: between the choices of its members.
    lo, hi = _choose(16, 0.2), _choose(16, 0.95)
    mixed = testing.spec_choose_length(LENGTHS, H200_ROWS, 16, [[0.2] * 15] * 8 + [[0.95] * 15] * 8, [1000] * 16)
    assert lo <= mixed <= hi and lo < hi


def test_policy_ties_go_to_the_shorter_length():
    # Cost proportional to the rows and every draft accepted: the same tokens per second for all.
    prop = [[1, 1.0, 2.0, 4.0, 8.0, 16.0], [4, 4.0, 8.0, 16.0, 32.0, 64.0]]
    assert _choose(1, 1.0, rows=prop) == 0 and _choose(4, 1.0, rows=prop) == 0
    flat = [[1, 1.0, 1.0, 1.0, 1.0, 1.0]]
    assert _choose(1, 0.0, rows=flat) == 0  # nothing accepted: one token for any length
    assert _choose(1, 1.0, rows=flat) == 15  # free drafts that are always accepted
    assert _choose(1, 0.2, rows=flat) == 15  # small gains still beat a tie
    # Gains below the relative tolerance (1e-9) are ties: 1e-6 pays for the first draft only.
    assert _choose(1, 1e-6, rows=flat) == 1


def test_policy_counts_only_the_tokens_left():
    flat = [[1, 1.0, 1.0, 1.0, 1.0, 1.0]]
    assert testing.spec_expected_tokens([0.5] * 15, 3, 1000) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert testing.spec_expected_tokens([0.5] * 15, 3, 2) == pytest.approx(1.5)
    assert testing.spec_expected_tokens([0.5] * 15, 15, 1) == 1.0
    assert testing.spec_expected_tokens([0.9, 0.5, 0.0, 1.0], 4, 100) == pytest.approx(1 + 0.9 + 0.45)
    # A request one token from its end gains nothing from drafts: cheaper AR wins.
    assert _choose(8, 0.9, remaining=1) == 0
    # With free drafts, the shortest length that covers the tokens left.
    assert _choose(1, 1.0, remaining=3, rows=flat) == 3
    assert _choose(1, 1.0, remaining=5, rows=flat) == 7


def test_cost_table_lookup():
    c = lambda b, n: testing.spec_cost(LENGTHS, H200_ROWS, b, n)  # noqa: E731
    assert c(8, 15) == 9.0 and c(64, 0) == 6.4
    assert c(1, 3) == 5.3 and c(0, 3) == 5.3  # below the smallest size: its cost
    assert c(12, 15) == pytest.approx(11.0)  # interpolated between 8 and 16
    assert c(96, 15) == pytest.approx(32.5 + 12.5 * 32 / 32)  # extrapolated from 32 and 64
    assert c(128, 0) == pytest.approx(6.4 + 0.7 * 64 / 32)
    one = [[4, 1.0, 3.0]]
    assert testing.spec_cost([0, 3], one, 8, 3) == pytest.approx(6.0)  # one size: proportional
    assert testing.spec_cost([0, 3], one, 2, 0) == 1.0


@pytest.mark.parametrize("rows, lengths", [
    ([[1, 1.0, 2.0]], [0, 1, 3]),             # too few costs
    ([[2, 1.0, 2.0], [1, 1.0, 2.0]], [0, 1]),  # sizes not ascending
    ([[1, 1.0, -2.0]], [0, 1]),                # negative cost
    ([[1, 1.0, float("nan")]], [0, 1]),
    ([[0, 1.0, 2.0]], [0, 1]),                 # batch size 0
    ([[1.5, 1.0, 2.0]], [0, 1]),
    ([[1, 1.0, 2.0]], [1, 0]),                 # lengths not ascending
    ([], [0, 1]),
])
def test_bad_cost_tables_are_value_errors(rows, lengths):
    with pytest.raises(ValueError):
        testing.spec_cost(lengths, rows, 1, 0)


def test_acceptance_estimates():
    p = testing.SpecPolicy(4, [0, 1, 4], [[1, 1.0, 1.5, 3.0]], prior=0.5, request_rate=0.5, global_rate=0.1)
    assert p.rates(7) == [0.5] * 4 and p.num_tracked == 0  # unseen: the session-wide estimate
    p.observe(7, 4, 2)  # drafts 0, 1 accepted, draft 2 rejected, draft 3 not reached
    assert p.rates(7) == pytest.approx([0.75, 0.75, 0.25, 0.5])
    assert p.global_rates == pytest.approx([0.55, 0.55, 0.45, 0.5])
    p.observe(7, 4, 4)
    assert p.rates(7) == pytest.approx([0.875, 0.875, 0.625, 0.75])
    p.observe(7, 1, 0)  # a one-draft step observes position 0 only
    assert p.rates(7) == pytest.approx([0.4375, 0.875, 0.625, 0.75])
    seen = list(p.global_rates)
    p.observe(7, 0, 0)  # AR steps observe nothing; recovery_rate 0.01 moves estimates below the prior up
    assert p.rates(7) == pytest.approx([0.4375 + 0.01 * 0.0625, 0.875, 0.625, 0.75])
    assert p.global_rates == seen
    assert p.rates(8) == p.global_rates  # a new request starts from what the session saw
    p.observe(8, 4, 4)
    assert p.num_tracked == 2
    p.forget(7)
    assert p.num_tracked == 1 and p.rates(7) == p.global_rates
    # choose() reads the estimates: one request that always hits turns speculation on.
    q = testing.SpecPolicy(4, [0, 4], [[1, 1.0, 2.0]], prior=0.1, request_rate=1.0, global_rate=0.01)
    assert q.choose([1], [100], 1) == 0
    q.observe(1, 4, 4)
    assert q.choose([1], [100], 1) == 4
    with pytest.raises(ValueError):
        testing.SpecPolicy(4, [0, 4], [[1, 1.0, 2.0]], recovery_rate=-0.1)
    with pytest.raises(ValueError):
        testing.SpecPolicy(2, [0, 4], [[1, 1.0, 2.0]])  # a length beyond the drafter
    with pytest.raises(ValueError):
        testing.SpecPolicy(4, [0, 4], [[1, 1.0, 2.0]], prior=1.5)


def test_ar_steps_bring_speculation_back():
    """A request whose first drafts keep failing is moved to L = 0, and AR steps (which observe
    nothing) raise its estimate towards the prior until a speculative step is tried again; a
    failed probe sends it back to AR steps. With recovery off it stays at L = 0 for good.
    H200-like costs of one request: L = 7 pays from an expected 0.855 / 0.558 = 1.53 tokens."""
    rows = [[1, 0.558, 0.689, 0.856, 0.855]]
    for recovery in (0.0, 0.01):
        p = testing.SpecPolicy(7, [0, 1, 3, 7], rows, prior=0.6, request_rate=0.125, global_rate=0.02,
                               recovery_rate=recovery)
        spec_steps = 0
        while p.choose([1], [10_000], 1) > 0:  # a passage the drafter cannot follow
            p.observe(1, 7, 0)
            spec_steps += 1
            assert spec_steps < 40
        low = p.rates(1)[0]
        ar_steps = 0
        while p.choose([1], [10_000], 1) == 0 and ar_steps < 1000:
            p.observe(1, 0, 0)
            ar_steps += 1
        if recovery == 0.0:
            assert ar_steps == 1000 and p.rates(1)[0] == low
            continue
        assert 1 <= ar_steps < 1000 and low < p.rates(1)[0] <= 0.6
        p.observe(1, 7, 0)  # the probe fails too: back to AR steps
        assert p.choose([1], [10_000], 1) == 0


# ---------------------------------------------------------------------------------------------- engine

# Spec pays alone or in pairs, not from 3 requests on (costs in arbitrary units per draft length of
# a block-8 drafter, lengths 0, 1, 3, 7).
SWITCH_ROWS = [[1, 1.0, 1.0, 1.0, 1.0], [2, 2.0, 2.0, 2.0, 2.0], [3, 1.0, 6.0, 6.0, 6.0], [8, 1.0, 9.0, 9.0, 9.0]]


def _prompts(n, seed, lo=3, hi=30):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 352, size=int(rng.integers(lo, hi)))] for _ in range(n)]


@pytest.fixture(scope="module")
def target(tiny_model_dirs):
    return tiny_model_dirs[TARGET]


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory):
    pair = small_drafter_pair(tmp_path_factory.mktemp("adaptive_drafters"), target, dflash_layers=1, dflash_block_size=8,
                              dflash_seed=4, dflash2_block_size=5, dflash2_top_k=16)
    return pair


DRAFTS = [
    pytest.param("dflash", "greedy", id="dflash_greedy"),
    pytest.param("dflash", "auto", id="dflash_probabilistic"),
    pytest.param("dflash2", "auto", id="dflash2_walk"),
]


def _core_session(target, draft=None, draft_sampling="auto", **kw):
    c = _core.SessionConfig()
    c.num_threads = 2
    c.kv_cache_tokens = 4096
    c.max_num_seqs = 8
    c.block_size = 4
    if draft is not None:
        c.draft_dir = str(draft)
        c.draft_sampling = draft_sampling
    for k, v in kw.items():
        setattr(c, k, v)
    return _core.Session(str(target), c)


def _submit(sess, prompt, i, temperature, max_tokens=None, oracle=None):
    req = _core.RequestInput()
    req.prompt = list(prompt)
    if oracle is not None:
        req.oracle_drafts = list(oracle)
    s = _core.SamplingConfig()
    s.max_tokens = max_tokens or 12 + 5 * (i % 4)
    s.temperature, s.top_k, s.top_p, s.seed, s.ignore_eos = temperature, 40, 0.95, 500 + i, bool(i % 2)
    req.sampling = s
    return sess.add_request(req)


def _run(sess, prompts, temperature=0.0, oracle=None, index0=0):
    """Runs the prompts to completion (request i seeded 500 + i, its own max_tokens); token lists."""
    ids = [_submit(sess, p, index0 + i, temperature, oracle=None if oracle is None else oracle[i])
           for i, p in enumerate(prompts)]
    while sess.has_unfinished():
        sess.step()
    out = [list(sess.take_result(i).token_ids) for i in ids]
    st = sess.stats()
    assert st.num_free_blocks == st.num_blocks and not sess.has_unfinished()
    return out


def _run_alone(sess, prompts, temperature=0.0):
    return [_run(sess, [p], temperature, index0=i)[0] for i, p in enumerate(prompts)]


SCHEDULES = [[0, 7, 0, 0, 3, 1, 7, 0], [7, 0], [1, 3, 0, 7, 7, 0, 0, 0, 1]]
V2_SCHEDULES = [[0, 4, 0, 0, 3, 1, 4, 0], [4, 0], [1, 3, 0, 4, 4, 0, 0, 0, 1]]  # block 5: n = 4


@pytest.mark.parametrize("pad", [False, True], ids=["exact", "padded"])
@pytest.mark.parametrize("draft, draft_sampling", DRAFTS)
def test_greedy_under_forced_switching_equals_target_only(target, drafters, draft, draft_sampling, pad):
    prompts = _prompts(6, seed=1)
    want = _run(_core_session(target), prompts)
    for schedule in (V2_SCHEDULES if draft == "dflash2" else SCHEDULES):
        sess = _core_session(target, drafters[draft], draft_sampling, speculation="adaptive",
                             spec_length_schedule=schedule, pad_decode_batches=pad,
                             spec_cost_table=[[1, 1.0, 1.0, 1.0, 1.0]])
        assert _run(sess, prompts) == want, schedule
        assert _run_alone(sess, prompts[:3]) == want[:3], schedule
        steps = sess.stats().engine.spec_length_steps
        assert all(steps[n] > 0 for n in set(schedule)) and sum(steps) == sum(steps[n] for n in set(schedule))


@pytest.mark.parametrize("draft, draft_sampling", DRAFTS)
def test_greedy_under_the_policy_equals_target_only(target, drafters, draft, draft_sampling):
    """The policy on a table where speculation pays only for one or two requests: L switches from 0
    to a draft length as the batch drains (oracle drafts for some requests: long accepted runs)."""
    prompts = _prompts(6, seed=2)
    want = _run(_core_session(target), prompts)
    sess = _core_session(target, drafters[draft], draft_sampling, speculation="adaptive", spec_cost_table=SWITCH_ROWS)
    oracle = [w if i % 2 == 0 and draft_sampling == "greedy" else None for i, w in enumerate(want)]
    assert _run(sess, prompts, oracle=oracle) == want
    steps = sess.stats().engine.spec_length_steps
    assert steps[0] > 0 and sum(steps[1:]) > 0, steps  # both AR and speculative steps ran
    st = sess.stats().engine
    assert st.num_spec_steps > 0 and st.num_spec_emitted >= st.num_spec_steps


def test_ar_steps_sample_as_target_only(target, drafters):
    """Schedule [0]: every decode step is the AR program with the drafter's context update; its
    tokens are those of target-only decoding, greedy and seeded T > 0, and nothing is drafted."""
    prompts = _prompts(5, seed=3)
    for temperature in (0.0, 0.9):
        want = _run(_core_session(target), prompts, temperature)
        for draft in ("dflash", "dflash2"):
            sess = _core_session(target, drafters[draft], speculation="adaptive", spec_length_schedule=[0],
                                 spec_cost_table=[[1, 1.0, 2.0, 3.0, 4.0]])
            assert _run(sess, prompts, temperature) == want, (draft, temperature)
            e = sess.stats().engine
            assert e.num_spec_steps == 0 and e.num_drafted == 0 and e.spec_length_steps[0] > 0


@pytest.mark.parametrize("draft, draft_sampling", DRAFTS[1:])
def test_seeded_sampling_is_deterministic_for_a_decision_sequence(target, drafters, draft, draft_sampling):
    prompts = _prompts(5, seed=4)
    schedule = V2_SCHEDULES[0] if draft == "dflash2" else SCHEDULES[0]
    table = [[1, 1.0, 1.0, 1.0, 1.0]]
    mk = lambda **kw: _core_session(target, drafters[draft], draft_sampling, speculation="adaptive",  # noqa: E731
                                    spec_cost_table=table, **kw)
    # A forced schedule: the requests start together, so each sees the same lengths alone or batched.
    forced = mk(spec_length_schedule=schedule)
    batched = _run(forced, prompts, 0.9)
    assert batched == _run_alone(mk(spec_length_schedule=schedule), prompts, 0.9)
    assert batched == _run(mk(spec_length_schedule=schedule), prompts, 0.9)
    # The policy on an injected table: two fresh sessions take the same decisions and tokens.
    a, b = (_core_session(target, drafters[draft], draft_sampling, speculation="adaptive",
                          spec_cost_table=SWITCH_ROWS) for _ in range(2))
    assert _run(a, prompts, 0.9) == _run(b, prompts, 0.9)
    assert list(a.stats().engine.spec_length_steps) == list(b.stats().engine.spec_length_steps)


@pytest.mark.parametrize("length", [1, 3])
def test_short_drafts_follow_the_target_distribution(tmp_path, target, drafters, length):
    """The first decode step drafts `length` of the block-8 drafter's 7 (probabilistic drafts,
    q = the drafter's softmax): the token it decides follows the target's distribution."""
    from tests.runtime_helpers import _CoreSession, sampled_second_tokens

    sess = _CoreSession(_core_session(target, drafters["dflash"], "probabilistic", speculation="adaptive",
                                      spec_length_schedule=[length], spec_cost_table=[[1, 1.0, 1.0, 1.0, 1.0]],
                                      kv_cache_tokens=8192, max_num_seqs=64))
    ar = dflash.Session(target, num_threads=2)
    prompt, first, temperature = [17, 42, 99, 7, 250, 31], 120, 0.8
    probs = _target_probs(ar, prompt, first, temperature, 1.0)
    results = sampled_second_tokens(sess, prompt, first, temperature=temperature, top_p=1.0, num_seeds=2000)
    second = np.array([r.token_ids[1] for r in results])
    chi2, dof, ok = _chi2_ok(second, probs)
    assert ok, (chi2, dof)
    assert sess._core.stats().engine.spec_length_steps[length] > 0


TINY = dict(kv_cache_tokens=96, block_size=4, max_num_batched_tokens=16)


@pytest.mark.parametrize("draft, draft_sampling", DRAFTS)
def test_switching_with_preemption_and_chunked_prefill(target, drafters, draft, draft_sampling):
    prompts = _prompts(8, seed=5, lo=10, hi=45)
    want = _run(_core_session(target), prompts)
    schedule = V2_SCHEDULES[2] if draft == "dflash2" else SCHEDULES[2]
    for kw in (dict(spec_length_schedule=schedule, spec_cost_table=[[1, 1.0, 1.0, 1.0, 1.0]]),
               dict(spec_cost_table=SWITCH_ROWS)):
        tiny = _core_session(target, drafters[draft], draft_sampling, speculation="adaptive", **TINY, **kw)
        assert _run(tiny, prompts) == want
        e = tiny.stats().engine
        assert e.num_preemptions > 0 and e.num_prefill_chunks > len(prompts) + 2, (e.num_preemptions,)
        assert sum(1 for c in e.spec_length_steps if c) >= 2  # several lengths ran
    # Seeded T > 0 under preemption: the same decisions give the same tokens.
    a, b = (_core_session(target, drafters[draft], draft_sampling, speculation="adaptive", **TINY,
                          spec_length_schedule=schedule, spec_cost_table=[[1, 1.0, 1.0, 1.0, 1.0]])
            for _ in range(2))
    assert _run(a, prompts, 0.9) == _run(b, prompts, 0.9)


def test_the_drafter_context_stays_exact_across_switches():
    """With the shipped SmolLM2 drafter (block 8): a schedule full of AR runs and short lengths; each
    speculative step accepts exactly as many drafts as the drafter proposes from a context built in
    one prefill of the same prefix (Session.propose with that many speculative tokens), so AR steps
    and shorter blocks leave the drafter's context as if every step had drafted. Its acceptance
    length stays that of the drafter (an AR step that skipped the context update drops it)."""
    from dflash.default_model import SHIPPED_DRAFTER_DIR, default_model_dir

    model, drafter = default_model_dir(), SHIPPED_DRAFTER_DIR
    tok = dflash.Session(model, device="cpu", draft="none").tokenizer
    question = ("Tom has 3 boxes with 12 pencils each. He gives 7 pencils to his sister. How many pencils does "
                "he have now? Please reason step by step.")
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True),
                        add_special_tokens=False)
    schedule = [7, 0, 0, 0, 7, 0, 3, 7, 1, 0, 0, 7, 7, 3, 0, 1, 7]
    sess = _core_session(model, drafter, "greedy", speculation="adaptive", spec_length_schedule=schedule,
                         spec_cost_table=[[1, 1.0, 1.0, 1.0, 1.0]], block_size=16, max_model_len=1024,
                         max_num_seqs=4)
    rid = _submit(sess, prompt, 0, 0.0, max_tokens=72)
    steps = []
    while sess.has_unfinished():
        steps.extend(list(o.new_tokens) for o in sess.step())
    out = list(sess.take_result(rid).token_ids)
    tokens = prompt + out
    refs = {n: dflash.Session(model, draft=str(drafter), device="cpu", num_speculative_tokens=n, max_model_len=1024,
                              kv_cache_tokens=2048, draft_sampling="greedy") for n in (1, 3, 7)}
    known = len(prompt) + 1  # tokens known after the prefill's first token
    checked = accepted = 0
    for k, emitted in enumerate(steps[1:]):
        n, anchor = schedule[k % len(schedule)], known - 1
        if n > 0 and k < len(steps) - 2:  # the last step may stop inside its accepted run
            drafts, _ = refs[n].propose(tokens[:anchor])
            expect = 0
            while expect < n and drafts[expect] == tokens[anchor + 1 + expect]:
                expect += 1
            assert len(emitted) - 1 == expect, (k, n, len(emitted) - 1, expect)
            checked += 1
            accepted += expect
        else:
            assert n > 0 or len(emitted) == 1
        known += len(emitted)
    assert checked >= 12 and accepted / checked > 1.5, (checked, accepted)
    e = sess.stats().engine
    assert e.spec_length_steps[0] > 0 and e.num_spec_emitted / e.num_spec_steps > 2.0


# ---------------------------------------------------------------------------------------------- options


def test_stats_fixed_and_adaptive(target, drafters):
    fixed = dflash.Session(target, draft=drafters["dflash"], num_threads=2)
    prompts = _prompts(3, seed=6)
    fixed.generate(prompts, dflash.SamplingParams(max_tokens=8))
    st = fixed.stats()
    assert st["speculation"] == "fixed" and st["draft_lengths"] == [7] and st["spec_cost_table"] is None
    assert st["spec_length_steps"] == {7: st["num_steps"] - 1}  # every step but the prefill's decodes
    assert dflash.Session(target, num_threads=2).stats()["speculation"] is None

    table = {"batch_sizes": [1, 4], "lengths": [0, 2, 7], "seconds": [[1.0, 1.1, 1.5], [1.2, 2.0, 5.0]]}
    ad = dflash.Session(target, draft=drafters["dflash"], num_threads=2, speculation="adaptive",
                        spec_cost_table=table, max_num_seqs=4)
    st = ad.stats()
    assert st["speculation"] == "adaptive" and st["draft_lengths"] == [0, 2, 7]
    assert st["spec_cost_table"] == table and st["spec_cost_measure_s"] == 0.0
    ad.generate(prompts, dflash.SamplingParams(max_tokens=8))
    st = ad.stats()
    assert set(st["spec_length_steps"]) == {0, 2, 7} and sum(st["spec_length_steps"].values()) > 0

    # Measured at start-up (eager programs on the CPU): positive, for 1, 2, 4 (max_num_seqs) requests,
    # the default lengths; the same table fed back is used as is.
    ad = dflash.Session(target, draft=drafters["dflash"], num_threads=2, speculation="adaptive", max_num_seqs=4)
    st = ad.stats()
    costs = st["spec_cost_table"]
    assert costs["batch_sizes"] == [1, 2, 4] and costs["lengths"] == [0, 1, 3, 7] == st["draft_lengths"]
    assert np.all(np.array(costs["seconds"]) > 0) and st["spec_cost_measure_s"] > 0
    again = dflash.Session(target, draft=drafters["dflash"], num_threads=2, speculation="adaptive",
                           spec_cost_table=costs)
    assert again.stats()["spec_cost_table"] == costs
    # The padded path measures at the graph batch sizes.
    padded = _core_session(target, drafters["dflash"], speculation="adaptive", pad_decode_batches=True,
                           max_num_seqs=6, draft_lengths=[3])
    assert list(padded.stats().spec_cost_batch_sizes) == [1, 2, 4, 6]
    assert list(padded.stats().draft_lengths) == [0, 3, 7]


@pytest.mark.parametrize("kwargs, match", [
    (dict(speculation="sometimes"), "speculation must be"),
    (dict(speculation="adaptive", draft="none"), "needs a draft model"),
    (dict(draft_lengths=[1, 3]), "need speculation='adaptive'"),
    (dict(speculation="adaptive", draft_lengths=[9]), "draft lengths must be in"),
    (dict(speculation="adaptive", draft_lengths=[-1]), "draft_lengths must be"),
    (dict(speculation="adaptive", draft_lengths="13"), "draft_lengths must be"),
    (dict(speculation="adaptive", spec_cost_table={"batch_sizes": [1]}), "spec_cost_table must be"),
    (dict(speculation="adaptive", spec_cost_table={"batch_sizes": [1], "lengths": [0, 7], "seconds": [[1.0]]}),
     "cost table row"),
    (dict(speculation="adaptive", draft_lengths=[3],
          spec_cost_table={"batch_sizes": [1], "lengths": [0, 7], "seconds": [[1.0, 2.0]]}), "not both"),
    (dict(speculation="adaptive", spec_cost_table={"batch_sizes": [1], "lengths": [0, 7], "seconds": [[1.0, 0.0]]}),
     "finite and > 0"),
])
def test_bad_options_are_value_errors(target, drafters, kwargs, match):
    kwargs.setdefault("draft", drafters["dflash"])
    with pytest.raises(ValueError, match=match):
        dflash.Session(target, num_threads=2, **kwargs)


def test_bad_schedules_are_value_errors(target, drafters):
    with pytest.raises(ValueError, match="not one of the draft lengths"):
        _core_session(target, drafters["dflash"], speculation="adaptive", spec_length_schedule=[2])
    with pytest.raises(ValueError, match="needs adaptive speculation|need speculation='adaptive'"):
        _core_session(target, drafters["dflash"], spec_length_schedule=[7])

# tests/test_dflash_probabilistic.py
#
# Probabilistic DFlash (v1) drafts (draft_sampling="probabilistic", and the default "auto"; CPU
# backend): at T > 0 each draft is a Gumbel-max draw from the drafter's softmax(logits / T) on the
# draft stream, and acceptance is exact rejection sampling against that dense proposal: the
# emitted token follows the target's distribution (chi-squared, with and without top-p); at T = 0
# output equals target greedy; seeded runs are identical alone and batched; the default resolves
# to it for DFlash and to the walk for DFlash2; bad settings are ValueErrors.
from __future__ import annotations

import json

import pytest

import dflash
from dflash.drafter_format import write_dflash2_drafter, write_dflash_drafter
from tests.runtime_helpers import assert_no_leaks
from tests.test_dflash_sampling import check_sampled_second_token

PROMPTS = [[17, 42, 99, 7, 250, 31], [5, 6, 7, 8], list(range(40, 70))]


@pytest.fixture
def target(tiny_model_dirs):
    return tiny_model_dirs["llama_gqa"]


def _drafter(tmp_path, target, **kw):
    cfg = json.loads((target / "config.json").read_text())
    kw.setdefault("num_layers", 1)
    kw.setdefault("target_layer_ids", [0, 1])
    kw.setdefault("block_size", 4)
    return write_dflash_drafter(tmp_path / "d", target_config=cfg, **kw)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_probabilistic_drafts_keep_the_target_distribution(tmp_path, target, top_p):
    # A small init keeps the drafter's distribution broad and T = 2 flattens the target's, so
    # drafts are accepted often enough that both branches of the rejection sampler run.
    d = _drafter(tmp_path, target, seed=5, init_std=0.02)
    spec = dflash.Session(target, draft=d, device="cpu", num_threads=2, draft_sampling="probabilistic")
    ar = dflash.Session(target, device="cpu", num_threads=2)
    # T = 2: a flat p, which overlaps the broad q
    check_sampled_second_token(spec, ar, PROMPTS[0], 120, 2.0, top_p, 2000, "probabilistic DFlash")


def test_greedy_at_temperature_zero_and_seeded_determinism(tmp_path, target):
    d = _drafter(tmp_path, target, block_size=5, seed=2)
    spec = dflash.Session(target, draft=d, device="cpu", num_threads=2, draft_sampling="probabilistic")
    ar = dflash.Session(target, device="cpu", num_threads=2)
    greedy = dflash.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in spec.generate(PROMPTS, greedy)] == [o.token_ids for o in ar.generate(PROMPTS, greedy)]
    params = [dflash.SamplingParams(max_tokens=16, temperature=1.0, seed=3 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    batched = [o.token_ids for o in spec.generate(PROMPTS, params)]
    alone = [spec.generate([p], [pp])[0].token_ids for p, pp in zip(PROMPTS, params)]
    assert batched == alone
    assert_no_leaks(spec)


def test_probabilistic_drafts_differ_from_greedy_drafts_at_t1(tmp_path, target):
    """The probabilistic mode really samples its drafts: over a few seeded requests at T = 1 its
    drafted tokens are not all the drafter's argmax (which greedy drafting would give)."""
    d = _drafter(tmp_path, target, seed=4, init_std=0.05)
    greedy = dflash.Session(target, draft=d, device="cpu", num_threads=1, draft_sampling="greedy")
    prob = dflash.Session(target, draft=d, device="cpu", num_threads=1, draft_sampling="probabilistic")
    params = [dflash.SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True) for s in range(6)]
    a = [o.metrics.num_accepted for o in greedy.generate([PROMPTS[0]] * 6, params)]
    b = [o.metrics.num_accepted for o in prob.generate([PROMPTS[0]] * 6, params)]
    # Both are exact samplers of the target, so outputs differ only through acceptance; with a
    # broad drafter the sampled drafts are accepted more often than its argmax rows.
    assert sum(b) >= sum(a)


def test_the_default_is_probabilistic_for_dflash_and_the_walk_for_dflash2(tmp_path, target):
    """draft_sampling="auto" (the default): probabilistic DFlash (v1) drafts, the higher tau at
    T = 1; DFlash2 drafters walk their candidates; stats() names what runs. At T = 0 the default
    drafts the same tokens as greedy drafting (same output, same acceptance)."""
    d = _drafter(tmp_path, target, seed=4, init_std=0.05)
    default = dflash.Session(target, draft=d, device="cpu", num_threads=1)
    greedy = dflash.Session(target, draft=d, device="cpu", num_threads=1, draft_sampling="greedy")
    assert default.stats()["draft_sampling"] == "probabilistic"
    assert greedy.stats()["draft_sampling"] == "greedy"
    assert dflash.Session(target, device="cpu", num_threads=1).stats()["draft_sampling"] is None
    params = dflash.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    a, b = default.generate(PROMPTS, params), greedy.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.metrics.num_accepted for o in a] == [o.metrics.num_accepted for o in b]
    cfg = json.loads((target / "config.json").read_text())
    d2 = write_dflash2_drafter(tmp_path / "d2", target_config=cfg, num_layers=1, target_layer_ids=[0, 1],
                               block_size=4, conv_group_size=8, selector_rank=4, selector_top_k=4)
    for mode, runs in (("auto", "walk"), ("greedy", "greedy_walk")):
        s2 = dflash.Session(target, draft=d2, device="cpu", num_threads=1, draft_sampling=mode)
        assert s2.stats()["draft_sampling"] == runs


def test_bad_draft_sampling_settings(tmp_path, target, tiny_model_dirs):
    d = _drafter(tmp_path, target)
    with pytest.raises(ValueError, match="draft_sampling must be"):
        dflash.Session(target, draft=d, device="cpu", num_threads=1, draft_sampling="beam")
    with pytest.raises(ValueError, match="needs a draft model"):
        dflash.Session(target, draft="none", device="cpu", num_threads=1, draft_sampling="probabilistic")
    cfg = json.loads((target / "config.json").read_text())
    d2 = write_dflash2_drafter(tmp_path / "d2", target_config=cfg, num_layers=1, target_layer_ids=[0, 1],
                               block_size=4, conv_group_size=8, selector_rank=4, selector_top_k=4)
    with pytest.raises(ValueError, match="applies to DFlash \\(v1\\) drafters"):
        dflash.Session(target, draft=d2, device="cpu", num_threads=1, draft_sampling="probabilistic")

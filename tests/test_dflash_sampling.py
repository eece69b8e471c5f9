# tests/test_dflash_sampling.py
#
# Exact sampling with speculative decoding: at T = 0.8, with and without top-p, the token
# decided by the draft–verify acceptance follows the target's own next-token distribution
# (chi-squared test), both when drafts are mostly rejected (a random drafter) and when the
# draft is the likeliest token (accepted with probability p(d), via the oracle-draft hook). The
# one-hot proposals of draft_sampling="greedy"; the drafter's own distribution as q
# (the default) is tested in test_dflash_probabilistic.py.
from __future__ import annotations

import json

import numpy as np
import pytest

import dflash
from dflash.drafter_format import write_dflash_drafter
from tests.runtime_helpers import assert_no_leaks, forced_run, sampled_second_tokens

N = 3000


def _target_probs(ar, prompt, first, temperature, top_p):
    logits, _, _ = forced_run(ar, prompt, [first])
    z = logits[-1].astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = order[: int(np.searchsorted(np.cumsum(p[order]), top_p) + 1)]
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return p


def _chi2_ok(samples, probs):
    expected = probs * len(samples)
    big = expected >= 5
    obs = [np.sum(samples == t) for t in np.nonzero(big)[0]]
    exp = list(expected[big])
    rest_obs, rest_exp = int(np.sum(~big[samples])), float(expected[~big].sum())
    if rest_exp > 0:
        obs.append(rest_obs)
        exp.append(rest_exp)
    else:
        assert rest_obs == 0  # tokens outside the support (e.g. cut by top-p) never appear
    obs, exp = np.array(obs, dtype=float), np.array(exp)
    chi2 = float(np.sum((obs - exp) ** 2 / exp))
    dof = len(exp) - 1
    limit = dof + 3.3 * np.sqrt(2 * max(dof, 1)) + 10  # about the 99.9 % quantile for these dof
    return chi2, dof, chi2 < limit


def check_sampled_second_token(spec, ar, prompt, first, temperature, top_p, num_seeds, label, min_accepted=10):
    """The token sampled after a forced `first` token goes through spec's speculative step (its
    first draft through acceptance): over num_seeds seeds it must follow ar's distribution
    (chi-squared), with at least min_accepted first drafts accepted (the acceptance branch ran, not
    only the residual one), and spec must hold no KV block afterwards. Returns (chi2, dof)."""
    probs = _target_probs(ar, prompt, first, temperature, top_p)
    results = sampled_second_tokens(spec, prompt, first, temperature=temperature, top_p=top_p, num_seeds=num_seeds)
    second = np.array([r.token_ids[1] for r in results])
    chi2, dof, ok = _chi2_ok(second, probs)
    accepted = sum(r.metrics.num_accepted > 0 for r in results)
    print(f"{label} top_p={top_p}: chi2={chi2:.1f} dof={dof} first drafts accepted {accepted} / {num_seeds}")
    assert ok, (chi2, dof)
    assert accepted >= min_accepted
    assert_no_leaks(spec)
    return chi2, dof


@pytest.mark.parametrize("top_p", [1.0, 0.8])
@pytest.mark.parametrize("proposal", ["random_drafter", "likeliest_token"])
def test_speculative_sampling_matches_target_distribution(tmp_path, tiny_model_dirs, top_p, proposal):
    target = tiny_model_dirs["llama_gqa"]
    cfg = json.loads((target / "config.json").read_text())
    dr = write_dflash_drafter(tmp_path / "d", target_config=cfg, num_layers=1, target_layer_ids=[0, 1],
                              block_size=4, seed=5)
    spec = dflash.Session(target, draft=dr, num_threads=2, draft_sampling="greedy")  # one-hot q (oracle drafts too)
    ar = dflash.Session(target, num_threads=2)
    prompt = [17, 42, 99, 7, 250, 31]
    first = 120
    T = 0.8
    probs = _target_probs(ar, prompt, first, T, top_p)
    likeliest = int(np.argmax(probs))
    oracle = [first, likeliest, likeliest, likeliest] if proposal == "likeliest_token" else None
    results = sampled_second_tokens(spec, prompt, first, temperature=T, top_p=top_p, num_seeds=N,
                                    oracle_drafts=oracle)
    second = np.array([r.token_ids[1] for r in results])
    chi2, dof, ok = _chi2_ok(second, probs)
    accepted = sum(r.metrics.num_accepted > 0 for r in results) / N
    print(f"{proposal} top_p={top_p}: chi2={chi2:.1f} dof={dof} first-draft acceptance={accepted:.3f} "
          f"p(likeliest)={probs[likeliest]:.3f}")
    assert ok, (chi2, dof)
    if proposal == "likeliest_token":  # the draft is accepted with probability p(d)
        assert abs(accepted - probs[likeliest]) < 4 * np.sqrt(probs[likeliest] * (1 - probs[likeliest]) / N) + 0.01
    assert_no_leaks(spec)

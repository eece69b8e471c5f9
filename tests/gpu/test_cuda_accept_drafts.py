# tests/gpu/test_cuda_accept_drafts.py
#
# The accept_drafts kernel: greedy acceptance, exact agreement with host_acceptance.cpp's rejection
# sampling (Philox streams included), and chi-squared tests of the accepted distribution for random
# and likeliest-token proposals. Skipped without a CUDA device or a CUDA build of dflash.
from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.gpu_helpers import DEV, kernel_ops, requires_cuda, torch
from tests.gpu.sampling_reference import (
    SAMPLE_CONFIGS,
    chi2_ok,
    drafts_following_argmax,
    llm_like_logits,
    ref_accept,
    ref_filtered,
    run_accept,
)

pytestmark = requires_cuda

_ops = kernel_ops


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("n", [0, 1, 7, 15, 40])
@pytest.mark.parametrize("vocab", [1000, 151936])
def test_accept_greedy(rows, n, vocab):
    logits = llm_like_logits(rows * (n + 1), vocab, seed=rows * 31 + n).view(rows, n + 1, vocab)
    drafts = drafts_following_argmax(logits, seed=n)
    num, nxt = run_accept(drafts, logits, 0.0, 0, 1.0, range(rows), range(rows))
    best = torch.argmax(logits, dim=-1).cpu().numpy()
    d = drafts.cpu().numpy()
    for r in range(rows):
        a = 0
        while a < n and d[r, a] == best[r, a]:
            a += 1
        assert (num[r], nxt[r]) == (a, best[r, a]), r


@pytest.mark.parametrize("vocab", [1000, 151936])
@pytest.mark.parametrize("rows,n", [(20, 6), (10, 6), (8, 15), (3, 31), (2, 40)])
def test_accept_sampling_matches_cpu_reference(vocab, rows, n):
    """Few requests run the cluster kernel (8 blocks per request), many the one-block kernel."""
    logits = llm_like_logits(rows * (n + 1), vocab, seed=vocab + 1, spread=2.0).view(rows, n + 1, vocab)
    drafts = drafts_following_argmax(logits, seed=vocab)  # likely accepted, then a rejection
    temps = [SAMPLE_CONFIGS[i % len(SAMPLE_CONFIGS)][0] for i in range(rows)]
    ks = [SAMPLE_CONFIGS[i % len(SAMPLE_CONFIGS)][1] for i in range(rows)]
    ps = [SAMPLE_CONFIGS[i % len(SAMPLE_CONFIGS)][2] for i in range(rows)]
    seeds = [77 + 1009 * r for r in range(rows)]
    positions = [40 + 3 * r for r in range(rows)]
    num, nxt = run_accept(drafts, logits, temps, ks, ps, seeds, positions)
    host, d = logits.cpu().numpy(), drafts.cpu().numpy()
    mismatches, skipped = [], 0
    for r in range(rows):
        a, tok, hit = ref_accept(d[r], host[r], temps[r], ks[r], ps[r], seeds[r], positions[r])
        if hit:
            skipped += 1
        elif (num[r], nxt[r]) != (a, tok):
            mismatches.append((r, temps[r], ks[r], ps[r], (int(num[r]), int(nxt[r])), (a, tok)))
    print(f"accept vocab={vocab} n={n}: {rows} requests, accepted {num.tolist()}, {len(mismatches)} mismatches, "
          f"{skipped} skipped (u == 1)")
    assert not mismatches, mismatches[:5]


@pytest.mark.parametrize("top_p", [1.0, 0.8])
@pytest.mark.parametrize("proposal", ["random_draft", "likeliest_token"])
def test_accept_sampling_distribution(top_p, proposal):
    """The token emitted at the draft's position (the draft if accepted, else the correction)
    follows the target distribution; a draft d is accepted with frequency p(d)."""
    rows, vocab, temperature = 20000, 50, 0.8
    base = llm_like_logits(2, vocab, seed=9, spread=1.5, boost=False)
    logits = base.unsqueeze(0).expand(rows, 2, vocab).contiguous()
    ids, probs = ref_filtered(base[0].cpu().numpy(), temperature, 0, top_p)
    p = np.zeros(vocab)
    p[ids] = probs
    if proposal == "likeliest_token":
        draft = np.full(rows, int(np.argmax(p)))
    else:
        draft = np.random.default_rng(1).integers(0, vocab, rows)
    drafts = torch.tensor(draft, device=DEV, dtype=torch.int32).view(rows, 1)
    num, nxt = run_accept(drafts, logits, temperature, 0, top_p, [5 * r + 2 for r in range(rows)], [r % 89 for r in range(rows)])
    emitted = np.where(num >= 1, draft, nxt)
    chi2, dof, ok = chi2_ok(emitted, p)
    accepted = float(np.mean(num >= 1))
    expected = float(np.mean(p[draft]))
    print(f"accept {proposal} top_p={top_p}: chi2={chi2:.1f} dof={dof} acceptance={accepted:.4f} "
          f"mean p(d)={expected:.4f}")
    assert ok, (chi2, dof)
    assert abs(accepted - expected) < 4 * np.sqrt(max(expected * (1 - expected), 1e-4) / rows) + 0.005
    assert np.all(nxt[num == 0] != draft[num == 0])  # a rejected draft is never the correction

# tests/gpu/test_cuda_sampling.py
#
# The sample kernel: greedy equals argmax, exact agreement with the CPU backend's sampling (its
# Philox streams included) over temperature / top-k / top-p, the exact-cut fallbacks, support,
# chi-squared tests of the sampled distribution, determinism. Skipped without a CUDA device.
from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.gpu_helpers import DEV, kernel_ops, requires_cuda, torch
from tests.gpu.sampling_reference import (
    SAMPLE_CONFIGS,
    chi2_ok,
    llm_like_logits,
    ref_filtered,
    ref_sample,
    run_sample,
)

pytestmark = requires_cuda

_ops = kernel_ops


@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("vocab", [1000, 151936, 1001])
@pytest.mark.parametrize("ties", [False, True])
def test_sample_greedy_is_argmax(rows, vocab, ties):
    logits = llm_like_logits(rows, vocab, seed=vocab + rows)
    if ties:
        logits = logits.round().clamp(max=5.0)  # many equal maxima: the lowest id wins
    tokens = run_sample(logits, 0.0, 0, 1.0, range(rows), range(rows))
    want = torch.argmax(logits, dim=-1).cpu().numpy()  # first maximal index
    assert np.array_equal(tokens, want)




def compare_with_reference(logits, configs, seeds, positions, name):
    rows = logits.shape[0]
    temps = [configs[i % len(configs)][0] for i in range(rows)]
    ks = [configs[i % len(configs)][1] for i in range(rows)]
    ps = [configs[i % len(configs)][2] for i in range(rows)]
    tokens = run_sample(logits, temps, ks, ps, seeds, positions)
    host = logits.cpu().numpy()
    mismatches, skipped = [], 0
    for r in range(rows):
        want, hit_one = ref_sample(host[r], temps[r], ks[r], ps[r], int(seeds[r]), int(positions[r]))
        if hit_one:
            skipped += 1
            continue
        if tokens[r] != want:
            mismatches.append((r, temps[r], ks[r], ps[r], int(tokens[r]), want))
    print(f"{name}: {rows} rows, {len(mismatches)} mismatches vs the CPU reference, {skipped} rows skipped (u == 1)")
    assert not mismatches, mismatches[:5]


@pytest.mark.parametrize("vocab", [1000, 151936, 50257])
def test_sample_matches_cpu_reference(vocab):
    rows = 2 * len(SAMPLE_CONFIGS) + 3
    logits = llm_like_logits(rows, vocab, seed=vocab)
    seeds = [1000 + 7919 * r for r in range(rows)]
    positions = [5 + 13 * r for r in range(rows)]
    compare_with_reference(logits, SAMPLE_CONFIGS, seeds, positions, f"sample vocab={vocab}")


@pytest.mark.parametrize("vocab", [1000, 151936])
@pytest.mark.parametrize("kind", ["all_equal", "concentrated", "two_levels"])
def test_sample_exact_cut_fallbacks(vocab, kind):
    """Ties across the cut and bins of more than 2048 tokens (the radix select + scan by id)."""
    rows = 12
    g = torch.Generator(device=DEV).manual_seed(3)
    if kind == "all_equal":
        logits = torch.full((rows, vocab), 1.25, device=DEV)
    elif kind == "concentrated":
        logits = torch.randn(rows, vocab, device=DEV, generator=g) * 0.002
    else:
        logits = (torch.rand(rows, vocab, device=DEV, generator=g) < 0.5).float() * 0.5
    configs = [(1.0, 5, 1.0), (1.0, 0, 0.3037), (0.9, 3000, 0.77), (1.0, 2500, 1.0), (1.1, 0, 0.61), (1.0, 1, 1.0)]
    seeds = [11 + r for r in range(rows)]
    positions = [100 + r for r in range(rows)]
    compare_with_reference(logits, configs, seeds, positions, f"sample fallback {kind} vocab={vocab}")


@pytest.mark.parametrize("vocab", [1000, 151936])
def test_sample_support_respected(vocab):
    """Many draws of one row: every token lies in the CPU reference's kept set."""
    rows = 512
    base = llm_like_logits(1, vocab, seed=42)
    logits = base.expand(rows, vocab).contiguous()
    host = base[0].cpu().numpy()
    for temperature, top_k, top_p in [(1.0, 10, 1.0), (1.0, 0, 0.7), (1.2, 40, 0.9)]:
        tokens = run_sample(logits, temperature, top_k, top_p, range(rows), [9] * rows)
        ids, _ = ref_filtered(host, temperature, top_k, top_p)
        outside = set(tokens.tolist()) - set(ids.tolist())
        print(f"support vocab={vocab} T={temperature} k={top_k} p={top_p}: kept {len(ids)}, distinct drawn "
              f"{len(set(tokens.tolist()))}")
        assert not outside, sorted(outside)[:10]


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (10, 1.0), (0, 0.8), (10, 0.8)])
def test_sample_distribution_chi2(top_k, top_p):
    rows, vocab, temperature = 20000, 50, 0.8
    base = llm_like_logits(1, vocab, seed=5, spread=1.5, boost=False)
    logits = base.expand(rows, vocab).contiguous()
    tokens = run_sample(logits, temperature, top_k, top_p, [3 * r + 1 for r in range(rows)], [r % 97 for r in range(rows)])
    ids, probs = ref_filtered(base[0].cpu().numpy(), temperature, top_k, top_p)
    p = np.zeros(vocab)
    p[ids] = probs
    chi2, dof, ok = chi2_ok(tokens, p)
    print(f"sample chi2 T={temperature} top_k={top_k} top_p={top_p}: chi2={chi2:.1f} dof={dof}")
    assert ok, (chi2, dof)


def test_sample_is_deterministic():
    logits = llm_like_logits(17, 151936, seed=8)
    args = (logits, 0.9, 30, 0.9, range(17), range(17))
    assert np.array_equal(run_sample(*args), run_sample(*args))

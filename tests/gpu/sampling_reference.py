# tests/gpu/sampling_reference.py
#
# The GPU sampling and acceptance tests' reference: a numpy port of common/philox.h and of
# cpu_sampling.cpp / host_acceptance.cpp (filtering, draws, rejection acceptance), a chi-squared
# check, LLM-like logits, and runners of the cuda_sample / cuda_accept_drafts bindings.
from __future__ import annotations

import numpy as np

from tests.gpu.gpu_helpers import DEV, kernel_ops, torch

_ops = kernel_ops


STREAM_TARGET_SAMPLE, STREAM_ACCEPT = 0, 2
_M32 = np.uint64(0xFFFFFFFF)


def philox_uniform(seed, position, index, stream):
    c0 = np.asarray(index, dtype=np.uint64).copy()
    c1 = np.full(c0.shape, stream, dtype=np.uint64)
    c2 = np.full(c0.shape, position & 0xFFFFFFFF, dtype=np.uint64)
    c3 = np.full(c0.shape, (position >> 32) & 0xFFFFFFFF, dtype=np.uint64)
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    for _ in range(10):
        p0, p1 = c0 * np.uint64(0xD2511F53), c2 * np.uint64(0xCD9E8D57)
        n0 = (p1 >> np.uint64(32)) ^ c1 ^ np.uint64(k0)
        n2 = (p0 >> np.uint64(32)) ^ c3 ^ np.uint64(k1)
        c0, c1, c2, c3 = n0, p1 & _M32, n2, p0 & _M32
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return ((c0 >> np.uint64(9)).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 8388608.0)


def ref_filtered(logits, temperature, top_k, top_p):
    """cpu_sampling.cpp filtered_distribution: kept ids (CPU order) and their probabilities."""
    vocab = logits.shape[0]
    use_k, use_p = 0 < top_k < vocab, np.float32(top_p) < 1
    ids = np.arange(vocab)
    if use_k or use_p:
        ids = np.lexsort((ids, -logits.astype(np.float64)))  # logit desc, id asc
        if use_k:
            ids = ids[:top_k]
    z = logits[ids].astype(np.float64) * (1.0 / np.float64(np.float32(temperature)))
    p = np.exp(z - z.max())
    if use_p:
        cum = np.cumsum(p / p.sum())
        n = int(np.argmax(cum >= np.float64(np.float32(top_p)))) + 1 if (cum >= np.float32(top_p)).any() else len(ids)
        ids, p = ids[:n], p[:n]
    return ids, p / p.sum()


def ref_draw(ids, probs, excluded, seed, position):
    """cpu_sampling.cpp draw_token. Returns (token, u_hit_one): the second flags a kept token whose
    uniform is exactly 1.0 (philox_uniform can return 1.0f; see the report), where the GPU's
    candidate bound may legitimately differ from the CPU."""
    u = philox_uniform(seed, position, ids, STREAM_TARGET_SAMPLE).astype(np.float64)
    ok = (ids != excluded) & (probs > 0)
    with np.errstate(divide="ignore"):
        score = np.where(ok, np.log(probs) - np.log(-np.log(u)), -np.inf)
    hit_one = bool((u[ok] >= 1.0).any())
    if not ok.any():
        return -1, hit_one
    return int(ids[int(np.argmax(score))]), hit_one


def ref_sample(logits, temperature, top_k, top_p, seed, position):
    if temperature <= 0:
        return int(np.argmax(logits)), False
    ids, probs = ref_filtered(logits, temperature, top_k, top_p)
    return ref_draw(ids, probs, -1, seed, position)


def ref_accept(drafts, logits, temperature, top_k, top_p, seed, first_position):
    """host_acceptance.cpp accept_drafts: (num_accepted, next_token, u_hit_one)."""
    n = len(drafts)
    if temperature <= 0:
        for j in range(n + 1):
            best = int(np.argmax(logits[j]))
            if j == n or drafts[j] != best:
                return j, best, False
    for j in range(n + 1):
        pos = first_position + j
        ids, probs = ref_filtered(logits[j], temperature, top_k, top_p)
        if j == n:
            tok, hit = ref_draw(ids, probs, -1, seed, pos)
            return n, tok, hit
        p_d = float(probs[ids == drafts[j]].sum())
        u = float(philox_uniform(seed, pos, [0], STREAM_ACCEPT)[0])
        if u < p_d:
            continue
        tok, hit = ref_draw(ids, probs, drafts[j], seed, pos)
        return j, tok, hit


def chi2_ok(samples, probs):
    """The chi-squared test of tests/test_dflash_sampling.py (about the 99.9 % quantile)."""
    expected = probs * len(samples)
    big = expected >= 5
    obs = [np.sum(samples == t) for t in np.nonzero(big)[0]]
    exp = list(expected[big])
    rest_obs, rest_exp = int(np.sum(~big[samples])), float(expected[~big].sum())
    if rest_exp > 0:
        obs.append(rest_obs)
        exp.append(rest_exp)
    else:
        assert rest_obs == 0  # tokens outside the support never appear
    obs, exp = np.array(obs, dtype=float), np.array(exp)
    chi2 = float(np.sum((obs - exp) ** 2 / exp))
    dof = len(exp) - 1
    limit = dof + 3.3 * np.sqrt(2 * max(dof, 1)) + 10
    return chi2, dof, chi2 < limit


def llm_like_logits(rows, vocab, seed, spread=3.0, boost=True):
    """fp32 logits, with a peaked head like a language model's when boost."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(rows, vocab, device=DEV, generator=g) * spread
    if boost:
        top = torch.randint(0, vocab, (rows, 8), device=DEV, generator=g)
        x.scatter_add_(1, top, torch.rand(rows, 8, device=DEV, generator=g) * 12 + 4)
    return x


def run_sample(logits, temperature, top_k, top_p, seeds, positions):
    K = _ops()
    rows = logits.shape[0]
    as_list = lambda v, t: list(v) if isinstance(v, (list, tuple, np.ndarray)) else [t(v)] * rows  # noqa: E731
    tokens = torch.full((rows,), -7, device=DEV, dtype=torch.int32)
    K.cuda_sample(logits.contiguous(), as_list(temperature, float), as_list(top_k, int), as_list(top_p, float),
                  [int(s) for s in seeds], [int(p) for p in positions], tokens)
    return tokens.cpu().numpy()


def run_accept(drafts, logits, temperature, top_k, top_p, seeds, positions):
    K = _ops()
    rows = drafts.shape[0]
    as_list = lambda v, t: list(v) if isinstance(v, (list, tuple, np.ndarray)) else [t(v)] * rows  # noqa: E731
    num = torch.full((rows,), -7, device=DEV, dtype=torch.int32)
    nxt = torch.full((rows,), -7, device=DEV, dtype=torch.int32)
    K.cuda_accept_drafts(drafts.contiguous(), logits.contiguous(), as_list(temperature, float), as_list(top_k, int),
                         as_list(top_p, float), [int(s) for s in seeds], [int(p) for p in positions], num, nxt)
    return num.cpu().numpy(), nxt.cpu().numpy()


def drafts_following_argmax(logits, seed):
    """Drafts equal to each row's argmax up to a random first mismatch (or none)."""
    rows, n1, vocab = logits.shape
    n = n1 - 1
    drafts = torch.argmax(logits[:, :n], dim=-1).to(torch.int32)
    rng = np.random.default_rng(seed)
    for r in range(rows):
        cut = int(rng.integers(0, n + 1))
        if cut < n:
            drafts[r, cut] = (drafts[r, cut] + 1 + int(rng.integers(0, vocab - 1))) % vocab
    return drafts


SAMPLE_CONFIGS = [  # temperature, top_k, top_p
    (1.0, 0, 1.0),
    (0.8, 0, 1.0),
    (0.7, 20, 1.0),
    (0.6, 0, 0.95),
    (0.6, 20, 0.95),
    (1.3, 50, 0.8),
    (0.8, 1, 1.0),
    (1.0, 0, 0.3),
    (1.5, 5000, 1.0),  # top-k larger than the shared-memory list: cut in one bin
    (2.0, 0, 0.999),  # top-p over a large kept set
]

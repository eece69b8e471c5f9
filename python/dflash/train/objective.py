# python/dflash/train/objective.py
#
# The DFlash training objective on a batch (training.md 2-3):
#
# 1. Target features.  The frozen target runs causally over prompt+response
#    (right-padded; causality keeps pads out of real positions).  The feature
#    of layer id l is the OUTPUT of decoder layer l (HF hidden_states[l + 1]);
#    for the last layer the pre-final-norm output is taken from a forward hook,
#    because transformers 5 replaces hidden_states[-1] by the normed state
#    (same convention as tests/reference/dflash_reference.target_features).
#    Features of all positions are concatenated per token: F [b, S, K*Ht].
# 2. Anchors.  Valid anchors of a sequence with prompt length P and length L
#    are a in [P, L-2]: response tokens whose next token is also a response
#    token (loss mask = response only).  N = min(num_anchors, max #valid in the
#    batch); each sequence draws min(num_anchors, #valid) of them uniformly
#    without replacement (all of them when fewer exist), re-drawn every step
#    from a seeded generator, sorted ascending; missing slots are padding
#    blocks (keep = False).
# 3. Blocks.  Block j = [x[a_j], MASK * (B-1)] at positions a_j .. a_j+B-1,
#    embedded with the target's frozen table.  Padding blocks are all MASK.
# 4. Mask.  Block j sees context positions t < a_j (strict: the anchor's own
#    target state does not exist at inference) and all B keys of its own
#    block, non-causally; nothing of other blocks (model.py computes it as
#    [masked context scores | own-block scores] per query row).  Padding
#    blocks see only themselves and carry zero loss weight.
# 5. Loss.  Block position k >= 1 predicts x[a_j + k] (same-position labels;
#    position 0 has no loss).  Weight W = keep * [a_j+k < L] * w_k with
#    w_k = exp(-(k-1)/gamma) (gamma <= 0 or None: uniform).  Loss =
#    sum(W * CE) / sum(W), CE over the full vocabulary in fp32, LM head + CE in
#    checkpointed chunks of rows (the logits are the memory hog).
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = [
    "Batch", "collate", "default_gamma", "position_weights", "target_features", "sample_anchors",
    "eval_anchors", "build_blocks", "dflash_loss", "unary_terms", "UnaryTerms",
]

IGNORE = -100


def default_gamma(block_size: int) -> float:
    """Paper values (training.md 3.1): 7 for B=16, 5 for B=10, 4 for B=8; else B/2."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(int(block_size), max(1.0, block_size / 2.0))


def position_weights(block_size: int, gamma: float | None) -> torch.Tensor:
    """[B] weights: 0 at k = 0, exp(-(k-1)/gamma) for k >= 1 (uniform 1 when gamma <= 0/None)."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.ones(block_size) if not gamma or gamma <= 0 else torch.exp(-(k - 1) / float(gamma))
    w[0] = 0.0
    return w


@dataclass
class Batch:
    input_ids: torch.Tensor  # [b, S] long, right-padded
    lengths: torch.Tensor  # [b] long
    prompt_lens: torch.Tensor  # [b] long

    def to(self, device: Any) -> "Batch":
        return Batch(self.input_ids.to(device), self.lengths.to(device), self.prompt_lens.to(device))


def collate(examples: Sequence[tuple[Sequence[int], int]], pad_id: int = 0) -> Batch:
    """[(token ids of prompt+response, prompt length)] -> right-padded Batch."""
    s = max(len(ids) for ids, _ in examples)
    x = torch.full((len(examples), s), int(pad_id), dtype=torch.long)
    for i, (ids, _) in enumerate(examples):
        x[i, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
    return Batch(x, torch.tensor([len(ids) for ids, _ in examples]), torch.tensor([int(p) for _, p in examples]))


@torch.no_grad()
def target_features(target_model: Any, input_ids: torch.Tensor, layer_ids: Sequence[int],
                    return_logits: bool = False) -> Any:
    """Frozen target forward over input_ids [b, S]: features [b, S, K*Ht] fp32.

    With return_logits, also the fp32 logits of the LAST position [b, V].
    """
    layers = target_model.model.layers
    n = len(layers)
    ids = [int(i) for i in layer_ids]
    if any(not 0 <= i < n for i in ids):
        raise ValueError(f"target_layer_ids {ids} outside [0, {n})")
    captured: dict[str, torch.Tensor] = {}

    def keep_last(_m: Any, _a: Any, out: Any) -> None:
        captured["last"] = out[0] if isinstance(out, tuple) else out

    handle = layers[n - 1].register_forward_hook(keep_last)
    try:
        out = target_model(input_ids=input_ids, output_hidden_states=True, use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    feats = torch.cat([(captured["last"] if i == n - 1 else out.hidden_states[i + 1]).float() for i in ids], dim=-1)
    if return_logits:
        return feats, out.logits[:, -1].float()
    return feats


def _valid_anchor_range(batch: Batch, i: int) -> tuple[int, int]:
    return int(batch.prompt_lens[i]), int(batch.lengths[i]) - 1  # a in [P, L-2] -> range(P, L-1)


def sample_anchors(batch: Batch, num_anchors: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors (see header): (anchors [b, N] long, keep [b, N] bool), on the CPU."""
    picks = []
    for i in range(batch.input_ids.shape[0]):
        lo, hi = _valid_anchor_range(batch, i)
        c = max(0, hi - lo)
        r = torch.rand(c, generator=generator)
        idx = torch.argsort(r)[: min(int(num_anchors), c)]
        picks.append(torch.sort(idx + lo).values)
    return _pad_anchors(picks)


def eval_anchors(batch: Batch, num_anchors: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic anchors: every valid position, or num_anchors evenly spaced ones."""
    picks = []
    for i in range(batch.input_ids.shape[0]):
        lo, hi = _valid_anchor_range(batch, i)
        c = max(0, hi - lo)
        if c <= num_anchors:
            picks.append(torch.arange(lo, hi))
        else:
            picks.append(torch.unique(torch.linspace(lo, hi - 1, int(num_anchors)).round().long()))
    return _pad_anchors(picks)


def _pad_anchors(picks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(1, max(p.numel() for p in picks))
    anchors = torch.zeros(len(picks), n, dtype=torch.long)
    keep = torch.zeros(len(picks), n, dtype=torch.bool)
    for i, p in enumerate(picks):
        anchors[i, : p.numel()] = p
        keep[i, : p.numel()] = True
    return anchors, keep


def build_blocks(batch: Batch, anchors: torch.Tensor, keep: torch.Tensor, block_size: int, mask_token_id: int,
                 pos_weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Block inputs, positions, context mask, labels and loss weights (header steps 3-5)."""
    dev = batch.input_ids.device
    anchors, keep = anchors.to(dev), keep.to(dev)
    b, s = batch.input_ids.shape
    k = torch.arange(block_size, device=dev)
    pos = anchors[..., None] + k  # [b, N, B]
    in_seq = (pos < batch.lengths[:, None, None]) & keep[..., None]
    tokens = torch.gather(batch.input_ids, 1, pos.clamp(max=s - 1).reshape(b, -1)).view(pos.shape)
    block_ids = torch.full_like(pos, int(mask_token_id))
    block_ids[..., 0] = torch.where(keep, tokens[..., 0], block_ids[..., 0])
    supervised = in_seq & (k >= 1)
    labels = torch.where(supervised, tokens, torch.full_like(tokens, IGNORE))
    weights = supervised.float() * pos_weights.to(dev)
    ctx_mask = (torch.arange(s, device=dev)[None, None, :] < anchors[..., None]) & keep[..., None]
    return {"block_ids": block_ids, "block_pos": pos, "ctx_mask": ctx_mask, "labels": labels, "weights": weights}


def _ce_rows(h: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             top_k: int = 0) -> tuple[torch.Tensor, ...]:
    """Per-row CE and argmax of the LM head on h; with top_k > 0 also the top-K logits and
    ids (largest first, lower id first among ties) and the label's logit (DFlash2 selector)."""
    logits = F.linear(h, weight, bias).float()
    ce, pred = F.cross_entropy(logits, labels, reduction="none"), logits.argmax(dim=-1)
    if top_k <= 0:
        return ce, pred
    values, ids = top_k_lowest_index(logits, top_k)
    return ce, pred, values, ids, logits.gather(1, labels[:, None])[:, 0]


def top_k_lowest_index(logits: torch.Tensor, k: int, spare: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V] -> (values [n, k], ids [n, k]): the k largest, largest first, the lower id
    first among equal values (the runtime's rule), without sorting the whole vocabulary.

    torch.topk breaks ties in no stated order, so it takes k + spare values and a stable sort by
    (value, id) orders them; that is exact unless the tie group of the k-th value reaches the
    last value taken (then ids outside the taken set may tie with it), and those rows take the
    full stable sort.  The outputs own their memory (no view of an [n, V] tensor)."""
    v = logits.shape[-1]
    m = min(v, int(k) + int(spare))
    if m >= v:
        s = torch.sort(logits, dim=-1, descending=True, stable=True)
        return s.values[:, :k].contiguous(), s.indices[:, :k].contiguous()
    vals, ids = torch.topk(logits, m, dim=-1)
    last = vals[:, -1]  # the m-th largest value
    ids, order = torch.sort(ids, dim=-1)  # by id, then stably by value: lower id first among ties
    vals, order = torch.sort(vals.gather(1, order), dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)
    vals, ids = vals[:, :k].contiguous(), ids[:, :k].contiguous()
    tied = torch.nonzero(vals[:, k - 1] <= last).flatten()
    if tied.numel():
        s = torch.sort(logits[tied], dim=-1, descending=True, stable=True)
        vals = vals.index_put((tied,), s.values[:, :k])
        ids = ids.index_put((tied,), s.indices[:, :k])
    return vals, ids


@dataclass
class UnaryTerms:
    """What the DFlash (unary) loss computed on one batch, for an extra loss term on top."""

    loss: torch.Tensor  # weighted CE over the supervised rows
    stats: dict[str, Any]
    blocks: dict[str, torch.Tensor]  # build_blocks' output
    supervised: torch.Tensor  # [b, N, B] bool: rows with a label
    rows: torch.Tensor  # [n, H] final-normed drafter states of the supervised rows
    weights: torch.Tensor  # [n] position weights
    top_values: torch.Tensor | None = None  # [n, K] unary top-K logits (top_k > 0)
    top_ids: torch.Tensor | None = None  # [n, K]
    label_logit: torch.Tensor | None = None  # [n] the label's unary logit


def dflash_loss(
    drafter: Any,
    target_model: Any,
    batch: Batch,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    *,
    gamma: float | None,
    chunk_rows: int = 8192,
    feats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The weighted DFlash loss of one batch and its statistics.

    Returns (loss, stats): stats has per-position correct/total counts (k = 1..B-1),
    the weighted loss numerator/denominator, the number of kept blocks and the summed
    teacher-forced accepted length (1 + leading correct drafts, over kept blocks).
    """
    t = unary_terms(drafter, target_model, batch, anchors, keep, gamma=gamma, chunk_rows=chunk_rows, feats=feats)
    return t.loss, t.stats


def unary_terms(
    drafter: Any,
    target_model: Any,
    batch: Batch,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    *,
    gamma: float | None,
    chunk_rows: int = 8192,
    feats: torch.Tensor | None = None,
    top_k: int = 0,
) -> UnaryTerms:
    """dflash_loss with its intermediate rows (and, with top_k > 0, the unary top-K per row)."""
    cfg = drafter.config
    bs = cfg.block_size
    if feats is None:
        feats = target_features(target_model, batch.input_ids, cfg.target_layer_ids)
    blocks = build_blocks(batch, anchors, keep, bs, cfg.mask_token_id, position_weights(bs, gamma))
    b, s = batch.input_ids.shape
    ctx_pos = torch.arange(s, device=batch.input_ids.device)[None].expand(b, s)
    h = drafter(blocks["block_ids"], blocks["block_pos"], feats, ctx_pos, blocks["ctx_mask"])
    sel = blocks["labels"] != IGNORE
    rows, labels, w = h[sel], blocks["labels"][sel], blocks["weights"][sel]
    parts: list[tuple[torch.Tensor, ...]] = []
    for i in range(0, rows.shape[0], max(1, int(chunk_rows))):
        args = (rows[i:i + chunk_rows], labels[i:i + chunk_rows], drafter.lm_head_weight, drafter.lm_head_bias,
                int(top_k))
        parts.append(checkpoint(_ce_rows, *args, use_reentrant=False) if rows.requires_grad else _ce_rows(*args))
    if parts:
        cols = [torch.cat(c) for c in zip(*parts)]
    else:
        cols = [rows.new_zeros(0), labels.new_zeros(0)]
        if top_k > 0:
            cols += [rows.new_zeros(0, top_k), labels.new_zeros(0, top_k), rows.new_zeros(0)]
    ce, pred = cols[0], cols[1]
    denom = w.sum()
    num = (w * ce).sum()
    loss = num / denom.clamp_min(1e-12)

    with torch.no_grad():
        correct = torch.zeros_like(blocks["labels"], dtype=torch.bool)
        correct[sel] = pred == labels
        kk = sel.sum(dim=(0, 1))[1:]
        ck = correct.sum(dim=(0, 1))[1:]
        # teacher-forced accepted length of each kept block: 1 + leading correct drafts
        lead = torch.cumprod(correct[..., 1:].long(), dim=-1).sum(-1)
        kept = keep.to(lead.device)
        al_sum = float((1 + lead)[kept].sum())
    stats = {
        "loss_num": float(num.detach()), "loss_den": float(denom), "correct": ck.cpu().tolist(),
        "total": kk.cpu().tolist(), "blocks": int(kept.sum()), "al_sum": al_sum,
        "tokens": int(batch.lengths.sum()), "supervised": int(sel.sum()),
    }
    if not math.isfinite(stats["loss_num"]):
        stats["nonfinite"] = True
    out = UnaryTerms(loss, stats, blocks, sel, rows, w)
    if top_k > 0:
        out.top_values, out.top_ids, out.label_logit = cols[2], cols[3], cols[4]
    return out

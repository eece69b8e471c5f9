# python/dflash/train/dflash2_objective.py
#
# The DFlash2 training objective (training.md 3.4): the DFlash loss of
# objective.py (the unary term) + alpha * the candidate-selector loss.
#
# For every supervised slot k >= 1 of every anchor block:
#   * candidates: the top-K of the unary logits (the target LM head on the drafter's
#     final-normed state, largest first, lower id first among ties, as the runtime);
#   * predecessor: teacher-forced, the true previous token (the anchor for k = 1);
#   * scores: unary[c] + <A[pred] * Hproj h, B[c]> (DFlash2Drafter.candidate_selector);
#   * K-way cross-entropy against the index of the true token among the candidates;
#     when the true token is not in the top-K it replaces the weakest candidate
#     (slot K-1, with its own unary logit) for the loss only (speculators' rule) and
#     the miss counts against recall;
#   * the same position weights as the unary term, normalised by the same sum.
# Statistics (besides the DFlash ones): unary recall@K (true token in the unary top-K),
# teacher-forced selector accuracy (argmax of the K scores is the true token, with the
# injection), the unary and selector loss numerators, and (with target_mass=True, the
# held-out evaluation: it costs a second target forward) target mass@K, the target's
# probability of the unary top-K at each slot, softmax of the target's logits at the
# slot's predecessor position (T = 1).
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from dflash.train.objective import Batch, unary_terms

__all__ = ["dflash2_loss"]


def dflash2_loss(
    drafter: Any,
    target_model: Any,
    batch: Batch,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    *,
    gamma: float | None,
    alpha: float = 1.0,
    detach_unary: bool = False,
    chunk_rows: int = 8192,
    feats: torch.Tensor | None = None,
    target_mass: bool = False,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """(unary loss + alpha * selector loss, stats); stats["loss_num"] is the total's numerator.

    detach_unary: the selector loss sees the unary logits as constants, so its gradient reaches the
    backbone only through the selector's hidden projection and the unary head is trained by the
    DFlash loss alone. The published recipe (False) lets the selector loss train it too; a drafter
    trained that way was measured with a weaker unary head on sampled text (fewer drafts accepted
    at T = 1, bench/train_slot0_sampled_t1.py), and this option tests whether that is the cause."""
    k = int(drafter.config.selector_top_k)
    t = unary_terms(drafter, target_model, batch, anchors, keep, gamma=gamma, chunk_rows=chunk_rows, feats=feats,
                    top_k=k)
    labels_full, block_ids = t.blocks["labels"], t.blocks["block_ids"]
    anchor = block_ids[..., :1]  # slot k's predecessor: the anchor for k = 1, the true x[a+k-1] after
    prev_full = torch.cat((anchor, anchor, labels_full[..., 1:-1]), dim=-1)  # (slot 0 has no label)
    labels, prev = labels_full[t.supervised], prev_full[t.supervised]
    assert t.top_ids is not None and t.top_values is not None and t.label_logit is not None
    hit = t.top_ids == labels[:, None]
    recalled = hit.any(dim=-1)
    index = torch.where(recalled, hit.long().argmax(dim=-1), torch.full_like(labels, k - 1))
    cand = t.top_ids.clone()
    cand[:, k - 1] = torch.where(recalled, cand[:, k - 1], labels)
    last = torch.where(recalled, t.top_values[:, k - 1], t.label_logit)
    unary = torch.cat((t.top_values[:, : k - 1], last[:, None]), dim=1)
    if detach_unary:
        unary = unary.detach()
    scores = drafter.candidate_selector.scores(t.rows, prev, cand, unary)
    ce = F.cross_entropy(scores, index, reduction="none")
    sel_num = (t.weights * ce).sum()
    den = t.weights.sum()
    loss = t.loss + float(alpha) * sel_num / den.clamp_min(1e-12)
    st = t.stats
    st["unary_num"] = st["loss_num"]
    st["selector_num"] = float(sel_num.detach())
    st["loss_num"] = st["unary_num"] + float(alpha) * st["selector_num"]
    with torch.no_grad():
        st["recall_hits"] = int(recalled.sum())
        st["selector_correct"] = int((scores.argmax(dim=-1) == index).sum())
        st["selector_rows"] = int(labels.numel())
        if target_mass:
            st["target_mass_num"] = float(_target_mass(target_model, batch, t.supervised, t.blocks["block_pos"],
                                                       t.top_ids, chunk_rows).sum())
    if not math.isfinite(st["loss_num"]):
        st["nonfinite"] = True
    return loss, st


@torch.no_grad()
def _target_mass(target_model: Any, batch: Batch, supervised: torch.Tensor, block_pos: torch.Tensor,
                 cand: torch.Tensor, chunk_rows: int, per_candidate: bool = False) -> torch.Tensor:
    """[n] the target's probability (softmax of its logits, T = 1) of each supervised slot's
    K candidates cand [n, K] ([n, K], each candidate's, with per_candidate); slot k of the
    block at anchor a is predicted from position a+k-1."""
    captured: dict[str, torch.Tensor] = {}

    def keep(_m: Any, _a: Any, out: Any) -> None:
        captured["final"] = out[0] if isinstance(out, tuple) else out

    handle = target_model.model.norm.register_forward_hook(keep)
    try:
        target_model(input_ids=batch.input_ids, use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    final = captured["final"]  # [b, S, H] after the final norm
    seq = torch.nonzero(supervised)[:, 0]  # [n] the row's sequence (supervised is [b, N, B])
    pos = block_pos[supervised] - 1  # [n] the predecessor position
    head = target_model.get_output_embeddings()
    parts = []
    for i in range(0, seq.numel(), max(1, int(chunk_rows))):
        h = final[seq[i:i + chunk_rows], pos[i:i + chunk_rows]]
        p = torch.softmax(head(h).float(), dim=-1)
        g = p.gather(1, cand[i:i + chunk_rows])
        parts.append(g if per_candidate else g.sum(dim=-1))
    if not parts:
        return cand.new_zeros((0, cand.shape[1]) if per_candidate else (0,), dtype=torch.float32)
    return torch.cat(parts)

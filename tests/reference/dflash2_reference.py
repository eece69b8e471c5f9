# tests/reference/dflash2_reference.py
#
# Plain-PyTorch (fp32) reference of a DFlash2 drafter ("DFlash2DraftModel"),
# written from docs spec /work/shared/spec/dflash2.md sections 1-3, on top of the
# DFlash reference (tests/reference/dflash_reference.py): same context
# precompute, attention, RoPE and greedy draft-verify loop; DFlash2 adds
#   * a grouped dynamic depthwise conv around every attention and MLP sublayer
#     (spec 2.1/2.2), through `DraftRef.wrap_sublayer`;
#   * `input_embedding_scale` on the block-token embeddings;
#   * top-level `is_causal`, which takes precedence over the DFlash rule
#     (sliding layers causal).  Not causal: full layers unmasked, sliding layers
#     a SYMMETRIC window |q_pos - k_pos| < window; causal: k_pos <= q_pos (and
#     q_pos - k_pos < window on sliding layers).  This is what z-lab's
#     dflash/model.py `_attention_mask` does (checked: non-causal sliding layers
#     also keep k - q < window; with is_causal absent it falls back to "sliding
#     = causal", and it reads no dflash_config.causal -- vLLM does, spec 1.2);
#   * the candidate selector (spec 3): per-slot top-K of the target lm_head on
#     block rows 1..S, edge scores [S, K, K] and a sequential walk (greedy, or
#     Gumbel-max at temperature T > 0 on our Philox stream 1);
#   * exact rejection sampling against a sparse proposal q (spec 3.4).
# Batch 1 throughout: the spec's [R, S, ...] tensors are [S, ...] here.
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from tests.reference.dflash_reference import (
    ContextKV,
    DraftRef,
    append_context,
    as_token_ids,
    draft_hidden,
    drafter_fields,
    num_spec_tokens,
    read_drafter_checkpoint,
    speculative_loop,
    target_features,
    target_lm_head,
)

__all__ = [
    "DRAFT_SAMPLE_STREAM",
    "Draft2Ref",
    "GroupedConvRef",
    "Proposal2",
    "Walk",
    "accept_with_q",
    "candidates_ref",
    "dflash2_added_shapes",
    "draft2_forward",
    "draw_inverse_cdf",
    "edge_scores_ref",
    "grouped_conv",
    "grouped_conv_vectorized",
    "gumbel_noise",
    "load_drafter2",
    "philox_u32",
    "philox_uniform",
    "proposal_probs",
    "propose2_ref",
    "spec_generate2_ref",
    "top_k_lowest_index",
    "unary_scores",
    "walk_ref",
]

CONV_MODULES = {"attention": "attention_conv", "mlp": "mlp_conv"}  # wrap_sublayer kind -> tensor prefix
PREDECESSOR_CODEBOOK = "candidate_selector.predecessor_codebook"
SUCCESSOR_CODEBOOK = "candidate_selector.successor_codebook"
HIDDEN_PROJECTION = "candidate_selector.hidden_projection.weight"
DRAFT_SAMPLE_STREAM = 1  # cpp/common/philox.h kStreamDraftSample


# --------------------------------------------------------------------------------------
# Grouped dynamic depthwise convolution (spec 2.1)


def grouped_conv(
    y: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, group_size: int, block_size: int
) -> torch.Tensor:
    """conv_s(y, D)[i, c] = sum_t (base[t, c] + D[i, t, c // g]) * y[i - t, c] * 1[(i mod B) >= t].

    y [N, H] (N a multiple of B: contiguous blocks), base [T, H] (one side's
    kernel), delta [N, T, G] with G = H / g.  Written as the definition: an
    explicit loop over rows and taps.
    """
    _check_conv_shapes(y, base, delta, group_size, block_size)
    n, taps = y.shape[0], base.shape[0]
    out = torch.zeros_like(y, dtype=torch.float32)
    for i in range(n):
        for t in range(taps):
            if i % block_size < t:  # the tap would read across the block start (zero padding)
                continue
            coefficient = base[t] + delta[i, t].repeat_interleave(group_size)  # [H]
            out[i] += coefficient * y[i - t]
    return out


def grouped_conv_vectorized(
    y: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, group_size: int, block_size: int
) -> torch.Tensor:
    """`grouped_conv` without Python loops: gather the T shifted rows [N, T, H], mask, reduce."""
    _check_conv_shapes(y, base, delta, group_size, block_size)
    n, taps = y.shape[0], base.shape[0]
    rows = torch.arange(n)[:, None] - torch.arange(taps)[None, :]  # [N, T] source row i - t
    inside = (torch.arange(n) % block_size)[:, None] >= torch.arange(taps)[None, :]  # [N, T]
    shifted = y.float()[rows.clamp(min=0)] * inside[..., None]  # [N, T, H]
    coefficient = base[None] + delta.repeat_interleave(group_size, dim=-1)  # [N, T, H]
    return (coefficient * shifted).sum(dim=1)


def _check_conv_shapes(
    y: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, group_size: int, block_size: int
) -> None:
    n, h = y.shape
    taps = base.shape[0]
    if base.shape != (taps, h) or delta.shape != (n, taps, h // group_size) or h % group_size != 0:
        raise ValueError(f"conv shapes do not fit: y {tuple(y.shape)}, base {tuple(base.shape)}, "
                         f"delta {tuple(delta.shape)}, group_size {group_size}")
    if block_size < 1 or n % block_size != 0:
        raise ValueError(f"{n} rows are not whole blocks of {block_size}")


@dataclass
class GroupedConvRef:
    """One `attention_conv` / `mlp_conv` wrapper around a sublayer (spec 2.1)."""

    base_kernel: torch.Tensor  # [2 sides, T, H]
    kernel_projection: torch.Tensor  # [2 * T * G, H]
    group_size: int
    block_size: int

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] (the sublayer's normed input) -> (conv_0(x, D[:, 0]) [N, H], out-side deltas D[:, 1] [N, T, G])."""
        n, h = x.shape
        taps = self.base_kernel.shape[1]
        deltas = F.linear(x, self.kernel_projection).reshape(n, 2, taps, h // self.group_size)
        return grouped_conv(x, self.base_kernel[0], deltas[:, 0], self.group_size, self.block_size), deltas[:, 1]

    def finish(self, y: torch.Tensor, out_deltas: torch.Tensor) -> torch.Tensor:
        """conv_1(y, D1): y [N, H] the sublayer's output, out_deltas [N, T, G] from `prepare`."""
        return grouped_conv(y, self.base_kernel[1], out_deltas, self.group_size, self.block_size)


# --------------------------------------------------------------------------------------
# Checkpoint


def dflash2_added_shapes(
    num_layers: int, hidden_size: int, vocab_size: int, conv_kernel_size: int, conv_group_size: int,
    selector_rank: int,
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors DFlash2 adds to the published DFlash set (4 per layer + 3; spec 1.3)."""
    h, taps, rank = hidden_size, conv_kernel_size, selector_rank
    conv_parts = {"base_kernel": (2, taps, h), "kernel_projection.weight": (2 * taps * (h // conv_group_size), h)}
    shapes = {f"layers.{i}.{conv}.{part}": shape for i in range(num_layers) for conv in CONV_MODULES.values()
              for part, shape in conv_parts.items()}
    return shapes | {PREDECESSOR_CODEBOOK: (vocab_size, rank), SUCCESSOR_CODEBOOK: (vocab_size, rank),
                     HIDDEN_PROJECTION: (rank, h)}


@dataclass
class Draft2Ref(DraftRef):
    """A loaded DFlash2 drafter: the DFlash fields plus the conv / selector config (weights hold all 81-style)."""

    conv_kernel_size: int  # T
    conv_group_size: int  # g
    selector_rank: int  # r
    selector_top_k: int  # K
    output_multiplier: float  # on the K unary values (1.0 when absent)
    final_logit_softcapping: float | None  # tanh cap on the K unary values (None: off)
    input_embedding_scale: float  # on the block-token embeddings (1.0 when absent)
    is_causal: bool | None  # top-level config.is_causal (None: absent)
    dflash_causal: bool | None  # dflash_config.causal (None: absent)

    @property
    def embedding_scale(self) -> float:
        return self.input_embedding_scale

    def layer_is_causal(self, layer_idx: int) -> bool:
        """Top-level is_causal, else dflash_config.causal, else the DFlash rule (vLLM precedence, spec 1.2)."""
        if self.is_causal is not None:
            return self.is_causal
        if self.dflash_causal is not None:
            return self.dflash_causal
        return super().layer_is_causal(layer_idx)

    def conv(self, layer_idx: int, kind: str, block_size: int) -> GroupedConvRef:
        p = f"layers.{layer_idx}.{CONV_MODULES[kind]}."
        return GroupedConvRef(self.w(p + "base_kernel"), self.w(p + "kernel_projection.weight"),
                              self.conv_group_size, block_size)

    def wrap_sublayer(
        self, layer_idx: int, kind: str, sublayer: Callable[[torch.Tensor], torch.Tensor], normed: torch.Tensor
    ) -> torch.Tensor:
        """finish(sublayer(prepare(normed))) on the one query block [B, H] of this forward (spec 2.2)."""
        conv = self.conv(layer_idx, kind, block_size=normed.shape[0])
        conv_in, out_deltas = conv.prepare(normed)
        return conv.finish(sublayer(conv_in), out_deltas)


def _dflash_value(cfg: dict[str, Any], name: str) -> Any:
    """A DFlash field from dflash_config, else from the top level (like z-lab's _draft_value)."""
    return (cfg.get("dflash_config") or {}).get(name, cfg.get(name))


def load_drafter2(draft_dir: str | Path) -> Draft2Ref:
    """Read config.json + *.safetensors of a DFlash2DraftModel checkpoint (weights as fp32)."""
    cfg, weights = read_drafter_checkpoint(draft_dir)
    if "DFlash2DraftModel" not in (cfg.get("architectures") or []):
        raise ValueError(f"{draft_dir} is not a DFlash2DraftModel checkpoint: architectures {cfg.get('architectures')}")
    n_layers, hidden, vocab = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), int(cfg["vocab_size"])
    required = {}
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        if _dflash_value(cfg, name) is None:
            raise ValueError(f"DFlash2 config lacks dflash_config.{name}")
        required[name] = int(_dflash_value(cfg, name))
    taps, group, rank, top_k = (required[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                      "selector_top_k"))
    if taps < 1 or group < 1 or hidden % group != 0 or rank < 1 or not 1 <= top_k < vocab:
        raise ValueError(f"bad DFlash2 geometry {required} for hidden {hidden}, vocab {vocab}")
    added = dflash2_added_shapes(n_layers, hidden, vocab, taps, group, rank)
    fields = drafter_fields(Path(draft_dir), cfg, weights, extra_tensor_names=added)
    for name, shape in added.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{name} has shape {tuple(weights[name].shape)}, expected {shape}")
    multiplier, embedding_scale = (_dflash_value(cfg, name) for name in ("output_multiplier", "input_embedding_scale"))
    multiplier = 1.0 if multiplier is None else float(multiplier)
    if not multiplier > 0:
        raise ValueError(f"output_multiplier must be > 0, got {multiplier}")  # vLLM rejects it too (spec 3.1)
    softcap = _dflash_value(cfg, "final_logit_softcapping")
    is_causal, dflash_causal = cfg.get("is_causal"), (cfg.get("dflash_config") or {}).get("causal")
    return Draft2Ref(
        **fields, **required, output_multiplier=multiplier,
        final_logit_softcapping=float(softcap) if softcap is not None and float(softcap) > 0 else None,
        input_embedding_scale=1.0 if embedding_scale is None else float(embedding_scale),
        is_causal=None if is_causal is None else bool(is_causal),
        dflash_causal=None if dflash_causal is None else bool(dflash_causal),
    )


# --------------------------------------------------------------------------------------
# Candidates and edges (spec 3.1, 3.2)


def top_k_lowest_index(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [S, k], ids [S, k]) of logits [S, V]: largest first, the lower id first among equal values."""
    values, ids = torch.sort(logits, dim=-1, descending=True, stable=True)
    return values[:, :k], ids[:, :k]


def unary_scores(drafter: Draft2Ref, values: torch.Tensor) -> torch.Tensor:
    """fp32 unary [S, K] of the K selected logits [S, K]: * output_multiplier, then tanh(v / cap) * cap."""
    unary = values.float() * drafter.output_multiplier
    if drafter.final_logit_softcapping is not None:
        cap = drafter.final_logit_softcapping
        unary = torch.tanh(unary / cap) * cap
    return unary


def candidates_ref(drafter: Draft2Ref, target_model: Any, slot_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(candidate_ids [S, K] long, unary [S, K] fp32) from the final-normed block rows 1..S [S, H]."""
    values, ids = top_k_lowest_index(target_lm_head(target_model, slot_hidden.float()), drafter.selector_top_k)
    return ids, unary_scores(drafter, values)


def edge_scores_ref(
    drafter: Draft2Ref, slot_hidden: torch.Tensor, anchor_id: int, candidate_ids: torch.Tensor, unary: torch.Tensor
) -> torch.Tensor:
    """scores [S, K(pred), K(cand)] = unary[s, c] + sum_r A[pred[s, p], r] * hid[s, r] * B[cand[s, c], r].

    slot_hidden [S, H] (final-normed block rows 1..S), candidate_ids / unary
    [S, K]; hid = hidden_projection(slot_hidden) [S, r] (the context gate of
    the successor slot); pred[0, :] = anchor_id, pred[s, :] = candidate_ids[s-1].
    """
    hid = F.linear(slot_hidden.float(), drafter.w(HIDDEN_PROJECTION))  # [S, r]
    predecessor_ids = torch.empty_like(candidate_ids)
    predecessor_ids[0] = int(anchor_id)
    predecessor_ids[1:] = candidate_ids[:-1]
    pred = drafter.w(PREDECESSOR_CODEBOOK)[predecessor_ids]  # [S, K, r]
    succ = drafter.w(SUCCESSOR_CODEBOOK)[candidate_ids]  # [S, K, r]
    return unary[:, None, :] + torch.einsum("spr,sr,scr->spc", pred, hid, succ)


# --------------------------------------------------------------------------------------
# Philox-4x32-10, exactly as cpp/common/philox.h


_MASK32 = 0xFFFFFFFF


def philox_u32(seed: int, position: int, index: int, stream: int) -> int:
    """First 32-bit word of Philox-4x32-10(counter = (index, stream, pos lo, pos hi), key = (seed lo, seed hi))."""
    c0, c1, c2, c3 = index & _MASK32, stream & _MASK32, position & _MASK32, (position >> 32) & _MASK32
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & _MASK32, p1 & _MASK32, ((p0 >> 32) ^ c3 ^ k1) & _MASK32, p0 & _MASK32
        k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
    return c0


def philox_uniform(seed: int, position: int, index: int, stream: int) -> float:
    """((x >> 9) + 0.5) / 2^23 in (0, 1): the fp32 value of philox.h, exactly (it fits in 24 bits)."""
    return ((philox_u32(seed, position, index, stream) >> 9) + 0.5) / 8388608.0


def gumbel_noise(seed: int, position: int, token_id: int) -> float:
    """-log(-log(u)) in fp64, u = philox_uniform(seed, position, token_id, stream 1)."""
    return -math.log(-math.log(philox_uniform(seed, position, token_id, DRAFT_SAMPLE_STREAM)))


# --------------------------------------------------------------------------------------
# The walk (spec 3.3) and its proposal q (spec 3.4)


class Walk(NamedTuple):
    draft_ids: torch.Tensor  # [S] long: candidate_ids[s, chosen[s]]
    chosen: torch.Tensor  # [S] long: index into the K candidates
    realized_rows: torch.Tensor  # [S, K] fp32: edges[s, chosen[s-1]] (slot 0: edges[0, 0]), pre-temperature
    proposal_probs: torch.Tensor  # [S, K] fp32: q_s over candidate_ids[s]


def _first_argmax(scores: torch.Tensor) -> int:
    """Index of the largest entry, the lowest among ties; NaN counts as -inf; all -inf -> 0."""
    clean = torch.nan_to_num(scores, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    best, best_idx = float("-inf"), 0
    for k, value in enumerate(clean.tolist()):
        if value > best:
            best, best_idx = value, k
    return best_idx


def _as_fp32(value: float) -> float:
    return float(torch.tensor(float(value), dtype=torch.float32))


def proposal_probs(row: torch.Tensor, temperature: float, chosen: int) -> torch.Tensor:
    """q [K] fp32 of a walked row [K]: one-hot at `chosen` when greedy (T <= 0), else softmax(row / T).

    Degenerate sampled rows follow the walk: a +inf entry or an all -inf row
    give the one-hot of the index the walk then picks.
    """
    clean = torch.nan_to_num(row.double(), nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    if temperature <= 0 or torch.isposinf(clean).any() or torch.isneginf(clean).all():
        return F.one_hot(torch.tensor(chosen), row.numel()).float()
    return torch.softmax(clean / _as_fp32(temperature), dim=-1).float()


def walk_ref(
    edges: torch.Tensor, candidate_ids: torch.Tensor, *, temperature: float = 0.0, seed: int = 0,
    anchor_position: int = 0,
) -> Walk:
    """Sequential walk over edges [S, K, K] with candidate_ids [S, K] (spec 3.3).

    prev = 0; per slot s: row = edges[s, prev]; greedy (T <= 0): the first
    argmax (NaN as -inf, all -inf -> 0); sampled: argmax_k(row[k] / T + g_k) in
    fp64 with Gumbel g_k = -log(-log(u_k)), u_k = philox_uniform(seed,
    anchor_position + 1 + s, candidate_ids[s, k], stream 1), i.e. keyed by the
    position of the drafted token and the candidate's token id.  T is rounded
    to fp32 first (the runtime's sampling parameters are fp32).
    """
    temperature = _as_fp32(temperature)
    num_slots, k = candidate_ids.shape
    if edges.shape != (num_slots, k, k):
        raise ValueError(f"edges {tuple(edges.shape)} do not match candidate_ids {tuple(candidate_ids.shape)}")
    prev, chosen, rows, probs = 0, [], [], []
    for s in range(num_slots):
        row = edges[s, prev].float()
        if temperature <= 0:
            idx = _first_argmax(row)
        else:
            position = int(anchor_position) + 1 + s
            noise = torch.tensor([gumbel_noise(seed, position, int(t)) for t in candidate_ids[s]], dtype=torch.float64)
            idx = _first_argmax(row.double() / float(temperature) + noise)
        chosen.append(idx)
        rows.append(row)
        probs.append(proposal_probs(row, temperature, idx))
        prev = idx
    chosen_t = torch.tensor(chosen, dtype=torch.long)
    return Walk(candidate_ids.gather(1, chosen_t[:, None])[:, 0], chosen_t, torch.stack(rows), torch.stack(probs))


# --------------------------------------------------------------------------------------
# Drafting


class Proposal2(NamedTuple):
    draft_ids: torch.Tensor  # [S] long: the walked drafts
    candidate_ids: torch.Tensor  # [S, K] long
    unary: torch.Tensor  # [S, K] fp32
    edges: torch.Tensor  # [S, K, K] fp32
    realized_rows: torch.Tensor  # [S, K] fp32
    proposal_probs: torch.Tensor  # [S, K] fp32: q_s over candidate_ids[s]


@torch.no_grad()
def draft2_forward(
    drafter: Draft2Ref,
    target_model: Any,
    ctx_feats: torch.Tensor,
    ctx_positions: Any,
    block_ids: Any,
    block_positions: Any,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    cached_ctx_kv: ContextKV | None = None,
) -> Proposal2:
    """One DFlash2 draft (spec 2-3): backbone with convs, candidates, edges and the walk.

    ctx_feats [C, K*Ht] are the new context rows at ctx_positions [C] (appended
    to `cached_ctx_kv` when given, as in dflash_reference.draft_forward);
    block_ids [B] = [anchor, mask * S] at block_positions [B].
    """
    cache = cached_ctx_kv if cached_ctx_kv is not None else ContextKV.empty(drafter)
    append_context(drafter, cache, ctx_feats, ctx_positions)
    ids, positions = as_token_ids(block_ids), as_token_ids(block_positions)
    slot_hidden = draft_hidden(drafter, target_model, cache, ids, positions)[1:]  # [S, H]
    candidate_ids, unary = candidates_ref(drafter, target_model, slot_hidden)
    edges = edge_scores_ref(drafter, slot_hidden, int(ids[0]), candidate_ids, unary)
    walk = walk_ref(edges, candidate_ids, temperature=temperature, seed=seed, anchor_position=int(positions[0]))
    return Proposal2(walk.draft_ids, candidate_ids, unary, edges, walk.realized_rows, walk.proposal_probs)


@torch.no_grad()
def propose2_ref(
    target_model: Any, drafter: Draft2Ref, prompt_ids: Any, num_spec: int | None = None, *,
    temperature: float = 0.0, seed: int = 0,
) -> Proposal2:
    """First DFlash2 draft after prefill: the anchor is the target's greedy token at position P."""
    ids = as_token_ids(prompt_ids)
    p, n = ids.numel(), num_spec_tokens(drafter, num_spec)
    logits, feats = target_features(target_model, ids, drafter.target_layer_ids)
    block = torch.tensor([int(logits[-1].argmax())] + [drafter.mask_token_id] * n, dtype=torch.long)
    return draft2_forward(drafter, target_model, feats, torch.arange(p), block, torch.arange(p, p + n + 1),
                          temperature=temperature, seed=seed)


@torch.no_grad()
def spec_generate2_ref(
    target_model: Any,
    drafter: Draft2Ref,
    prompt_ids: Any,
    max_new_tokens: int,
    num_spec: int | None = None,
    eos_ids: Iterable[int] = (),
) -> tuple[list[int], list[int]]:
    """Greedy DFlash2 draft-verify loop at batch 1: dflash_reference.speculative_loop with greedy walked drafts."""

    def walked_drafts(ctx_feats: torch.Tensor, anchor_id: int, anchor_position: int, n: int) -> list[int]:
        block = torch.tensor([anchor_id] + [drafter.mask_token_id] * n, dtype=torch.long)
        proposal = draft2_forward(drafter, target_model, ctx_feats, torch.arange(anchor_position), block,
                                  torch.arange(anchor_position, anchor_position + n + 1))
        return [int(t) for t in proposal.draft_ids]

    return speculative_loop(target_model, drafter, prompt_ids, max_new_tokens, num_spec, eos_ids, walked_drafts)


# --------------------------------------------------------------------------------------
# Exact rejection sampling against a sparse q (spec 3.4)


def draw_inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """Token drawn from unnormalised probs [V] with uniform u in [0, 1): first id whose cumsum exceeds u * total."""
    cumulative = probs.double().cumsum(dim=0)
    idx = int(torch.searchsorted(cumulative, torch.tensor([u * float(cumulative[-1])], dtype=torch.float64),
                                 right=True)[0])
    return min(idx, probs.numel() - 1)


def accept_with_q(
    p_rows: torch.Tensor, draft_ids: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor, u: torch.Tensor
) -> tuple[int, int]:
    """Sequential rejection of drafts against target probabilities: returns (accepted count a, next token).

    p_rows [S+1, V] target probabilities at the S draft positions and the
    bonus position; draft_ids [S]; q_ids / q_probs [S, K] the sparse proposal
    (q = 0 off q_ids); u [S+1] uniforms: u[j] tests draft j, u[S] drives the
    one final draw.  Draft j is accepted iff u[j] * q_j(x_j) < p_j(x_j); at the
    first rejection the next token is drawn from norm(max(p_j - q_j, 0)) (from
    p_j if that is all zero); after S accepts it is the bonus, drawn from p_S.
    """
    num_drafts = draft_ids.numel()
    if p_rows.shape[0] != num_drafts + 1 or u.numel() != num_drafts + 1:
        raise ValueError(f"need S+1 = {num_drafts + 1} rows of p and uniforms, got {p_rows.shape[0]}, {u.numel()}")
    for j in range(num_drafts):
        x = int(draft_ids[j])
        p = p_rows[j].double()
        q = torch.zeros_like(p).index_add_(0, q_ids[j].long(), q_probs[j].double())  # [V] dense q_j
        if float(u[j]) * float(q[x]) < float(p[x]):
            continue
        residual = (p - q).clamp(min=0)
        return j, draw_inverse_cdf(residual if float(residual.sum()) > 0 else p, float(u[num_drafts]))
    return num_drafts, draw_inverse_cdf(p_rows[num_drafts], float(u[num_drafts]))

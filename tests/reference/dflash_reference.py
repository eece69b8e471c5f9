# tests/reference/dflash_reference.py
#
# Plain-PyTorch (fp32) reference of a DFlash drafter and of the greedy
# draft-verify loop, written from docs spec /work/shared/spec/dflash.md
# sections 1-3.  Correctness over speed: the target is recomputed over the
# whole sequence at every step (no target KV cache), and the drafter keeps its
# context K/V in a simple append-only `ContextKV`.
#
# Conventions (spec 1.4):
# * target feature of layer id `l` = residual stream AFTER decoder layer `l`
#   (pre final norm) = HF `hidden_states[l + 1]`.  In transformers 5.24,
#   `hidden_states` is recorded by forward hooks on the decoder layers
#   (utils/output_capturing.py): [inputs_embeds, out(layer 0), ...,
#   out(layer T-1)], and then `capture_outputs(tie_last_hidden_states=True)`
#   REPLACES the last entry by `last_hidden_state`, i.e. by norm(out(layer
#   T-1)).  So for l == T-1 we take the output of the last decoder layer from
#   our own forward hook instead (the decoder layer returns a plain tensor in
#   5.24; a tuple's first element is taken for older versions).
# * RoPE: NeoX / rotate-half, inv_freq[i] = 1 / theta ** (2i / hd) computed in
#   fp32 (`theta ** (arange(0, hd, 2, float32) / hd)`, exactly as HF's default
#   rope init), angles = position (as fp32) * inv_freq in fp32, cos/sin of
#   cat(angles, angles).  Only the "default" rope type is supported.
# * Drafter attention: block queries over [context ++ block] keys; full
#   attention layers have NO mask; sliding_attention layers are causal with a
#   window (key allowed iff k_pos <= q_pos and q_pos - k_pos < sliding_window),
#   as vLLM / SGLang treat them (spec 2.3; the HF reference keeps them
#   non-causal, an open question).  `DraftRef.layer_is_causal` and
#   `attention_mask` keep the causal choice separate from the window so that a
#   subclass (tests/reference/dflash2_reference.py) can override it.
# * Extension points for DFlash2: `DraftRef.embedding_scale` (multiplies the
#   block token embeddings) and `DraftRef.wrap_sublayer` (runs each attention /
#   MLP sublayer on its normed input; the identity here).
# * Draft logits: target lm_head on the final-normed rows 1..B-1; row j-1
#   predicts the token AT block position j (not next-token).
from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "ContextKV",
    "DraftRef",
    "append_context",
    "as_token_ids",
    "attention_mask",
    "build_target_layer_ids",
    "draft_forward",
    "draft_hidden",
    "draft_query",
    "drafter_fields",
    "greedy_generate_ref",
    "load_drafter",
    "num_spec_tokens",
    "propose_ref",
    "read_drafter_checkpoint",
    "rms_norm",
    "rope_cos_sin",
    "rope_inv_freq",
    "spec_generate_ref",
    "speculative_loop",
    "target_embed",
    "target_features",
    "target_lm_head",
]

_LAYER_TYPES = ("full_attention", "sliding_attention")


# --------------------------------------------------------------------------------------
# Checkpoint


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Published default layer selection (spec 1.1); independent of dflash.drafter_format."""
    t, d = int(num_target_layers), int(num_draft_layers)
    if d == 1:
        return [t // 2]
    start, end = 1, t - 3
    return [round(start + i * (end - start) / (d - 1)) for i in range(d)]


@dataclass
class DraftRef:
    """A loaded drafter: config values and fp32 tensors (unprefixed names)."""

    path: Path
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int | None
    layer_types: list[str]
    sliding_window: int | None
    weights: dict[str, torch.Tensor] = field(repr=False)

    def w(self, name: str) -> torch.Tensor:
        return self.weights[name]

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x @ W^T (+ bias when the checkpoint has one, i.e. attention_bias)."""
        return F.linear(x, self.weights[name + ".weight"], self.weights.get(name + ".bias"))

    @property
    def inv_freq(self) -> torch.Tensor:
        return rope_inv_freq(self.rope_theta, self.head_dim)

    @property
    def embedding_scale(self) -> float:
        """Factor on the embeddings of the block tokens (1 for DFlash)."""
        return 1.0

    def layer_is_causal(self, layer_idx: int) -> bool:
        """DFlash rule (spec 2.3): sliding_attention layers are causal, full layers are not."""
        return self.layer_types[layer_idx] == "sliding_attention"

    def wrap_sublayer(
        self, layer_idx: int, kind: str, sublayer: Callable[[torch.Tensor], torch.Tensor], normed: torch.Tensor
    ) -> torch.Tensor:
        """Output [B, H] of the `kind` ("attention" / "mlp") sublayer on its normed input [B, H]."""
        return sublayer(normed)


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise NotImplementedError(f"reference supports only default RoPE, got rope_type {rope_type!r}")
    if cfg.get("rope_theta") is not None:
        return float(cfg["rope_theta"])
    if params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return 10000.0


def _expected_names(num_layers: int) -> list[str]:
    names = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    per_layer = [
        "input_layernorm.weight", "post_attention_layernorm.weight",
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    ]
    for i in range(num_layers):
        names += [f"layers.{i}.{n}" for n in per_layer]
    return names


def read_drafter_checkpoint(draft_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json as a dict, every tensor of its *.safetensors as fp32)."""
    from safetensors.torch import load_file

    d = Path(draft_dir)
    cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {d}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update({k: v.to(torch.float32) for k, v in load_file(str(f)).items()})
    return cfg, weights


def load_drafter(draft_dir: str | Path) -> DraftRef:
    """Read config.json + *.safetensors of a DFlashDraftModel checkpoint (weights as fp32)."""
    cfg, weights = read_drafter_checkpoint(draft_dir)
    return DraftRef(**drafter_fields(Path(draft_dir), cfg, weights))


def drafter_fields(
    path: Path, cfg: dict[str, Any], weights: dict[str, torch.Tensor], extra_tensor_names: Iterable[str] = ()
) -> dict[str, Any]:
    """The DraftRef fields of a checked DFlash checkpoint.

    The tensor set must be exactly the published DFlash one plus
    `extra_tensor_names` (which a subclass such as DFlash2's checks itself).
    """
    dcfg = cfg.get("dflash_config") or {}
    n_layers = int(cfg["num_hidden_layers"])
    n_target = cfg.get("num_target_layers")
    ids = dcfg.get("target_layer_ids")
    if ids is None:
        if n_target is None:
            raise ValueError("drafter config has neither dflash_config.target_layer_ids nor num_target_layers")
        ids = build_target_layer_ids(int(n_target), n_layers)
    block_size = cfg.get("block_size", dcfg.get("block_size"))
    if block_size is None:
        raise ValueError("drafter config lacks block_size")
    mask_id = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
    if mask_id is None:
        raise ValueError("drafter config lacks dflash_config.mask_token_id")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    layer_types = list(cfg.get("layer_types") or ["full_attention"] * n_layers)
    if len(layer_types) != n_layers or any(t not in _LAYER_TYPES for t in layer_types):
        raise ValueError(f"bad layer_types {layer_types} for {n_layers} layers")
    window = cfg.get("sliding_window")
    if "sliding_attention" in layer_types and not window:
        raise ValueError("sliding_attention layers without sliding_window")

    expected = set(_expected_names(n_layers)) | set(extra_tensor_names)
    if cfg.get("attention_bias"):
        expected |= {f"layers.{i}.self_attn.{p}_proj.bias" for i in range(n_layers) for p in "qkvo"}
    missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or extra:
        raise ValueError(f"unexpected drafter tensor set: missing {missing}, extra {extra}")
    fc_in = weights["fc.weight"].shape[1]
    if weights["fc.weight"].shape[0] != hidden or fc_in % len(ids) != 0:
        raise ValueError(f"fc.weight {tuple(weights['fc.weight'].shape)} does not fit hidden {hidden}, K={len(ids)}")
    return {
        "path": path, "num_layers": n_layers, "hidden_size": hidden, "num_heads": heads, "num_kv_heads": kv_heads,
        "head_dim": head_dim, "intermediate_size": int(cfg["intermediate_size"]),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)), "rope_theta": _rope_theta(cfg),
        "block_size": int(block_size), "mask_token_id": int(mask_id), "target_layer_ids": [int(i) for i in ids],
        "num_target_layers": None if n_target is None else int(n_target), "layer_types": layer_types,
        "sliding_window": None if window is None else int(window), "weights": weights,
    }


# --------------------------------------------------------------------------------------
# Math helpers


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """inv_freq[i] = 1 / theta^(2i/hd), computed in fp32 like HF's default rope."""
    return 1.0 / (float(theta) ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [N, hd] for rotate-half RoPE at integer positions [N]."""
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, hd]; cos/sin [N, hd]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


def as_token_ids(ids: Any) -> torch.Tensor:
    t = torch.as_tensor(ids if not isinstance(ids, torch.Tensor) else ids.detach(), dtype=torch.long)
    if t.dim() != 1:
        raise ValueError(f"expected a 1-D sequence of token ids, got shape {tuple(t.shape)}")
    return t


# --------------------------------------------------------------------------------------
# Target side


@torch.no_grad()
def target_features(
    target_model: Any, input_ids: Any, target_layer_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One causal target forward over `input_ids` (positions 0..S-1).

    Returns (logits [S, V] fp32, feats [S, K*Ht] fp32), feats = concat over
    `target_layer_ids` of the pre-final-norm output of each listed layer.
    """
    ids = as_token_ids(input_ids)
    layers = target_model.model.layers
    n_layers = len(layers)
    for lid in target_layer_ids:
        if not 0 <= int(lid) < n_layers:
            raise ValueError(f"target layer id {lid} outside [0, {n_layers})")
    captured: dict[str, torch.Tensor] = {}

    def keep_last_layer_output(_module: Any, _args: Any, output: Any) -> None:
        captured["last"] = output[0] if isinstance(output, tuple) else output

    handle = layers[n_layers - 1].register_forward_hook(keep_last_layer_output)
    try:
        out = target_model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    hidden_states = out.hidden_states
    parts = []
    for lid in target_layer_ids:
        lid = int(lid)
        # hidden_states[-1] is post-final-norm in transformers 5.x (tie_last_hidden_states).
        h = captured["last"] if lid == n_layers - 1 else hidden_states[lid + 1]
        parts.append(h[0].float())
    return out.logits[0].float(), torch.cat(parts, dim=-1)


def target_embed(target_model: Any, ids: torch.Tensor) -> torch.Tensor:
    return target_model.get_input_embeddings().weight.detach().float()[ids]


def target_lm_head(target_model: Any, h: torch.Tensor) -> torch.Tensor:
    head = target_model.get_output_embeddings()
    bias = None if getattr(head, "bias", None) is None else head.bias.detach().float()
    return F.linear(h, head.weight.detach().float(), bias)


# --------------------------------------------------------------------------------------
# Drafter


@dataclass
class ContextKV:
    """Append-only per-layer context K/V of one sequence (post k_norm + RoPE)."""

    keys: list[torch.Tensor]  # per layer [C, nkv, hd]
    values: list[torch.Tensor]  # per layer [C, nkv, hd]
    positions: torch.Tensor  # [C] long

    @classmethod
    def empty(cls, drafter: DraftRef) -> ContextKV:
        z = torch.zeros(0, drafter.num_kv_heads, drafter.head_dim)
        return cls([z] * drafter.num_layers, [z] * drafter.num_layers, torch.zeros(0, dtype=torch.long))

    def __len__(self) -> int:
        return int(self.positions.numel())


@torch.no_grad()
def append_context(drafter: DraftRef, cache: ContextKV, ctx_feats: torch.Tensor, ctx_positions: Any) -> None:
    """Context precompute (spec 2.4): hidden_norm(fc(feats)) -> per-layer k_norm/RoPE K and V, appended."""
    feats = ctx_feats.float()
    pos = as_token_ids(ctx_positions)
    if feats.dim() != 2 or feats.shape[0] != pos.numel():
        raise ValueError(f"ctx_feats {tuple(feats.shape)} does not match {pos.numel()} positions")
    if feats.shape[1] != drafter.w("fc.weight").shape[1]:
        raise ValueError(f"ctx_feats width {feats.shape[1]} != fc in-features {drafter.w('fc.weight').shape[1]}")
    c = feats.shape[0]
    ctx = rms_norm(F.linear(feats, drafter.w("fc.weight")), drafter.w("hidden_norm.weight"), drafter.rms_norm_eps)
    cos, sin = rope_cos_sin(drafter.inv_freq, pos)
    nkv, hd = drafter.num_kv_heads, drafter.head_dim
    for i in range(drafter.num_layers):
        p = f"layers.{i}.self_attn."
        k = rms_norm(drafter.linear(ctx, p + "k_proj").view(c, nkv, hd), drafter.w(p + "k_norm.weight"),
                     drafter.rms_norm_eps)
        k = _apply_rope(k, cos, sin)
        v = drafter.linear(ctx, p + "v_proj").view(c, nkv, hd)
        cache.keys[i] = torch.cat((cache.keys[i], k), dim=0)
        cache.values[i] = torch.cat((cache.values[i], v), dim=0)
    cache.positions = torch.cat((cache.positions, pos), dim=0)


def attention_mask(
    layer_type: str, is_causal: bool, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None
) -> torch.Tensor | None:
    """[Q, T] bool (True = may attend) for query positions [Q] and key positions [T], or None (no mask).

    Causal: k_pos <= q_pos.  sliding_attention layers also keep q_pos - k_pos <
    window, and, when not causal, k_pos - q_pos < window (a symmetric window).
    """
    dist = q_pos[:, None] - k_pos[None, :]
    mask = None if not is_causal else dist >= 0
    if layer_type == "sliding_attention":
        in_window = (dist.abs() if not is_causal else dist) < int(window)  # type: ignore[arg-type]
        mask = in_window if mask is None else mask & in_window
    return mask


def _attention_sublayer(
    drafter: DraftRef, layer_idx: int, cache: ContextKV, q_pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    normed: torch.Tensor,
) -> torch.Tensor:
    """Self-attention of layer `layer_idx` (through o_proj): block rows [B, H] at q_pos [B] over context ++ block."""
    b, nh, nkv, hd = normed.shape[0], drafter.num_heads, drafter.num_kv_heads, drafter.head_dim
    eps = drafter.rms_norm_eps
    sa = f"layers.{layer_idx}.self_attn."
    q = rms_norm(drafter.linear(normed, sa + "q_proj").view(b, nh, hd), drafter.w(sa + "q_norm.weight"), eps)
    kb = rms_norm(drafter.linear(normed, sa + "k_proj").view(b, nkv, hd), drafter.w(sa + "k_norm.weight"), eps)
    vb = drafter.linear(normed, sa + "v_proj").view(b, nkv, hd)
    q, kb = _apply_rope(q, cos, sin), _apply_rope(kb, cos, sin)
    rep = nh // nkv
    keys = torch.cat((cache.keys[layer_idx], kb)).repeat_interleave(rep, dim=1)  # query head j -> kv head j // rep
    vals = torch.cat((cache.values[layer_idx], vb)).repeat_interleave(rep, dim=1)
    scores = torch.einsum("bhd,thd->hbt", q, keys) * hd**-0.5
    k_pos = torch.cat((cache.positions, q_pos))
    mask = attention_mask(drafter.layer_types[layer_idx], drafter.layer_is_causal(layer_idx), q_pos, k_pos,
                          drafter.sliding_window)
    if mask is not None:
        scores = scores.masked_fill(~mask[None], float("-inf"))
    attn = torch.einsum("hbt,thd->bhd", scores.softmax(dim=-1), vals).reshape(b, nh * hd)
    return drafter.linear(attn, sa + "o_proj")


def _mlp_sublayer(drafter: DraftRef, layer_idx: int, normed: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP of layer `layer_idx` on rows [B, H]."""
    p = f"layers.{layer_idx}.mlp."
    return drafter.linear(F.silu(drafter.linear(normed, p + "gate_proj")) * drafter.linear(normed, p + "up_proj"),
                          p + "down_proj")


@torch.no_grad()
def draft_hidden(
    drafter: DraftRef, target_model: Any, cache: ContextKV, block_ids: Any, block_positions: Any
) -> torch.Tensor:
    """Query forward over the B block tokens (spec 2.2); returns the final-normed hidden states [B, H].

    Each layer: x += wrap(attention(input_layernorm(x))), then
    x += wrap(mlp(post_attention_layernorm(x))), with `drafter.wrap_sublayer`
    (the identity for DFlash) and `drafter.embedding_scale` on the embeddings.
    """
    ids, qpos = as_token_ids(block_ids), as_token_ids(block_positions)
    if ids.numel() != qpos.numel() or ids.numel() < 1:
        raise ValueError("block_ids and block_positions must have the same, non-zero length")
    eps = drafter.rms_norm_eps
    x = target_embed(target_model, ids) * drafter.embedding_scale
    if x.shape[1] != drafter.hidden_size:
        raise ValueError(f"target hidden {x.shape[1]} != drafter hidden {drafter.hidden_size}")
    cos, sin = rope_cos_sin(drafter.inv_freq, qpos)
    for i in range(drafter.num_layers):
        p = f"layers.{i}."
        attend = functools.partial(_attention_sublayer, drafter, i, cache, qpos, cos, sin)
        x = x + drafter.wrap_sublayer(i, "attention", attend, rms_norm(x, drafter.w(p + "input_layernorm.weight"), eps))
        mlp = functools.partial(_mlp_sublayer, drafter, i)
        x = x + drafter.wrap_sublayer(i, "mlp", mlp, rms_norm(x, drafter.w(p + "post_attention_layernorm.weight"), eps))
    return rms_norm(x, drafter.w("norm.weight"), eps)


@torch.no_grad()
def draft_query(
    drafter: DraftRef, target_model: Any, cache: ContextKV, block_ids: Any, block_positions: Any
) -> torch.Tensor:
    """Query forward over the B block tokens (spec 2.2); returns logits [B-1, V] (rows 1..B-1)."""
    return target_lm_head(target_model, draft_hidden(drafter, target_model, cache, block_ids, block_positions)[1:])


@torch.no_grad()
def draft_forward(
    drafter: DraftRef,
    target_model: Any,
    ctx_feats: torch.Tensor,
    ctx_positions: Any,
    block_ids: Any,
    block_positions: Any,
    cached_ctx_kv: ContextKV | None = None,
) -> torch.Tensor:
    """Drafter forward of spec 2.2: returns logits [B-1, V] for block rows 1..B-1.

    `ctx_feats` [C, K*Ht] are the NEW context rows at `ctx_positions`.  If
    `cached_ctx_kv` is given, their K/V are appended to it (in place, like an
    engine's append-only draft cache) and the block attends to everything in
    it; otherwise a temporary cache holding only these rows is used.
    """
    cache = cached_ctx_kv if cached_ctx_kv is not None else ContextKV.empty(drafter)
    append_context(drafter, cache, ctx_feats, ctx_positions)
    return draft_query(drafter, target_model, cache, block_ids, block_positions)


def num_spec_tokens(drafter: DraftRef, num_spec: int | None) -> int:
    n = drafter.block_size - 1 if num_spec is None else int(num_spec)
    if n < 0:
        raise ValueError(f"num_spec must be >= 0, got {n}")
    return n


@torch.no_grad()
def propose_ref(
    target_model: Any, drafter: DraftRef, prompt_ids: Any, num_spec: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """First draft after prefill (spec 3.5): returns (draft_ids [n], draft_logits [n, V])."""
    ids = as_token_ids(prompt_ids)
    p, n = ids.numel(), num_spec_tokens(drafter, num_spec)
    logits, feats = target_features(target_model, ids, drafter.target_layer_ids)
    anchor = int(logits[-1].argmax())
    block = torch.tensor([anchor] + [drafter.mask_token_id] * n, dtype=torch.long)
    draft_logits = draft_forward(drafter, target_model, feats, torch.arange(p), block, torch.arange(p, p + n + 1))
    return draft_logits.argmax(dim=-1), draft_logits


# --------------------------------------------------------------------------------------
# Loops


# draft_block(ctx_feats [start, K*Ht], anchor_id, anchor_position, n) -> n draft ids
DraftBlockFn = Callable[[torch.Tensor, int, int, int], list[int]]


@torch.no_grad()
def speculative_loop(
    target_model: Any,
    drafter: DraftRef,
    prompt_ids: Any,
    max_new_tokens: int,
    num_spec: int | None,
    eos_ids: Iterable[int],
    draft_block: DraftBlockFn,
) -> tuple[list[int], list[int]]:
    """Greedy draft-verify loop at batch 1 (spec 3.1) around any drafter's `draft_block`.

    Returns (new tokens, per-step accepted counts).  The first new token comes
    from the prefill; each draft-verify step then emits a accepted drafts + 1
    bonus.  Output is cut after the first EOS or at exactly `max_new_tokens`;
    a step's recorded count is the number of ITS tokens kept minus one, so
    always len(tokens) == 1 + len(per_step) + sum(per_step) (when tokens is
    non-empty).  Raw acceptance of the last step may be higher than recorded.
    """
    prompt = as_token_ids(prompt_ids).tolist()
    n = num_spec_tokens(drafter, num_spec)
    eos = {int(e) for e in eos_ids}
    if max_new_tokens <= 0:
        return [], []
    layer_ids = drafter.target_layer_ids
    logits, ctx_feats = target_features(target_model, prompt, layer_ids)  # context = all P prompt rows
    seq = prompt + [int(logits[-1].argmax())]
    new, per_step = [seq[-1]], []
    while new[-1] not in eos and len(new) < max_new_tokens:
        start = len(seq) - 1  # position of the anchor = tokens the target has "in cache"
        assert ctx_feats.shape[0] == start, "context must cover exactly the positions before the anchor"
        drafts = [int(t) for t in draft_block(ctx_feats, seq[-1], start, n)] if n > 0 else []
        # Verify: causal target over [committed ..., anchor, drafts]; post[j] = target token after block row j.
        v_logits, v_feats = target_features(target_model, seq + drafts, layer_ids)
        post = [int(t) for t in v_logits[start:start + n + 1].argmax(dim=-1)]
        a = 0
        while a < n and drafts[a] == post[a]:
            a += 1
        emitted = drafts[:a] + [post[a]]
        # Context grows by the anchor + accepted drafts (positions start..start+a); bonus not yet verified.
        ctx_feats = torch.cat((ctx_feats, v_feats[start:start + a + 1]), dim=0)
        keep = emitted[: max_new_tokens - len(new)]
        for j, t in enumerate(keep):
            if t in eos:
                keep = keep[: j + 1]
                break
        new += keep
        seq += keep
        per_step.append(len(keep) - 1)
    return new, per_step


@torch.no_grad()
def spec_generate_ref(
    target_model: Any,
    drafter: DraftRef,
    prompt_ids: Any,
    max_new_tokens: int,
    num_spec: int | None = None,
    eos_ids: Iterable[int] = (),
) -> tuple[list[int], list[int]]:
    """Greedy DFlash draft-verify loop at batch 1 (spec 3.1): `speculative_loop` with argmax drafts."""

    def argmax_drafts(ctx_feats: torch.Tensor, anchor_id: int, anchor_position: int, n: int) -> list[int]:
        block = torch.tensor([anchor_id] + [drafter.mask_token_id] * n, dtype=torch.long)
        logits = draft_forward(drafter, target_model, ctx_feats, torch.arange(anchor_position), block,
                               torch.arange(anchor_position, anchor_position + n + 1))
        return [int(t) for t in logits.argmax(dim=-1)]

    return speculative_loop(target_model, drafter, prompt_ids, max_new_tokens, num_spec, eos_ids, argmax_drafts)


@torch.no_grad()
def greedy_generate_ref(
    target_model: Any, prompt_ids: Any, max_new_tokens: int, eos_ids: Iterable[int] = ()
) -> list[int]:
    """Plain greedy decoding (full recompute each step); stops after the first EOS or at max_new_tokens."""
    seq = as_token_ids(prompt_ids).tolist()
    eos = {int(e) for e in eos_ids}
    new: list[int] = []
    while len(new) < max_new_tokens:
        logits = target_model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
        tok = int(logits.argmax())
        new.append(tok)
        seq.append(tok)
        if tok in eos:
            break
    return new

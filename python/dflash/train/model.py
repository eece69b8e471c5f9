# python/dflash/train/model.py
#
# The trainable DFlash drafter (spec dflash.md 1-2, training.md 2.5 and 4): a
# stack of pre-norm Qwen3 layers (q/k RMSNorm, GQA, SwiGLU) whose parameters
# carry EXACTLY the published names (fc, hidden_norm, norm, layers.{i}.
# input_layernorm / self_attn.{q,k,v,o}_proj / self_attn.{q,k}_norm /
# post_attention_layernorm / mlp.{gate,up,down}_proj), so `state_dict()` is the
# published tensor set.  The target's embedding table and LM head are passed in
# and kept as frozen, non-persistent fp32 buffers (exact copies of the served
# weights): they are neither trained nor saved.
#
# Forward (one call for many blocks): the context features F [b, S, K*Ht] are
# projected once, ctx = hidden_norm(fc(F)), and injected as extra keys/values
# into every layer (each layer applies its own k_proj/v_proj/k_norm and RoPE at
# the context positions).  The queries are the N blocks of B tokens of each
# sequence.  Block (j) attends NON-causally to
#   (a) context keys t with ctx_mask[j, t] (the objective sets t < anchor_j), and
#   (b) all B keys of its own block -- never another block.
# This is the block-diagonal mask over [context | block_0 | ... | block_N-1] of
# training.md 2.5, computed without materializing the N*B x N*B part: each
# query's scores are [context scores (masked) | own-block scores] and one
# softmax runs over that row ("eager"); the "sdpa" variant calls
# F.scaled_dot_product_attention (fused kernels on CUDA; same result) on groups
# of G blocks: the queries of G blocks against [context | those G blocks] with
# a bool mask (context rule + block-diagonal), so the masked-out waste is G*B
# keys per query instead of N*B (G = sdpa_group_blocks; 0: all blocks in one
# group, i.e. the dense [context | block_0 .. block_N-1] mask).  Math conventions follow the reference
# (tests/reference/dflash_reference.py): fp32 RMSNorm, RoPE rotate-half with
# inv_freq = 1 / theta^(2i/hd) in fp32, softmax in fp32, scale hd^-0.5,
# query head h uses kv head h // (nh / nkv).
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dflash.drafter_format import build_target_layer_ids, target_rope_theta, write_dflash_drafter

__all__ = ["DrafterConfig", "DFlashDrafter", "dense_block_mask", "grouped_block_mask", "target_rope_theta",
           "frozen_target_tensors"]


@dataclass
class DrafterConfig:
    """Geometry and DFlash fields of a drafter (the published config.json, in short)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int] = field(default_factory=list)
    num_target_layers: int = 0
    target_hidden_size: int = 0
    vocab_size: int = 0
    max_position_embeddings: int = 40960
    # DFlash2 (dflash2_model.py; ignored by a DFlash drafter): "dflash" | "dflash2"
    arch: str = "dflash"
    conv_kernel_size: int = 2  # conv taps T
    conv_group_size: int = 16  # channels per dynamic correction g (G = H / g corrections per tap)
    selector_rank: int = 256  # r
    selector_top_k: int = 16  # K candidates per slot

    @property
    def fc_in_features(self) -> int:
        return len(self.target_layer_ids) * self.target_hidden_size

    def validate(self) -> None:
        if self.num_layers < 1 or self.block_size < 2:
            raise ValueError(f"need num_layers >= 1 and block_size >= 2 (got {self.num_layers}, {self.block_size})")
        if self.num_heads < 1 or self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a positive multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim must be even, got {self.head_dim}")
        if not self.target_layer_ids or any(not 0 <= i < self.num_target_layers for i in self.target_layer_ids):
            raise ValueError(f"target_layer_ids {self.target_layer_ids} must be non-empty ids in "
                             f"[0, {self.num_target_layers})")
        if self.hidden_size != self.target_hidden_size:
            raise ValueError("the drafter's hidden size must equal the target's (shared embedding and LM head)")
        if self.vocab_size and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the vocabulary [0, {self.vocab_size})")
        if self.arch not in ("dflash", "dflash2"):
            raise ValueError(f"unknown drafter architecture {self.arch!r}: use dflash or dflash2")
        if self.arch == "dflash2":
            if self.conv_kernel_size < 1 or self.conv_kernel_size > self.block_size:
                raise ValueError(f"conv taps must be in [1, block_size {self.block_size}], got {self.conv_kernel_size}")
            if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
                raise ValueError(f"conv group size {self.conv_group_size} does not divide the hidden size "
                                 f"{self.hidden_size}; pick a divisor of {self.hidden_size}")
            if self.selector_rank < 1:
                raise ValueError(f"selector rank must be >= 1, got {self.selector_rank}")
            if self.vocab_size and not 1 <= self.selector_top_k < self.vocab_size:
                raise ValueError(f"selector top-K must be in [1, vocab size {self.vocab_size}), "
                                 f"got {self.selector_top_k}")

    @classmethod
    def from_target(
        cls,
        target_config: Mapping[str, Any],
        *,
        num_layers: int,
        block_size: int,
        mask_token_id: int,
        target_layer_ids: Sequence[int] | None = None,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        intermediate_size: int | None = None,
    ) -> "DrafterConfig":
        """Drafter geometry copied from the target's config.json (training.md 4)."""
        tc = target_config
        t_layers, hidden = int(tc["num_hidden_layers"]), int(tc["hidden_size"])
        heads = int(num_heads or tc["num_attention_heads"])
        kv = int(num_kv_heads or tc.get("num_key_value_heads") or heads)
        if head_dim is None:
            head_dim = (tc.get("head_dim") if num_heads is None else None) or hidden // heads
        ids = (build_target_layer_ids(t_layers, int(num_layers)) if target_layer_ids is None
               else [int(i) for i in target_layer_ids])
        cfg = cls(
            hidden_size=hidden, num_layers=int(num_layers), num_heads=heads, num_kv_heads=kv,
            head_dim=int(head_dim), intermediate_size=int(intermediate_size or tc["intermediate_size"]),
            rms_norm_eps=float(tc.get("rms_norm_eps", 1e-6)), rope_theta=target_rope_theta(tc),
            block_size=int(block_size), mask_token_id=int(mask_token_id), target_layer_ids=ids,
            num_target_layers=t_layers, target_hidden_size=hidden, vocab_size=int(tc["vocab_size"]),
            max_position_embeddings=int(tc.get("max_position_embeddings") or 40960),
        )
        cfg.validate()
        return cfg

    @classmethod
    def from_drafter_json(cls, cfg: Mapping[str, Any], target_config: Mapping[str, Any]) -> "DrafterConfig":
        """Read a published drafter config.json (for warm starts / reloading an export)."""
        dcfg = cfg.get("dflash_config") or {}
        n_layers = int(cfg["num_hidden_layers"])
        n_target = int(cfg.get("num_target_layers") or target_config["num_hidden_layers"])
        ids = dcfg.get("target_layer_ids") or build_target_layer_ids(n_target, n_layers)
        types = cfg.get("layer_types") or ["full_attention"] * n_layers
        if any(t != "full_attention" for t in types):
            raise ValueError("the trainer supports full_attention drafter layers only")
        heads = int(cfg["num_attention_heads"])
        out = cls(
            hidden_size=int(cfg["hidden_size"]), num_layers=n_layers, num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            intermediate_size=int(cfg["intermediate_size"]), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=target_rope_theta(cfg), block_size=int(cfg.get("block_size") or dcfg["block_size"]),
            mask_token_id=int(dcfg.get("mask_token_id", cfg.get("mask_token_id"))),
            target_layer_ids=[int(i) for i in ids], num_target_layers=n_target,
            target_hidden_size=int(target_config["hidden_size"]), vocab_size=int(target_config["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 40960),
        )
        if "DFlash2DraftModel" in (cfg.get("architectures") or []):
            if cfg.get("is_causal") or any(dcfg.get(k) not in (None, 1, 1.0) for k in
                                           ("output_multiplier", "input_embedding_scale")) \
                    or dcfg.get("final_logit_softcapping"):
                raise ValueError("the trainer supports DFlash2 drafters without is_causal, output_multiplier, "
                                 "final_logit_softcapping and input_embedding_scale only")
            out.arch = "dflash2"
            for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
                setattr(out, k, int(dcfg.get(k, cfg.get(k))))
        out.validate()
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DrafterConfig":
        return cls(**dict(d))


# --------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    """weight * x / sqrt(mean(x^2) + eps), computed in fp32 (output fp32)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return self.weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [b, N, B, H] normed block hidden
        rope_b: tuple[torch.Tensor, torch.Tensor],  # cos/sin [b, N, B, hd]
        ctx: torch.Tensor,  # [b, S, H] context hidden (hidden_norm(fc(F)))
        rope_c: tuple[torch.Tensor, torch.Tensor],  # cos/sin [b, S, hd]
        ctx_mask: torch.Tensor,  # [b, N, S] bool, True = block j may see context t
        dense_mask: tuple[torch.Tensor, int] | None = None,  # sdpa: (grouped_block_mask, G) or None (eager)
    ) -> torch.Tensor:
        b, n, bs, _ = x.shape
        s = ctx.shape[1]
        nkv, rep, hd = self.nkv, self.nh // self.nkv, self.hd
        cos_b, sin_b = rope_b[0][..., None, None, :], rope_b[1][..., None, None, :]
        q = _rope(self.q_norm(self.q_proj(x).view(b, n, bs, nkv, rep, hd)), cos_b, sin_b)
        cos_b, sin_b = rope_b[0][..., None, :], rope_b[1][..., None, :]
        kb = _rope(self.k_norm(self.k_proj(x).view(b, n, bs, nkv, hd)), cos_b, sin_b)
        vb = self.v_proj(x).view(b, n, bs, nkv, hd)
        kc = _rope(self.k_norm(self.k_proj(ctx).view(b, s, nkv, hd)), rope_c[0][..., None, :], rope_c[1][..., None, :])
        vc = self.v_proj(ctx).view(b, s, nkv, hd)
        dt = vb.dtype  # bf16 under CUDA autocast, fp32 otherwise
        q, kb, kc = q.to(dt), kb.to(dt), kc.to(dt)
        scale = hd ** -0.5
        if dense_mask is not None:  # "sdpa": fused calls, G blocks against [context | those G blocks]
            mask, g = dense_mask
            n_pad = mask.shape[0] // b * g
            ng = n_pad // g
            qh = q.reshape(b, n, bs, self.nh, hd)
            if n_pad > n:  # zero padding blocks: they see only their own (zero) keys, then are cut off
                pad = (0, 0, 0, 0, 0, 0, 0, n_pad - n)
                qh, kb, vb = F.pad(qh, pad), F.pad(kb, pad), F.pad(vb, pad)
            qh = qh.reshape(b * ng, g * bs, self.nh, hd).transpose(1, 2)
            k = torch.cat((kc[:, None].expand(b, ng, s, nkv, hd), kb.reshape(b, ng, g * bs, nkv, hd)), dim=2)
            v = torch.cat((vc[:, None].expand(b, ng, s, nkv, hd), vb.reshape(b, ng, g * bs, nkv, hd)), dim=2)
            k = k.reshape(b * ng, s + g * bs, nkv, hd).transpose(1, 2).repeat_interleave(rep, dim=1)
            v = v.reshape(b * ng, s + g * bs, nkv, hd).transpose(1, 2).repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale)
            o = o.transpose(1, 2).reshape(b, n_pad, bs, self.nh * hd)[:, :n]
            return self.o_proj(o)
        # scores [b, nkv, rep, N, B, S] (context) and [b, nkv, rep, N, B, B] (own block)
        sc = torch.einsum("bnqgrd,bsgd->bgrnqs", q, kc).float() * scale
        sb = torch.einsum("bnqgrd,bnkgd->bgrnqk", q, kb).float() * scale
        sc = sc.masked_fill(~ctx_mask[:, None, None, :, None, :], float("-inf"))
        p = torch.cat((sc, sb), dim=-1).softmax(dim=-1)  # never an empty row: the own block is visible
        pc, pb = p[..., :s].to(dt), p[..., s:].to(dt)
        o = torch.einsum("bgrnqs,bsgd->bnqgrd", pc, vc) + torch.einsum("bgrnqk,bnkgd->bnqgrd", pb, vb)
        return self.o_proj(o.reshape(b, n, bs, self.nh * hd))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope_b, ctx, rope_c, ctx_mask, dense_mask=None):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), rope_b, ctx, rope_c, ctx_mask, dense_mask).float()
        return x + self.mlp(self.post_attention_layernorm(x)).float()


# --------------------------------------------------------------------------------------
# The drafter


def dense_block_mask(ctx_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """[b, 1, N*B, S+N*B] bool over [context | block_0 .. block_N-1] keys: query (j, k)
    sees context t where ctx_mask[j, t] and every key of block j (training.md 2.5)."""
    return grouped_block_mask(ctx_mask, block_size, 0)[0]


def grouped_block_mask(ctx_mask: torch.Tensor, block_size: int, group_blocks: int) -> tuple[torch.Tensor, int]:
    """The sdpa mask for groups of G = group_blocks blocks (0: all N in one group): returns
    ([b * N'/G, 1, G*B, S + G*B] bool, G) with N' = N rounded up to a multiple of G; the
    rows of group i are its G blocks, the keys [context | its G blocks]; padding blocks see
    only their own keys."""
    b, n, s = ctx_mask.shape
    g = n if group_blocks <= 0 else max(1, min(n, int(group_blocks)))
    n_pad = -(-n // g) * g
    if n_pad > n:
        ctx_mask = F.pad(ctx_mask, (0, 0, 0, n_pad - n), value=False)
    ng = n_pad // g
    ctx = ctx_mask.reshape(b, ng, g, 1, s).expand(b, ng, g, block_size, s).reshape(b * ng, g * block_size, s)
    blk = torch.arange(g, device=ctx_mask.device).repeat_interleave(block_size)
    same = (blk[:, None] == blk[None, :])[None].expand(b * ng, -1, -1)
    return torch.cat((ctx, same), dim=-1)[:, None], g


def frozen_target_tensors(target_model: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(embedding table, LM head weight, LM head bias or None) of a HF causal LM, detached fp32."""
    emb = target_model.get_input_embeddings().weight.detach().float()
    head = target_model.get_output_embeddings()
    bias = getattr(head, "bias", None)
    return emb, head.weight.detach().float(), None if bias is None else bias.detach().float()


class DFlashDrafter(nn.Module):
    """Trainable DFlash drafter; `state_dict()` holds exactly the published tensor names."""

    def __init__(
        self,
        config: DrafterConfig,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        lm_head_bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        config.validate()
        self.config = config
        h = config.hidden_size
        if tuple(embed_weight.shape) != (config.vocab_size, h) or lm_head_weight.shape[1] != h:
            raise ValueError(f"target embedding {tuple(embed_weight.shape)} / lm_head "
                             f"{tuple(lm_head_weight.shape)} do not fit vocab {config.vocab_size}, hidden {h}")
        self.fc = nn.Linear(config.fc_in_features, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        # Frozen, shared with the target, never saved (non-persistent buffers follow .to()).
        self.register_buffer("embed_weight", embed_weight.detach().float(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach().float(), persistent=False)
        self.register_buffer("lm_head_bias", None if lm_head_bias is None else lm_head_bias.detach().float(),
                             persistent=False)
        inv = 1.0 / (float(config.rope_theta) ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32)
                                                  / config.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.attn_impl = "eager"  # or "sdpa" (see set_attention)
        self.sdpa_group_blocks = 32

    def set_attention(self, impl: str, group_blocks: int | None = None) -> "DFlashDrafter":
        """"eager": [masked context | own block] scores, softmax in fp32 (exact, memory
        O(N*B*(S+B)) per head); "sdpa": F.scaled_dot_product_attention over groups of
        `group_blocks` blocks against [context | the group's blocks] with a bool mask
        (fused kernels on CUDA; 0: one group of all blocks, the dense mask)."""
        if impl not in ("eager", "sdpa"):
            raise ValueError(f"attention must be 'eager' or 'sdpa', got {impl!r}")
        self.attn_impl = impl
        if group_blocks is not None:
            if int(group_blocks) < 0:
                raise ValueError(f"sdpa group size must be >= 0, got {group_blocks}")
            self.sdpa_group_blocks = int(group_blocks)
        return self

    # ---------------------------------------------------------------- init / io
    @torch.no_grad()
    def reset_parameters(self, seed: int = 0, std: float = 0.02) -> None:
        """HF-style init (training.md 4): Linear ~ N(0, std), RMSNorm gains = 1; seeded."""
        gen = torch.Generator().manual_seed(int(seed))
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)

    def published_weights(self) -> dict[str, np.ndarray]:
        """Name -> fp32 numpy array, the published tensor set."""
        return {k: v.detach().float().cpu().numpy() for k, v in self.state_dict().items()}

    def export(self, out_dir: str | Path, target_config: Mapping[str, Any], dtype: str = "float32") -> Path:
        """Write config.json + model.safetensors in the published DFlashDraftModel format."""
        c = self.config
        return write_dflash_drafter(
            out_dir, target_config=target_config, num_layers=c.num_layers, target_layer_ids=c.target_layer_ids,
            block_size=c.block_size, mask_token_id=c.mask_token_id, hidden_size=c.hidden_size,
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
            intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
            dtype=dtype, weights=self.published_weights(),
        )

    @classmethod
    def from_published(cls, draft_dir: str | Path, target_model: Any) -> "DFlashDrafter":
        """Load a published drafter directory (warm start, or reloading an export)."""
        from safetensors.torch import load_file

        d = Path(draft_dir)
        cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
        dc = DrafterConfig.from_drafter_json(cfg, target_model.config.to_dict())
        model = cls(dc, *frozen_target_tensors(target_model))
        weights: dict[str, torch.Tensor] = {}
        for f in sorted(d.glob("*.safetensors")):
            weights.update({k: v.float() for k, v in load_file(str(f)).items()})
        model.load_state_dict(weights, strict=True)
        return model

    # ---------------------------------------------------------------- forward
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos(), emb.sin()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_weight[ids]

    def forward(
        self,
        block_ids: torch.Tensor,  # [b, N, B] long: [anchor, MASK...] per block
        block_pos: torch.Tensor,  # [b, N, B] long: anchor position + k
        ctx_feats: torch.Tensor,  # [b, S, K*Ht] target features (tapped layer outputs, concatenated)
        ctx_pos: torch.Tensor,  # [b, S] long
        ctx_mask: torch.Tensor,  # [b, N, S] bool
    ) -> torch.Tensor:
        """Final-normed drafter hidden states [b, N, B, H] (fp32)."""
        ctx = self.hidden_norm(self.fc(ctx_feats.to(self.fc.weight.dtype)))
        rope_b, rope_c = self.rope(block_pos), self.rope(ctx_pos)
        x = self.embed(block_ids)
        dense = (grouped_block_mask(ctx_mask, block_ids.shape[2], self.sdpa_group_blocks)
                 if self.attn_impl == "sdpa" else None)
        for layer in self.layers:
            x = layer(x, rope_b, ctx, rope_c, ctx_mask, dense)
        return self.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Target LM head on final-normed drafter states."""
        return F.linear(h, self.lm_head_weight, self.lm_head_bias)

    @torch.no_grad()
    def propose(self, target_model: Any, prompt_ids: Sequence[int], num_spec: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """First draft after a prefill of `prompt_ids` (what `Session.propose` computes).

        Runs the TRAINING forward with one anchor at position P (the target's greedy next
        token) whose context is every prompt position: returns (draft ids [n], logits [n, V]).
        """
        from dflash.train.objective import target_features

        n = self.config.block_size - 1 if num_spec is None else int(num_spec)
        dev = self.embed_weight.device
        ids = torch.as_tensor(list(prompt_ids), dtype=torch.long, device=dev)[None]
        p = ids.shape[1]
        feats, last_logits = target_features(target_model, ids, self.config.target_layer_ids, return_logits=True)
        anchor = int(last_logits[0].argmax())
        block = torch.tensor([[[anchor] + [self.config.mask_token_id] * n]], device=dev)
        pos = torch.arange(p, p + n + 1, device=dev)[None, None]
        mask = torch.ones(1, 1, p, dtype=torch.bool, device=dev)
        h = self(block, pos, feats, torch.arange(p, device=dev)[None], mask)
        logits = self.logits(h[0, 0, 1:].float())
        return logits.argmax(dim=-1), logits

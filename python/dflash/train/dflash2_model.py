# python/dflash/train/dflash2_model.py
#
# The trainable DFlash2 drafter (spec dflash2.md 1-3, training.md 3.4): the
# DFlash drafter of model.py plus
#   * a grouped dynamic depthwise conv around every attention and MLP sublayer
#     (`layers.{i}.attention_conv` / `mlp_conv`: base_kernel [2 sides, T, H],
#     kernel_projection Linear(H -> 2*T*G), G = H / g).  One projection of the
#     sublayer's normed input gives both sides' dynamic deltas; `prepare` convolves
#     that input (side 0), `finish` the sublayer output (side 1):
#         h = h + finish(attn(prepare(norm h))), then the same around the MLP,
#     conv(y)[i] = sum_t (base[t] + delta[i, t] repeated g times) * y[i - t], taps
#     never reaching across a block start (the block axis is its own axis here);
#   * the candidate selector (`candidate_selector.*`): codebooks A (predecessor)
#     and B (successor) [V, r] and hidden_projection [r, H];
#         score(p -> c) = unary[c] + <A[p] * (Hproj h_slot), B[c]>,
#     unary = the target LM head on the drafter's final-normed slot state.
# Identity init (training.md 3.4): base tap 0 = 1, other taps 0, projections 0,
# B = 0, A and Hproj ~ N(0, std): a fresh DFlash2 is exactly its DFlash backbone
# and its selector scores equal the unary logits.  The math follows
# tests/reference/dflash2_reference.py (GroupedConvRef, edge_scores_ref).
# `state_dict()` is the published DFlash2DraftModel tensor set; the export goes
# through drafter_format.write_dflash2_drafter.
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash.drafter_format import write_dflash2_drafter
from dflash.train.model import (
    DecoderLayer,
    DFlashDrafter,
    DrafterConfig,
    frozen_target_tensors,
)

__all__ = [
    "CandidateSelector",
    "DFlash2Drafter",
    "GroupedDynamicConv",
    "build_drafter",
    "export_dflash2",
    "is_dflash2_parameter",
    "load_published_drafter",
]


def is_dflash2_parameter(name: str) -> bool:
    """True for the tensors DFlash2 adds to the DFlash set."""
    return ".attention_conv." in name or ".mlp_conv." in name or name.startswith("candidate_selector.")


class GroupedDynamicConv(nn.Module):
    """One attention_conv / mlp_conv wrapper (spec dflash2 2.1); inputs [..., B, H] (block axis -2)."""

    def __init__(self, hidden_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        self.taps, self.group_size = int(taps), int(group_size)
        self.groups = hidden_size // self.group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, self.taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * self.taps * self.groups, bias=False)
        self.reset_identity()

    @torch.no_grad()
    def reset_identity(self) -> None:
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def _conv(self, y: torch.Tensor, base: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """y [..., B, H], base [T, H], delta [..., B, T, G] -> [..., B, H] fp32."""
        bs = y.shape[-2]
        out = None
        for t in range(self.taps):
            coeff = base[t].float() + delta[..., t, :].float().repeat_interleave(self.group_size, dim=-1)
            shifted = y.float() if t == 0 else F.pad(y.float()[..., : max(0, bs - t), :], (0, 0, min(t, bs), 0))
            term = coeff * shifted
            out = term if out is None else out + term
        return out  # type: ignore[return-value]

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (the sublayer's normed input) -> (conv_0(x), side-1 deltas [..., B, T, G])."""
        d = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.taps, self.groups)
        return self._conv(x, self.base_kernel[0], d[..., 0, :, :]), d[..., 1, :, :]

    def finish(self, y: torch.Tensor, out_deltas: torch.Tensor) -> torch.Tensor:
        return self._conv(y, self.base_kernel[1], out_deltas)


class DFlash2DecoderLayer(DecoderLayer):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__(cfg)
        self.attention_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedDynamicConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x, rope_b, ctx, rope_c, ctx_mask, dense_mask=None):  # type: ignore[no-untyped-def]
        a_in, a_delta = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(a_in, rope_b, ctx, rope_c, ctx_mask, dense_mask), a_delta)
        m_in, m_delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(m_in), m_delta)


class CandidateSelector(nn.Module):
    """Low-rank predecessor -> successor bias on the unary logits of the K candidates (spec dflash2 3.2)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int) -> None:
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def scores(self, h: torch.Tensor, pred_ids: torch.Tensor, cand_ids: torch.Tensor, unary: torch.Tensor
               ) -> torch.Tensor:
        """h [n, H] final-normed slot states, pred_ids [n] or [n, P], cand_ids / unary [n, K]:
        scores [n, K] (one predecessor per row) or [n, P, K] (edges)."""
        hid = F.linear(h.float(), self.hidden_projection.weight.float())  # [n, r]
        succ = self.successor_codebook.float()[cand_ids]  # [n, K, r]
        if pred_ids.dim() == 1:
            pred = self.predecessor_codebook.float()[pred_ids] * hid  # [n, r]
            return unary.float() + torch.einsum("nr,nkr->nk", pred, succ)
        pred = self.predecessor_codebook.float()[pred_ids] * hid[:, None]  # [n, P, r]
        return unary.float()[:, None, :] + torch.einsum("npr,nkr->npk", pred, succ)


class DFlash2Drafter(DFlashDrafter):
    """Trainable DFlash2 drafter; `state_dict()` holds exactly the published DFlash2 tensor names."""

    def __init__(self, config: DrafterConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 lm_head_bias: torch.Tensor | None = None) -> None:
        if config.arch != "dflash2":
            raise ValueError(f"DFlash2Drafter needs a dflash2 config, got arch {config.arch!r}")
        super().__init__(config, embed_weight, lm_head_weight, lm_head_bias)
        self.layers = nn.ModuleList(DFlash2DecoderLayer(config) for _ in range(config.num_layers))
        self.candidate_selector = CandidateSelector(config.vocab_size, config.hidden_size, config.selector_rank)

    # ---------------------------------------------------------------- init / io
    @torch.no_grad()
    def reset_parameters(self, seed: int = 0, std: float = 0.02) -> None:
        """The backbone exactly as DFlashDrafter.reset_parameters draws it (same seed, same
        values), then the DFlash2 parts at their identity init."""
        gen = torch.Generator().manual_seed(int(seed))
        for name, p in self.named_parameters():
            if is_dflash2_parameter(name):
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
        self.reset_dflash2_parameters(seed, std)

    @torch.no_grad()
    def reset_dflash2_parameters(self, seed: int = 0, std: float = 0.02) -> None:
        """Identity convs, B = 0, A and Hproj ~ N(0, std) (seeded apart from the backbone)."""
        gen = torch.Generator().manual_seed(int(seed) + 0x5E1EC7)
        for layer in self.layers:
            layer.attention_conv.reset_identity()
            layer.mlp_conv.reset_identity()
        sel = self.candidate_selector
        sel.predecessor_codebook.copy_(torch.randn(sel.predecessor_codebook.shape, generator=gen) * std)
        sel.successor_codebook.zero_()
        sel.hidden_projection.weight.copy_(torch.randn(sel.hidden_projection.weight.shape, generator=gen) * std)

    def export(self, out_dir: str | Path, target_config: Mapping[str, Any], dtype: str = "float32") -> Path:
        """Write config.json + model.safetensors in the published DFlash2DraftModel format."""
        return export_dflash2(out_dir, self.config, self.published_weights(), target_config, dtype)

    @classmethod
    def from_published(cls, draft_dir: str | Path, target_model: Any, *, seed: int = 0, std: float = 0.02,
                       **dflash2_fields: Any) -> DFlash2Drafter:
        """Load a published drafter: a DFlash2 one entirely; a DFlash (v1) one as the backbone,
        the DFlash2 parts (geometry from dflash2_fields: conv_kernel_size, conv_group_size,
        selector_rank, selector_top_k) at their identity init."""
        d = Path(draft_dir)
        cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
        dc = DrafterConfig.from_drafter_json(cfg, target_model.config.to_dict())
        weights = _read_weights(d)
        if dc.arch == "dflash2":
            model = cls(dc, *frozen_target_tensors(target_model))
            model.load_state_dict(weights, strict=True)
            return model
        dc.arch = "dflash2"
        for k, v in dflash2_fields.items():
            if v is not None:
                setattr(dc, k, int(v))
        dc.validate()
        model = cls(dc, *frozen_target_tensors(target_model))
        model.reset_dflash2_parameters(seed, std)
        res = model.load_state_dict(weights, strict=False)
        missing = [k for k in res.missing_keys if not is_dflash2_parameter(k)]
        if missing or res.unexpected_keys:
            raise ValueError(f"{d}: not a DFlash drafter of this shape (missing {missing}, "
                             f"unexpected {res.unexpected_keys})")
        return model

    # ---------------------------------------------------------------- drafting
    @torch.no_grad()
    def propose_details(self, target_model: Any, prompt_ids: Sequence[int], num_spec: int | None = None
                        ) -> dict[str, torch.Tensor]:
        """First DFlash2 draft after a prefill (what `Session.propose_details` computes):
        candidate_ids [n, K], unary [n, K], edges [n, K, K] and the greedy walk's draft_ids [n]."""
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
        h = self(block, pos, feats, torch.arange(p, device=dev)[None], mask)[0, 0, 1:].float()
        values, cand = torch.sort(self.logits(h).float(), dim=-1, descending=True, stable=True)
        k = self.config.selector_top_k
        unary, cand = values[:, :k], cand[:, :k]
        pred = torch.empty_like(cand)
        pred[0] = anchor
        pred[1:] = cand[:-1]
        edges = self.candidate_selector.scores(h, pred, cand, unary)
        prev, draft = 0, []
        for s in range(n):
            prev = int(torch.argmax(edges[s, prev]))
            draft.append(int(cand[s, prev]))
        return {"draft_ids": torch.tensor(draft), "candidate_ids": cand, "unary": unary, "edges": edges}


def _read_weights(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        weights.update({k: v.float() for k, v in load_file(str(f)).items()})
    return weights


def export_dflash2(out_dir: str | Path, c: DrafterConfig, weights: Mapping[str, Any],
                   target_config: Mapping[str, Any], dtype: str = "float32") -> Path:
    """The published DFlash2DraftModel files of a drafter config and its fp32 weights."""
    return write_dflash2_drafter(
        out_dir, target_config=target_config, num_layers=c.num_layers, target_layer_ids=c.target_layer_ids,
        block_size=c.block_size, mask_token_id=c.mask_token_id, hidden_size=c.hidden_size,
        num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        dtype=dtype, weights=weights, conv_kernel_size=c.conv_kernel_size, conv_group_size=c.conv_group_size,
        selector_rank=c.selector_rank, selector_top_k=c.selector_top_k)


def build_drafter(config: DrafterConfig, target_model: Any) -> DFlashDrafter:
    """A fresh (uninitialised) drafter of config.arch for the target."""
    cls = DFlash2Drafter if config.arch == "dflash2" else DFlashDrafter
    return cls(config, *frozen_target_tensors(target_model))


def load_published_drafter(draft_dir: str | Path, target_model: Any, arch: str, *, seed: int = 0,
                           std: float = 0.02, **dflash2_fields: Any) -> DFlashDrafter:
    """Warm start of a drafter of `arch` from a published directory (DFlash or DFlash2)."""
    cfg = json.loads((Path(draft_dir) / "config.json").read_text(encoding="utf-8"))
    published_v2 = "DFlash2DraftModel" in (cfg.get("architectures") or [])
    if arch == "dflash2":
        return DFlash2Drafter.from_published(draft_dir, target_model, seed=seed, std=std, **dflash2_fields)
    if published_v2:
        raise ValueError(f"{draft_dir} is a DFlash2 drafter: train it with --arch dflash2")
    return DFlashDrafter.from_published(draft_dir, target_model)

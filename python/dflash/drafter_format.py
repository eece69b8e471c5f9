# python/dflash/drafter_format.py
#
# Writer of DFlash drafter checkpoints in the published z-lab format
# ("DFlashDraftModel", see docs/spec section 1): a Qwen3-style config.json with
# `block_size`, `num_target_layers` and `dflash_config: {target_layer_ids,
# mask_token_id}`, and a model.safetensors holding exactly the published tensor
# set with unprefixed names -- `fc.weight [H, K*Ht]`, `hidden_norm.weight`,
# `norm.weight` and 11 tensors per layer (no embedding, no lm_head: the drafter
# borrows both from the target).
#
# DFlash2 drafters ("DFlash2DraftModel", docs spec dflash2 section 1) are the same
# files plus, per layer, `attention_conv` / `mlp_conv` (`base_kernel [2, T, H]`,
# `kernel_projection.weight [2*T*H/g, H]`) and a `candidate_selector`
# (`predecessor_codebook [V, r]`, `successor_codebook [V, r]`,
# `hidden_projection.weight [r, H]`); both writers share one geometry, config and
# tensor path.
#
# Used by tests (random drafters for tiny targets) and by anything that wants to
# emit a drafter (e.g. a trainer passing `weights=`).  Only numpy is needed: the
# safetensors file is written directly so that bfloat16 works without torch.
from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "build_target_layer_ids",
    "dflash2_tensor_shapes",
    "drafter_tensor_shapes",
    "write_dflash2_drafter",
    "write_dflash_drafter",
]

LAYER_TYPES = ("full_attention", "sliding_attention")
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published default choice of target layers (spec 1.1).

    D == 1 -> [T // 2]; otherwise D ids spread evenly (Python `round`) from 1 to
    T - 3, e.g. T=36, D=5 -> [1, 9, 17, 25, 33].
    """
    t, d = int(num_target_layers), int(num_draft_layers)
    if t < 1 or d < 1:
        raise ValueError(f"need num_target_layers >= 1 and num_draft_layers >= 1, got {t}, {d}")
    if d == 1:
        return [t // 2]
    start, end = 1, t - 3
    ids = [round(start + i * (end - start) / (d - 1)) for i in range(d)]
    if any(not 0 <= i < t for i in ids):
        raise ValueError(f"the default rule gives out-of-range layer ids {ids} for a {t}-layer target; "
                         "pass target_layer_ids explicitly")
    return ids


def target_rope_theta(cfg: Mapping[str, Any]) -> float:
    """rope_theta of a HF config dict (top level or inside rope_parameters)."""
    if cfg.get("rope_theta") is not None:
        return float(cfg["rope_theta"])
    params = cfg.get("rope_parameters") or {}
    if params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return 10000.0


def _require(cfg: Mapping[str, Any], key: str) -> int:
    if cfg.get(key) is None:
        raise ValueError(f"target_config lacks {key!r}")
    return int(cfg[key])


def drafter_tensor_shapes(
    *, num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
    intermediate_size: int, fc_in_features: int,
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the published tensor set (11 per layer + 3), in file order."""
    h, hd = hidden_size, head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, fc_in_features),
        "hidden_norm.weight": (h,),
    }
    for i in range(num_layers):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (num_heads * hd, h)
        shapes[p + "self_attn.k_proj.weight"] = (num_kv_heads * hd, h)
        shapes[p + "self_attn.v_proj.weight"] = (num_kv_heads * hd, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, num_heads * hd)
        shapes[p + "self_attn.q_norm.weight"] = (hd,)
        shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, intermediate_size)
    shapes["norm.weight"] = (h,)
    return shapes


def _to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float -> bfloat16 bit patterns (uint16), round to nearest even."""
    if a.dtype.name == "bfloat16":  # e.g. ml_dtypes arrays: already bf16
        return a.view(np.uint16)
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def _encode(a: np.ndarray, dtype: str) -> bytes:
    if dtype == "bfloat16":
        return _to_bf16_bits(a).astype("<u2").tobytes()
    np_dtype = "<f4" if dtype == "float32" else "<f2"
    return np.ascontiguousarray(a, dtype=np_dtype).tobytes()


def _write_safetensors(path: Path, tensors: Mapping[str, np.ndarray], dtype: str) -> None:
    """Minimal safetensors writer (8-byte LE header size, JSON header, raw data)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name, arr in tensors.items():
        blob = _encode(arr, dtype)
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)


@dataclass(frozen=True)
class _Geometry:
    """Drafter geometry resolved from a target config and the writer's arguments (validated)."""

    num_target_layers: int
    vocab_size: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    max_position_embeddings: int
    bos_token_id: Any
    eos_token_id: Any
    dtype: str

    def shape_args(self) -> dict[str, int]:
        """The keyword arguments of `drafter_tensor_shapes` for this geometry."""
        return {"num_layers": self.num_layers, "hidden_size": self.hidden_size, "num_heads": self.num_heads,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "intermediate_size": self.intermediate_size,
                "fc_in_features": len(self.target_layer_ids) * self.hidden_size}

    def config(self, *, architecture: str, dflash_extra: Mapping[str, Any] | None = None,
               top_level_extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """config.json of a drafter of this geometry; the extras are merged in last."""
        uses_swa = self.sliding_window is not None
        config: dict[str, Any] = {
            "architectures": [architecture],
            "auto_map": {"AutoModel": f"dflash.{architecture}"},
            "model_type": "qwen3",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id,
                              **(dflash_extra or {})},
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "layer_types": list(self.layer_types),
            "use_sliding_window": uses_swa,
            "sliding_window": self.sliding_window,
            "max_window_layers": self.num_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "use_cache": True,
            "dtype": self.dtype,
            "torch_dtype": self.dtype,
        }
        config.update(top_level_extra or {})
        return config


def _resolve_geometry(
    tc: Mapping[str, Any], *, num_layers: int, target_layer_ids: Sequence[int] | None, block_size: int,
    mask_token_id: int | None, hidden_size: int | None, num_heads: int | None, num_kv_heads: int | None,
    head_dim: int | None, intermediate_size: int | None, rms_norm_eps: float | None, rope_theta: float | None,
    layer_types: Sequence[str] | None, sliding_window: int | None, dtype: str,
) -> _Geometry:
    """Geometry defaults from the target config `tc`; raises ValueError on anything inconsistent."""
    if dtype not in _ST_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_ST_DTYPES)}, got {dtype!r}")
    if int(num_layers) < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if int(block_size) < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n_target = _require(tc, "num_hidden_layers")
    vocab = _require(tc, "vocab_size")
    t_hidden = _require(tc, "hidden_size")
    t_heads = _require(tc, "num_attention_heads")

    hidden = int(hidden_size if hidden_size is not None else t_hidden)
    if hidden != t_hidden:
        raise ValueError(f"hidden_size {hidden} != target hidden_size {t_hidden}: the drafter shares "
                         "the target's embed_tokens and lm_head")
    heads = int(num_heads if num_heads is not None else t_heads)
    kv_heads = int(num_kv_heads if num_kv_heads is not None else (tc.get("num_key_value_heads") or t_heads))
    if head_dim is None:
        head_dim = tc.get("head_dim") if num_heads is None else None
        head_dim = int(head_dim) if head_dim else hidden // heads
    hd = int(head_dim)
    inter = int(intermediate_size if intermediate_size is not None else _require(tc, "intermediate_size"))
    eps = float(rms_norm_eps if rms_norm_eps is not None else tc.get("rms_norm_eps", 1e-6))
    theta = float(rope_theta if rope_theta is not None else target_rope_theta(tc))
    if heads < 1 or kv_heads < 1 or heads % kv_heads != 0:
        raise ValueError(f"num_heads ({heads}) must be a positive multiple of num_kv_heads ({kv_heads})")
    if hd < 2 or hd % 2 != 0 or inter < 1:
        raise ValueError(f"head_dim must be even and >= 2 and intermediate_size >= 1 (got {hd}, {inter})")

    ids = (build_target_layer_ids(n_target, int(num_layers)) if target_layer_ids is None
           else [int(i) for i in target_layer_ids])
    if not ids or any(not 0 <= i < n_target for i in ids):
        raise ValueError(f"target_layer_ids {ids} must be non-empty ids in [0, {n_target})")
    mask_id = int(mask_token_id if mask_token_id is not None else vocab - 1)
    if not 0 <= mask_id < vocab:
        raise ValueError(f"mask_token_id {mask_id} outside the target vocabulary [0, {vocab})")

    types = list(layer_types) if layer_types is not None else ["full_attention"] * int(num_layers)
    if len(types) != int(num_layers) or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"layer_types must be {num_layers} entries from {LAYER_TYPES}, got {types}")
    uses_swa = "sliding_attention" in types
    if uses_swa and (sliding_window is None or int(sliding_window) < 1):
        raise ValueError("sliding_attention layers need sliding_window >= 1")
    return _Geometry(
        num_target_layers=n_target, vocab_size=vocab, num_layers=int(num_layers), hidden_size=hidden,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=hd, intermediate_size=inter, rms_norm_eps=eps,
        rope_theta=theta, target_layer_ids=tuple(ids), mask_token_id=mask_id, block_size=int(block_size),
        layer_types=tuple(types), sliding_window=int(sliding_window) if uses_swa else None,  # type: ignore[arg-type]
        max_position_embeddings=int(tc.get("max_position_embeddings") or 40960),
        bos_token_id=tc.get("bos_token_id"), eos_token_id=tc.get("eos_token_id"), dtype=dtype,
    )


def _initial_value(name: str, noise: np.ndarray, init_std: float, identity_init: bool) -> np.ndarray:
    """Random init of one tensor from its standard-normal `noise` (same shape).

    Norm gains 1 + 0.1 N; conv base kernels 1 on tap 0 plus 0.1 N (exactly 1 / 0
    with identity_init); everything else init_std * N, except that identity_init
    zeroes the conv kernel projections and the successor codebook (spec:
    a fresh DFlash2 is then exactly its DFlash backbone, and the selector a no-op).
    """
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * noise
    if name.endswith(".base_kernel"):  # [2 sides, taps, H]
        base = np.zeros_like(noise) if identity_init else 0.1 * noise
        base[:, 0, :] += 1.0
        return base
    if identity_init and (name.endswith(".kernel_projection.weight") or name == _SUCCESSOR_CODEBOOK):
        return np.zeros_like(noise)
    return float(init_std) * noise


def _drafter_tensors(
    shapes: Mapping[str, tuple[int, ...]], weights: Mapping[str, np.ndarray] | None, *,
    seed: int, init_std: float, identity_init: bool = False,
) -> dict[str, np.ndarray]:
    """`weights` checked against `shapes` (exact names and shapes), or seeded random tensors."""
    if weights is None:
        rng = np.random.default_rng(seed)
        return {name: _initial_value(name, rng.standard_normal(shape, dtype=np.float32), init_std, identity_init)
                for name, shape in shapes.items()}
    missing = sorted(set(shapes) - set(weights))
    extra = sorted(set(weights) - set(shapes))
    if missing or extra:
        raise ValueError(f"weights do not match the published tensor set: missing {missing}, extra {extra}")
    tensors = {}
    for name, shape in shapes.items():
        arr = np.asarray(weights[name])
        if tuple(arr.shape) != shape:
            raise ValueError(f"weights[{name!r}] has shape {tuple(arr.shape)}, expected {shape}")
        tensors[name] = arr
    return tensors


def _write_checkpoint(out_dir: str | Path, config: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> Path:
    """config.json + model.safetensors (tensors encoded as config["dtype"]) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    _write_safetensors(out / "model.safetensors", tensors, config["dtype"])
    return out


def write_dflash_drafter(
    out_dir: str | Path,
    *,
    target_config: Mapping[str, Any],
    num_layers: int = 1,
    target_layer_ids: Sequence[int] | None = None,
    block_size: int = 16,
    mask_token_id: int | None = None,
    hidden_size: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    rms_norm_eps: float | None = None,
    rope_theta: float | None = None,
    layer_types: Sequence[str] | None = None,
    sliding_window: int | None = None,
    seed: int = 0,
    init_std: float = 0.2,
    dtype: str = "float32",
    weights: Mapping[str, np.ndarray] | None = None,
) -> Path:
    """Write config.json + model.safetensors of a DFlash drafter for a target.

    `target_config` is the target's config.json as a dict.  Geometry defaults to
    the target's; `target_layer_ids` to `build_target_layer_ids(T, num_layers)`;
    `mask_token_id` to target vocab_size - 1.  Without `weights`, tensors are
    random (seeded): normal(0, init_std) for matrices, 1 + 0.1 * N(0, 1) for
    norm gains.  `weights` must hold exactly the published names and shapes.
    Rope scaling of the target is not copied (the drafter gets plain RoPE).
    """
    geometry = _resolve_geometry(
        target_config, num_layers=num_layers, target_layer_ids=target_layer_ids, block_size=block_size,
        mask_token_id=mask_token_id, hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, intermediate_size=intermediate_size, rms_norm_eps=rms_norm_eps, rope_theta=rope_theta,
        layer_types=layer_types, sliding_window=sliding_window, dtype=dtype)
    tensors = _drafter_tensors(drafter_tensor_shapes(**geometry.shape_args()), weights, seed=seed, init_std=init_std)
    return _write_checkpoint(out_dir, geometry.config(architecture="DFlashDraftModel"), tensors)


# --------------------------------------------------------------------------------------
# DFlash2 ("DFlash2DraftModel"): the DFlash tensors plus two grouped dynamic convs per
# layer and a candidate selector (docs spec dflash2 section 1.3).

_SUCCESSOR_CODEBOOK = "candidate_selector.successor_codebook"


def _check_positive(name: str, value: float | None) -> None:
    if value is not None and not (math.isfinite(float(value)) and float(value) > 0):
        raise ValueError(f"{name} must be a finite number > 0 (or None), got {value}")


def _check_dflash2_geometry(*, hidden_size: int, conv_kernel_size: int, conv_group_size: int,
                            selector_rank: int) -> None:
    if int(conv_kernel_size) < 1:
        raise ValueError(f"conv_kernel_size must be >= 1, got {conv_kernel_size}")
    if int(conv_group_size) < 1 or hidden_size % int(conv_group_size) != 0:
        raise ValueError(f"conv_group_size must be >= 1 and divide hidden_size {hidden_size}, got {conv_group_size}")
    if int(selector_rank) < 1:
        raise ValueError(f"selector_rank must be >= 1, got {selector_rank}")


def dflash2_tensor_shapes(
    *, num_layers: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
    intermediate_size: int, fc_in_features: int, vocab_size: int, conv_kernel_size: int = 2,
    conv_group_size: int = 16, selector_rank: int = 256,
) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the published DFlash2 tensor set, in file order.

    The DFlash set of `drafter_tensor_shapes`, then per layer
    `attention_conv` / `mlp_conv` (`base_kernel [2, T, H]`,
    `kernel_projection.weight [2*T*H/g, H]`), then the candidate selector
    (`predecessor_codebook [V, r]`, `successor_codebook [V, r]`,
    `hidden_projection.weight [r, H]`).
    """
    _check_dflash2_geometry(hidden_size=hidden_size, conv_kernel_size=conv_kernel_size,
                            conv_group_size=conv_group_size, selector_rank=selector_rank)
    h, taps, rank = hidden_size, int(conv_kernel_size), int(selector_rank)
    shapes = drafter_tensor_shapes(
        num_layers=num_layers, hidden_size=h, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        intermediate_size=intermediate_size, fc_in_features=fc_in_features)
    for i in range(num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            shapes[f"layers.{i}.{conv}.base_kernel"] = (2, taps, h)
            shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * taps * (h // int(conv_group_size)), h)
    shapes["candidate_selector.predecessor_codebook"] = (vocab_size, rank)
    shapes[_SUCCESSOR_CODEBOOK] = (vocab_size, rank)
    shapes["candidate_selector.hidden_projection.weight"] = (rank, h)
    return shapes


def write_dflash2_drafter(
    out_dir: str | Path,
    *,
    target_config: Mapping[str, Any],
    num_layers: int = 1,
    target_layer_ids: Sequence[int] | None = None,
    block_size: int = 16,
    mask_token_id: int | None = None,
    hidden_size: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    rms_norm_eps: float | None = None,
    rope_theta: float | None = None,
    layer_types: Sequence[str] | None = None,
    sliding_window: int | None = None,
    seed: int = 0,
    init_std: float = 0.2,
    dtype: str = "float32",
    weights: Mapping[str, np.ndarray] | None = None,
    conv_kernel_size: int = 2,
    conv_group_size: int = 16,
    selector_rank: int = 256,
    selector_top_k: int = 16,
    output_multiplier: float | None = None,
    final_logit_softcapping: float | None = None,
    input_embedding_scale: float | None = None,
    is_causal: bool = False,
    identity_init: bool = False,
) -> Path:
    """Write config.json + model.safetensors of a DFlash2 drafter for a target.

    Same arguments and defaults as `write_dflash_drafter`, plus the DFlash2
    fields: conv taps T (`conv_kernel_size`), channels per dynamic correction g
    (`conv_group_size`, must divide H), selector rank r and candidates per slot
    K (1 <= K < vocab), the optional unary-logit `output_multiplier` and
    `final_logit_softcapping` and the block-embedding `input_embedding_scale`
    (each > 0 when given, written only when given), and the top-level
    `is_causal` of the drafter's attention.  The config has architectures
    ["DFlash2DraftModel"] and the DFlash2 fields inside `dflash_config` (with
    `block_size`, as the published checkpoints have it).

    Random tensors follow `write_dflash_drafter` (the shared DFlash tensors are
    drawn first and so equal that writer's for the same seed); conv base
    kernels are 1 + 0.1 N on tap 0 and 0.1 N on the other taps.
    `identity_init=True` gives the training-time init instead: base tap 0 = 1,
    other taps 0, kernel projections 0 (each conv an exact no-op) and the
    successor codebook 0 (edges equal the unary logits).
    """
    geometry = _resolve_geometry(
        target_config, num_layers=num_layers, target_layer_ids=target_layer_ids, block_size=block_size,
        mask_token_id=mask_token_id, hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, intermediate_size=intermediate_size, rms_norm_eps=rms_norm_eps, rope_theta=rope_theta,
        layer_types=layer_types, sliding_window=sliding_window, dtype=dtype)
    if not 1 <= int(selector_top_k) < geometry.vocab_size:
        raise ValueError(f"selector_top_k must be in [1, vocab_size {geometry.vocab_size}), got {selector_top_k}")
    optional = {"output_multiplier": output_multiplier, "final_logit_softcapping": final_logit_softcapping,
                "input_embedding_scale": input_embedding_scale}
    for name, value in optional.items():
        _check_positive(name, value)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")

    shapes = dflash2_tensor_shapes(
        **geometry.shape_args(), vocab_size=geometry.vocab_size, conv_kernel_size=conv_kernel_size,
        conv_group_size=conv_group_size, selector_rank=selector_rank)
    tensors = _drafter_tensors(shapes, weights, seed=seed, init_std=init_std, identity_init=identity_init)
    dflash_extra: dict[str, Any] = {
        "block_size": geometry.block_size,
        "conv_kernel_size": int(conv_kernel_size),
        "conv_group_size": int(conv_group_size),
        "selector_rank": int(selector_rank),
        "selector_top_k": int(selector_top_k),
        **{name: float(value) for name, value in optional.items() if value is not None},
    }
    config = geometry.config(architecture="DFlash2DraftModel", dflash_extra=dflash_extra,
                             top_level_extra={"is_causal": is_causal})
    return _write_checkpoint(out_dir, config, tensors)

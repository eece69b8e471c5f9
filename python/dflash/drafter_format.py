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
# Used by tests (random drafters for tiny targets) and by anything that wants to
# emit a drafter (e.g. a trainer passing `weights=`).  Only numpy is needed: the
# safetensors file is written directly so that bfloat16 works without torch.
from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["build_target_layer_ids", "drafter_tensor_shapes", "write_dflash_drafter"]

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
    tc = target_config
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

    shapes = drafter_tensor_shapes(
        num_layers=int(num_layers), hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=hd, intermediate_size=inter, fc_in_features=len(ids) * t_hidden)
    if weights is None:
        rng = np.random.default_rng(seed)
        tensors: dict[str, np.ndarray] = {}
        for name, shape in shapes.items():
            noise = rng.standard_normal(shape, dtype=np.float32)
            is_norm = name.endswith("norm.weight")
            tensors[name] = (1.0 + 0.1 * noise) if is_norm else (float(init_std) * noise)
    else:
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

    config: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": int(block_size),
        "num_target_layers": n_target,
        "dflash_config": {"target_layer_ids": ids, "mask_token_id": mask_id},
        "num_hidden_layers": int(num_layers),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hd,
        "intermediate_size": inter,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "rope_scaling": None,
        "max_position_embeddings": int(tc.get("max_position_embeddings") or 40960),
        "vocab_size": vocab,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "layer_types": types,
        "use_sliding_window": uses_swa,
        "sliding_window": int(sliding_window) if uses_swa else None,
        "max_window_layers": int(num_layers),
        "bos_token_id": tc.get("bos_token_id"),
        "eos_token_id": tc.get("eos_token_id"),
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    _write_safetensors(out / "model.safetensors", tensors, dtype)
    return out

# python/dflash/train/state.py
#
# Training checkpoints of `dflash train` in two formats:
#
# * "torch": <ckpt>/state.pt, torch.save of the whole state (fp32 weights and Adam
#   moments): resuming from it is bit-exact.
# * "bf16" / "int8" (compact): <ckpt>/state.json + <ckpt>/state.part00, part01, ...
#   The JSON holds everything but the big tensors (config, step, scheduler, data
#   cursor, RNG states in base64, optimizer hyper-parameters) and an index of the
#   tensors; the tensors are encoded and concatenated into one byte stream that is
#   cut into parts of at most `part_bytes` bytes (so that each file fits a transfer
#   limit).  Encodings:
#     weights (2-D and larger) bfloat16, 1-D weights (norm gains) float32;
#     "bf16": Adam moments bfloat16                          (6 bytes / parameter)
#     "int8": exp_avg 8-bit linear per block of 256 values (absmax scale),
#             exp_avg_sq 8-bit logarithmic per block (min/max of log2, code 0 =
#             exact zero; relative error <= 2^(range/508) - 1)  (~4.05 bytes / parameter)
#   Rounding the fp32 master weights to bf16 once per invocation changes them by
#   at most 2^-9 relative (a fraction of one Adam step at the usual learning
#   rates); exp_avg decays in ~1/(1-beta1) = 10 steps, so its 8-bit error is
#   forgotten quickly; exp_avg_sq (time constant 1000 steps) keeps a bounded
#   relative error instead.  Resuming from a compact state is therefore close to,
#   not bit-identical with, an uninterrupted run.
#
# A checkpoint directory is replaced atomically enough for a killed process: the
# new one is written as <ckpt>.new, then <ckpt> is renamed to <ckpt>.old, <ckpt>.new
# to <ckpt>, and <ckpt>.old removed; a reader that finds no <ckpt> uses <ckpt>.old.
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

__all__ = ["STATE_FORMATS", "find_checkpoint", "save_checkpoint", "load_checkpoint", "checkpoint_files",
           "encode_tensor", "decode_tensor", "state_bytes_estimate"]

STATE_FORMATS = ("torch", "bf16", "int8")
_BLOCK = 256
_LOG_RANGE = 64.0  # octaves kept below a block's largest exp_avg_sq (smaller values are rounded up)
FORMAT_NAME = "dflash-train-state"


# ------------------------------------------------------------------------------ encodings


def _bf16_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to(torch.bfloat16).contiguous().view(torch.int16).cpu().numpy().tobytes()


def _from_bf16(buf: bytes, shape: list[int]) -> torch.Tensor:
    a = np.frombuffer(buf, dtype=np.int16).copy()
    return torch.from_numpy(a).view(torch.bfloat16).float().reshape(shape)


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    flat = x.detach().float().reshape(-1).cpu()
    n = flat.numel()
    pad = (-n) % _BLOCK
    if pad:
        flat = torch.cat((flat, flat.new_zeros(pad)))
    return flat.view(-1, _BLOCK), n


def encode_tensor(t: torch.Tensor, enc: str) -> bytes:
    """Bytes of `t` in encoding enc: f32 | bf16 | q8lin (signed) | q8log (non-negative)."""
    if enc == "f32":
        return t.detach().float().contiguous().cpu().numpy().tobytes()
    if enc == "bf16":
        return _bf16_bytes(t)
    if enc == "q8lin":
        blk, n = _blocks(t)
        scale = blk.abs().amax(dim=1)
        q = torch.round(blk / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None] * 127.0)
        q = q.clamp(-127, 127).to(torch.int8).reshape(-1)[:n]
        return scale.numpy().astype("<f4").tobytes() + q.numpy().tobytes()
    if enc == "q8log":
        blk, n = _blocks(t)
        if bool((blk < 0).any()):
            raise ValueError("q8log encodes non-negative tensors only")
        pos = blk > 0
        lg = torch.where(pos, torch.log2(torch.where(pos, blk, torch.ones_like(blk))), torch.zeros_like(blk))
        hi = torch.where(pos, lg, torch.full_like(lg, -float("inf"))).amax(dim=1)
        lo = torch.where(pos, lg, torch.full_like(lg, float("inf"))).amin(dim=1)
        empty = ~pos.any(dim=1)
        hi = torch.where(empty, torch.zeros_like(hi), hi)
        lo = torch.where(empty, torch.zeros_like(lo), torch.maximum(lo, hi - _LOG_RANGE))
        span = (hi - lo)
        frac = (lg - lo[:, None]) / torch.where(span > 0, span, torch.ones_like(span))[:, None]
        code = 1 + torch.round(frac.clamp(0.0, 1.0) * 254.0)
        code = torch.where(pos, code, torch.zeros_like(code)).to(torch.uint8).reshape(-1)[:n]
        return (lo.numpy().astype("<f4").tobytes() + hi.numpy().astype("<f4").tobytes()
                + code.numpy().tobytes())
    raise ValueError(f"unknown tensor encoding {enc!r}")


def decode_tensor(buf: bytes, enc: str, shape: list[int]) -> torch.Tensor:
    """Inverse of encode_tensor (float32 result)."""
    n = int(np.prod(shape)) if shape else 1
    if enc == "f32":
        return torch.from_numpy(np.frombuffer(buf, dtype="<f4").copy()).reshape(shape)
    if enc == "bf16":
        return _from_bf16(buf, shape)
    nb = (n + _BLOCK - 1) // _BLOCK
    if enc == "q8lin":
        scale = torch.from_numpy(np.frombuffer(buf[: 4 * nb], dtype="<f4").copy())
        q = torch.from_numpy(np.frombuffer(buf[4 * nb:], dtype=np.int8).copy()).float()
        q = torch.cat((q, q.new_zeros(nb * _BLOCK - n))).view(nb, _BLOCK)
        return (q / 127.0 * scale[:, None]).reshape(-1)[:n].reshape(shape)
    if enc == "q8log":
        lo = torch.from_numpy(np.frombuffer(buf[: 4 * nb], dtype="<f4").copy())
        hi = torch.from_numpy(np.frombuffer(buf[4 * nb: 8 * nb], dtype="<f4").copy())
        code = torch.from_numpy(np.frombuffer(buf[8 * nb:], dtype=np.uint8).copy()).float()
        code = torch.cat((code, code.new_zeros(nb * _BLOCK - n))).view(nb, _BLOCK)
        val = torch.exp2(lo[:, None] + (code - 1.0) / 254.0 * (hi - lo)[:, None])
        return torch.where(code > 0, val, torch.zeros_like(val)).reshape(-1)[:n].reshape(shape)
    raise ValueError(f"unknown tensor encoding {enc!r}")


def _encoded_size(numel: int, enc: str) -> int:
    nb = (numel + _BLOCK - 1) // _BLOCK
    return {"f32": 4 * numel, "bf16": 2 * numel, "q8lin": numel + 4 * nb, "q8log": numel + 8 * nb}[enc]


def _weight_enc(shape: Any, fmt: str) -> str:
    return "f32" if fmt == "torch" or len(shape) < 2 else "bf16"


def _moment_encs(fmt: str) -> tuple[str, str]:
    return {"torch": ("f32", "f32"), "bf16": ("bf16", "bf16"), "int8": ("q8lin", "q8log")}[fmt]


def state_bytes_estimate(shapes: Mapping[str, Any], fmt: str) -> int:
    """Bytes of the tensor stream of a compact state for parameters of these shapes."""
    m_enc, v_enc = _moment_encs(fmt)
    total = 0
    for shape in shapes.values():
        n = int(np.prod(list(shape))) if len(shape) else 1
        total += _encoded_size(n, _weight_enc(shape, fmt)) + _encoded_size(n, m_enc) + _encoded_size(n, v_enc)
    return total


# ------------------------------------------------------------------------------ JSON helpers


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.detach().cpu().contiguous().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.uint8).copy())


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (np.integer, np.floating)):
        return v.item()
    return v


# ------------------------------------------------------------------------------ checkpoints


def find_checkpoint(ckpt_dir: str | os.PathLike) -> tuple[str, Path] | None:
    """("torch" | "compact", directory) of the checkpoint in ckpt_dir (or its .old twin), or None."""
    base = Path(ckpt_dir)
    for d in (base, base.with_name(base.name + ".old")):
        if (d / "state.json").is_file():
            return "compact", d
        if (d / "state.pt").is_file():
            return "torch", d
    return None


def checkpoint_files(ckpt_dir: str | os.PathLike) -> list[Path]:
    """The files of the checkpoint in ckpt_dir (what must travel to resume)."""
    found = find_checkpoint(ckpt_dir)
    if found is None:
        return []
    kind, d = found
    if kind == "torch":
        return [d / "state.pt"]
    meta = json.loads((d / "state.json").read_text(encoding="utf-8"))
    return [d / "state.json"] + [d / p["name"] for p in meta["parts"]]


def save_checkpoint(ckpt_dir: str | os.PathLike, payload: Mapping[str, Any], *, fmt: str = "torch",
                    param_names: list[str] | None = None, part_bytes: int = 15 << 20) -> Path:
    """Write a checkpoint (payload as built by the trainer) into ckpt_dir, replacing it.

    payload keys: model (state_dict), optimizer (state_dict, params in param_names order),
    rng ({name: ByteTensor or list of them}) and JSON-able rest.  Returns ckpt_dir.
    """
    if fmt not in STATE_FORMATS:
        raise ValueError(f"state format must be one of {STATE_FORMATS}, got {fmt!r}")
    final = Path(ckpt_dir)
    new = final.with_name(final.name + ".new")
    old = final.with_name(final.name + ".old")
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir(parents=True)
    if fmt == "torch":
        torch.save(dict(payload), new / "state.pt")
    else:
        _save_compact(new, payload, fmt, list(param_names or []), int(part_bytes))
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(new, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def _save_compact(d: Path, payload: Mapping[str, Any], fmt: str, names: list[str], part_bytes: int) -> None:
    if part_bytes < 1:
        raise ValueError("part size must be positive")
    model: Mapping[str, torch.Tensor] = payload["model"]
    opt = payload["optimizer"]
    if sorted(names) != sorted(model):
        raise ValueError("param_names must list the model's parameters in optimizer order")
    m_enc, v_enc = _moment_encs(fmt)
    tensors: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    offset = 0

    def add(key: str, t: torch.Tensor, enc: str) -> None:
        nonlocal offset
        b = encode_tensor(t, enc)
        tensors.append({"key": key, "shape": list(t.shape), "enc": enc, "offset": offset, "nbytes": len(b)})
        chunks.append(b)
        offset += len(b)

    for name in names:
        add(f"model/{name}", model[name], _weight_enc(model[name].shape, fmt))
    steps: dict[str, float] = {}
    for i, name in enumerate(names):
        st = opt["state"].get(i)
        if not st:
            continue
        steps[name] = float(st["step"])
        add(f"exp_avg/{name}", st["exp_avg"], m_enc)
        add(f"exp_avg_sq/{name}", st["exp_avg_sq"], v_enc)
    stream = b"".join(chunks)
    parts = []
    for k, start in enumerate(range(0, max(len(stream), 1), part_bytes)):
        piece = stream[start:start + part_bytes]
        name = f"state.part{k:02d}"
        (d / name).write_bytes(piece)
        parts.append({"name": name, "bytes": len(piece), "sha256": hashlib.sha256(piece).hexdigest()})
    rng = {k: ([_b64(x) for x in v] if isinstance(v, (list, tuple)) else _b64(v))
           for k, v in payload.get("rng", {}).items()}
    rest = {k: _jsonable(v) for k, v in payload.items() if k not in ("model", "optimizer", "rng")}
    meta = {
        "format": FORMAT_NAME, "version": 1, "encoding": fmt, "param_names": names, "parts": parts,
        "tensors": tensors, "adam_steps": steps, "param_groups": _jsonable(opt["param_groups"]), "rng": rng,
        "payload": rest,
    }
    (d / "state.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")


def load_checkpoint(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """The payload of the checkpoint in ckpt_dir (either format), tensors on the CPU."""
    found = find_checkpoint(ckpt_dir)
    if found is None:
        raise FileNotFoundError(f"no checkpoint (state.json or state.pt) in {ckpt_dir}")
    kind, d = found
    if kind == "torch":
        return torch.load(d / "state.pt", map_location="cpu", weights_only=False)
    meta = json.loads((d / "state.json").read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT_NAME:
        raise ValueError(f"{d / 'state.json'} is not a {FORMAT_NAME} file")
    blobs = []
    for p in meta["parts"]:
        f = d / p["name"]
        if not f.is_file():
            raise ValueError(f"checkpoint part {f} is missing")
        b = f.read_bytes()
        if len(b) != p["bytes"] or hashlib.sha256(b).hexdigest() != p["sha256"]:
            raise ValueError(f"checkpoint part {f} is damaged (size or sha256 differs from state.json)")
        blobs.append(b)
    stream = b"".join(blobs)
    decoded = {t["key"]: decode_tensor(stream[t["offset"]:t["offset"] + t["nbytes"]], t["enc"], t["shape"])
               for t in meta["tensors"]}
    names = meta["param_names"]
    model = {n: decoded[f"model/{n}"] for n in names}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, n in enumerate(names):
        if f"exp_avg/{n}" in decoded:
            state[i] = {"step": torch.tensor(float(meta["adam_steps"][n])), "exp_avg": decoded[f"exp_avg/{n}"],
                        "exp_avg_sq": decoded[f"exp_avg_sq/{n}"]}
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    rng = {k: ([_unb64(x) for x in v] if isinstance(v, list) else _unb64(v)) for k, v in meta["rng"].items()}
    out = dict(meta["payload"])
    out.update({"model": model, "optimizer": {"state": state, "param_groups": groups}, "rng": rng,
                "state_encoding": meta["encoding"]})
    return out

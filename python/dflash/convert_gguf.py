# Convert a llama-architecture GGUF file (llama.cpp format) into a Hugging Face
# LlamaForCausalLM directory: model.safetensors, config.json, generation_config.json,
# tokenizer.json (rebuilt from the GGUF vocab/merges), tokenizer_config.json and
# special_tokens_map.json. Weights are dequantized to fp32 with gguf.quants, and
# llama.cpp's Q/K row permutation is undone so the standard HF RoPE applies.
# The directory is written under a temporary name and renamed into place at the end,
# with a completion marker (MARKER_NAME) written last.
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

MARKER_NAME = ".dflash_converted"
CONVERTER_FORMAT = 1

_DTYPES: dict[str, type[np.floating[Any]]] = {"float32": np.float32, "float16": np.float16}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")

# tokenizer.ggml.pre values whose llama.cpp split is "each digit alone, then the GPT-2
# regex": expressed in HF tokenizers as Digits(individual) followed by ByteLevel.
_PRE_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_PRE_GPT2 = {"default", "gpt-2", "gpt2"}

_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


class _Meta:
    """Typed access to the key/value metadata of a GGUFReader."""

    def __init__(self, reader: Any, path: Path) -> None:
        self._fields = reader.fields
        self._path = path

    def has(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        if key not in self._fields:
            raise ValueError(f"{self._path}: GGUF metadata key {key!r} is missing")
        return self._fields[key].contents()


def _open_gguf(path: Path) -> Any:
    if not path.is_file():
        raise ValueError(f"{path}: not a GGUF file (no such file, or not a regular file)")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (bad magic {magic!r})")
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as exc:  # truncated or corrupt file: a caller mistake, not a bug
        raise ValueError(f"{path}: not a valid GGUF file ({exc})") from exc


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of Q/K rows (for its adjacent-pair RoPE)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str, n_layers: int, path: Path) -> tuple[str, str]:
    """(HF tensor name, GGUF tensor kind). Raises ValueError for tensors we cannot map."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name], gguf_name.split(".")[0]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES and int(m.group(1)) < n_layers:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.weight", m.group(2)
    if gguf_name.startswith("rope_freqs"):
        raise ValueError(f"{path}: rope frequency scaling (tensor {gguf_name!r}) is not supported")
    raise ValueError(f"{path}: unsupported tensor {gguf_name!r} for a plain Llama model")


def _f32_clean(x: float) -> float:
    """Shortest decimal that round-trips a GGUF float32 (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _read_config(meta: _Meta, arch: str, path: Path) -> dict[str, Any]:
    hidden = int(meta.need(f"{arch}.embedding_length"))
    n_head = int(meta.need(f"{arch}.attention.head_count"))
    n_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // n_head))
    rope_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings ({rope_dim} of {head_dim}) are not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"{path}: rope scaling type {scaling!r} is not supported")
    tokens = meta.need("tokenizer.ggml.tokens")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta.need(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.need(f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _f32_clean(meta.need(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32_clean(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "vocab_size": int(meta.get(f"{arch}.vocab_size", len(tokens))),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def _convert_tensors(reader: Any, cfg: dict[str, Any], dtype: type, path: Path) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name, kind = _hf_name(t.name, cfg["num_hidden_layers"], path)
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if kind == "attn_q":
            w = _unpermute(w, cfg["num_attention_heads"])
        elif kind == "attn_k":
            w = _unpermute(w, cfg["num_key_value_heads"])
        out[name] = np.ascontiguousarray(w.astype(dtype, copy=False))
    h, kvd = cfg["hidden_size"], cfg["num_key_value_heads"] * cfg["head_dim"]
    qd, ffn = cfg["num_attention_heads"] * cfg["head_dim"], cfg["intermediate_size"]
    expect = {"model.embed_tokens.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        expect.update({
            p + "self_attn.q_proj.weight": (qd, h), p + "self_attn.k_proj.weight": (kvd, h),
            p + "self_attn.v_proj.weight": (kvd, h), p + "self_attn.o_proj.weight": (h, qd),
            p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
            p + "mlp.down_proj.weight": (h, ffn), p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    if "lm_head.weight" in out:
        expect["lm_head.weight"] = (cfg["vocab_size"], h)
    for name, shape in expect.items():
        if name not in out:
            raise ValueError(f"{path}: GGUF lacks the tensor that maps to {name!r}")
        if out[name].shape != shape:
            raise ValueError(f"{path}: tensor {name!r} has shape {out[name].shape}, expected {shape}")
    return out


def _build_tokenizer(meta: _Meta, path: Path) -> tuple[Any, dict[str, Any]]:
    """Rebuild the HF fast tokenizer; returns (tokenizers.Tokenizer, special-token info)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.need("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    tokens: list[str] = list(meta.need("tokenizer.ggml.tokens"))
    types: list[int] = [int(x) for x in meta.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    merges = [tuple(m.split(" ", 1)) for m in meta.need("tokenizer.ggml.merges")]

    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _PRE_DIGITS_THEN_GPT2:
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _PRE_GPT2:
        tk.pre_tokenizer = byte_level
    else:
        raise ValueError(f"{path}: pre-tokenizer {pre!r} is not supported")
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL])
    tk.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED])

    def tok(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    info = {
        "bos_token": tok("bos_token_id"), "eos_token": tok("eos_token_id"),
        "unk_token": tok("unknown_token_id"), "pad_token": tok("padding_token_id"),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
    }
    single, specials = "$A:0", []
    for flag, key, before in (("add_bos_token", "bos", True), ("add_eos_token", "eos", False)):
        if info[flag] and info[f"{key}_token"] is not None:
            t = info[f"{key}_token"]
            single = f"{t}:0 {single}" if before else f"{single} {t}:0"
            specials.append((t, int(info[f"{key}_token_id"])))
    if specials:
        tk.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} {single.replace('$A', '$B').replace(':0', ':1')}", special_tokens=specials)
    return tk, info


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _finish_tree(d: Path) -> None:
    """Give the tree umask-normal permissions (mkdtemp makes it 0700) and fsync it."""
    probe = d / ".mode-probe"
    probe.touch()
    file_mode = probe.stat().st_mode & 0o777
    probe.unlink()
    d.chmod(file_mode | ((file_mode & 0o444) >> 2))
    for p in d.iterdir():
        p.chmod(file_mode)
        with open(p, "rb") as fh:
            os.fsync(fh.fileno())
    if hasattr(os, "O_DIRECTORY"):
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_model_dir(tmp: Path, gguf_path: Path, reader: Any, dtype: str) -> None:
    from safetensors.numpy import save_file

    meta = _Meta(reader, gguf_path)
    arch = meta.need("general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: architecture {arch!r} is not supported (only 'llama')")
    cfg = _read_config(meta, arch, gguf_path)
    tk, info = _build_tokenizer(meta, gguf_path)
    weights = _convert_tensors(reader, cfg, _DTYPES[dtype], gguf_path)

    cfg["tie_word_embeddings"] = "lm_head.weight" not in weights
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if info[k] is not None:
            cfg[k] = int(info[k])
    cfg["torch_dtype"] = dtype
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    del weights
    _write_json(tmp / "config.json", cfg)
    _write_json(tmp / "generation_config.json",
                {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg})
    tk.save(str(tmp / "tokenizer.json"))
    specials = {k: info[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if info[k] is not None}
    tok_cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": info["add_bos_token"],
        "add_eos_token": info["add_eos_token"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg["max_position_embeddings"],
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        tok_cfg["chat_template"] = template
    _write_json(tmp / "tokenizer_config.json", tok_cfg)
    _write_json(tmp / "special_tokens_map.json", specials)
    _write_json(tmp / MARKER_NAME, {
        "format": CONVERTER_FORMAT, "source": gguf_path.name, "source_size": gguf_path.stat().st_size,
        "source_sha256": _sha256(gguf_path), "dtype": dtype,
    })


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                 dtype: str = "float32", overwrite: bool = False) -> Path:
    """Convert `gguf_path` into an HF Llama directory at `out_dir` and return its path.

    Raises ValueError for a missing/invalid GGUF or an unsupported model, and
    FileExistsError if `out_dir` exists and is not empty (unless `overwrite`).
    """
    src, dst = Path(gguf_path), Path(out_dir)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {dtype!r}")
    reader = _open_gguf(src)

    def occupied() -> bool:
        return dst.exists() and (not dst.is_dir() or any(dst.iterdir()))

    if occupied() and not overwrite:
        raise FileExistsError(f"{dst} already exists and is not empty")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        _write_model_dir(tmp, src, reader, dtype)
        _finish_tree(tmp)
        old: Path | None = None
        if dst.is_dir() and not any(dst.iterdir()):
            dst.rmdir()
        elif occupied():
            if not overwrite:
                raise FileExistsError(f"{dst} appeared while converting")
            old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
            os.replace(dst, old / "x")
        try:
            os.rename(tmp, dst)
        except OSError as exc:
            if old is not None:
                os.replace(old / "x", dst)
                old.rmdir()
            raise FileExistsError(f"{dst} appeared while converting") from exc
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst

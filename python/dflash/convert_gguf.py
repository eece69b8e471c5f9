# Convert a llama-architecture GGUF file (llama.cpp format) into a Hugging Face
# LlamaForCausalLM directory: model.safetensors, config.json, generation_config.json,
# tokenizer.json (rebuilt from the GGUF vocab/merges), tokenizer_config.json and
# special_tokens_map.json. Weights are dequantized to fp32 with gguf.quants, and
# llama.cpp's Q/K row permutation is undone so the standard HF RoPE applies.
# The directory is written under a temporary name and renamed into place at the end,
# with a completion marker (MARKER_NAME) written last.
# A GGUF whose content is broken or unsupported raises dflash.DFlashError naming the file and
# the key or tensor (metadata is read with type and range checks, tensor shapes are checked
# before anything is dequantized); a missing path or a bad argument raises ValueError.
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

from .errors import DFlashError

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


_REQUIRED = object()
_INT32_MAX = 2**31 - 1
# Bounds on the model geometry a GGUF may declare (those of the C++ config reader,
# cpp/config/model_config.h): far beyond real models, refused before anything is allocated.
_MAX_WIDTH = 1 << 20
_MAX_VOCAB = 1 << 24
_MAX_LAYERS = 4096
_MAX_HEADS = 4096


class _Meta:
    """Typed access to the key/value metadata of a GGUFReader: every reader checks the value's
    type (and range), so a wrongly typed key is a DFlashError naming it, never a default."""

    def __init__(self, reader: Any, path: Path) -> None:
        self._fields = reader.fields
        self._path = path

    def has(self, key: str) -> bool:
        return key in self._fields

    def _value(self, key: str) -> Any:
        field = self._fields.get(key)
        if field is None:
            raise DFlashError(f"{self._path}: GGUF metadata key {key!r} is missing")
        try:
            return field.contents()
        except Exception as exc:  # undecodable strings, truncated parts
            raise DFlashError(f"{self._path}: GGUF metadata key {key!r} cannot be read ({exc})") from None

    def _checked(self, key: str, default: Any, ok: Any, want: str) -> Any:
        """The value of `key` if ok(value), `default` when the key is absent (unless _REQUIRED)."""
        if default is not _REQUIRED and key not in self._fields:
            return default
        value = self._value(key)
        if not ok(value):
            text = repr(value)
            raise DFlashError(f"{self._path}: GGUF metadata key {key!r} must be {want}, got "
                              f"{text[:80] + '...' if len(text) > 80 else text}")
        return value

    def int(self, key: str, default: Any = _REQUIRED, lo: int = 0, hi: int = _INT32_MAX) -> Any:
        return self._checked(key, default, lambda v: _is_int(v) and lo <= v <= hi, f"an integer in [{lo}, {hi}]")

    def float(self, key: str, default: Any = _REQUIRED) -> float:
        return float(self._checked(key, default, lambda v: (_is_int(v) or isinstance(v, float)) and v > 0
                                   and bool(np.isfinite(v)), "a positive finite number"))

    def str(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._checked(key, default, lambda v: isinstance(v, str), "a string")

    def bool(self, key: str, default: bool) -> bool:
        return self._checked(key, default, lambda v: isinstance(v, bool), "a boolean")

    def list(self, key: str, item: type, default: Any = _REQUIRED) -> Any:
        def ok(v: Any) -> bool:
            return isinstance(v, list) and all(isinstance(x, item) and not isinstance(x, bool) for x in v)

        return self._checked(key, default, ok, f"a list of {item.__name__}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _open_gguf(path: Path) -> Any:
    if not path.is_file():
        raise ValueError(f"{path}: not a GGUF file (no such file, or not a regular file)")
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise DFlashError(f"{path}: not a GGUF file (bad magic {magic!r})")
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as exc:  # truncated or corrupt file (the reader raises many types)
        raise DFlashError(f"{path}: not a valid GGUF file ({type(exc).__name__}: {exc})") from None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of Q/K rows (for its adjacent-pair RoPE)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str, n_layers: int, path: Path) -> tuple[str, str]:
    """(HF tensor name, GGUF tensor kind). Raises DFlashError for tensors we cannot map."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name], gguf_name.split(".")[0]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES and int(m.group(1)) < n_layers:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.weight", m.group(2)
    if gguf_name.startswith("rope_freqs"):
        raise DFlashError(f"{path}: rope frequency scaling (tensor {gguf_name!r}) is not supported")
    raise DFlashError(f"{path}: unsupported tensor {gguf_name!r} for a plain Llama model with {n_layers} layers")


def _f32_clean(x: float) -> float:
    """Shortest decimal that round-trips a GGUF float32 (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _read_config(meta: _Meta, arch: str, path: Path) -> dict[str, Any]:
    hidden = meta.int(f"{arch}.embedding_length", lo=1, hi=_MAX_WIDTH)
    n_head = meta.int(f"{arch}.attention.head_count", lo=1, hi=_MAX_HEADS)
    n_kv = meta.int(f"{arch}.attention.head_count_kv", n_head, lo=1, hi=_MAX_HEADS)
    if n_head % n_kv:
        raise DFlashError(f"{path}: attention.head_count ({n_head}) is not a multiple of head_count_kv ({n_kv})")
    head_dim = meta.int(f"{arch}.attention.key_length", hidden // n_head, lo=2, hi=_MAX_HEADS)
    if head_dim % 2:
        raise DFlashError(f"{path}: attention.key_length must be even, got {head_dim}")
    rope_dim = meta.int(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise DFlashError(f"{path}: partial rotary embeddings ({rope_dim} of {head_dim}) are not supported")
    scaling = meta.str(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise DFlashError(f"{path}: rope scaling type {scaling!r} is not supported")
    tokens = meta.list("tokenizer.ggml.tokens", str)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": meta.int(f"{arch}.feed_forward_length", lo=1, hi=_MAX_WIDTH),
        "num_hidden_layers": meta.int(f"{arch}.block_count", lo=1, hi=_MAX_LAYERS),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _f32_clean(meta.float(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32_clean(meta.float(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": meta.int(f"{arch}.context_length", 2048, lo=1),
        "vocab_size": meta.int(f"{arch}.vocab_size", len(tokens), lo=1, hi=_MAX_VOCAB),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def _expected_shapes(cfg: dict[str, Any], with_lm_head: bool) -> dict[str, tuple[int, ...]]:
    """HF name -> numpy shape of every tensor a Llama of `cfg` has."""
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
    if with_lm_head:
        expect["lm_head.weight"] = (cfg["vocab_size"], h)
    return expect


def _convert_tensors(reader: Any, cfg: dict[str, Any], dtype: type, path: Path) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    # Names and shapes first (from the header alone): a GGUF declaring other or enormous
    # tensors is refused before anything is dequantized.
    mapped = [(t, *_hf_name(t.name, cfg["num_hidden_layers"], path)) for t in reader.tensors]
    expect = _expected_shapes(cfg, any(name == "lm_head.weight" for _, name, _ in mapped))
    for t, name, _ in mapped:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if shape != expect[name]:
            raise DFlashError(f"{path}: tensor {t.name!r} ({name!r}) has shape {shape}, expected {expect[name]}")
    missing = sorted(expect.keys() - {name for _, name, _ in mapped})
    if missing:
        raise DFlashError(f"{path}: GGUF lacks the tensor that maps to {missing[0]!r}")
    out: dict[str, np.ndarray] = {}
    for t, name, kind in mapped:
        try:
            with np.errstate(all="ignore"):  # a corrupt scale is reported below, not warned about
                w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(expect[name])
        except Exception as exc:  # unsupported quantization, data cut short
            raise DFlashError(f"{path}: tensor {t.name!r} of type {getattr(t.tensor_type, 'name', t.tensor_type)} "
                              f"cannot be dequantized ({type(exc).__name__}: {exc})") from None
        if not np.isfinite(w).all():
            raise DFlashError(f"{path}: tensor {t.name!r} holds NaN or infinite values")
        if kind == "attn_q":
            w = _unpermute(w, cfg["num_attention_heads"])
        elif kind == "attn_k":
            w = _unpermute(w, cfg["num_key_value_heads"])
        out[name] = np.ascontiguousarray(w.astype(dtype, copy=False))
    return out


def _build_tokenizer(meta: _Meta, path: Path) -> tuple[Any, dict[str, Any]]:
    """Rebuild the HF fast tokenizer; returns (tokenizers.Tokenizer, special-token info)."""
    kind = meta.str("tokenizer.ggml.model")
    if kind != "gpt2":
        raise DFlashError(f"{path}: tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE)")
    pre = meta.str("tokenizer.ggml.pre", "default")
    if pre not in _PRE_DIGITS_THEN_GPT2 and pre not in _PRE_GPT2:
        raise DFlashError(f"{path}: pre-tokenizer {pre!r} is not supported")
    tokens: list[str] = meta.list("tokenizer.ggml.tokens", str)
    if not tokens or len(set(tokens)) != len(tokens):
        raise DFlashError(f"{path}: tokenizer.ggml.tokens must be a non-empty list of distinct tokens")
    types: list[int] = meta.list("tokenizer.ggml.token_type", int, [1] * len(tokens))
    if len(types) != len(tokens):
        raise DFlashError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    merges = []
    for m in meta.list("tokenizer.ggml.merges", str):
        left, sep, right = m.partition(" ")
        if not (sep and left and right):
            raise DFlashError(f"{path}: tokenizer.ggml.merges entry {m[:40]!r} is not two tokens separated by a space")
        merges.append((left, right))

    def tok(key: str) -> tuple[str | None, int | None]:
        i = meta.int(f"tokenizer.ggml.{key}", None, hi=len(tokens) - 1)
        return (None, None) if i is None else (tokens[i], i)

    (bos, bos_id), (eos, eos_id) = tok("bos_token_id"), tok("eos_token_id")
    (unk, _), (pad, pad_id) = tok("unknown_token_id"), tok("padding_token_id")
    info = {
        "bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id,
        "add_bos_token": meta.bool("tokenizer.ggml.add_bos_token", False),
        "add_eos_token": meta.bool("tokenizer.ggml.add_eos_token", False),
    }
    try:
        return _make_tokenizer(tokens, types, merges, pre, info), info
    except Exception as exc:  # the tokenizers library refuses the vocabulary or merges
        raise DFlashError(f"{path}: the GGUF's tokenizer cannot be rebuilt ({type(exc).__name__}: {exc})") from None


def _make_tokenizer(tokens: list[str], types: list[int], merges: list[tuple[str, str]], pre: str,
                    info: dict[str, Any]) -> Any:
    """The byte-level BPE tokenizer of validated GGUF vocabulary, merges and special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _PRE_DIGITS_THEN_GPT2:
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tk.pre_tokenizer = byte_level
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL])
    tk.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED])
    single, specials = "$A:0", []
    for flag, key, before in (("add_bos_token", "bos", True), ("add_eos_token", "eos", False)):
        if info[flag] and info[f"{key}_token"] is not None:
            t = info[f"{key}_token"]
            single = f"{t}:0 {single}" if before else f"{single} {t}:0"
            specials.append((t, int(info[f"{key}_token_id"])))
    if specials:
        tk.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} {single.replace('$A', '$B').replace(':0', ':1')}", special_tokens=specials)
    return tk


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
    arch = meta.str("general.architecture")
    if arch != "llama":
        raise DFlashError(f"{gguf_path}: architecture {arch!r} is not supported (only 'llama')")
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
    template = meta.str("tokenizer.chat_template", None)
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

    Raises ValueError for a missing GGUF path or a bad `dtype`, DFlashError for a GGUF whose
    content is broken or describes an unsupported model, and FileExistsError if `out_dir`
    exists and is not empty (unless `overwrite`).
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

# tests/test_hardening_gguf.py
#
# The GGUF converter on a tiny llama GGUF (tests/fixtures/loader_fuzz.py) and hostile variants
# of it: the valid file converts into a directory a Session loads and runs; wrongly typed or
# out-of-range metadata, inconsistent vocabularies, tensors of other names or shapes (refused
# before anything is dequantized), NaN weights, truncation, corrupt counts and arrays nested
# 100,000 deep are each a dflash.DFlashError naming the file and the key or tensor, with no
# directory left behind. A missing path stays a ValueError (a caller mistake).
from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGUFValueType as T

from dflash import DFlashError, SamplingParams, Session
from dflash.convert_gguf import convert_gguf
from tests.fixtures.loader_fuzz import gguf_metadata, gguf_tensors, gguf_vocab, write_gguf

VOCAB = len(gguf_vocab()[0])


def _convert(tmp_path, metadata=None, tensors=None, arch="llama"):
    src = write_gguf(tmp_path / "m.gguf", metadata, tensors, arch)
    return convert_gguf(src, tmp_path / "out")


def test_tiny_gguf_converts_and_runs(tmp_path):
    out = _convert(tmp_path)
    s = Session(out, device="cpu", max_model_len=32, kv_cache_tokens=32, num_threads=1)
    assert s.model_config.vocab_size == VOCAB and s.model_config.num_layers == 1
    assert len(s.generate(["abc"], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


def _edited(base: dict, changes: dict) -> dict:
    """`base` with each change applied: keys are written with '__' for '.', None deletes."""
    for key, value in changes.items():
        key = key.replace("__", ".")
        if value is None:
            del base[key]
        else:
            base[key] = value
    return base


def _meta(**changes):
    return _edited(gguf_metadata(), changes)


METADATA_CASES = [
    # id, metadata edits (key with '.' written '__'), message regex
    ("block_count_string", {"llama__block_count": ("1", T.STRING, None)},
     r"'llama\.block_count' must be an integer in \[1, 4096\], got '1'"),
    ("embedding_length_2_pow_40", {"llama__embedding_length": (2**40, T.UINT64, None)},
     r"'llama\.embedding_length' must be an integer in \[1, 1048576\], got 1099511627776"),
    ("head_count_zero", {"llama__attention__head_count": (0, T.UINT32, None)},
     r"'llama\.attention\.head_count' must be an integer in \[1, 4096\], got 0"),
    ("context_length_u64_max", {"llama__context_length": (2**64 - 1, T.UINT64, None)},
     r"'llama\.context_length' must be an integer in \[1, 2147483647\]"),
    ("rms_eps_nan", {"llama__attention__layer_norm_rms_epsilon": (float("nan"), T.FLOAT32, None)},
     r"'llama\.attention\.layer_norm_rms_epsilon' must be a positive finite number, got nan"),
    ("rms_eps_missing", {"llama__attention__layer_norm_rms_epsilon": None},
     r"GGUF metadata key 'llama\.attention\.layer_norm_rms_epsilon' is missing"),
    ("tokens_not_strings", {"tokenizer__ggml__tokens": ([1, 2, 3], T.ARRAY, T.INT32)},
     r"'tokenizer\.ggml\.tokens' must be a list of str"),
    ("duplicate_tokens", {"tokenizer__ggml__tokens": (["a"] * VOCAB, T.ARRAY, T.STRING)},
     r"tokenizer\.ggml\.tokens must be a non-empty list of distinct tokens"),
    ("token_type_length", {"tokenizer__ggml__token_type": ([1, 1], T.ARRAY, T.INT32)},
     rf"tokenizer\.ggml\.token_type has 2 entries for {VOCAB} tokens"),
    ("merge_without_space", {"tokenizer__ggml__merges": (["ab"], T.ARRAY, T.STRING)},
     r"tokenizer\.ggml\.merges entry 'ab' is not two tokens separated by a space"),
    ("bos_id_out_of_range", {"tokenizer__ggml__bos_token_id": (VOCAB, T.UINT32, None)},
     rf"'tokenizer\.ggml\.bos_token_id' must be an integer in \[0, {VOCAB - 1}\], got {VOCAB}"),
    ("add_bos_token_not_bool", {"tokenizer__ggml__add_bos_token": (1, T.UINT32, None)},
     r"'tokenizer\.ggml\.add_bos_token' must be a boolean, got 1"),
    ("tokenizer_model_spm", {"tokenizer__ggml__model": ("llama", T.STRING, None)},
     r"tokenizer model 'llama' is not supported"),
    ("rope_scaling_yarn", {"llama__rope__scaling__type": ("yarn", T.STRING, None)},
     r"rope scaling type 'yarn' is not supported"),
    ("vocab_size_disagrees", {"llama__vocab_size": (VOCAB + 5, T.UINT32, None)},
     rf"'model\.embed_tokens\.weight'\) has shape \({VOCAB}, 32\), expected \({VOCAB + 5}, 32\)"),
    ("chat_template_not_string", {"tokenizer__chat_template": (7, T.UINT32, None)},
     r"'tokenizer\.chat_template' must be a string, got 7"),
]


@pytest.mark.parametrize("edits, message", [pytest.param(e, m, id=i) for i, e, m in METADATA_CASES])
def test_bad_metadata_is_a_dflash_error(tmp_path, edits, message):
    with pytest.raises(DFlashError, match=message):
        _convert(tmp_path, metadata=_meta(**edits))
    assert not (tmp_path / "out").exists()


def _tensors(**changes):
    return _edited(gguf_tensors(VOCAB), changes)


TENSOR_CASES = [
    ("second_layer_for_one_layer_config", {"blk__1__attn_norm__weight": np.ones(32, np.float32)},
     r"unsupported tensor 'blk\.1\.attn_norm\.weight' for a plain Llama model with 1 layers"),
    ("unknown_tensor", {"token_embd__bias": np.ones(32, np.float32)}, r"unsupported tensor 'token_embd\.bias'"),
    ("missing_tensor", {"blk__0__ffn_up__weight": None},
     r"GGUF lacks the tensor that maps to 'model\.layers\.0\.mlp\.up_proj\.weight'"),
    ("wrong_shape", {"blk__0__ffn_gate__weight": np.zeros((63, 32), np.float32)},
     r"tensor 'blk\.0\.ffn_gate\.weight' \('model\.layers\.0\.mlp\.gate_proj\.weight'\) has shape \(63, 32\), "
     r"expected \(64, 32\)"),
    ("nan_weights", {"output_norm__weight": np.full(32, np.nan, np.float32)},
     r"tensor 'output_norm\.weight' holds NaN or infinite values"),
]


@pytest.mark.parametrize("edits, message", [pytest.param(e, m, id=i) for i, e, m in TENSOR_CASES])
def test_bad_tensors_are_a_dflash_error(tmp_path, edits, message):
    with pytest.raises(DFlashError, match=message):
        _convert(tmp_path, tensors=_tensors(**edits))


def test_other_architecture_is_a_dflash_error(tmp_path):
    with pytest.raises(DFlashError, match=r"architecture 'qwen2' is not supported"):
        _convert(tmp_path, arch="qwen2")


def _seed_bytes(tmp_path) -> bytes:
    return write_gguf(tmp_path / "seed.gguf").read_bytes()


def test_truncated_and_corrupt_files_are_dflash_errors(tmp_path):
    seed = _seed_bytes(tmp_path)
    variants = {
        "cut_in_metadata": seed[:200],
        "cut_in_data": seed[:-100],
        "kv_count_2_pow_63": seed[:16] + struct.pack("<Q", 2**63) + seed[24:],
        "tensor_count_u64_max": seed[:8] + struct.pack("<Q", 2**64 - 1) + seed[16:],
        "version_9": seed[:4] + struct.pack("<I", 9) + seed[8:],
    }
    for name, data in variants.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(DFlashError, match=rf"{name}\.gguf"):
            convert_gguf(path, tmp_path / f"out_{name}")


def test_enormous_declared_tensor_shape_is_refused_before_allocating(tmp_path):
    # blk.0.attn_norm.weight's dims rewritten to [2^40] in the tensor infos.
    seed = _seed_bytes(tmp_path)
    name = b"blk.0.attn_norm.weight"
    at = seed.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    assert struct.unpack("<I", seed[at:at + 4]) == (1,)  # one dimension
    path = tmp_path / "huge.gguf"
    path.write_bytes(seed[:at + 4] + struct.pack("<Q", 2**40) + seed[at + 12:])
    with pytest.raises(DFlashError, match=r"huge\.gguf: (not a valid GGUF file|tensor 'blk\.0\.attn_norm\.weight')"):
        convert_gguf(path, tmp_path / "out")


def test_array_nested_100000_deep_is_a_dflash_error(tmp_path):
    # One key whose value is an array of an array of ... 100,000 levels (the reader recurses).
    key = b"deep.key"
    body = struct.pack("<I", T.ARRAY) + struct.pack("<IQ", T.ARRAY, 1) * 100000 + struct.pack("<IQ", T.UINT8, 0)
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + body
    path = tmp_path / "deep.gguf"
    path.write_bytes(data)
    with pytest.raises(DFlashError, match=r"deep\.gguf: not a valid GGUF file \(RecursionError"):
        convert_gguf(path, tmp_path / "out")


def test_missing_path_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.gguf: not a GGUF file \(no such file"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")

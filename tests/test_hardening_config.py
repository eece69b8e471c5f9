# tests/test_hardening_config.py
#
# Hostile config.json / tokenizer files and checkpoints that disagree with their config get a
# dflash.DFlashError naming the file and the field or tensor; caller options asking for more
# memory than exists get a ValueError before anything is allocated:
#   * JSON nested 100,000 deep (target config, drafter config, tokenizer files, generation
#     config) and non-UTF-8 bytes: no crash, no RecursionError / UnicodeDecodeError;
#   * 64-bit integers read with full range checks (target_layer_ids of 2^32 is not layer 0);
#   * wrongly typed fields are errors, not defaults (architectures: 5, hidden_act: null,
#     rope_scaling: [1, 2], ...); duplicate keys are errors; enormous dimensions are refused;
#   * every tensor of the checkpoint is used (a 2-layer checkpoint with num_hidden_layers 1, a
#     tied model with an lm_head, an index that leaves a tensor out);
#   * kv_cache_tokens beyond memory is a ValueError raised before the cache is allocated;
#   * property-based (hypothesis): any JSON value in any field of a valid config is parsed or
#     refused with DFlashError.
from __future__ import annotations

import json
import pathlib
import re
import shutil
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash import DFlashError, Session, _core
from dflash.drafter_format import write_dflash_drafter
from tests.fixtures.loader_fuzz import DFLASH_CONFIG, LLAMA_CONFIG, deep_json
from tests.runtime_helpers import target_config

DEEP = deep_json(100000)


def _copy(tiny_model_dirs, tmp_path: pathlib.Path, preset: str = "llama_gqa") -> pathlib.Path:
    d = tmp_path / preset
    shutil.copytree(tiny_model_dirs[preset], d)
    return d


def _load(d, **kw):
    kw = {"device": "cpu", "max_model_len": 32, "kv_cache_tokens": 32, "num_threads": 1, **kw}
    return Session(d, **kw)


def _with_field(cfg: dict, key: str, raw: bytes) -> bytes:
    """config.json text with `key` set to the raw JSON text `raw`."""
    return json.dumps({**cfg, key: "@"}).encode().replace(b'"@"', raw)


def _parse_target(text: bytes):
    return _core.testing.model_config_parse(text, "config.json")


def _parse_drafter(text: bytes):
    return _core.testing.draft_config_parse(text, "config.json")


# --- nesting and bytes ------------------------------------------------------------------------


@pytest.mark.parametrize("parse", [_parse_target, _parse_drafter], ids=["target", "drafter"])
def test_config_nested_100000_deep_is_refused_before_parsing_deeper(parse):
    seed = LLAMA_CONFIG if parse is _parse_target else DFLASH_CONFIG
    with pytest.raises(DFlashError, match=r"config\.json: JSON nests deeper than 64 levels"):
        parse(_with_field(seed, "rope_scaling", DEEP))
    parse(_with_field(seed, "unused_field", deep_json(63)))  # 64 levels with the config itself


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "generation_config.json",
                                  "special_tokens_map.json", "tokenizer.json"])
def test_model_file_nested_100000_deep_is_a_dflash_error(tiny_model_dirs, tmp_path, name):
    d = _copy(tiny_model_dirs, tmp_path)
    path = d / name
    obj = json.loads(path.read_text()) if path.exists() else {}
    path.write_bytes(_with_field(obj, "deep", DEEP))
    with pytest.raises(DFlashError, match=re.escape(name)):
        _load(d)


def test_drafter_config_nested_100000_deep_is_a_dflash_error(tiny_model_dirs, tmp_path):
    target = tiny_model_dirs["llama_gqa"]
    d = write_dflash_drafter(tmp_path / "d", target_config=target_config(target), target_layer_ids=[0, 1],
                             block_size=4)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_bytes(_with_field(cfg, "layer_types", DEEP))
    with pytest.raises(DFlashError, match=r"d/config\.json: JSON nests deeper than 64 levels"):
        _load(target, draft=d)


def test_non_utf8_bytes_in_config_are_quoted_escaped(tiny_model_dirs, tmp_path):
    text = json.dumps(LLAMA_CONFIG).encode().replace(b'"silu"', b'"si\xfflu"')
    with pytest.raises(DFlashError, match=r"ill-formed UTF-8 byte; last read: '\"si\\xff'"):
        _parse_target(text)
    d = _copy(tiny_model_dirs, tmp_path)
    (d / "config.json").write_bytes(text)
    with pytest.raises(DFlashError, match=r"config\.json: UnicodeDecodeError"):
        _load(d)  # the tokenizer reads config.json (EOS ids) first


def test_duplicate_key_is_refused(tiny_model_dirs, tmp_path):
    d = _copy(tiny_model_dirs, tmp_path)
    text = (d / "config.json").read_text().strip()
    (d / "config.json").write_text('{"num_hidden_layers": 1, ' + text[1:])
    with pytest.raises(DFlashError, match=r"config\.json: duplicate key \"num_hidden_layers\""):
        _load(d)


# --- integer ranges ---------------------------------------------------------------------------


@pytest.mark.parametrize("ids, shown", [([2**32, 1], "4294967296"), ([0, 2**64 - 1], "18446744073709551615"),
                                        ([-1, 0], "-1"), ([0, 2**63], "9223372036854775808")])
def test_target_layer_ids_are_range_checked(ids, shown):
    cfg = json.loads(json.dumps(DFLASH_CONFIG))
    cfg["dflash_config"]["target_layer_ids"] = ids
    with pytest.raises(DFlashError, match=rf"field 'dflash_config\.target_layer_ids' is {shown}, outside \[0, 4095\]"):
        _parse_drafter(json.dumps(cfg).encode())


def test_target_layer_id_2_pow_32_does_not_load_as_layer_0(tiny_model_dirs, tmp_path):
    target = tiny_model_dirs["llama_gqa"]
    d = write_dflash_drafter(tmp_path / "d", target_config=target_config(target), target_layer_ids=[0, 1],
                             block_size=4)
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [2**32, 1]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match=r"target_layer_ids' is 4294967296, outside"):
        _load(target, draft=d)


@pytest.mark.parametrize("key, value, message", [
    ("hidden_size", 2**64 - 1, r"field 'hidden_size' is 18446744073709551615, outside"),
    ("num_hidden_layers", 2**32, r"field 'num_hidden_layers' is 4294967296, beyond the largest dflash accepts "
                                 r"\(4096\)"),
    ("vocab_size", 2**40, r"field 'vocab_size' is 1099511627776, beyond the largest dflash accepts"),
    ("hidden_size", 2**30, r"field 'hidden_size' is 1073741824, beyond the largest dflash accepts \(1048576\)"),
    ("max_position_embeddings", 2**31, r"field 'max_position_embeddings' is 2147483648, beyond"),
    ("bos_token_id", 2**33, r"bos_token_id 8589934592 is outside the vocabulary"),
    ("eos_token_id", [1, 2**64 - 1], r"field 'eos_token_id' is 18446744073709551615, outside"),
])
def test_integer_fields_are_range_checked(key, value, message):
    with pytest.raises(DFlashError, match=message):
        _parse_target(json.dumps({**LLAMA_CONFIG, key: value}).encode())


# --- wrongly typed fields ---------------------------------------------------------------------

TYPE_CASES = [
    # parser, field, value, message regex
    ("target", "architectures", 5, r"field 'architectures' must be a list, got 5"),
    ("target", "architectures", [5], r"field 'architectures' must be a list of strings, got \[5\]"),
    ("target", "hidden_act", None, r"field 'hidden_act' must be a string, got null"),
    ("target", "hidden_act", 5, r"field 'hidden_act' must be a string, got 5"),
    ("target", "rope_scaling", [1, 2], r"field 'rope_scaling' must be an object, got \[1,2\]"),
    ("target", "rope_parameters", "default", r"field 'rope_parameters' must be an object, got \"default\""),
    ("target", "rope_theta", "1e4", r"field 'rope_theta' must be a number"),
    ("target", "rms_norm_eps", 0, r"field 'rms_norm_eps' must be a positive number"),
    ("target", "eos_token_id", "2", r"field 'eos_token_id' must be an integer or a list, got \"2\""),
    ("target", "num_key_value_heads", 2.0, r"field 'num_key_value_heads' must be an integer, got 2\.0"),
    ("target", "tie_word_embeddings", 0, r"field 'tie_word_embeddings' must be a boolean, got 0"),
    ("drafter", "architectures", "DFlashDraftModel", r"field 'architectures' must be a list"),
    ("drafter", "dflash_config", 5, r"field 'dflash_config' must be an object, got 5"),
    ("drafter", "layer_types", "full_attention", r"field 'layer_types' must be a list"),
    ("drafter", "is_causal", "yes", r"field 'is_causal' must be a boolean"),
    ("drafter", "num_target_layers", 2**40, r"field 'num_target_layers' must be in \[1, 4096\]"),
]


@pytest.mark.parametrize("parser, key, value, message", [pytest.param(*c, id=f"{c[0]}-{c[1]}-{c[2]!r}")
                                                         for c in TYPE_CASES])
def test_wrongly_typed_fields_are_errors(parser, key, value, message):
    seed, parse = (LLAMA_CONFIG, _parse_target) if parser == "target" else (DFLASH_CONFIG, _parse_drafter)
    with pytest.raises(DFlashError, match=message):
        parse(json.dumps({**seed, key: value}).encode())


def test_null_rope_scaling_and_absent_hidden_act_keep_their_defaults():
    cfg = {k: v for k, v in LLAMA_CONFIG.items() if k != "hidden_act"}
    assert _parse_target(json.dumps({**cfg, "rope_scaling": None}).encode()).hidden_size == 64


@pytest.mark.parametrize("field, value, message", [
    ("clean_up_tokenization_spaces", "no", r"clean_up_tokenization_spaces must be true or false, got 'no'"),
    ("chat_template", {"default": 5}, r"chat_template must map names to template strings"),
    ("chat_template", [{"name": "default", "template": 5}], r"malformed chat_template entry"),
    ("additional_special_tokens", "<x>", r"additional_special_tokens must be a list or an object, got '<x>'"),
    ("eos_token", {"content": "<|im_end|>", "lstrip": "yes"}, r"special token flag 'lstrip' must be true or false"),
    ("bos_token", 5, r"special token must be a string or an object with 'content', got 5"),
])
def test_wrongly_typed_tokenizer_config_fields_are_errors(tiny_model_dirs, tmp_path, field, value, message):
    d = _copy(tiny_model_dirs, tmp_path)
    path = d / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    with pytest.raises(DFlashError, match=message):
        _load(d)


# --- every tensor used ------------------------------------------------------------------------


def _edit_config(d: pathlib.Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_two_layer_checkpoint_with_num_hidden_layers_1_is_refused(tiny_model_dirs, tmp_path):
    d = _copy(tiny_model_dirs, tmp_path)
    _edit_config(d, num_hidden_layers=1)
    with pytest.raises(DFlashError, match=r"model\.safetensors: tensor 'model\.layers\.1\.[a-z_.]+' is not used by a "
                                          r"LlamaForCausalLM with 1 layers \(check num_hidden_layers"):
        _load(d)


def test_tied_model_with_an_lm_head_is_refused(tiny_model_dirs, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy(tiny_model_dirs, tmp_path, "llama_mqa_tied")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["lm_head.weight"] = np.zeros_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(DFlashError, match=r"tensor 'lm_head\.weight' is not used by .*tie_word_embeddings=true"):
        _load(d)


def test_index_that_leaves_a_shard_tensor_out_is_refused(tiny_model_dirs, tmp_path):
    d = _copy(tiny_model_dirs, tmp_path, "llama_sharded_f16")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.norm.weight"]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(DFlashError, match=r"index\.json: tensor 'model\.norm\.weight' of a shard is not listed"):
        _load(d)


def test_target_checkpoint_check_accepts_every_preset(tiny_model_dirs):
    for d in tiny_model_dirs.values():
        _core.testing.target_checkpoint_check(str(d))


# --- allocations beyond memory ----------------------------------------------------------------


def test_huge_kv_cache_tokens_is_refused_before_allocating(tiny_model_dirs):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"kv_cache_tokens=2147483647 needs \d+ bytes of KV cache \(\d+ per token\), "
                                         r"more than the \d+ bytes of host memory"):
        Session(tiny_model_dirs["llama_gqa"], device="cpu", kv_cache_tokens=2**31 - 1, num_threads=1)
    assert time.perf_counter() - t0 < 20  # nothing of the terabyte-sized cache was touched


def test_config_declaring_enormous_sizes_is_refused_before_allocating(tiny_model_dirs, tmp_path):
    d = _copy(tiny_model_dirs, tmp_path)
    _edit_config(d, intermediate_size=1 << 20, num_hidden_layers=4096)
    with pytest.raises(DFlashError, match=r"is not used by|has shape|checkpoint has no tensor"):
        _load(d)  # the tensor-set check runs before the backend allocates a byte


# --- property-based: any value in any field ---------------------------------------------------

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(set(LLAMA_CONFIG) | set(DFLASH_CONFIG) | {"head_dim", "rope_parameters"})),
       value=_JSON, drafter=st.booleans())
def test_any_value_in_any_field_is_parsed_or_refused(key, value, drafter):
    seed, parse = (DFLASH_CONFIG, _parse_drafter) if drafter else (LLAMA_CONFIG, _parse_target)
    text = json.dumps({**seed, key: value}).encode()
    try:
        parsed = parse(text)
    except DFlashError:
        return
    if not drafter and key in ("hidden_size", "vocab_size", "num_hidden_layers"):
        assert getattr(parsed, {"num_hidden_layers": "num_layers"}.get(key, key)) == value

# tests/test_bad_input.py
#
# Bad input gets a clear Python exception, never a crash, and changes nothing:
#   * broken or inconsistent model files -> dflash.DFlashError naming the file / field / tensor;
#   * caller mistakes (arguments, prompts, sampling parameters) -> ValueError (TypeError for
#     unknown keywords), and the Session that saw them still generates the same tokens with
#     no KV block leaked and no request left queued.
from __future__ import annotations

import json
import math
import pathlib
import re
import shutil
import struct

import numpy as np
import pytest

import dflash
from dflash import DFlashError, SamplingParams, Session
from tests.runtime_helpers import assert_no_leaks

# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _copy(tiny_model_dirs, tmp_path: pathlib.Path, preset: str = "llama_gqa") -> pathlib.Path:
    dst = tmp_path / preset
    shutil.copytree(tiny_model_dirs[preset], dst)
    return dst


def _load(model_dir) -> Session:
    return Session(model_dir, device="cpu", max_model_len=64, kv_cache_tokens=64, num_threads=1)


def _edit_config(d: pathlib.Path, **changes) -> None:
    path = d / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DELETE:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


_DELETE = object()


def _read_safetensors(path: pathlib.Path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_safetensors(path: pathlib.Path, header, data: bytes) -> None:
    hb = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + data)


def _rewrite_tensors(path: pathlib.Path, fn) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


ST = "model.safetensors"
INDEX = "model.safetensors.index.json"

# ---------------------------------------------------------------------------------------------
# 1. Model directory problems
# ---------------------------------------------------------------------------------------------


def test_missing_model_directory_is_value_error(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(ValueError, match=r"model directory not found: .*no_such_model"):
        _load(missing)


def test_model_path_that_is_a_file_is_value_error(tiny_model_dirs):
    with pytest.raises(ValueError, match=r"model directory not found: .*config\.json"):
        _load(tiny_model_dirs["llama_gqa"] / "config.json")


# Each breaker edits a fresh copy of a preset; the message must name what is wrong.
def _truncate_half(d):
    p = d / ST
    raw = p.read_bytes()
    p.write_bytes(raw[: len(raw) // 2])


def _header_size_too_large(d):
    p = d / ST
    raw = p.read_bytes()
    p.write_bytes(struct.pack("<Q", 10**12) + raw[8:])


def _header_size_u64_max(d):
    p = d / ST
    raw = p.read_bytes()
    p.write_bytes(struct.pack("<Q", 2**64 - 1) + raw[8:])


def _header_not_json(d):
    p = d / ST
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    p.write_bytes(raw[:8] + b"x" * n + raw[8 + n :])


def _header_not_object(d):
    _, data = _read_safetensors(d / ST)
    _write_safetensors(d / ST, [1, 2, 3], data)


def _header_lies_about_size(d):
    header, data = _read_safetensors(d / ST)
    header["model.norm.weight"]["data_offsets"][1] -= 4
    _write_safetensors(d / ST, header, data)


def _offsets_beyond_file(d):
    header, data = _read_safetensors(d / ST)
    begin, end = header["model.norm.weight"]["data_offsets"]
    header["model.norm.weight"]["data_offsets"] = [len(data), len(data) + end - begin]
    _write_safetensors(d / ST, header, data)


def _negative_shape(d):
    header, data = _read_safetensors(d / ST)
    header["model.norm.weight"]["shape"] = [-64]
    _write_safetensors(d / ST, header, data)


def _overflowing_shape(d):
    # 2**62 * 2**62 * 4 bytes wraps to 0 in 64 bits; must not pass as a 0-byte tensor.
    header, data = _read_safetensors(d / ST)
    begin, _ = header["model.norm.weight"]["data_offsets"]
    header["model.norm.weight"]["shape"] = [2**62, 2**62]
    header["model.norm.weight"]["data_offsets"] = [begin, begin]
    _write_safetensors(d / ST, header, data)


def _unknown_dtype(d):
    header, data = _read_safetensors(d / ST)
    header["model.norm.weight"]["dtype"] = "Q4_K"
    _write_safetensors(d / ST, header, data)


def _unsupported_dtype(d):
    # A valid F64 tensor where a float weight is expected: not "missing", but unloadable.
    header, data = _read_safetensors(d / ST)
    begin, end = header["model.norm.weight"]["data_offsets"]
    header["model.norm.weight"]["dtype"] = "F64"
    header["model.norm.weight"]["shape"] = [(end - begin) // 8]
    _write_safetensors(d / ST, header, data)


def _transposed_tensor(d):
    name = "model.layers.0.mlp.down_proj.weight"
    _rewrite_tensors(d / ST, lambda t: t.__setitem__(name, np.ascontiguousarray(t[name].T)))


def _drop_tensor(d):
    _rewrite_tensors(d / ST, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))


def _drop_lm_head(d):
    _rewrite_tensors(d / ST, lambda t: t.pop("lm_head.weight"))


def _index_points_to_missing_shard(d):
    p = d / INDEX
    j = json.loads(p.read_text())
    j["weight_map"]["model.norm.weight"] = "model-00009-of-00004.safetensors"
    p.write_text(json.dumps(j))


def _index_lists_phantom_tensor(d):
    p = d / INDEX
    j = json.loads(p.read_text())
    j["weight_map"]["model.phantom.weight"] = "model-00001-of-00004.safetensors"
    p.write_text(json.dumps(j))


def _index_lists_tensor_in_wrong_shard(d):
    p = d / INDEX
    j = json.loads(p.read_text())
    wm = j["weight_map"]
    # A tensor of a shard holding several is listed for another shard (both are still read).
    name = "model.layers.0.input_layernorm.weight"
    assert sum(f == wm[name] for f in wm.values()) > 1
    wm[name] = next(f for f in sorted(set(wm.values())) if f != wm[name])
    p.write_text(json.dumps(j))


def _index_not_json(d):
    (d / INDEX).write_text("this is not json")


def _index_escapes_directory(d):
    p = d / INDEX
    j = json.loads(p.read_text())
    j["weight_map"]["lm_head.weight"] = "../elsewhere.safetensors"
    p.write_text(json.dumps(j))


def _delete_shard(d):
    (d / "model-00002-of-00004.safetensors").unlink()


MODEL_FILE_CASES = [
    # id, preset, breaker, message regex
    ("missing_config", "llama_gqa", lambda d: (d / "config.json").unlink(),
     r"missing config\.json"),
    ("config_not_json", "llama_gqa", lambda d: (d / "config.json").write_text("{not json"),
     r"config\.json"),
    ("config_not_object", "llama_gqa", lambda d: (d / "config.json").write_text("[1, 2]"),
     r"config\.json"),
    ("missing_hidden_size", "llama_gqa", lambda d: _edit_config(d, hidden_size=_DELETE),
     r"config\.json: missing field 'hidden_size'"),
    ("hidden_size_is_string", "llama_gqa", lambda d: _edit_config(d, hidden_size="64"),
     r"config\.json: field 'hidden_size' must be an integer, got \"64\""),
    ("hidden_size_is_float", "llama_gqa", lambda d: _edit_config(d, hidden_size=64.5),
     r"field 'hidden_size' must be an integer"),
    ("tie_word_embeddings_not_bool", "llama_gqa",
     lambda d: _edit_config(d, tie_word_embeddings="no"),
     r"field 'tie_word_embeddings' must be a boolean"),
    ("negative_layers", "llama_gqa", lambda d: _edit_config(d, num_hidden_layers=-1),
     r"field 'num_hidden_layers' must be positive, got -1"),
    ("zero_kv_heads", "llama_gqa", lambda d: _edit_config(d, num_key_value_heads=0),
     r"field 'num_key_value_heads' must be positive"),
    ("heads_not_multiple_of_kv_heads", "llama_gqa",
     lambda d: _edit_config(d, num_attention_heads=4, num_key_value_heads=3),
     r"'num_attention_heads' \(4\) must be a multiple of 'num_key_value_heads' \(3\)"),
    ("odd_head_dim", "llama_gqa", lambda d: _edit_config(d, head_dim=15),
     r"field 'head_dim' must be positive and even, got 15"),
    ("unknown_architecture", "llama_gqa",
     lambda d: _edit_config(d, architectures=["GPT2LMHeadModel"]),
     r"unsupported architecture 'GPT2LMHeadModel'"),
    ("unsupported_rope_type", "llama_gqa",
     lambda d: _edit_config(d, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                                "factor": 2.0}),
     r"unsupported rope_type 'yarn'"),
    ("eos_outside_vocab", "llama_gqa", lambda d: _edit_config(d, eos_token_id=100000),
     r"eos_token_id 100000 is outside the vocabulary"),
    ("vocab_size_disagrees_with_weights", "llama_gqa", lambda d: _edit_config(d, vocab_size=100),
     r"'model\.embed_tokens\.weight' has shape \[\d+, 64\], expected \[100, 64\]"),
    ("missing_safetensors", "llama_gqa", lambda d: (d / ST).unlink(),
     r"no model\.safetensors or model\.safetensors\.index\.json"),
    ("safetensors_truncated_in_half", "llama_gqa", _truncate_half,
     r"model\.safetensors tensor '.*': data_offsets .* outside the file's \d+ data bytes"),
    ("safetensors_shorter_than_8_bytes", "llama_gqa", lambda d: (d / ST).write_bytes(b"abc"),
     r"model\.safetensors: truncated safetensors file \(3 bytes"),
    ("safetensors_empty", "llama_gqa", lambda d: (d / ST).write_bytes(b""),
     r"model\.safetensors: truncated safetensors file \(0 bytes"),
    ("header_size_larger_than_file", "llama_gqa", _header_size_too_large,
     r"model\.safetensors: corrupt safetensors header: header size 1000000000000 exceeds"),
    ("header_size_u64_max", "llama_gqa", _header_size_u64_max,
     r"header size 18446744073709551615 exceeds the file size"),
    ("header_not_json", "llama_gqa", _header_not_json,
     r"model\.safetensors \(safetensors header\): invalid JSON"),
    ("header_not_object", "llama_gqa", _header_not_object,
     r"model\.safetensors: safetensors header is not a JSON object"),
    ("header_lies_about_sizes", "llama_gqa", _header_lies_about_size,
     r"tensor 'model\.norm\.weight': header says 252 bytes but shape \[64\] of F32 needs 256"),
    ("data_offsets_beyond_file", "llama_gqa", _offsets_beyond_file,
     r"tensor 'model\.norm\.weight': data_offsets \[\d+, \d+\) lie outside the file"),
    ("negative_shape", "llama_gqa", _negative_shape,
     r"tensor 'model\.norm\.weight': bad shape \[-64\]"),
    ("shape_size_overflows", "llama_gqa", _overflowing_shape,
     r"tensor 'model\.norm\.weight': shape "
     r"\[4611686018427387904, 4611686018427387904\] is too large"),
    ("unknown_dtype", "llama_gqa", _unknown_dtype,
     r"tensor 'model\.norm\.weight': unknown dtype Q4_K"),
    ("unsupported_dtype", "llama_gqa", _unsupported_dtype,
     r"tensor 'model\.norm\.weight' has dtype F64, which dflash cannot load"),
    ("tensor_wrong_shape", "llama_gqa", _transposed_tensor,
     r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.down_proj\.weight' has shape "
     r"\[128, 64\], expected \[64, 128\]"),
    ("tensor_missing", "llama_gqa", _drop_tensor,
     r"checkpoint has no tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"),
    ("untied_without_lm_head", "llama_gqa", _drop_lm_head,
     r"tie_word_embeddings=false but there is no 'lm_head\.weight'"),
    ("index_points_to_missing_shard", "llama_sharded_f16", _index_points_to_missing_shard,
     r"missing safetensors shard .*model-00009-of-00004\.safetensors"),
    ("shard_file_deleted", "llama_sharded_f16", _delete_shard,
     r"missing safetensors shard .*model-00002-of-00004\.safetensors"),
    ("index_lists_phantom_tensor", "llama_sharded_f16", _index_lists_phantom_tensor,
     r"index\.json: tensor 'model\.phantom\.weight' listed for "
     r"model-00001-of-00004\.safetensors is not in that shard"),
    ("index_lists_tensor_in_wrong_shard", "llama_sharded_f16", _index_lists_tensor_in_wrong_shard,
     r"index\.json: tensor 'model\.layers\.0\.input_layernorm\.weight' listed for "
     r"model-0000\d-of-00004\.safetensors is not in that shard "
     r"\(it is in model-0000\d-of-00004\.safetensors\)"),
    ("index_not_json", "llama_sharded_f16", _index_not_json,
     r"model\.safetensors\.index\.json: invalid JSON"),
    ("index_escapes_directory", "llama_sharded_f16", _index_escapes_directory,
     r"shard name '\.\./elsewhere\.safetensors' escapes the model directory"),
    ("missing_tokenizer", "llama_gqa", lambda d: (d / "tokenizer.json").unlink(),
     r"missing .*tokenizer\.json"),
    ("corrupt_tokenizer", "llama_gqa", lambda d: (d / "tokenizer.json").write_text("{garbage"),
     r"cannot parse .*tokenizer\.json"),
    ("tokenizer_wrong_schema", "llama_gqa",
     lambda d: (d / "tokenizer.json").write_text('{"version": "1.0"}'),
     r"cannot parse .*tokenizer\.json"),
]


@pytest.mark.parametrize(
    "preset, breaker, message",
    [pytest.param(p, b, m, id=i) for i, p, b, m in MODEL_FILE_CASES],
)
def test_broken_model_files_raise_dflash_error(tiny_model_dirs, tmp_path, preset, breaker, message):
    d = _copy(tiny_model_dirs, tmp_path, preset)
    breaker(d)
    with pytest.raises(DFlashError, match=message):
        _load(d)


def test_dflash_error_is_not_value_error():
    # Broken files and caller mistakes are told apart by type.
    assert not issubclass(DFlashError, ValueError)
    assert issubclass(DFlashError, RuntimeError)


def test_unmodified_copies_still_load(tiny_model_dirs, tmp_path):
    # The breakers above are what fails, not the copying.
    for preset in ("llama_gqa", "llama_sharded_f16"):
        s = _load(_copy(tiny_model_dirs, tmp_path, preset))
        assert len(s.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids) == 2
        assert_no_leaks(s)


# ---------------------------------------------------------------------------------------------
# 2. Caller mistakes on a working Session
# ---------------------------------------------------------------------------------------------

REF_PROMPTS = ["Hello there", [5, 6, 7]]
REF_PARAMS = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def session(tiny_model_dirs):
    return Session(tiny_model_dirs["llama_gqa"], device="cpu", max_model_len=64, num_threads=2)


@pytest.fixture(scope="module")
def reference(session):
    return [o.token_ids for o in session.generate(REF_PROMPTS, REF_PARAMS)]


@pytest.fixture
def healthy(session, reference):
    """Yields the session; afterwards it must generate as before and hold no blocks."""
    assert_no_leaks(session)
    yield session
    assert_no_leaks(session)
    assert [o.token_ids for o in session.generate(REF_PROMPTS, REF_PARAMS)] == reference
    assert_no_leaks(session)


VOCAB = 359  # llama_gqa's vocab_size (checked below)


def test_vocab_size_of_the_preset(session):
    assert session.model_config.vocab_size == VOCAB


BAD_PROMPTS = [
    # id, prompts, regex
    ("ids_longer_than_max_model_len", [[5] * 64], r"the prompt has 64 tokens.*max_model_len=64"),
    ("text_longer_than_max_model_len", "hello " * 100,
     r"the prompt has \d+ tokens.*max_model_len=64"),
    ("empty_text", "", r"the prompt is empty"),
    ("empty_id_list", [[]], r"a prompt of token ids is empty"),
    ("negative_token_id", [[1, -1]], r"prompt token id -1 is outside the vocabulary \[0, 359\)"),
    ("token_id_equal_to_vocab", [[1, VOCAB]], r"prompt token id 359 is outside the vocabulary"),
    ("token_id_beyond_int32", [[1, 2**40]],
     r"prompt token id 1099511627776 is outside the vocabulary"),
    ("none", None, r"prompts must be a str or a list, got NoneType"),
    ("int", 3, r"prompts must be a str or a list, got int"),
    ("bytes", b"abc", r"prompts must be a str or a list, got bytes"),
    ("flat_int_list", [1, 2, 3], r"a flat list of ints is ambiguous"),
    ("str_in_id_list", [[1, "a"]], r"element 1 is 'a' \(str\)"),
    ("float_in_id_list", [[1.0, 2]], r"element 0 is 1\.0 \(float\)"),
    ("bool_in_id_list", [[True, 2]], r"element 0 is True \(bool\)"),
    ("message_without_content", [{"role": "user"}],
     r"messages\[0\] \(role 'user'\) has no 'content'"),
    ("message_content_not_text", [{"role": "user", "content": 3}],
     r"messages\[0\] \(role 'user'\) content must be a string"),
    ("message_role_rejected_by_template", [{"role": "wizard", "content": "hi"}],
     r"the chat template rejected these messages: Unsupported chat role: wizard"),
    ("list_mixing_str_and_int", ["hello", 3], r"each prompt must be a str.*got int"),
    ("second_conversation_broken", [[{"role": "user", "content": "hi"}], [{"role": "user"}]],
     r"has no 'content'"),
]


@pytest.mark.parametrize("prompts, message", [pytest.param(p, m, id=i) for i, p, m in BAD_PROMPTS])
def test_bad_prompts(healthy, prompts, message):
    with pytest.raises(ValueError, match=message):
        healthy.generate(prompts, SamplingParams(max_tokens=4))


BAD_SAMPLING = [
    (dict(max_tokens=0), r"max_tokens must be >= 1, got 0"),
    (dict(max_tokens=-1), r"max_tokens must be >= 1, got -1"),
    (dict(max_tokens=1.5), r"max_tokens must be an integer, got 1\.5"),
    (dict(max_tokens="5"), r"max_tokens must be an integer, got '5'"),
    (dict(max_tokens=True), r"max_tokens must be an integer, got True"),
    (dict(temperature=-1), r"temperature must be a finite number >= 0, got -1"),
    (dict(temperature=math.nan), r"temperature must be a finite number >= 0, got nan"),
    (dict(temperature=math.inf), r"temperature must be a finite number >= 0, got inf"),
    (dict(temperature="1"), r"temperature must be a number, got '1'"),
    (dict(top_p=0), r"top_p must be in \(0, 1\], got 0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1\.5"),
    (dict(top_p=math.nan), r"top_p must be in \(0, 1\], got nan"),
    (dict(top_k=-2), r"top_k must be >= 0 \(0 disables it\), got -2"),
    (dict(top_k=2.0), r"top_k must be an integer, got 2\.0"),
    (dict(seed=-1), r"seed must be in \[0, 2\*\*64\), got -1"),
    (dict(seed=2**64), r"seed must be in \[0, 2\*\*64\), got 18446744073709551616"),
    (dict(seed=1.5), r"seed must be an integer or None, got 1\.5"),
    (dict(stop=[""]), r"stop must hold non-empty strings, got ''"),
    (dict(stop=""), r"stop must hold non-empty strings, got ''"),
    (dict(stop=[3]), r"stop must hold non-empty strings, got 3"),
    (dict(stop=3), r"stop must be a string or a list of strings, got 3"),
    (dict(stop=b"x"), r"stop must be a string or a list of strings, got b'x'"),
    (dict(stop_token_ids=[-1]), r"stop_token_ids must hold non-negative integers, got -1"),
    (dict(stop_token_ids=["a"]), r"stop_token_ids must hold non-negative integers, got 'a'"),
    (dict(stop_token_ids=[True]), r"stop_token_ids must hold non-negative integers, got True"),
    (dict(stop_token_ids=3), r"stop_token_ids must be a list of token ids, got 3"),
    (dict(stop_token_ids="12"), r"stop_token_ids must be a list of token ids, got '12'"),
]


@pytest.mark.parametrize(
    "kwargs, message", [pytest.param(k, m, id=repr(k)) for k, m in BAD_SAMPLING]
)
def test_bad_sampling_params_raise_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_unknown_keyword_is_type_error():
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'foo'"):
        SamplingParams(foo=1)


@pytest.mark.parametrize(
    "stop_ids, message",
    [([VOCAB], r"stop token id 359 is outside the vocabulary \[0, 359\)"),
     ([2, 2**40], r"stop token id 1099511627776 is outside the vocabulary")],
)
def test_stop_token_ids_outside_vocab_raise_at_generate(healthy, stop_ids, message):
    params = SamplingParams(max_tokens=4, stop_token_ids=stop_ids)  # valid on its own
    with pytest.raises(ValueError, match=message):
        healthy.generate([[1, 2, 3]], params)


def test_huge_but_meaningful_sampling_values_work(healthy, reference):
    # max_tokens beyond max_model_len is capped; top_k beyond the vocabulary keeps every token.
    out = healthy.generate([[5, 6, 7]], SamplingParams(max_tokens=2**70, top_k=2**40))[0]
    assert out.finish_reason in ("stop", "length")
    assert out.token_ids[:8] == reference[1][: len(out.token_ids[:8])]
    assert len(out.prompt_token_ids) + len(out.token_ids) <= 64


@pytest.mark.parametrize(
    "params, message",
    [
        pytest.param([REF_PARAMS], r"params has 1 SamplingParams for 2 prompts", id="too_few"),
        pytest.param([REF_PARAMS] * 3, r"params has 3 SamplingParams for 2 prompts", id="too_many"),
        pytest.param([REF_PARAMS, 1], r"params must be a SamplingParams or a list",
                     id="not_params"),
        pytest.param({"max_tokens": 4}, r"params must be a SamplingParams or a list.*got dict",
                     id="dict"),
        pytest.param(3, r"params must be a SamplingParams or a list.*got int", id="int"),
    ],
)
def test_bad_params_argument(healthy, params, message):
    with pytest.raises(ValueError, match=message):
        healthy.generate(["a b", "c d"], params)


@pytest.mark.parametrize(
    "prompts, params, message",
    [
        # rejected by the C++ engine after the good prompts were queued
        pytest.param(["Hello", [1, 2, 3], [5] * 70], REF_PARAMS,
                     r"the prompt has 70 tokens.*max_model_len=64", id="last_too_long"),
        pytest.param([[1, 2, 3], [5] * 64, "Hello"], REF_PARAMS,
                     r"the prompt has 64 tokens.*max_model_len=64", id="middle_too_long"),
        # rejected in Python while building the third request
        pytest.param(["Hello", [1, 2, 3], [4, 5]],
                     [REF_PARAMS, REF_PARAMS, SamplingParams(stop_token_ids=[VOCAB])],
                     r"stop token id 359 is outside the vocabulary", id="last_bad_stop_id"),
        # rejected before anything is queued
        pytest.param(["Hello", [1, 2, 3], [1, 999]], REF_PARAMS,
                     r"prompt token id 999 is outside the vocabulary", id="last_bad_token"),
    ],
)
def test_batch_with_one_bad_prompt_leaves_nothing_behind(healthy, prompts, params, message):
    before = healthy.stats()
    with pytest.raises(ValueError, match=message):
        healthy.generate(prompts, params)
    assert not healthy._core.has_unfinished()
    after = healthy.stats()
    assert after["num_free_blocks"] == after["num_blocks"]
    # Nothing of the failed call was run.
    assert after["num_steps"] == before["num_steps"]
    assert after["num_requests_finished"] == before["num_requests_finished"]


def test_bad_calls_in_a_row_then_good_batch(healthy, reference):
    for bad in ([[1, -5]], [[]], None, [[5] * 80]):
        with pytest.raises(ValueError):
            healthy.generate(bad, REF_PARAMS)
    out = healthy.generate(REF_PROMPTS + REF_PROMPTS, REF_PARAMS)
    assert [o.token_ids for o in out] == reference + reference


# --- Session construction -----------------------------------------------------------------


def test_session_unknown_keyword_is_type_error(tiny_model_dirs):
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\): foo"):
        Session(tiny_model_dirs["llama_gqa"], foo=1)


@pytest.mark.parametrize("value,message", [(True, "cuda_graphs=True needs device='cuda'"),
                                           ("yes", "cuda_graphs must be True or False"),
                                           (1, "cuda_graphs must be True or False")])
def test_session_cuda_graphs_argument(tiny_model_dirs, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Session(tiny_model_dirs["llama_gqa"], device="cpu", cuda_graphs=value)
    Session(tiny_model_dirs["llama_gqa"], device="cpu", cuda_graphs=False)  # eager is what the CPU does


@pytest.mark.parametrize("device", ["tpu", "CPU", "", None])
def test_session_bad_device(tiny_model_dirs, device):
    message = r"device must be 'auto', 'cpu' or 'cuda', got " + re.escape(repr(device))
    with pytest.raises(ValueError, match=message):
        Session(tiny_model_dirs["llama_gqa"], device=device)


@pytest.mark.skipif(dflash.built_with_cuda(), reason="this build has CUDA")
def test_session_cuda_without_cuda_build(tiny_model_dirs):
    with pytest.raises(ValueError, match=r"device='cuda'.*no CUDA backend"):
        Session(tiny_model_dirs["llama_gqa"], device="cuda")


@pytest.mark.parametrize(
    "kwargs, message",
    [pytest.param(k, m, id=repr(k)) for k, m in [
        (dict(max_model_len=0), r"max_model_len must be a positive integer, got 0"),
        (dict(max_model_len=-5), r"max_model_len must be a positive integer, got -5"),
        (dict(max_model_len=1.5), r"max_model_len must be a positive integer, got 1\.5"),
        (dict(max_model_len=2**40), r"max_model_len=1099511627776 is too large"),
        (dict(kv_cache_tokens=0), r"kv_cache_tokens must be a positive integer, got 0"),
        (dict(kv_cache_tokens=2**40), r"kv_cache_tokens=1099511627776 is too large"),
        (dict(block_size=0), r"block_size must be a positive integer, got 0"),
        (dict(block_size=True), r"block_size must be a positive integer, got True"),
        (dict(block_size=4096), r"block_size must be in \[1, 1024\], got 4096"),
        (dict(num_threads=0), r"num_threads must be a positive integer, got 0"),
        (dict(num_threads=100_000), r"num_threads must be in \[1, \d+\], got 100000"),
        (dict(num_threads=2**40), r"num_threads=1099511627776 is too large"),
        (dict(max_num_seqs="8"), r"max_num_seqs must be a positive integer, got '8'"),
    ]],
)
def test_session_bad_options(tiny_model_dirs, kwargs, message):
    with pytest.raises(ValueError, match=message):
        Session(tiny_model_dirs["llama_gqa"], device="cpu", **kwargs)


def test_kv_cache_too_small_for_request(tiny_model_dirs):
    s = Session(tiny_model_dirs["llama_gqa"], device="cpu", kv_cache_tokens=32, num_threads=1)
    assert s.stats()["kv_cache_tokens"] == 32
    message = r"needs 100 KV cache slots.*holds only 32.*raise kv_cache_tokens"
    with pytest.raises(ValueError, match=message):
        s.generate([[5] * 50], SamplingParams(max_tokens=50))
    assert_no_leaks(s)
    # In a batch: the fitting request before it is withdrawn too.
    with pytest.raises(ValueError, match=r"kv_cache_tokens"):
        s.generate([[1, 2, 3], [5] * 50],
                   [SamplingParams(max_tokens=4), SamplingParams(max_tokens=50)])
    assert_no_leaks(s)
    out = s.generate([[5, 6, 7]], SamplingParams(max_tokens=8))[0]
    assert len(out.token_ids) == 8
    assert_no_leaks(s)


# ---------------------------------------------------------------------------------------------
# 3. Chat prompt on a model without a chat template
# ---------------------------------------------------------------------------------------------


def test_chat_prompt_without_chat_template(tiny_model_dirs, tmp_path):
    d = _copy(tiny_model_dirs, tmp_path)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["chat_template"]
    cfg_path.write_text(json.dumps(cfg))
    s = _load(d)
    with pytest.raises(ValueError, match=r"no chat template"):
        s.generate([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=4))
    assert_no_leaks(s)
    assert len(s.generate("hi", SamplingParams(max_tokens=3))[0].token_ids) == 3
    assert_no_leaks(s)

# tests/test_dflash_bad_input.py
#
# Mismatched target/drafter pairs and malformed drafter files give clear errors naming the
# files and the field (dflash.DFlashError for broken or mismatched files, ValueError for caller
# mistakes), and never crash the process.
from __future__ import annotations

import json

import pytest

import dflash
from dflash.drafter_format import write_dflash_drafter


@pytest.fixture
def target(tiny_model_dirs):
    return tiny_model_dirs["llama_gqa"]


def _cfg(target):
    return json.loads((target / "config.json").read_text())


def _good(tmp_path, target, **kw):
    kw.setdefault("num_layers", 1)
    kw.setdefault("target_layer_ids", [0, 1])
    kw.setdefault("block_size", 4)
    return write_dflash_drafter(tmp_path / "good", target_config=_cfg(target), **kw)


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def test_good_pair_loads(tmp_path, target):
    dflash.Session(target, draft=_good(tmp_path, target), num_threads=1)


def test_other_hidden_size(tmp_path, target, tiny_model_dirs):
    other = tiny_model_dirs["qwen3_tied_bf16"]  # another geometry
    cfg = _cfg(other)
    cfg["hidden_size"] = 96
    d = write_dflash_drafter(tmp_path / "d", target_config=cfg, num_layers=1, target_layer_ids=[0, 1], block_size=4)
    with pytest.raises(dflash.DFlashError, match=r"config\.json vs .*hidden_size"):
        dflash.Session(target, draft=d, num_threads=1)


def test_vocab_mismatch(tmp_path, target):
    d = _good(tmp_path, target)
    _edit_config(d, vocab_size=1000)
    with pytest.raises(dflash.DFlashError, match="vocab_size"):
        dflash.Session(target, draft=d, num_threads=1)


def test_mask_out_of_range(tmp_path, target):
    d = _good(tmp_path, target)
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["mask_token_id"] = 10_000
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(dflash.DFlashError, match="mask_token_id"):
        dflash.Session(target, draft=d, num_threads=1)


def test_layer_ids_out_of_range(tmp_path, target):
    d = _good(tmp_path, target)
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0, 7]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(dflash.DFlashError, match="target_layer_ids"):
        dflash.Session(target, draft=d, num_threads=1)


def test_fc_width_does_not_match_the_taps(tmp_path, target):
    d = _good(tmp_path, target)
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [0]  # fc was written for two taps
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(dflash.DFlashError, match=r"fc\.weight.*target layers"):
        dflash.Session(target, draft=d, num_threads=1)


def test_num_target_layers_mismatch(tmp_path, target):
    d = _good(tmp_path, target)
    _edit_config(d, num_target_layers=36)
    with pytest.raises(dflash.DFlashError, match="num_target_layers"):
        dflash.Session(target, draft=d, num_threads=1)


def test_wrong_architecture_and_missing_fields(tmp_path, target):
    d = _good(tmp_path, target)
    _edit_config(d, architectures=["LlamaForCausalLM"])
    with pytest.raises(dflash.DFlashError, match="DFlashDraftModel"):
        dflash.Session(target, draft=d, num_threads=1)
    d2 = write_dflash_drafter(tmp_path / "d2", target_config=_cfg(target), num_layers=1, target_layer_ids=[0, 1],
                              block_size=4)
    cfg = json.loads((d2 / "config.json").read_text())
    del cfg["dflash_config"]["mask_token_id"]
    (d2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(dflash.DFlashError, match="mask_token_id"):
        dflash.Session(target, draft=d2, num_threads=1)
    d3 = write_dflash_drafter(tmp_path / "d3", target_config=_cfg(target), num_layers=1, target_layer_ids=[0, 1],
                              block_size=4)
    _edit_config(d3, block_size=None)
    with pytest.raises(dflash.DFlashError, match="block_size"):
        dflash.Session(target, draft=d3, num_threads=1)


def test_missing_and_truncated_weights(tmp_path, target):
    d = _good(tmp_path, target)
    st = d / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2])
    with pytest.raises(dflash.DFlashError, match="model.safetensors"):
        dflash.Session(target, draft=d, num_threads=1)
    st.unlink()
    with pytest.raises(dflash.DFlashError, match="model.safetensors"):
        dflash.Session(target, draft=d, num_threads=1)


def test_missing_tensor(tmp_path, target):
    from safetensors.numpy import load_file, save_file

    d = _good(tmp_path, target)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["layers.0.self_attn.k_norm.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(dflash.DFlashError, match="layers.0.self_attn.k_norm.weight"):
        dflash.Session(target, draft=d, num_threads=1)


def test_caller_mistakes(tmp_path, target):
    d = _good(tmp_path, target)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        dflash.Session(target, draft=d, num_speculative_tokens=4, num_threads=1)  # block_size 4 → at most 3
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        dflash.Session(target, draft=d, num_speculative_tokens=0, num_threads=1)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        dflash.Session(target, num_speculative_tokens=2, num_threads=1)
    with pytest.raises(ValueError, match="draft model directory not found"):
        dflash.Session(target, draft=tmp_path / "nope", num_threads=1)
    plain = dflash.Session(target, num_threads=1)
    with pytest.raises(ValueError, match="draft model"):
        plain.propose([1, 2, 3])
    spec = dflash.Session(target, draft=d, num_threads=1)
    with pytest.raises(ValueError):
        spec.propose([])
    with pytest.raises(ValueError, match="vocabulary"):
        spec.propose([1, 10_000])
    # The session still works and holds no blocks.
    assert spec.generate([[5, 6, 7]], dflash.SamplingParams(max_tokens=3))[0].token_ids
    st = spec.stats()
    assert st["num_free_blocks"] == st["num_blocks"]

# tests/test_fixtures.py
#
# Smoke tests of the tiny-checkpoint writers in tests/fixtures/tiny_models.py:
# every preset loads in transformers, runs a forward pass, greedy-decodes a
# varied continuation, and was stored in the requested dtype / sharding.
from __future__ import annotations

import json
import pathlib
from typing import Any, Callable

import pytest
import torch

from tests.fixtures.tiny_models import (
    LLAMA3_ROPE_SCALING,
    PRESETS,
    SPECIAL_TOKENS,
    default_vocab_size,
    special_token_ids,
    train_tokenizer,
    write_tiny_model,
)

PROMPT_IDS: list[int] = [1, 42, 71, 279, 81, 3, 346, 294]
ALL_PRESETS = sorted(PRESETS)


def _config(model_dir: pathlib.Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text(encoding="utf-8"))


def _safetensors_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(model_dir.glob("*.safetensors"))


def _stored_tensors(model_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(model_dir):
        out.update(load_file(str(file)))
    return out


def _greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", ALL_PRESETS)
def test_preset_has_complete_checkpoint(tiny_model_dirs: dict[str, pathlib.Path], name: str) -> None:
    model_dir = tiny_model_dirs[name]
    for file in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / file).is_file(), file
    assert _safetensors_files(model_dir)
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert "<|im_start|>" in tok_cfg["chat_template"]


@pytest.mark.parametrize("name", ALL_PRESETS)
def test_preset_forward_and_greedy(
    tiny_model_dirs: dict[str, pathlib.Path], hf_model: Callable[[pathlib.Path], Any], name: str
) -> None:
    model = hf_model(tiny_model_dirs[name])
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT_IDS])).logits
    assert logits.shape == (1, len(PROMPT_IDS), model.config.vocab_size)
    assert torch.isfinite(logits).all()
    assert logits[0, -1].std() > 1.0, "logits should be far from uniform"
    tokens = _greedy(model, PROMPT_IDS, 10)
    assert len(tokens) == 10
    assert len(set(tokens)) >= 5, f"degenerate greedy continuation {tokens}"


def test_sharded_f16_files(tiny_model_dirs: dict[str, pathlib.Path]) -> None:
    model_dir = tiny_model_dirs["llama_sharded_f16"]
    shards = _safetensors_files(model_dir)
    assert len(shards) >= 2
    index = json.loads((model_dir / "model.safetensors.index.json").read_text(encoding="utf-8"))
    assert {pathlib.Path(p).name for p in index["weight_map"].values()} == {p.name for p in shards}
    tensors = _stored_tensors(model_dir)
    assert set(index["weight_map"]) == set(tensors)
    assert {t.dtype for t in tensors.values()} == {torch.float16}
    assert _config(model_dir)["dtype"] == "float16"


def test_bf16_tied_files(tiny_model_dirs: dict[str, pathlib.Path]) -> None:
    model_dir = tiny_model_dirs["qwen3_tied_bf16"]
    assert [p.name for p in _safetensors_files(model_dir)] == ["model.safetensors"]
    tensors = _stored_tensors(model_dir)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert "lm_head.weight" not in tensors
    assert _config(model_dir)["tie_word_embeddings"] is True


@pytest.mark.parametrize("name", ["llama_gqa", "llama_mha", "llama3_rope", "qwen3"])
def test_unsharded_f32_presets(tiny_model_dirs: dict[str, pathlib.Path], name: str) -> None:
    tensors = _stored_tensors(tiny_model_dirs[name])
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    assert "lm_head.weight" in tensors


def test_mqa_tied_has_no_lm_head(tiny_model_dirs: dict[str, pathlib.Path]) -> None:
    model_dir = tiny_model_dirs["llama_mqa_tied"]
    assert "lm_head.weight" not in _stored_tensors(model_dir)
    assert _config(model_dir)["num_key_value_heads"] == 1


def test_qwen3_head_dim_and_qk_norm(tiny_model_dirs: dict[str, pathlib.Path]) -> None:
    model_dir = tiny_model_dirs["qwen3"]
    cfg = _config(model_dir)
    assert cfg["head_dim"] == 32 != cfg["hidden_size"] // cfg["num_attention_heads"]
    tensors = _stored_tensors(model_dir)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert tensors["model.layers.0.self_attn.k_norm.weight"].shape == (32,)
    norm = tensors["model.layers.0.self_attn.q_norm.weight"]
    assert 0.5 < float(norm.mean()) < 1.5 and float(norm.std()) > 0.01


def test_rope_keys(tiny_model_dirs: dict[str, pathlib.Path]) -> None:
    """transformers 5 writes a single `rope_parameters` dict (no rope_theta/rope_scaling)."""
    for name in ALL_PRESETS:
        cfg = _config(tiny_model_dirs[name])
        assert "rope_theta" not in cfg and "rope_scaling" not in cfg, name
        assert "rope_theta" in cfg["rope_parameters"], name
    scaled = _config(tiny_model_dirs["llama3_rope"])["rope_parameters"]
    assert scaled == {**LLAMA3_ROPE_SCALING, "rope_theta": 500000.0}


def test_legacy_rope_keys_roundtrip(tmp_path: pathlib.Path) -> None:
    from transformers import AutoConfig

    model_dir = write_tiny_model(tmp_path / "m", num_layers=1, rope_scaling=LLAMA3_ROPE_SCALING, legacy_rope_keys=True)
    cfg = _config(model_dir)
    assert "rope_parameters" not in cfg
    assert cfg["rope_theta"] == 10000.0 and cfg["rope_scaling"]["rope_type"] == "llama3"
    loaded = AutoConfig.from_pretrained(model_dir).rope_parameters
    assert loaded == {**LLAMA3_ROPE_SCALING, "rope_theta": 10000.0}


def test_vocab_is_odd_and_larger_than_tokenizer(tiny_model_dirs: dict[str, pathlib.Path]) -> None:
    tok_size = train_tokenizer().get_vocab_size(with_added_tokens=True)
    assert 300 <= tok_size <= 400
    for name in ALL_PRESETS:
        vocab = _config(tiny_model_dirs[name])["vocab_size"]
        assert vocab == default_vocab_size(tok_size) and vocab % 2 == 1 and vocab > tok_size


def test_special_tokens_and_eos(tiny_model_dirs: dict[str, pathlib.Path]) -> None:
    ids = special_token_ids()
    assert set(ids) == set(SPECIAL_TOKENS)
    model_dir = tiny_model_dirs["llama_gqa"]
    gen = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
    assert gen["eos_token_id"] == ids["<|im_end|>"] == _config(model_dir)["eos_token_id"]


def test_tokenizer_training_is_deterministic() -> None:
    assert train_tokenizer().to_str() == train_tokenizer().to_str()


def test_writer_is_deterministic(tmp_path: pathlib.Path) -> None:
    first = _stored_tensors(write_tiny_model(tmp_path / "a", num_layers=1, seed=7))
    second = _stored_tensors(write_tiny_model(tmp_path / "b", num_layers=1, seed=7))
    other = _stored_tensors(write_tiny_model(tmp_path / "c", num_layers=1, seed=8))
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_presets_are_tiny() -> None:
    for name, spec in PRESETS.items():
        # hidden 128 admits head_dim 64 with two heads (the CUDA attention kernels' sizes).
        assert spec.get("hidden_size", 64) <= 128 and spec.get("num_layers", 2) <= 3, name

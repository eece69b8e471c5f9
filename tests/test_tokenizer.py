# tests/test_tokenizer.py
#
# dflash.tokenizer against transformers on the tiny fixture tokenizer:
# encode/decode parity, chat-template rendering, eos ids, add_bos handling,
# incremental decoding, and error types for broken files / bad input.
from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any, Callable

import pytest
from dflash.errors import DFlashError
from dflash.tokenizer import IncrementalDecoder, Tokenizer

from tests.fixtures.tiny_models import special_token_ids, write_tiny_model

SAMPLE_TEXTS: list[str] = [
    "Hello world",
    "Hello! How are you today?",
    " leading space and trailing space ",
    "The lighthouse keeper counted 112 steps; bread costs 3, cake 7.",
    "multiple\n\nnewlines\tand\ttabs   and  spaces",
    "unicode: café, naïve, Straße, 漢字, emoji 🙂🚀",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "text with <|endoftext|> inside",
    "",
    "a",
]

SYSTEM_CHAT: list[dict[str, str]] = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of a country?"},
    {"role": "assistant", "content": "It depends on the country."},
    {"role": "user", "content": "Where does the river begin?"},
]
SINGLE_TURN: list[dict[str, str]] = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def tok_dir(tiny_model_dirs: dict[str, pathlib.Path]) -> pathlib.Path:
    return tiny_model_dirs["qwen3"]


@pytest.fixture(scope="module")
def tok(tok_dir: pathlib.Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tok_dir)


@pytest.fixture(scope="module")
def ref(tok_dir: pathlib.Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def _copy_model_dir(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: pathlib.Path, edit: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    edit(data)
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


# -- encode / decode ----------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, ref: Any, text: str) -> None:
    assert tok.encode(text) == ref(text)["input_ids"]
    assert tok.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
def test_decode_matches_transformers(tok: Tokenizer, ref: Any, text: str) -> None:
    ids = ref(text)["input_ids"]
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)


def test_roundtrip_plain_text(tok: Tokenizer) -> None:
    for text in SAMPLE_TEXTS:
        if "<|" not in text:
            assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_single_ids(tok: Tokenizer) -> None:
    ids = special_token_ids()
    assert tok.encode("<|im_start|><|im_end|><|endoftext|>") == [
        ids["<|im_start|>"],
        ids["<|im_end|>"],
        ids["<|endoftext|>"],
    ]
    assert tok.decode([ids["<|im_end|>"]]) == ""
    assert tok.decode([ids["<|im_end|>"]], skip_special_tokens=False) == "<|im_end|>"


def test_decode_ignores_ids_beyond_tokenizer(tok: Tokenizer, ref: Any) -> None:
    # Tiny models have more embedding rows than tokenizer entries.
    ids = tok.encode("Hello") + [tok.vocab_size + 3] + tok.encode(" world")
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True) == "Hello world"


def test_vocab_and_special_ids(tok: Tokenizer, ref: Any) -> None:
    assert tok.vocab_size == len(ref)
    assert tok.bos_token_id == ref.bos_token_id
    assert tok.eos_token_id == ref.eos_token_id
    assert tok.pad_token_id == ref.pad_token_id
    assert tok.special_tokens == ref.special_tokens_map


# -- add_bos_token ------------------------------------------------------------


@pytest.mark.parametrize("add_bos", [True, False, None])
def test_config_add_bos_token_matches_transformers(tmp_path: pathlib.Path, add_bos: bool | None) -> None:
    """transformers 5 ignores tokenizer_config's add_bos_token when tokenizer.json exists."""
    from transformers import AutoTokenizer

    model_dir = write_tiny_model(tmp_path / "m", add_bos_token=add_bos, num_layers=1)
    tok = Tokenizer.from_model_dir(model_dir)
    ref = AutoTokenizer.from_pretrained(model_dir)
    for text in ("Hello world", ""):
        assert tok.encode(text) == ref(text)["input_ids"]
        assert tok.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]
    assert tok.encode("Hello")[0] != tok.bos_token_id


def _with_bos_post_processor(src: pathlib.Path, dst: pathlib.Path) -> tuple[pathlib.Path, int]:
    """Copy of a model dir whose tokenizer.json prepends <|endoftext|> (Llama-3 style)."""
    from tokenizers import processors

    model_dir = _copy_model_dir(src, dst)
    backend = Tokenizer.from_model_dir(model_dir).backend
    bos_id = backend.token_to_id("<|endoftext|>")
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A $B", special_tokens=[("<|endoftext|>", bos_id)]
    )
    backend.save(str(model_dir / "tokenizer.json"))
    return model_dir, bos_id


@pytest.mark.parametrize("config_add_bos", [None, False, True])
def test_post_processor_bos_matches_transformers(
    tmp_path: pathlib.Path, tok_dir: pathlib.Path, config_add_bos: bool | None
) -> None:
    from transformers import AutoTokenizer

    model_dir, bos_id = _with_bos_post_processor(tok_dir, tmp_path / "m")
    if config_add_bos is not None:
        _edit_json(model_dir / "tokenizer_config.json", lambda cfg: cfg.update(add_bos_token=config_add_bos))
    tok = Tokenizer.from_model_dir(model_dir)
    ref = AutoTokenizer.from_pretrained(model_dir)
    assert tok.encode("Hi")[0] == bos_id
    assert tok.encode("Hi") == ref("Hi")["input_ids"]
    assert tok.encode("Hi", add_special_tokens=False) == ref("Hi", add_special_tokens=False)["input_ids"]
    ref_chat = ref.apply_chat_template(SINGLE_TURN, add_generation_prompt=True, return_dict=False)
    assert tok.encode_chat(SINGLE_TURN) == list(ref_chat)


@pytest.mark.parametrize("add_bos", [True, False])
def test_add_bos_override_matches_transformers_kwarg(
    tmp_path: pathlib.Path, tok_dir: pathlib.Path, add_bos: bool
) -> None:
    from transformers import AutoTokenizer

    model_dir, bos_id = _with_bos_post_processor(tok_dir, tmp_path / "m")
    tok = Tokenizer.from_model_dir(model_dir, add_bos_token=add_bos)
    ref = AutoTokenizer.from_pretrained(model_dir, add_bos_token=add_bos)
    assert tok.encode("Hi") == ref("Hi")["input_ids"]
    assert (tok.encode("Hi")[0] == bos_id) is add_bos


# -- chat templates -----------------------------------------------------------


@pytest.mark.parametrize("messages", [SINGLE_TURN, SYSTEM_CHAT], ids=["single", "system_multi"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, ref: Any, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") is add_generation_prompt


def test_encode_chat_matches_transformers(tok: Tokenizer, ref: Any) -> None:
    ours = tok.encode_chat(SYSTEM_CHAT, add_generation_prompt=True)
    theirs = ref.apply_chat_template(SYSTEM_CHAT, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ours == list(theirs)


def test_template_features_match_transformers(tok: Tokenizer, ref: Any) -> None:
    """tojson without HTML escaping, loop controls, kwargs, special-token variables."""
    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{{ m | tojson }}|{% endfor %}{{ bos_token }}{{ eos_token }}{{ flavour | default('none') }}"
        "{% if add_generation_prompt %}GEN{% endif %}"
    )
    messages = [{"role": "user", "content": "<b>&'\"é"}] + SYSTEM_CHAT
    ours = tok.apply_chat_template(messages, chat_template=template, flavour="salty")
    theirs = ref.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True, flavour="salty"
    )
    assert ours == theirs
    assert '"<b>&\'\\"é"' in ours


def test_chat_template_from_jinja_file(tmp_path: pathlib.Path, tok_dir: pathlib.Path) -> None:
    model_dir = _copy_model_dir(tok_dir, tmp_path / "m")
    (model_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!", encoding="utf-8")
    assert Tokenizer.from_model_dir(model_dir).apply_chat_template(SINGLE_TURN) == "Hello!!"


def test_missing_chat_template_raises_value_error(tmp_path: pathlib.Path, tok_dir: pathlib.Path) -> None:
    model_dir = _copy_model_dir(tok_dir, tmp_path / "m")
    _edit_json(model_dir / "tokenizer_config.json", lambda cfg: cfg.pop("chat_template"))
    tok = Tokenizer.from_model_dir(model_dir)
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(SINGLE_TURN)


def test_template_raise_exception_is_value_error(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="Unsupported chat role"):
        tok.apply_chat_template([{"role": "wizard", "content": "abracadabra"}])


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [],
        ["hello"],
        [{"content": "no role"}],
        [{"role": "user"}],
        [{"role": 3, "content": "x"}],
        [{"role": "user", "content": 42}],
        {"role": "user", "content": "not a list"},
    ],
)
def test_bad_messages_raise_value_error(tok: Tokenizer, messages: Any) -> None:
    with pytest.raises(ValueError):
        tok.apply_chat_template(messages)


# -- eos ids ------------------------------------------------------------------


def test_eos_ids_default(tok: Tokenizer) -> None:
    assert tok.eos_token_ids == (special_token_ids()["<|im_end|>"],)


def test_eos_ids_union(tmp_path: pathlib.Path, tok_dir: pathlib.Path) -> None:
    ids = special_token_ids()
    model_dir = _copy_model_dir(tok_dir, tmp_path / "m")
    _edit_json(model_dir / "config.json", lambda cfg: cfg.update(eos_token_id=ids["<|endoftext|>"]))
    _edit_json(model_dir / "generation_config.json", lambda cfg: cfg.update(eos_token_id=[ids["<|im_end|>"], 77]))
    tok = Tokenizer.from_model_dir(model_dir)
    assert set(tok.eos_token_ids) == {ids["<|endoftext|>"], ids["<|im_end|>"], 77}
    assert len(tok.eos_token_ids) == 3


def test_eos_ids_from_list_in_fixture(tmp_path: pathlib.Path) -> None:
    ids = special_token_ids()
    wanted = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    model_dir = write_tiny_model(tmp_path / "m", num_layers=1, eos_token_id=wanted)
    assert list(Tokenizer.from_model_dir(model_dir).eos_token_ids) == wanted


def test_eos_ids_without_config_files(tmp_path: pathlib.Path, tok_dir: pathlib.Path) -> None:
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, model_dir / name)
    assert Tokenizer.from_model_dir(model_dir).eos_token_ids == (special_token_ids()["<|im_end|>"],)


# -- broken files -------------------------------------------------------------


def test_missing_tokenizer_json_raises(tmp_path: pathlib.Path, tok_dir: pathlib.Path) -> None:
    model_dir = _copy_model_dir(tok_dir, tmp_path / "m")
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(DFlashError, match="tokenizer.json"):
        Tokenizer.from_model_dir(model_dir)


@pytest.mark.parametrize("payload", ["{ not json", '{"model": {"type": "BPE", "vocab": 5}}', ""])
def test_corrupt_tokenizer_json_raises(tmp_path: pathlib.Path, tok_dir: pathlib.Path, payload: str) -> None:
    model_dir = _copy_model_dir(tok_dir, tmp_path / "m")
    (model_dir / "tokenizer.json").write_text(payload, encoding="utf-8")
    with pytest.raises(DFlashError, match=str(model_dir / "tokenizer.json").replace("\\", "\\\\")):
        Tokenizer.from_model_dir(model_dir)


def test_corrupt_tokenizer_config_raises(tmp_path: pathlib.Path, tok_dir: pathlib.Path) -> None:
    model_dir = _copy_model_dir(tok_dir, tmp_path / "m")
    (model_dir / "tokenizer_config.json").write_text("[1, 2", encoding="utf-8")
    with pytest.raises(DFlashError, match="tokenizer_config.json"):
        Tokenizer.from_model_dir(model_dir)


def test_missing_model_dir_raises(tmp_path: pathlib.Path) -> None:
    with pytest.raises(DFlashError):
        Tokenizer.from_model_dir(tmp_path / "does-not-exist")


def test_broken_chat_template_raises_dflash_error(tmp_path: pathlib.Path, tok_dir: pathlib.Path) -> None:
    model_dir = _copy_model_dir(tok_dir, tmp_path / "m")
    _edit_json(model_dir / "tokenizer_config.json", lambda cfg: cfg.update(chat_template="{% for %}"))
    with pytest.raises(DFlashError, match="chat template"):
        Tokenizer.from_model_dir(model_dir).apply_chat_template(SINGLE_TURN)


def test_dflash_error_is_runtime_error() -> None:
    assert issubclass(DFlashError, RuntimeError)


# -- incremental decoding -----------------------------------------------------


def _stream(decoder: IncrementalDecoder, ids: list[int]) -> list[str]:
    pieces = [decoder.push(i) for i in ids]
    pieces.append(decoder.finish())
    return pieces


@pytest.mark.parametrize("text", [t for t in SAMPLE_TEXTS if t])
def test_incremental_decoder_reassembles_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    decoder = tok.incremental_decoder()
    pieces = _stream(decoder, ids)
    assert "".join(pieces) == decoder.text == tok.decode(ids)
    assert all("\ufffd" not in piece for piece in pieces)


def test_incremental_decoder_holds_partial_utf8(tok: Tokenizer) -> None:
    ids = tok.encode("🙂")
    assert len(ids) > 1  # byte-level: the emoji spans several tokens
    decoder = tok.incremental_decoder()
    assert [decoder.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.push(ids[-1]) == "🙂"


def test_incremental_decoder_flushes_dangling_bytes(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🙂")[:-1]
    decoder = tok.incremental_decoder()
    streamed = "".join(decoder.push(i) for i in ids)
    assert streamed == "ok "
    assert decoder.finish() == tok.decode(ids)[len("ok ") :]

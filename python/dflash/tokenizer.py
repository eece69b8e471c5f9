# python/dflash/tokenizer.py
#
# Text side of the dflash runtime: tokenisation, detokenisation (including an
# incremental detokeniser for streaming / stop strings), chat templates and
# end-of-sequence ids.  Pure Python: depends on the `tokenizers` library and
# jinja2 only, never on the compiled dflash extension.
#
# Behaviour follows what transformers 5 does for a checkpoint whose
# tokenizer is loaded through its generic `tokenizer.json` backend:
#   * named special tokens from tokenizer_config.json (bos/eos/unk/...) are
#     registered as special added tokens;
#   * which special tokens `encode` adds is decided by tokenizer.json's
#     post-processor alone: transformers 5 drops `add_bos_token` /
#     `add_eos_token` from tokenizer_config.json whenever tokenizer.json
#     exists (they only take effect when passed explicitly, which
#     `Tokenizer.from_model_dir(add_bos_token=...)` mirrors);
#   * chat templates are rendered by a sandboxed jinja2 environment configured
#     like transformers' (trim_blocks, lstrip_blocks, loop controls,
#     raise_exception, strftime_now, a non-HTML-escaping tojson).
from __future__ import annotations

import datetime
import json
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .errors import DFlashError

__all__ = ["Tokenizer", "IncrementalDecoder", "CHAT_ROLES", "validate_chat_messages"]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# Named special-token attributes, in the order transformers lists them.
SPECIAL_TOKEN_KEYS: tuple[str, ...] = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_EXTRA_SPECIAL_KEYS: tuple[str, ...] = ("extra_special_tokens", "additional_special_tokens")
_REASONING_FIELDS: tuple[str, ...] = ("reasoning_content", "thinking", "reasoning")
_REPLACEMENT_CHAR = "\ufffd"
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# The message roles of chat templates (OpenAI's and Hugging Face's vocabulary). ChatML templates
# such as SmolLM2's render any role string verbatim, so a typo would reach the model silently.
CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool", "developer")


# ----------------------------------------------------------------------------
# File helpers
# ----------------------------------------------------------------------------


def _read_json(path: pathlib.Path) -> Any:
    """Parse a JSON model file; any failure is a broken model file.

    ValueError covers syntax errors, bytes that are not UTF-8 and integers beyond Python's digit
    limit; RecursionError is JSON nested past the interpreter's recursion limit.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError, RecursionError) as exc:
        raise DFlashError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None


def _read_json_optional(path: pathlib.Path) -> dict[str, Any]:
    """Like `_read_json` for an optional file holding a JSON object."""
    if not path.is_file():
        return {}
    data = _read_json(path)
    if not isinstance(data, dict):
        raise DFlashError(f"{path} does not hold a JSON object")
    return data


def _read_text_optional(path: pathlib.Path) -> str | None:
    if not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DFlashError(f"cannot read {path}: {exc}") from exc


def _load_backend(path: pathlib.Path) -> Any:
    """Load tokenizer.json with the `tokenizers` library."""
    from tokenizers import Tokenizer as BackendTokenizer

    if not path.is_file():
        raise DFlashError(
            f"missing {path}: dflash needs a Hugging Face fast-tokenizer file "
            f"({TOKENIZER_FILE}) in the model directory"
        )
    try:
        return BackendTokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception subclasses
        raise DFlashError(f"cannot parse {path}: {exc}") from exc


# ----------------------------------------------------------------------------
# Special tokens
# ----------------------------------------------------------------------------


def _token_content(value: Any, where: str) -> str | None:
    """Text of a special token given as a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    raise DFlashError(f"{where}: special token must be a string or an object with 'content', got {value!r}")


def _added_token(value: Any, where: str) -> Any:
    """An `AddedToken(special=True)` carrying the flags given in the config."""
    from tokenizers import AddedToken

    content = _token_content(value, where)
    flags: dict[str, bool] = {"normalized": False}
    if isinstance(value, Mapping):
        for key in ("lstrip", "rstrip", "single_word", "normalized"):
            if key in value:
                flags[key] = _bool_field(value[key], f"{where}: special token flag {key!r}")
    return AddedToken(content, special=True, **flags)


def _merged_special_config(tok_cfg: Mapping[str, Any], special_map: Mapping[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json entries, falling back to special_tokens_map.json."""
    merged = dict(tok_cfg)
    for key, value in special_map.items():
        if merged.get(key) is None:
            merged[key] = value
    return merged


def _named_special_tokens(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """{attribute: raw value} for bos/eos/... tokens that are set."""
    return {key: cfg[key] for key in SPECIAL_TOKEN_KEYS if cfg.get(key) is not None}


def _bool_field(value: Any, where: str) -> bool:
    """A boolean config value; any other type is a broken file, not a truthy default."""
    if not isinstance(value, bool):
        raise DFlashError(f"{where} must be true or false, got {value!r:.80}")
    return value


def _extra_special_tokens(cfg: Mapping[str, Any], where: str) -> list[Any]:
    for key in _EXTRA_SPECIAL_KEYS:
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, Mapping):
            return list(value.values())
        if isinstance(value, (list, tuple)):
            return list(value)
        raise DFlashError(f"{where}: {key} must be a list or an object, got {value!r:.80}")
    return []


def _register_special_tokens(backend: Any, raw_tokens: Iterable[Any], where: str) -> None:
    """Mark named special tokens as special added tokens, as transformers does."""
    tokens = [_added_token(value, where) for value in raw_tokens]
    if tokens:
        backend.add_special_tokens(tokens)


def _override_bos_eos(
    backend: Any, add_bos: bool | None, add_eos: bool | None, bos: str | None, eos: str | None
) -> None:
    """Replace the post-processor by one adding exactly the requested tokens.

    Same effect as passing `add_bos_token=` / `add_eos_token=` to transformers'
    `from_pretrained`; a no-op when neither is given.
    """
    from tokenizers import processors

    if add_bos is None and add_eos is None:
        return
    add_bos = bool(add_bos) and bos is not None
    add_eos = bool(add_eos) and eos is not None
    single = f"{bos}:0 " if add_bos else ""
    single += "$A:0"
    single += f" {eos}:0" if add_eos else ""
    pair = single + (f" {bos}:1" if add_bos else "") + " $B:1" + (f" {eos}:1" if add_eos else "")
    specials: list[tuple[str, int]] = []
    for flag, token in ((add_bos, bos), (add_eos, eos)):
        if flag and token is not None:
            specials.append((token, _require_id(backend, token)))
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _require_id(backend: Any, token: str) -> int:
    tid = backend.token_to_id(token)
    if tid is None:
        raise DFlashError(f"special token {token!r} is not in the tokenizer vocabulary")
    return int(tid)


# ----------------------------------------------------------------------------
# EOS ids
# ----------------------------------------------------------------------------


def _ids_from_field(value: Any, where: str) -> list[int]:
    """`eos_token_id` may be null, an int or a list of ints."""
    if value is None:
        return []
    if isinstance(value, bool):
        raise DFlashError(f"{where}: eos_token_id must be an integer or a list, got {value!r}")
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise DFlashError(f"{where}: eos_token_id must be an integer or a list of integers, got {value!r}")


def _collect_eos_ids(model_dir: pathlib.Path, backend: Any, eos_token: str | None) -> tuple[int, ...]:
    """Union (ordered, deduplicated) of config, generation config and tokenizer EOS."""
    ids: list[int] = []
    for name in (CONFIG_FILE, GENERATION_CONFIG_FILE):
        path = model_dir / name
        cfg = _read_json_optional(path)
        ids.extend(_ids_from_field(cfg.get("eos_token_id"), str(path)))
        text_cfg = cfg.get("text_config")
        if isinstance(text_cfg, Mapping):
            ids.extend(_ids_from_field(text_cfg.get("eos_token_id"), str(path)))
    if eos_token is not None:
        tid = backend.token_to_id(eos_token)
        if tid is not None:
            ids.append(int(tid))
    return tuple(dict.fromkeys(ids))


# ----------------------------------------------------------------------------
# Chat templates
# ----------------------------------------------------------------------------


def _templates_from_config(value: Any, where: str) -> dict[str, str]:
    """tokenizer_config `chat_template`: a string, or a list of {name, template}."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, Mapping):
        if not all(isinstance(v, str) for v in value.values()):
            raise DFlashError(f"{where}: chat_template must map names to template strings")
        return {str(k): v for k, v in value.items()}
    if isinstance(value, list):
        out: dict[str, str] = {}
        for item in value:
            if not (isinstance(item, Mapping) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template", ""), str)):
                raise DFlashError(f"{where}: malformed chat_template entry {item!r:.80}")
            out[item["name"]] = item.get("template", "")
        return out
    raise DFlashError(f"{where}: chat_template must be a string or a list, got {type(value).__name__}")


def _templates_from_files(model_dir: pathlib.Path) -> dict[str, str]:
    """chat_template.jinja and additional_chat_templates/*.jinja (transformers 5)."""
    out: dict[str, str] = {}
    main = _read_text_optional(model_dir / CHAT_TEMPLATE_FILE)
    if main is not None:
        out["default"] = main
    extra_dir = model_dir / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            out[file.stem] = _read_text_optional(file) or ""
    return out


def _load_chat_templates(model_dir: pathlib.Path, tok_cfg: Mapping[str, Any]) -> dict[str, str]:
    from_files = _templates_from_files(model_dir)
    if from_files:
        return from_files
    return _templates_from_config(tok_cfg.get("chat_template"), str(model_dir / TOKENIZER_CONFIG_FILE))


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON without jinja's HTML escaping (matches transformers' filter)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _generation_extension() -> type:
    """`{% generation %}...{% endgeneration %}` support; renders the body as-is."""
    import jinja2
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_render_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _render_body(self, caller: Any) -> str:
            return caller()

    return GenerationBlock


def _compile_template(source: str) -> Any:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_generation_extension(), "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise DFlashError(f"chat template does not compile: {exc}") from exc


def _plain(value: Any) -> Any:
    """Deep copy of template input restricted to plain JSON-like types."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _validate_messages(messages: Any) -> None:
    """A conversation is a non-empty list of dicts, each with role and content."""
    if not isinstance(messages, (list, tuple)) or isinstance(messages, str):
        raise ValueError(f"messages must be a list of dicts with 'role' and 'content', got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least one message")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{index}] must be a dict with 'role' and 'content', got {message!r}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{index}] needs a non-empty string 'role', got {role!r}")
        if "content" not in message:
            raise ValueError(f"messages[{index}] (role {role!r}) has no 'content'")
        content = message["content"]
        if content is None and not message.get("tool_calls"):
            raise ValueError(f"messages[{index}] (role {role!r}) has content None and no tool_calls")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(
                f"messages[{index}] (role {role!r}) content must be a string or a list of parts, "
                f"got {type(content).__name__}"
            )


def _check_roles(messages: Sequence[Mapping[str, Any]]) -> None:
    for index, message in enumerate(messages):
        role = message["role"]
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{index}] has role {role!r}, which is not a chat role; "
                             f"allowed roles: {', '.join(CHAT_ROLES)}")


def validate_chat_messages(messages: Any) -> None:
    """Raise ValueError unless `messages` is a conversation apply_chat_template accepts before
    rendering: a non-empty list of {"role", "content"} dicts with roles from CHAT_ROLES."""
    _validate_messages(messages)
    _check_roles(messages)


def _normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Drop None-valued keys and alias reasoning fields, as transformers 5 does."""
    out = {k: v for k, v in _plain(message).items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


# ----------------------------------------------------------------------------
# Decoding helpers
# ----------------------------------------------------------------------------


def _clean_up_tokenization(text: str) -> str:
    """The WordPiece-era space clean-up transformers applies when configured."""
    for old, new in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(old, new)
    return text


def _as_id_list(ids: Any) -> list[int]:
    if isinstance(ids, int) and not isinstance(ids, bool):
        return [ids]
    try:
        return [int(i) for i in ids]
    except (TypeError, ValueError) as exc:
        raise TypeError(f"token ids must be an int or an iterable of ints, got {type(ids).__name__}") from exc


# ----------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------


class Tokenizer:
    """Tokenizer, detokenizer and chat-template renderer for one model directory."""

    def __init__(
        self,
        backend: Any,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        clean_up_tokenization_spaces: bool = False,
        source: str | None = None,
    ) -> None:
        self._backend = backend
        self._special = dict(special_tokens or {})
        self._templates = dict(chat_templates or {})
        self._compiled: dict[str, Any] = {}
        self._eos_ids = tuple(int(i) for i in eos_token_ids)
        self._clean_up = bool(clean_up_tokenization_spaces) and self._model_type() != "BPE"
        self._source = source

    # -- construction -------------------------------------------------------

    @classmethod
    def from_model_dir(
        cls,
        path: str | pathlib.Path,
        *,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
    ) -> Tokenizer:
        """Load tokenizer.json + tokenizer_config.json (+ eos ids from configs).

        `add_bos_token` / `add_eos_token` override tokenizer.json's
        post-processor (None keeps it, as transformers does by default).
        """
        model_dir = pathlib.Path(path)
        if not model_dir.is_dir():
            raise DFlashError(f"model directory {model_dir} does not exist")
        backend = _load_backend(model_dir / TOKENIZER_FILE)
        cfg_path = model_dir / TOKENIZER_CONFIG_FILE
        tok_cfg = _read_json_optional(cfg_path)
        special_map = _read_json_optional(model_dir / SPECIAL_TOKENS_MAP_FILE)
        cfg = _merged_special_config(tok_cfg, special_map)
        named_raw = _named_special_tokens(cfg)
        _register_special_tokens(backend, [*named_raw.values(), *_extra_special_tokens(cfg, str(cfg_path))],
                                 str(cfg_path))
        named = {key: _token_content(value, str(cfg_path)) or "" for key, value in named_raw.items()}
        _override_bos_eos(backend, add_bos_token, add_eos_token, named.get("bos_token"), named.get("eos_token"))
        return cls(
            backend,
            special_tokens=named,
            chat_templates=_load_chat_templates(model_dir, tok_cfg),
            eos_token_ids=_collect_eos_ids(model_dir, backend, named.get("eos_token")),
            clean_up_tokenization_spaces=cfg.get("clean_up_tokenization_spaces") is not None
            and _bool_field(cfg["clean_up_tokenization_spaces"], f"{cfg_path}: clean_up_tokenization_spaces"),
            source=str(model_dir),
        )

    # -- vocabulary ---------------------------------------------------------

    @property
    def backend(self) -> Any:
        """The underlying `tokenizers.Tokenizer`."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        tid = self._backend.token_to_id(token)
        return None if tid is None else int(tid)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens, e.g. {"bos_token": "<s>", "eos_token": "</s>"}."""
        return dict(self._special)

    def _special_id(self, key: str) -> int | None:
        token = self._special.get(key)
        return None if token is None else self.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self._special.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """Id of the tokenizer's eos token (see `eos_token_ids` for the full set)."""
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: config.json, generation_config.json and
        the tokenizer's eos token, deduplicated, in that order."""
        return self._eos_ids

    def _model_type(self) -> str:
        return type(self._backend.model).__name__

    # -- encode / decode ----------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; same as transformers' `tokenizer(text)["input_ids"]`."""
        if not isinstance(text, str):
            raise TypeError(f"encode() expects a str, got {type(text).__name__}")
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int] | int, skip_special_tokens: bool = True) -> str:
        """Text for `ids`; ids unknown to the tokenizer (padded embedding rows) are dropped."""
        text = self._backend.decode(_as_id_list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A streaming detokenizer bound to this tokenizer."""
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    # -- chat templates -----------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The default chat template source, or None."""
        if len(self._templates) == 1:
            return next(iter(self._templates.values()))
        return self._templates.get("default")

    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    def _select_template(self, name: str | None, tools: Any) -> str:
        if not self._templates:
            where = f" in {self._source}" if self._source else ""
            raise ValueError(
                f"this tokenizer has no chat template{where} (looked for {CHAT_TEMPLATE_FILE} and "
                f"'chat_template' in {TOKENIZER_CONFIG_FILE}); format the prompt yourself or pass raw text"
            )
        if name is not None:
            if name not in self._templates:
                raise ValueError(f"no chat template named {name!r}; available: {sorted(self._templates)}")
            return name
        if len(self._templates) == 1:
            return next(iter(self._templates))
        if tools is not None and "tool_use" in self._templates:
            return "tool_use"
        if "default" in self._templates:
            return "default"
        raise ValueError(f"several chat templates and no default; pick one of {sorted(self._templates)}")

    def _compiled_source(self, source: str) -> Any:
        if source not in self._compiled:
            self._compiled[source] = _compile_template(source)
        return self._compiled[source]

    def _template_for(self, chat_template: str | None, tools: Any) -> Any:
        """Compiled template: a named model template, an inline source, or the default."""
        if chat_template is not None and chat_template not in self._templates:
            return self._compiled_source(chat_template)
        return self._compiled_source(self._templates[self._select_template(chat_template, tools)])

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` with the model's chat template (as a string).

        `chat_template` picks a named template of the model, or is itself a
        template source (as in transformers).  Extra keyword arguments become
        template variables (e.g. `enable_thinking=False`), overriding the
        special-token variables.  Roles outside CHAT_ROLES raise ValueError.
        """
        import jinja2

        _validate_messages(messages)
        reserved = _RESERVED_TEMPLATE_VARS.intersection(template_kwargs)
        if reserved:
            raise ValueError(f"template variables {sorted(reserved)} are set by apply_chat_template itself")
        template = self._template_for(chat_template, tools)
        variables: dict[str, Any] = {**self._special, **_plain(template_kwargs)}
        try:
            text = template.render(
                messages=[_normalize_message(m) for m in messages],
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=bool(add_generation_prompt),
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template rejected these messages: {exc}") from exc
        # After rendering: a template that checks roles itself has the first word (its message
        # is kept); one that renders any role (ChatML) is held to CHAT_ROLES here.
        _check_roles(messages)
        return text

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[int]:
        """Chat template rendered then encoded without extra special tokens
        (what transformers' `apply_chat_template(..., tokenize=True)` returns)."""
        text = self.apply_chat_template(messages, add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer(source={self._source!r}, vocab_size={self.vocab_size}, eos_token_ids={self._eos_ids})"


class IncrementalDecoder:
    """Turns a stream of token ids into a stream of text.

    `push(ids)` returns the text that became final with these ids.  Text is
    held back while the tail decodes to an incomplete UTF-8 sequence (the
    replacement character), so multi-byte characters split across tokens
    never appear half-decoded.  `text` is everything emitted so far, which is
    what stop strings should be searched in; `finish()` flushes the rest.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window re-decoded each step
        self._read = 0  # ids before this index have been emitted
        self._parts: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._parts)

    @property
    def num_pending_ids(self) -> int:
        """Ids pushed whose text is not in `text` yet (an incomplete character, or a skipped
        special token not yet followed by text)."""
        return len(self._ids) - self._read

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, ids: Iterable[int] | int) -> str:
        """Add token ids; return the newly completed text (maybe "")."""
        self._ids.extend(_as_id_list(ids))
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._parts.append(delta)
        return delta

    def finish(self) -> str:
        """Emit whatever is still held back (e.g. a dangling partial character)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self._prefix = self._read = len(self._ids)
        if delta:
            self._parts.append(delta)
        return delta

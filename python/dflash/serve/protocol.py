"""The OpenAI wire format of dflash serve: request bodies of /v1/chat/completions and
/v1/completions checked field by field into a GenerationRequest (a 400 naming the parameter for
anything wrong or unsupported), and the JSON of responses, stream chunks and usage."""

from __future__ import annotations

import math
import numbers
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from dflash.outputs import RequestMetrics
from dflash.params import SamplingParams
from dflash.serve.errors import APIError, bad_request

# Completions' default max_tokens in OpenAI's API; chat completions default to the room left in
# the context (resolved by the app once the prompt is tokenized).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

# Parameters of OpenAI's API this server does not implement: accepted only at their no-op value.
_UNSUPPORTED = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
    "best_of": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
    "function_call": (None, "none"), "audio": (None,), "prediction": (None,), "modalities": (None, ["text"]),
}


@dataclass
class GenerationRequest:
    """A checked request: the prompt (chat messages, a str, or token ids), the SamplingParams
    keywords (max_tokens None: the app's default), and the streaming options."""

    kind: str  # "chat" or "completion"
    prompt: Any
    sampling: Dict[str, Any] = field(default_factory=dict)
    max_tokens_param: str = "max_tokens"  # the name the client used (for errors)
    stream: bool = False
    include_usage: bool = False


# ---------------------------------------------------------------------------------------- fields
def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _optional(body: Dict[str, Any], name: str, check, what: str) -> Any:
    value = body.get(name)
    if value is not None and not check(value):
        raise bad_request(f"'{name}' must be {what}, got {value!r}", name)
    return value


def _check_model(body: Dict[str, Any], model_names: List[str]) -> None:
    model = body.get("model")
    if model is None:
        return  # the one model served
    if not isinstance(model, str):
        raise bad_request(f"'model' must be a string, got {model!r}", "model")
    if model not in model_names:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{model_names[0]}'",
                       param="model", code="model_not_found")


def _check_unsupported(body: Dict[str, Any]) -> None:
    for name, allowed in _UNSUPPORTED.items():
        if name in body and body[name] not in allowed:
            raise bad_request(f"'{name}' is not supported by this server (got {body[name]!r})", name,
                              code="unsupported_parameter")


def _sampling(body: Dict[str, Any], max_tokens_names: List[str]) -> Dict[str, Any]:
    n = _optional(body, "n", _is_int, "an integer")
    if n is not None and n != 1:
        raise bad_request(f"'n' must be 1: this server returns one choice per request (got {n})", "n")
    max_tokens, max_tokens_param = None, max_tokens_names[-1]
    for name in max_tokens_names:  # the first one given wins (max_completion_tokens for chat)
        value = _optional(body, name, _is_int, "an integer")
        if value is not None:
            max_tokens, max_tokens_param = value, name
            break
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str):
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request(f"'stop' must be a string or a list of strings, got {stop!r}", "stop")
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and (not isinstance(stop_token_ids, list)
                                       or not all(_is_int(t) for t in stop_token_ids)):
        raise bad_request(f"'stop_token_ids' must be a list of integers, got {stop_token_ids!r}", "stop_token_ids")
    sampling = {
        "max_tokens": max_tokens,
        "temperature": _optional(body, "temperature", _is_number, "a number"),
        "top_p": _optional(body, "top_p", _is_number, "a number"),
        "top_k": _optional(body, "top_k", _is_int, "an integer"),
        "seed": _optional(body, "seed", _is_int, "an integer"),
        "stop": stop or None,
        "stop_token_ids": stop_token_ids,
        "ignore_eos": _optional(body, "ignore_eos", lambda v: isinstance(v, bool), "true or false"),
    }
    for name in ("temperature", "top_p"):
        if sampling[name] is not None and not math.isfinite(sampling[name]):
            raise bad_request(f"'{name}' must be a finite number, got {sampling[name]!r}", name)
    sampling["_max_tokens_param"] = max_tokens_param
    return sampling


def _stream_options(body: Dict[str, Any]) -> tuple:
    stream = _optional(body, "stream", lambda v: isinstance(v, bool), "true or false") or False
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise bad_request(f"'stream_options' must be an object, got {options!r}", "stream_options")
    if not stream:
        raise bad_request("'stream_options' is only allowed with \"stream\": true", "stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad_request(f"'stream_options.include_usage' must be true or false, got {include!r}",
                          "stream_options.include_usage")
    return stream, include


def _message_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"{where}.content[{i}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                  f"are supported, got {kind!r}", f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{where}.content must be a string or a list of text parts, got {content!r}",
                      f"{where}.content")


def _messages(body: Dict[str, Any]) -> List[Dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object with 'role' and 'content', got {m!r}", where)
        role = m.get("role")
        if not isinstance(role, str):
            raise bad_request(f"{where}.role must be a string, got {role!r}", f"{where}.role")
        content = m.get("content")
        text = "" if content is None and role == "assistant" else _message_text(content, where)
        out.append({**m, "content": text})
    return out


def _completion_prompt(body: Dict[str, Any]) -> Any:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' is empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [int(t) for t in prompt]
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("'prompt' holds several prompts; this server takes one per request", "prompt")
    raise bad_request(f"'prompt' must be a string or a list of token ids, got {prompt!r}", "prompt")


def parse_chat_request(body: Dict[str, Any], model_names: List[str]) -> GenerationRequest:
    _check_model(body, model_names)
    _check_unsupported(body)
    messages = _messages(body)
    sampling = _sampling(body, ["max_completion_tokens", "max_tokens"])
    stream, include_usage = _stream_options(body)
    return GenerationRequest("chat", messages, sampling, sampling.pop("_max_tokens_param"), stream, include_usage)


def parse_completion_request(body: Dict[str, Any], model_names: List[str]) -> GenerationRequest:
    _check_model(body, model_names)
    _check_unsupported(body)
    prompt = _completion_prompt(body)
    sampling = _sampling(body, ["max_tokens"])
    stream, include_usage = _stream_options(body)
    return GenerationRequest("completion", prompt, sampling, sampling.pop("_max_tokens_param"), stream, include_usage)


# OpenAI's defaults where dflash's differ (temperature 1; dflash.SamplingParams defaults to greedy).
_OPENAI_DEFAULTS = {"temperature": 1.0}
_PARAM_OF_MESSAGE = re.compile(r"^(\w+) ")


def sampling_params(request: GenerationRequest, default_max_tokens: int) -> SamplingParams:
    """SamplingParams of a checked request; its ValueError becomes a 400 naming the parameter."""
    kwargs = {k: v for k, v in request.sampling.items() if v is not None}
    for name, value in _OPENAI_DEFAULTS.items():
        kwargs.setdefault(name, value)
    kwargs.setdefault("max_tokens", default_max_tokens)
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        match = _PARAM_OF_MESSAGE.match(str(e))
        param = match.group(1) if match and match.group(1) in kwargs else None
        if param == "max_tokens":
            param = request.max_tokens_param
        raise bad_request(str(e), param) from None


# ---------------------------------------------------------------------------------------- responses
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int, metrics: Optional[RequestMetrics],
          speculative: bool) -> Dict[str, Any]:
    """OpenAI usage (with prompt_tokens_details.cached_tokens: prompt tokens from the prefix cache),
    plus `speculative` (the request's acceptance metrics) when a drafter runs."""
    out: Dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if metrics is not None:  # OpenAI's field for prompt tokens served from the prefix cache
        out["prompt_tokens_details"] = {"cached_tokens": min(metrics.num_cached_tokens, prompt_tokens)}
    if speculative and metrics is not None:
        out["speculative"] = {
            "acceptance_length": metrics.acceptance_length,
            "accepted_per_position": list(metrics.accepted_per_position),
            "num_drafted": metrics.num_drafted,
            "num_accepted": metrics.num_accepted,
            "num_spec_steps": metrics.num_spec_steps,
        }
    else:
        out["speculative"] = None
    return out


def response_body(request: GenerationRequest, response_id: str, model: str, text: str,
                  finish_reason: str, usage_body: Dict[str, Any]) -> Dict[str, Any]:
    created = int(time.time())
    if request.kind == "chat":
        return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": finish_reason}],
                "usage": usage_body}
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage_body}


def chunk_body(request: GenerationRequest, response_id: str, created: int, model: str, *,
               text: Optional[str] = None, role: bool = False, finish_reason: Optional[str] = None,
               usage_body: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One stream chunk: a text delta (the first chat chunk also names the role), the last
    chunk's finish_reason, or (usage_body) the usage chunk, which has no choices."""
    if request.kind == "chat":
        obj = "chat.completion.chunk"
        delta: Dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        obj = "text_completion"
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    body = {"id": response_id, "object": obj, "created": created, "model": model,
            "choices": [] if usage_body is not None else [choice]}
    if request.include_usage:
        body["usage"] = usage_body
    return body

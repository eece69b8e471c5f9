"""What Session.generate returns (one RequestOutput per prompt, with its metrics) and what
Session.stream yields (StreamOutput items: text and token ids as they become final)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional


@dataclass
class RequestMetrics:
    """Per-request measurements. Times are seconds from the request's submission.

    With a draft model: acceptance_length is tau, the mean number of tokens emitted per
    draft-verify step (bonus token included); accepted_per_position[j] counts the steps whose
    draft j was accepted; num_drafted / num_accepted count draft tokens. num_cached_tokens: prompt
    tokens found in the prefix cache instead of computed; num_preemptions: times the request's KV
    blocks were taken back under memory pressure (it then recomputed them, with the same output).
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    time_to_first_token: float = 0.0
    decode_tokens_per_s: float = 0.0
    total_time: float = 0.0
    num_steps: int = 0
    acceptance_length: float = 0.0
    accepted_per_position: List[int] = field(default_factory=list)
    num_drafted: int = 0
    num_accepted: int = 0
    num_spec_steps: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """The result of one prompt.

    text: generated text (special tokens skipped, cut before a matched stop string).
    token_ids: generated token ids (including a final EOS / stop token when one ended it).
    finish_reason: "stop" (EOS, stop token or stop string) or "length" (max_tokens or
        max_model_len); "abort" for a request ended by Session.abort or Session.close; "error" when
        the logits of its next token held a NaN or an infinity (the text is what came before; no
        other request is affected).
    """

    prompt: Optional[str]
    prompt_token_ids: List[int]
    text: str
    token_ids: List[int]
    finish_reason: str
    metrics: RequestMetrics = field(default_factory=RequestMetrics)


@dataclass
class StreamOutput:
    """One item of Session.stream / Session.astream: the text and token ids of one request that
    became final since the previous item.

    request_id: the request (Session.abort takes it). text: new text (never half a multi-byte
    character; text that could start a stop string is held back until decided). token_ids: new
    token ids. The deltas of a stream concatenate to what generate() returns for the same request.
    finish_reason: None until the last item; then "stop", "length", "abort" (Session.abort,
    or the session closing) or "error" (non-finite logits), and metrics holds the request's metrics.
    """

    request_id: int
    text: str = ""
    token_ids: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    metrics: Optional[RequestMetrics] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def metrics_from_core(m: Any) -> RequestMetrics:
    """RequestMetrics from the C++ runtime's per-request metrics."""
    return RequestMetrics(
        prompt_tokens=m.prompt_tokens,
        generated_tokens=m.generated_tokens,
        time_to_first_token=m.time_to_first_token_s,
        decode_tokens_per_s=m.decode_tokens_per_s,
        total_time=m.total_time_s,
        num_steps=m.num_steps,
        acceptance_length=m.acceptance_length,
        accepted_per_position=list(m.accepted_per_position),
        num_drafted=m.num_drafted,
        num_accepted=m.num_accepted,
        num_spec_steps=m.num_spec_steps,
        num_cached_tokens=m.num_cached_tokens,
        num_preemptions=m.num_preemptions,
    )

"""What Session.generate returns: one RequestOutput per prompt, with its metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class RequestMetrics:
    """Per-request measurements. Times are seconds from the request's submission.

    With a draft model: acceptance_length is tau, the mean number of tokens emitted per
    draft-verify step (bonus token included); accepted_per_position[j] counts the steps whose
    draft j was accepted; num_drafted / num_accepted count draft tokens.
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


@dataclass
class RequestOutput:
    """The result of one prompt.

    text: generated text (special tokens skipped, cut before a matched stop string).
    token_ids: generated token ids (including a final EOS / stop token when one ended it).
    finish_reason: "stop" (EOS, stop token or stop string) or "length" (max_tokens or
        max_model_len).
    """

    prompt: Optional[str]
    prompt_token_ids: List[int]
    text: str
    token_ids: List[int]
    finish_reason: str
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

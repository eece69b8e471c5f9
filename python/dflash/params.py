"""SamplingParams: how one request is sampled and when it stops (validated on construction)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional, Sequence, Union


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of a request.

    max_tokens: new tokens at most (also capped by the session's max_model_len).
    temperature: 0 is greedy decoding; > 0 samples from softmax(logits / temperature).
    top_p: nucleus filter in (0, 1]; 1 disables it.  top_k: keep the k likeliest; 0 disables.
    seed: per-request seed; the same seed gives the same tokens alone or in a batch.
        None draws a fresh random seed.
    stop: a string or list of strings that end generation; the text stops before them.
    stop_token_ids: token ids that end generation (in addition to the model's EOS ids).
    ignore_eos: keep generating past the model's EOS ids (benchmarks; stop / stop_token_ids
        still apply).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: Optional[Union[str, Sequence[str]]] = None
    stop_token_ids: Optional[Sequence[int]] = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, numbers.Integral):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.temperature, numbers.Real) or isinstance(self.temperature, bool):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not isinstance(self.top_p, numbers.Real) or isinstance(self.top_p, bool):
            raise ValueError(f"top_p must be a number, got {self.top_p!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if self.top_k == -1:  # vLLM's spelling of "disabled"
            self.top_k = 0
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
                raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
            if not (0 <= self.seed < 2**64):
                raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if isinstance(self.stop, bytes) or not isinstance(self.stop, Iterable):
                raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
            self.stop = list(self.stop)
            for s in self.stop:
                if not isinstance(s, str) or not s:
                    raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        if self.stop_token_ids is not None:
            ids = self.stop_token_ids
            if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
                raise ValueError(f"stop_token_ids must be a list of token ids, got {ids!r}")
            ids = list(self.stop_token_ids)
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
                    raise ValueError(f"stop_token_ids must hold non-negative integers, got {t!r}")
            self.stop_token_ids = [int(t) for t in ids]

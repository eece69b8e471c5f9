"""TextStream: one request's generated token ids turned into final text as they arrive.

It detokenizes incrementally (a multi-byte character split across tokens is never emitted
half-decoded), finds stop strings across step boundaries, holds back text that could still be
the start of a stop string until that is decided, and says at the end which text and token ids
the request's output keeps. Session.generate and Session.stream share it, so the deltas of a
stream concatenate to generate()'s text and token ids."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple


class TextStream:
    """Text of one request, released piece by piece.

    push(new_token_ids) -> (text, token_ids) that became final with this step; finish(all ids of
    the finished request) -> the rest. After a stop string is found (`stopped`), the output ends
    before it: text up to the stop string, token ids up to the fewest tokens whose text contains
    it (a speculative step may emit tokens past it, which the output does not keep).

    incremental=False (generate() without stop strings) skips the per-step decoding: push()
    releases nothing and finish() decodes the whole output once. Not thread-safe: one thread
    pushes (the engine thread).
    """

    def __init__(self, tokenizer, stop: Optional[Sequence[str]] = None, *, incremental: bool = True) -> None:
        self._tokenizer = tokenizer
        self._stops: List[str] = list(stop or [])
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self._incremental = incremental or bool(self._stops)
        self._decoder = tokenizer.incremental_decoder(True)
        self._ids: List[int] = []
        self._text = ""  # everything the decoder has made final (the decoder's `text`)
        self._sent_chars = 0  # text released to the caller
        self._sent_tokens = 0  # token ids released to the caller
        self.stopped = False
        self._stop_text_end: Optional[int] = None
        self._stop_token_count: Optional[int] = None

    # ------------------------------------------------------------------ per step
    def push(self, token_ids: Sequence[int]) -> Tuple[str, List[int]]:
        """Adds one step's new tokens; returns the text and token ids released by them."""
        if self.stopped or not self._incremental or not token_ids:
            return "", []
        before = len(self._text)
        self._ids.extend(int(t) for t in token_ids)
        self._text += self._decoder.push(token_ids)
        if self._stops:
            start = max(0, before - self._longest_stop + 1)
            hits = [i for i in (self._text.find(s, start) for s in self._stops) if i >= 0]
            if hits:
                self.stopped = True
                self._stop_text_end = min(hits)
                self._stop_token_count = max(self._tokens_through_stop(start), self._sent_tokens)
                return self._release(self._stop_text_end, self._stop_token_count)
        safe_end = max(len(self._text) - self._stop_prefix_length(), self._sent_chars)
        num_tokens = self._sent_tokens
        if safe_end == len(self._text) and self._decoder.num_pending_ids == 0:
            num_tokens = len(self._ids)  # every token's text is out: their ids are final too
        return self._release(safe_end, num_tokens)

    def _release(self, text_end: int, num_tokens: int) -> Tuple[str, List[int]]:
        text = self._text[self._sent_chars:text_end]
        ids = self._ids[self._sent_tokens:num_tokens]
        self._sent_chars = max(self._sent_chars, text_end)
        self._sent_tokens = max(self._sent_tokens, num_tokens)
        return text, ids

    def _stop_prefix_length(self) -> int:
        """Length of the longest end of the text that is a proper prefix of a stop string: text
        that a later token could turn into a stop string, so it is not released yet."""
        text = self._text
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text) - self._sent_chars), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _tokens_through_stop(self, start: int) -> int:
        """The fewest generated tokens whose text contains a stop string (at or after `start`):
        a binary search over token prefixes (the decoder may have held text back over several
        steps, so the stop string can end inside an earlier step's tokens)."""
        ids = self._ids

        def contains(k: int) -> bool:
            text = self._tokenizer.decode(ids[:k], skip_special_tokens=True)
            return any(text.find(s, start) >= 0 for s in self._stops)

        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if contains(mid):
                hi = mid
            else:
                lo = mid + 1
        return hi

    # ------------------------------------------------------------------ at the end
    def final_token_ids(self, result_token_ids: Sequence[int]) -> List[int]:
        """The output's token ids: the request's, cut after a matched stop string."""
        ids = list(result_token_ids)
        if self.stopped:
            ids = ids[: self._stop_token_count]
        return ids

    def final_text(self, result_token_ids: Sequence[int]) -> str:
        """The output's text: cut before a matched stop string, else the whole output decoded."""
        if self.stopped:
            return self._text[: self._stop_text_end]
        return self._tokenizer.decode(list(result_token_ids), skip_special_tokens=True)

    def finish(self, result_token_ids: Sequence[int]) -> Tuple[str, List[int]]:
        """The text and token ids not released yet, given every token id of the finished request
        (held-back text, an incomplete character at the end, tokens of the last step)."""
        ids = self.final_token_ids(result_token_ids)
        text = self.final_text(result_token_ids)
        rest_text, rest_ids = text[self._sent_chars:], ids[self._sent_tokens:]
        self._sent_chars, self._sent_tokens = len(text), len(ids)
        return rest_text, rest_ids

# tests/test_text_stream.py
#
# TextStream, the text side of streaming: multi-byte characters split across tokens are never
# released half-decoded, stop strings are found across token and step boundaries, text that
# could still begin a stop string is held back until decided, and the output's text and token
# ids at the end are generate()'s. Pure Python over the tiny models' tokenizer.
from __future__ import annotations

import pytest

from dflash.text_stream import TextStream
from dflash.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dirs):
    return Tokenizer.from_model_dir(tiny_model_dirs["llama_gqa"])


def _run(tok, ids, stop=None, chunk=1):
    """Pushes `ids` `chunk` at a time; returns (deltas, final text, final ids, stream)."""
    ts = TextStream(tok, stop)
    deltas = []
    for i in range(0, len(ids), chunk):
        if ts.stopped:
            break
        deltas.append(ts.push(ids[i:i + chunk]))
    deltas.append(ts.finish(ids))
    return deltas, ts.final_text(ids), ts.final_token_ids(ids), ts


def _longest_stop_prefix_suffix(text, stops):
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def test_multibyte_characters_are_never_split(tok):
    text = "café 日本 naïve 😀 end"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the characters really span tokens
    deltas, final_text, final_ids, _ = _run(tok, ids)
    assert all("\ufffd" not in t for t, _ in deltas), deltas
    assert "".join(t for t, _ in deltas) == final_text == text
    assert sum((i for _, i in deltas), []) == final_ids == ids


def test_token_ids_are_released_with_their_text(tok):
    ids = tok.encode("日本", add_special_tokens=False)
    ts = TextStream(tok)
    assert ts.push(ids[:1]) == ("", [])  # a partial character: neither its text nor its id yet
    text, released = ts.push(ids[1:])
    rest_text, rest_ids = ts.finish(ids)
    assert text + rest_text == "日本" and released + rest_ids == ids


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_stop_string_across_tokens_and_steps(tok, chunk):
    text = "the lighthouse keeper woke before dawn"
    ids = tok.encode(text, add_special_tokens=False)
    stop = "house kee"
    pieces = [tok.decode(ids[:k]) for k in range(len(ids) + 1)]
    first_with_stop = next(k for k, p in enumerate(pieces) if stop in p)
    assert len(tok.decode(ids[first_with_stop - 1:first_with_stop])) < len(stop)  # it spans tokens
    deltas, final_text, final_ids, ts = _run(tok, ids, [stop, "never there"], chunk)
    assert ts.stopped
    assert "".join(t for t, _ in deltas) == final_text == "the light"
    assert sum((i for _, i in deltas), []) == final_ids == ids[:first_with_stop]


def test_text_that_may_start_a_stop_string_is_held_back(tok):
    text = "the keeper woke, the keeper slept"
    ids = tok.encode(text, add_special_tokens=False)
    stops = ["keeper!", "slept."]
    ts = TextStream(tok, stops)
    released = ""
    for k in range(1, len(ids) + 1):
        t, _ = ts.push(ids[k - 1:k])
        released += t
        so_far = tok.decode(ids[:k])
        assert released == so_far[:len(so_far) - _longest_stop_prefix_suffix(so_far, stops)], (k, released)
    assert ts.finish(ids)[0] == "slept"[-_longest_stop_prefix_suffix(text, stops):]
    assert not ts.stopped


def test_stop_string_with_multibyte_characters(tok):
    ids = tok.encode("a naïve café", add_special_tokens=False)
    deltas, final_text, final_ids, ts = _run(tok, ids, ["ïv"])
    assert ts.stopped and final_text == "a na" and "".join(t for t, _ in deltas) == "a na"
    assert "ïv" in tok.decode(final_ids) and "ïv" not in tok.decode(final_ids[:-1])


def test_not_incremental_decodes_once_at_the_end(tok):
    ids = tok.encode("the sea", add_special_tokens=False)
    ts = TextStream(tok, None, incremental=False)
    assert ts.push(ids) == ("", [])
    assert ts.finish(ids) == ("the sea", ids)

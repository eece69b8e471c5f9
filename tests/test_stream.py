# tests/test_stream.py
#
# Session.stream / Session.astream and the engine thread behind them: the deltas concatenate to
# generate()'s text and token ids (greedy and seeded sampling, stop strings split across tokens,
# multi-byte characters), abort frees the request's KV blocks, refused requests raise
# ValueError at submission, generate() from several threads at once, and the engine thread
# stops on close(), when the Session is collected, and at interpreter exit.
from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import threading

import pytest

import dflash
from dflash import SamplingParams
from tests.runtime_helpers import assert_no_leaks

CHAT = [{"role": "user", "content": "Why is the sea blue?"}]


@pytest.fixture(scope="module")
def sess(tiny_model_dirs):
    with dflash.Session(tiny_model_dirs["llama_gqa"], device="cpu", num_threads=2) as s:
        yield s


def _joined(items):
    return "".join(i.text for i in items), sum((i.token_ids for i in items), [])


def _check_items(items):
    assert items and items[-1].finished and items[-1].metrics is not None
    assert all(not i.finished for i in items[:-1])
    assert len({i.request_id for i in items}) == 1


@pytest.mark.parametrize("prompt", ["the sea", [5, 17, 42, 99], CHAT], ids=["text", "token_ids", "chat"])
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=40, stop_token_ids=[]),
                                    SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=7)],
                         ids=["greedy", "seeded"])
def test_stream_deltas_concatenate_to_generate(sess, prompt, params):
    want = sess.generate([prompt], params)[0]
    items = list(sess.stream(prompt, params))
    _check_items(items)
    assert _joined(items) == (want.text, want.token_ids)
    assert items[-1].finish_reason == want.finish_reason
    assert items[-1].metrics.prompt_tokens == len(want.prompt_token_ids)
    assert len(items) > 2  # it really came in pieces
    assert_no_leaks(sess)


def test_stop_string_split_across_tokens(sess):
    params = SamplingParams(max_tokens=60, stop_token_ids=[])
    free = sess.generate("the", params)[0]
    tok = sess.tokenizer
    pieces = [tok.decode(free.token_ids[:k]) for k in range(len(free.token_ids) + 1)]
    # A stop string of plain characters that starts in one token and ends in a later one.
    stop = None
    for k in range(2, len(pieces)):
        start = len(pieces[k - 1]) - 1
        candidate = pieces[k][start:start + 3]
        if len(candidate) == 3 and candidate.isascii() and candidate.isprintable() and \
                pieces[k - 1][start:] == candidate[:1] and free.text.find(candidate) == start:
            stop = candidate
            break
    assert stop, free.text
    stopped = SamplingParams(max_tokens=60, stop_token_ids=[], stop=[stop])
    want = sess.generate("the", stopped)[0]
    assert want.finish_reason == "stop" and want.text == free.text[:free.text.find(stop)]
    items = list(sess.stream("the", stopped))
    _check_items(items)
    assert _joined(items) == (want.text, want.token_ids)
    assert items[-1].finish_reason == "stop"
    assert all(stop not in i.text for i in items)
    assert_no_leaks(sess)


def test_multibyte_characters_are_never_split(sess):
    text = "café 日本 naïve 😀!"
    forced = sess.tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(forced), ignore_eos=True, stop_token_ids=[])

    def force(req):
        req.forced_tokens = forced

    items = list(sess._stream("the", params, request_hooks=force))
    _check_items(items)
    assert _joined(items) == (text, forced)
    assert all("\ufffd" not in i.text for i in items), [i.text for i in items]
    assert sess._generate("the", params, request_hooks=force)[0].text == text


def test_astream_matches_generate_concurrently(sess):
    prompts = ["the sea", "a river runs", CHAT, [7, 8, 9]]  # one prompt each, as stream() takes them
    params = SamplingParams(max_tokens=30, stop_token_ids=[])
    want = [(o.text, o.token_ids) for o in sess.generate(prompts, params)]

    async def read(prompt):
        stream = sess.astream(prompt, params)
        assert isinstance(await stream.started(), int)
        return [item async for item in stream]

    async def main():
        return await asyncio.gather(*(read(p) for p in prompts))

    got = asyncio.run(main())
    for items, expected in zip(got, want):
        _check_items(items)
        assert _joined(items) == expected
    assert_no_leaks(sess)


def test_astream_merges_what_queued_behind_a_slow_consumer(sess):
    """A consumer that blocks its event loop while the engine runs finds the queued steps merged
    into fewer items, which still concatenate to generate()'s output."""
    import time

    params = SamplingParams(max_tokens=24, stop_token_ids=[])
    want = sess.generate(["the sea"], params)[0]

    async def main():
        stream = sess.astream("the sea", params)
        first = await stream.__anext__()
        time.sleep(0.5)  # the engine finishes the request meanwhile: the rest is queued
        return [first] + [item async for item in stream]

    items = asyncio.run(main())
    _check_items(items)
    assert _joined(items) == (want.text, want.token_ids)
    # On a fast machine the engine may finish before the first item is taken, so the first
    # item can already hold everything; unmerged there would be one item per decode step.
    assert len(items) <= 2, [len(i.token_ids) for i in items]
    assert items[-1].finish_reason is not None


def test_abort_frees_the_blocks(sess):
    params = SamplingParams(max_tokens=400, ignore_eos=True, stop_token_ids=[])
    stream = sess.stream("the sea", params)
    first = next(stream)
    assert first.request_id == stream.request_id and not first.finished
    assert sess.abort(stream.request_id) is True
    st = sess.stats()
    assert st["num_free_blocks"] == st["num_blocks"]  # freed when abort() returns
    rest = list(stream)
    assert rest[-1].finish_reason == "abort" and len(_joined([first] + rest)[1]) < 400
    assert sess.abort(stream.request_id) is False
    with sess.stream("the sea", params) as s2:  # leaving the block aborts it
        next(s2)
    assert_no_leaks(sess)
    with pytest.raises(ValueError, match="request_id"):
        sess.abort("1")


def test_astream_aclose_frees_the_blocks(sess):
    params = SamplingParams(max_tokens=400, ignore_eos=True, stop_token_ids=[])

    async def main():
        async with sess.astream("the sea", params) as stream:
            async for item in stream:
                assert not item.finished
                break
        stream2 = sess.astream("the sea", params)
        await stream2.__anext__()
        assert await stream2.abort() is True
        assert [i async for i in stream2][-1].finish_reason == "abort"

    asyncio.run(main())
    # aclose() does not wait for the engine; the next generate() runs after the abort.
    sess.generate("x", SamplingParams(max_tokens=2))
    assert_no_leaks(sess)


def test_refused_request_raises_at_submission(sess):
    too_long = [5] * (sess.stats()["max_model_len"] + 1)
    with pytest.raises(ValueError, match="max_model_len"):
        sess.stream(too_long)

    async def main():
        stream = sess.astream(too_long)
        with pytest.raises(ValueError, match="max_model_len"):
            await stream.started()
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()

    asyncio.run(main())
    with pytest.raises(ValueError, match="params must be a SamplingParams"):
        sess.stream("x", [SamplingParams()])
    with pytest.raises(RuntimeError):  # astream outside an event loop
        sess.astream("x")
    assert_no_leaks(sess)


def test_generate_from_several_threads_at_once(sess):
    prompts = [["the sea", "a b"], ["river"], [[3, 4, 5], CHAT], ["the lighthouse keeper"]]
    params = SamplingParams(max_tokens=25, stop_token_ids=[])
    want = [[(o.text, o.token_ids) for o in sess.generate(p, params)] for p in prompts]
    got = [None] * len(prompts)

    def run(i):
        got[i] = [(o.text, o.token_ids) for o in sess.generate(prompts[i], params)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want
    assert_no_leaks(sess)


def test_interrupted_generate_leaves_nothing_behind(sess):
    params = [SamplingParams(max_tokens=2, ignore_eos=True)] + [SamplingParams(max_tokens=400, ignore_eos=True)] * 3

    def interrupt(index, out):  # Ctrl-C while generate() waits for the other requests
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sess._generate(["a", "b", "c", "d"], params, on_finish=interrupt)
    assert_no_leaks(sess)
    assert sess.generate("a", SamplingParams(max_tokens=3, ignore_eos=True))[0].finish_reason == "length"


def _engine_threads():
    return [t for t in threading.enumerate() if t.name == "dflash-engine"]


def test_close_stops_the_engine_thread(tiny_model_dirs):
    before = len(_engine_threads())
    s = dflash.Session(tiny_model_dirs["llama_gqa"], device="cpu", num_threads=1)
    stream = s.stream("the sea", SamplingParams(max_tokens=400, ignore_eos=True))
    next(stream)
    thread = s._loop.thread
    assert thread.is_alive() and len(_engine_threads()) == before + 1
    s.close()
    assert not thread.is_alive() and len(_engine_threads()) == before
    assert s.closed and list(stream)[-1].finish_reason == "abort"  # a running request ends as aborted
    st = s.stats()
    assert st["num_free_blocks"] == st["num_blocks"]
    with pytest.raises(ValueError, match="closed"):
        s.generate("x")
    with pytest.raises(ValueError, match="closed"):
        s.stream("x")
    assert s.abort(stream.request_id) is False
    s.close()  # idempotent
    with dflash.Session(tiny_model_dirs["llama_gqa"], device="cpu", num_threads=1) as s2:
        s2.generate("x", SamplingParams(max_tokens=2))
        thread2 = s2._loop.thread
    assert not thread2.is_alive()


def test_collected_session_stops_its_thread(tiny_model_dirs):
    s = dflash.Session(tiny_model_dirs["llama_gqa"], device="cpu", num_threads=1)
    list(s.stream("the sea", SamplingParams(max_tokens=5)))
    thread = s._loop.thread
    del s
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_engine_thread_stops_at_interpreter_exit(tiny_model_dirs):
    script = (
        "import dflash\n"
        f"s = dflash.Session({str(tiny_model_dirs['llama_gqa'])!r}, device='cpu', num_threads=1)\n"
        "st = s.stream('the sea', dflash.SamplingParams(max_tokens=400, ignore_eos=True))\n"
        "next(st)\n"
        "print('streaming', flush=True)\n"  # exits with the request running and the session open
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "streaming"
    assert "Fatal" not in r.stderr and "Traceback" not in r.stderr, r.stderr

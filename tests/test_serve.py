# tests/test_serve.py
#
# `dflash serve` through the real `openai` client (and httpx / a raw socket where the client
# cannot say it): streamed output equals non-streamed output for greedy decoding (chat and
# completions) and Session.generate's; 8 concurrent streams; stop strings across deltas; a
# client that disconnects (streaming or not) has its request aborted and its KV blocks freed;
# every kind of bad request gets its OpenAI-style 4xx; /metrics; a drafter's acceptance metrics
# in usage and /metrics; and the `dflash serve` command itself.
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest

import dflash
from dflash import SamplingParams
from tests.serve_helpers import (LONG_CONTEXT, all_blocks_free, free_port, metric, metrics, running_server,
                                 wait_until)

API_KEY = "test-key"
MAX_BODY = 64 * 1024
MODEL = "tiny"
CHAT = [{"role": "user", "content": "Why is the sea blue?"}]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def long_model(long_context_model):
    return long_context_model


@pytest.fixture(scope="module")
def session(long_model):
    with dflash.Session(long_model, device="cpu", num_threads=1, max_model_len=LONG_CONTEXT,
                        kv_cache_tokens=4 * LONG_CONTEXT) as s:
        yield s


@pytest.fixture(scope="module")
def server(session):
    from dflash.serve import build_app

    app = build_app(session, model_name=MODEL, api_key=API_KEY, max_body_bytes=MAX_BODY)
    with running_server(app) as url:
        yield url


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def _chat_text(chunks):
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _completion_text(chunks):
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_models_health_and_metrics_need_no_key(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.get(f"{server}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert httpx.get(f"{server}/metrics").status_code == 200


def test_usage_reports_prefix_cache_hits(client):
    long_chat = [{"role": "user", "content": "Why is the sea blue? Explain it to a child. " * 6}]
    first = client.chat.completions.create(model=MODEL, messages=long_chat, max_tokens=3, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=long_chat, max_tokens=3, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens > 32 and 0 < cached < again.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens <= cached


def test_chat_streaming_equals_non_streaming(client, session):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0)
    want = session.generate([CHAT], SamplingParams(max_tokens=40))[0]
    assert full.choices[0].message.content == want.text and full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == want.finish_reason
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (len(want.prompt_token_ids),
                                                                         len(want.token_ids))
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert full.usage.model_extra["speculative"] is None  # no drafter on this server
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert _chat_text(chunks) == want.text
    # In one or more pieces: steps the server had not sent yet when the next came are merged
    # (AsyncRequestStream), and this tiny model can finish before the first chunk is written.
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 1
    assert chunks[-2].choices[0].finish_reason == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("prompt", ["the sea", [5, 17, 42, 99]], ids=["text", "token_ids"])
def test_completions_streaming_equals_non_streaming(client, session, prompt):
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0)
    want = session.generate([prompt], SamplingParams(max_tokens=30))[0]
    assert full.choices[0].text == want.text and full.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stream=True))
    assert _completion_text(chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_eight_concurrent_streams(server, client, session):
    prompts = [f"the {w}" for w in ("sea", "river", "baker", "storm", "school", "lighthouse", "apples", "boats")]
    want = [session.generate(p, SamplingParams(max_tokens=48, stop_token_ids=[]))[0].text for p in prompts]
    got = [None] * len(prompts)
    errors = []
    start = threading.Barrier(len(prompts))

    def run(i):
        try:
            start.wait()
            stream = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=48, temperature=0,
                                               stream=True, extra_body={"stop_token_ids": []})
            got[i] = _completion_text(list(stream))
        except Exception as e:  # reported below, with the thread's prompt
            errors.append((i, e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert got == want
    wait_until(lambda: all_blocks_free(server), what="every KV block free")


def test_stop_strings_across_deltas(client, session):
    # The engine's deltas, one per step (the blocking stream merges nothing; the server may merge
    # steps it had not sent yet), and a stop string that starts at the end of one and ends in the next.
    free_chunks = [item.text for item in session.stream("the", SamplingParams(max_tokens=60, stop_token_ids=[]))]
    full = "".join(free_chunks)
    assert full == "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="the", max_tokens=60, temperature=0, stream=True, extra_body={"stop_token_ids": []}))
    stop, offset = None, 0
    for i in range(len(free_chunks) - 1):
        offset += len(free_chunks[i])
        candidate = full[offset - 1:offset + 2]
        if len(candidate) == 3 and candidate.isascii() and candidate.isprintable() and full.find(candidate) == offset - 1:
            stop = candidate
            break
    assert stop, free_chunks
    want = session.generate("the", SamplingParams(max_tokens=60, stop_token_ids=[], stop=[stop]))[0]
    assert want.text == full[:full.find(stop)] and want.finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt="the", max_tokens=60, temperature=0, stream=True,
                                            stop=[stop, "\x00never"], extra_body={"stop_token_ids": []}))
    assert _completion_text(chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(stop not in c.choices[0].text for c in chunks)
    plain = client.completions.create(model=MODEL, prompt="the", max_tokens=60, temperature=0, stop=stop,
                                      extra_body={"stop_token_ids": []})
    assert plain.choices[0].text == want.text and plain.usage.completion_tokens == len(want.token_ids)


def _aborts(server):
    return metric(server, 'dflash_requests_finished_total{finish_reason="abort"}', default=0.0)


def test_disconnected_stream_is_aborted(server, client):
    before = _aborts(server)
    stream = client.completions.create(model=MODEL, prompt="the", max_tokens=LONG_CONTEXT - 100, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)
    assert not all_blocks_free(server)  # the request holds its blocks while it runs
    stream.close()  # the client goes away mid-stream
    wait_until(lambda: all_blocks_free(server), what="the disconnected request's blocks to be freed")
    assert _aborts(server) == before + 1


def test_disconnected_plain_request_is_aborted(server):
    before = _aborts(server)
    closed_before = metric(server, 'dflash_requests_total{endpoint="/v1/completions",status="499"}', default=0.0)
    body = json.dumps({"model": MODEL, "prompt": "the", "max_tokens": LONG_CONTEXT - 100, "ignore_eos": True})
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                      f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
        wait_until(lambda: not all_blocks_free(server), what="the request to start")
    wait_until(lambda: all_blocks_free(server), what="the disconnected request's blocks to be freed")
    assert _aborts(server) == before + 1
    wait_until(lambda: metric(server, 'dflash_requests_total{endpoint="/v1/completions",status="499"}',
                              default=0.0) == closed_before + 1, what="the 499 to be counted")


LONG_PROMPT = [5] * (LONG_CONTEXT + 10)
BAD_REQUESTS = [
    # (id, path, body (bytes: sent as is), status, param, code)
    ("bad_json", "/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, None, "invalid_json"),
    ("deeply_nested_json", "/v1/completions", b'{"prompt": "x", "stop": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
     400, None, "invalid_json"),
    ("integer_past_digit_limit", "/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400,
     None, "invalid_json"),
    ("non_utf8_body", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None, "invalid_json"),
    ("empty_body", "/v1/completions", b"", 400, None, None),
    ("not_an_object", "/v1/completions", [1, 2], 400, None, None),
    ("unknown_model", "/v1/chat/completions", {"model": "gpt-9", "messages": CHAT}, 404, "model", "model_not_found"),
    ("negative_max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens", None),
    ("zero_max_completion_tokens", "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens", None),
    ("fractional_max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", None),
    ("negative_temperature", "/v1/chat/completions", {"messages": CHAT, "temperature": -0.5}, 400, "temperature", None),
    ("text_temperature", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ("top_p_above_one", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", None),
    ("negative_top_k", "/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k", None),
    ("negative_seed", "/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed", None),
    ("n_above_one", "/v1/chat/completions", {"messages": CHAT, "n": 2}, 400, "n", None),
    ("too_long_prompt", "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 4}, 400, "prompt",
     "context_length_exceeded"),
    ("too_long_chat", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "the sea " * 6000}], "max_tokens": 4}, 400, "messages",
     "context_length_exceeded"),
    ("token_outside_vocab", "/v1/completions", {"prompt": [1, 99999]}, 400, "prompt", None),
    ("several_prompts", "/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", None),
    ("empty_prompt", "/v1/completions", {"prompt": ""}, 400, "prompt", None),
    ("no_messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages", None),
    ("unknown_role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages",
     None),
    ("image_content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content", None),
    ("stop_not_a_string", "/v1/completions", {"prompt": "x", "stop": 7}, 400, "stop", None),
    ("empty_stop_string", "/v1/completions", {"prompt": "x", "stop": ["a", ""]}, 400, "stop", None),
    ("stream_options_without_stream", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     400, "stream_options", None),
    ("logprobs", "/v1/chat/completions", {"messages": CHAT, "logprobs": True}, 400, "logprobs",
     "unsupported_parameter"),
    ("stream_not_bool", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", None),
]


@pytest.mark.parametrize("path,body,status,param,code", [c[1:] for c in BAD_REQUESTS],
                         ids=[c[0] for c in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(server, path, body, status, param, code):
    for stream in (False, True):  # the same error whether or not the client asked for a stream
        if isinstance(body, dict) and "stream" not in body and "stream_options" not in body:
            sent = {**body, "stream": stream}
        elif stream:
            continue
        else:
            sent = body
        content = sent if isinstance(sent, bytes) else json.dumps(sent).encode()
        r = httpx.post(f"{server}{path}", content=content, headers={**HEADERS, "Content-Type": "application/json"},
                       timeout=60)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        assert error["type"] == "invalid_request_error"
        assert (error["param"], error["code"]) == (param, code), error
    assert all_blocks_free(server)


def test_openai_client_sees_the_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, n=2)
    assert e.value.status_code == 400 and e.value.param == "n"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=CHAT, max_tokens=2)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1, stream=True)
    assert e.value.param == "max_tokens"


def test_api_key_is_required(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{server}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/v1/models").status_code == 401
    with openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert httpx.post(f"{server}/v1/completions", json=body, headers=HEADERS).status_code == 200


def test_body_too_large(server):
    body = json.dumps({"model": MODEL, "prompt": "x" * MAX_BODY, "max_tokens": 2}).encode()
    r = httpx.post(f"{server}/v1/completions", content=body, headers={**HEADERS, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit is counted as the body arrives
        for i in range(0, len(body), 4096):
            yield body[i:i + 4096]

    r = httpx.post(f"{server}/v1/completions", content=chunked(), headers={**HEADERS,
                                                                           "Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    small = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
    assert httpx.post(f"{server}/v1/completions", content=small, headers=HEADERS).status_code == 200


def test_unknown_routes_and_methods(server):
    r = httpx.get(f"{server}/v1/nothing", headers=HEADERS)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{server}/v1/completions", headers=HEADERS)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_metrics(server, client):
    before = metrics(server)
    client.completions.create(model=MODEL, prompt="the sea", max_tokens=12, temperature=0)
    list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    after = metrics(server)

    def grew(key, by=1):
        assert after.get(key, 0) - before.get(key, 0) >= by, (key, before.get(key), after.get(key))

    grew('dflash_requests_total{endpoint="/v1/completions",status="200"}')
    grew('dflash_requests_total{endpoint="/v1/chat/completions",status="200"}')
    grew('dflash_requests_total{endpoint="/v1/completions",status="400"}')
    grew("dflash_prompt_tokens_total", 2)
    grew("dflash_generation_tokens_total", 2)
    grew("dflash_time_to_first_token_seconds_count", 2)
    # One observation per streamed piece after the first: none when a request comes in one piece
    # (steps the server had not sent yet are merged, and this tiny model can outrun it).
    assert after["dflash_inter_token_latency_seconds_count"] >= before.get("dflash_inter_token_latency_seconds_count", 0)
    grew("dflash_e2e_request_latency_seconds_count", 2)
    assert after["dflash_num_requests_running"] == 0 and after["dflash_num_requests_waiting"] == 0
    assert after["dflash_kv_cache_usage_ratio"] == 0 and after["dflash_kv_cache_blocks"] > 0
    assert not any(k.startswith("dflash_spec_decode") for k in after)  # no drafter here


def test_drafter_acceptance_in_usage_and_metrics(long_model, tmp_path, session):
    from dflash.drafter_format import write_dflash_drafter
    from dflash.serve import build_app

    cfg = json.loads((long_model / "config.json").read_text())
    draft = write_dflash_drafter(tmp_path / "draft", target_config=cfg, block_size=4)
    with dflash.Session(long_model, draft=draft, device="cpu", num_threads=1, max_model_len=1024,
                        kv_cache_tokens=8192) as spec:
        with running_server(build_app(spec)) as url, openai.OpenAI(base_url=f"{url}/v1", api_key="none",
                                                                   max_retries=0) as c:
            name = c.models.list().data[0].id
            assert name == long_model.name
            full = c.completions.create(model=name, prompt="the sea", max_tokens=30, temperature=0)
            target_only = session.generate("the sea", SamplingParams(max_tokens=30))[0]
            assert full.choices[0].text == target_only.text  # lossless
            extra = full.usage.model_extra["speculative"]
            assert extra["num_spec_steps"] > 0 and extra["acceptance_length"] >= 1
            assert len(extra["accepted_per_position"]) == 3 and extra["num_drafted"] == 3 * extra["num_spec_steps"]
            chunks = list(c.completions.create(model=name, prompt="the sea", max_tokens=30, temperature=0,
                                               stream=True, stream_options={"include_usage": True}))
            assert _completion_text(chunks) == full.choices[0].text
            assert chunks[-1].usage.model_extra["speculative"]["num_spec_steps"] == extra["num_spec_steps"]
            m = metrics(url)
            assert m["dflash_spec_decode_acceptance_length"] >= 1
            rates = [m[f'dflash_spec_decode_acceptance_rate_by_position{{position="{j}"}}'] for j in range(3)]
            assert all(0 <= r <= 1 for r in rates) and rates == sorted(rates, reverse=True)
            assert m["dflash_spec_decode_steps_total"] >= 2 * extra["num_spec_steps"]
            assert all_blocks_free(url)


def test_serve_command(long_model):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dflash", "serve", "--model", str(long_model), "--port", str(port),
                             "--device", "cpu", "--threads", "1", "--max-model-len", "1024", "--api-key", "k",
                             "--served-model-name", "served", "--log-level", "warning", "--async-decode"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def healthy():
            assert proc.poll() is None, proc.communicate()[1]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, what="`dflash serve` to answer /health", poll_s=0.2)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0) as c:
            out = c.chat.completions.create(model="served", messages=CHAT, max_tokens=5, temperature=0)
            assert out.usage.completion_tokens >= 1 and out.model == "served"
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "dflash serve: served on cpu" in err


def test_serve_without_the_extra_is_one_line(monkeypatch, capsys):
    import importlib.util

    from dflash import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    assert cli.main(["serve", "--model", os.devnull]) == 2
    assert "pip install 'dflash[serve]'" in capsys.readouterr().err


def test_nan_logits_end_a_request_with_finish_reason_error(long_model, tmp_path, session):
    """A request that meets NaN logits (tests/nonfinite_helpers.py: a model whose embedding row of
    the prompt's first greedy token t0 is NaN) gets a 200 with finish_reason "error" after the
    text before it, streamed or not; the server goes on answering other requests exactly."""
    from dflash.serve import build_app
    from tests.nonfinite_helpers import poisoned_copy

    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    probe = session.generate("the sea", greedy)[0]
    t0 = probe.token_ids[0]
    assert t0 not in probe.prompt_token_ids
    other = next(o for o in session.generate(["why is", "a cat", "one two three", "hello there"], greedy)
                 if t0 not in o.prompt_token_ids and t0 not in o.token_ids)
    poisoned = poisoned_copy(long_model, tmp_path / "poisoned", t0)
    with dflash.Session(poisoned, device="cpu", num_threads=1, max_model_len=1024, kv_cache_tokens=8192) as s:
        with running_server(build_app(s)) as url, openai.OpenAI(base_url=f"{url}/v1", api_key="none",
                                                                max_retries=0) as c:
            name = c.models.list().data[0].id
            full = c.completions.create(model=name, prompt="the sea", max_tokens=12, temperature=0)
            assert full.choices[0].finish_reason == "error" and full.usage.completion_tokens == 1
            chunks = list(c.completions.create(model=name, prompt="the sea", max_tokens=12, temperature=0,
                                               stream=True))
            assert chunks[-1].choices[0].finish_reason == "error"
            assert _completion_text(chunks) == full.choices[0].text
            fine = c.completions.create(model=name, prompt=other.prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
            assert (fine.choices[0].finish_reason, fine.choices[0].text) == ("length", other.text)
            assert metrics(url)['dflash_requests_finished_total{finish_reason="error"}'] == 2
            assert all_blocks_free(url)

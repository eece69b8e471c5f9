# tests/test_serve_soak.py
#
# A bounded soak of `dflash serve` over loopback: a few hundred requests, 12 at a time against a
# server that decodes at most 8 together (so some wait for admission), mixing streams read to
# the end, streams dropped part way, plain requests, plain requests whose client gives up, and
# bad requests. Afterwards every KV block is free and no request is left, every answer that came
# was well formed, the process's memory stayed roughly flat between a warm-up round and the
# soak, and closing the session leaves no engine thread behind.
from __future__ import annotations

import asyncio
import json
import random

import httpx

import dflash
from tests.serve_helpers import LONG_CONTEXT, all_blocks_free, metric, running_server, wait_until

MODEL = "tiny"
CONCURRENCY = 12
WARMUP_REQUESTS = 60
SOAK_REQUESTS = 300
KINDS = (["stream"] * 7 + ["stream_dropped"] * 4 + ["plain"] * 5 + ["plain_given_up"] * 2 + ["bad"] * 2)
# Growth of the resident set between the warm-up and the end of the soak that still counts as
# flat: far below what keeping each request's output or KV blocks would cost over 300 requests.
RSS_GROWTH_LIMIT_BYTES = 48 * 1024 * 1024


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _body(rng: random.Random, i: int, long: bool) -> dict:
    chat = rng.random() < 0.5
    body = {"model": MODEL, "max_tokens": LONG_CONTEXT // 2 if long else rng.randint(1, 40),
            "temperature": rng.choice([0.0, 0.8]), "seed": i, "ignore_eos": long}
    if not long and rng.random() < 0.3:
        body["stop"] = [rng.choice(["the", "e", "a ", "\n"])]
    if chat:
        body["messages"] = [{"role": "user", "content": f"question {i}: why is the sea {rng.choice(['blue', 'grey'])}?"}]
    else:
        body["prompt"] = f"the {rng.choice(['sea', 'river', 'storm'])} number {i}"
    return body


def _path(body: dict) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


async def _one(client: httpx.AsyncClient, rng: random.Random, i: int, tally: dict) -> None:
    kind = rng.choice(KINDS)
    tally[kind] = tally.get(kind, 0) + 1
    if kind == "bad":
        body = rng.choice([{"prompt": "x", "max_tokens": -1}, {"messages": []}, {"prompt": "x", "n": 3},
                           {"prompt": "x", "temperature": -2}])
        r = await client.post("/v1/completions" if "prompt" in body else "/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"], r.text
        return
    if kind in ("stream", "stream_dropped"):
        body = {**_body(rng, i, long=kind == "stream_dropped"), "stream": True}
        keep = rng.randint(1, 6)
        async with client.stream("POST", _path(body), json=body) as r:
            assert r.status_code == 200, await r.aread()
            events = 0
            async for line in r.aiter_lines():
                if not line:
                    continue
                assert line.startswith("data: "), line
                if line == "data: [DONE]":
                    break
                json.loads(line[6:])
                events += 1
                if kind == "stream_dropped" and events >= keep:
                    return  # leaving the block closes the connection mid-stream
        assert kind == "stream" and events >= 2
        return
    body = _body(rng, i, long=kind == "plain_given_up")
    if kind == "plain_given_up":  # thousands of tokens: the client gives up long before the end
        try:
            r = await client.post(_path(body), json=body, timeout=httpx.Timeout(rng.uniform(0.01, 0.2)))
        except httpx.TimeoutException:
            tally["gave_up"] = tally.get("gave_up", 0) + 1
        else:
            assert r.status_code == 200, r.text
        return
    r = await client.post(_path(body), json=body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert 1 <= usage["completion_tokens"] <= body["max_tokens"] and usage["prompt_tokens"] > 0


async def _round(base_url: str, seed: int, num_requests: int) -> dict:
    rng = random.Random(seed)
    tally: dict = {}
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        async def guarded(i: int) -> None:
            async with gate:
                await _one(client, random.Random(rng.random()), i, tally)

        await asyncio.gather(*(guarded(i) for i in range(num_requests)))
    return tally


def test_soak(long_context_model):
    from dflash.serve import build_app

    session = dflash.Session(long_context_model, device="cpu", num_threads=1, max_model_len=LONG_CONTEXT,
                             kv_cache_tokens=4 * LONG_CONTEXT, max_num_seqs=8)
    try:
        with running_server(build_app(session, model_name=MODEL)) as url:
            asyncio.run(_round(url, 1, WARMUP_REQUESTS))
            wait_until(lambda: all_blocks_free(url), what="every KV block free after the warm-up")
            rss_before = _rss_bytes()
            tally = asyncio.run(_round(url, 2, SOAK_REQUESTS))
            wait_until(lambda: all_blocks_free(url), what="every KV block free after the soak")
            rss_after = _rss_bytes()
            assert set(tally) == set(KINDS) | {"gave_up"}, tally
            assert metric(url, 'dflash_requests_finished_total{finish_reason="abort"}') > 0
            assert metric(url, 'dflash_requests_total{endpoint="/v1/completions",status="400"}', default=0.0) + \
                metric(url, 'dflash_requests_total{endpoint="/v1/chat/completions",status="400"}', default=0.0) \
                >= tally["bad"]
        st = session.stats()
        assert st["num_free_blocks"] == st["num_blocks"]
        assert st["num_running_requests"] == 0 and st["num_waiting_requests"] == 0
        assert not session._core.has_unfinished()
        assert rss_after - rss_before < RSS_GROWTH_LIMIT_BYTES, (rss_before, rss_after)
    finally:
        thread = session._loop.thread
        session.close()
    assert thread is not None and not thread.is_alive()

# tests/runtime_helpers.py
#
# Helpers for tests that drive the C++ runtime directly through dflash._core's test hooks:
# teacher-forced decoding with recorded logits and hidden-state taps, decoding with oracle drafts,
# seeded two-token sampling runs (for the exactness tests), and the leak check.
from __future__ import annotations

from typing import Sequence

import numpy as np


def forced_run(session, prompt_ids: Sequence[int], forced_ids: Sequence[int], *, taps: bool = False):
    """Prefill `prompt_ids`, then decode step by step feeding `forced_ids` (teacher forcing).

    Returns (logits [len(prompt) + len(forced), V], taps or None, result). Row i of logits is
    the distribution over the token at position i + 1 (prompt rows from the prefill, the rest
    one per decode step).
    """
    from dflash import _core

    req = _core.RequestInput()
    req.prompt = list(prompt_ids)
    req.forced_tokens = list(forced_ids) + [0]
    req.record_logits = True
    req.record_prompt_logits = True
    req.record_taps = taps
    s = _core.SamplingConfig()
    s.max_tokens = len(forced_ids) + 1
    s.ignore_eos = True
    req.sampling = s
    core = session._core
    rid = core.add_request(req)
    while core.has_unfinished():
        core.step()
    result = core.take_result(rid)
    vocab = session.model_config.vocab_size
    logits = result.logits(vocab)
    tap_arr = None
    if taps:
        n_rows = len(prompt_ids) + len(forced_ids)
        tap_flat = result.taps(1).reshape(-1)
        tap_arr = tap_flat.reshape(n_rows, -1)
    return logits, tap_arr, result


class _CoreSession:
    """A dflash.Session-like holder of a _core.Session built with runtime-only options."""

    def __init__(self, core):
        self._core = core
        self.model_config = core.model_config

    def stats(self):
        st = self._core.stats()
        return {"num_free_blocks": st.num_free_blocks, "num_blocks": st.num_blocks}


def core_session(model_dir, *, tap_layers=(), num_threads=2, **config):
    """A runtime session with hidden-state taps (not a public Session option yet)."""
    from dflash import _core

    cfg = _core.SessionConfig()
    cfg.tap_layers = list(tap_layers)
    cfg.num_threads = num_threads
    for k, v in config.items():
        setattr(cfg, k, v)
    return _CoreSession(_core.Session(str(model_dir), cfg))


def oracle_run(session, prompts, oracle_drafts, *, max_tokens: int, ignore_eos: bool = False,
               stop_token_ids: Sequence[int] = ()) -> list:
    """Runs each prompt with the given drafts verified instead of the drafter's (a dflash.Session
    with a drafter) to completion; returns the core results (token_ids, metrics), in order."""
    from dflash import _core

    ids = []
    for p, drafts in zip(prompts, oracle_drafts):
        req = _core.RequestInput()
        req.prompt = p
        req.oracle_drafts = drafts
        sc = _core.SamplingConfig()
        sc.max_tokens, sc.ignore_eos, sc.stop_token_ids = max_tokens, ignore_eos, list(stop_token_ids)
        req.sampling = sc
        ids.append(session._core.add_request(req))
    while session._core.has_unfinished():
        session._core.step()
    return [session._core.take_result(i) for i in ids]


def core_request(prompt, **sampling):
    """A _core.RequestInput of `prompt` with these SamplingConfig fields."""
    from dflash import _core

    req = _core.RequestInput()
    req.prompt = list(prompt)
    sc = _core.SamplingConfig()
    for k, v in sampling.items():
        setattr(sc, k, v)
    req.sampling = sc
    return req


def core_generate(sess, prompts, sampling) -> list[list[int]]:
    """Runs `prompts` to completion on a _core.Session, request i with the SamplingConfig fields
    sampling(i) (a dict); returns the token lists in order and checks that every KV block is free."""
    ids = [sess.add_request(core_request(p, **sampling(i))) for i, p in enumerate(prompts)]
    while sess.has_unfinished():
        sess.step()
    st = sess.stats()
    assert st.num_free_blocks == st.num_blocks
    return [list(sess.take_result(i).token_ids) for i in ids]


def check_padded_pipelined_equals_sync(target, prompts, draft=None) -> None:
    """The CUDA path pads decode steps to the graph sizes (the CPU's pad_decode_batches test hook
    does the same): pipelined steps over padded batches (padding rows are not fed) equal unpadded
    synchronous decoding while the batch shrinks (request i: 6 + 5 i tokens, seeded, T 0 / 0.6)."""
    from dflash import _core

    def run(pad, async_decode):
        cfg = _core.SessionConfig()
        cfg.num_threads, cfg.max_num_seqs, cfg.kv_cache_tokens = 2, 8, 4096
        if draft is not None:
            cfg.draft_dir = str(draft)
        cfg.pad_decode_batches, cfg.async_decode = pad, async_decode
        sess = _core.Session(str(target), cfg)
        tokens = core_generate(sess, prompts, lambda i: {
            "max_tokens": 6 + 5 * i, "temperature": 0.6 * (i % 2), "seed": 20 + i, "ignore_eos": True})
        return tokens, sess.stats().engine.pipelined_steps

    want, _ = run(False, False)
    got, pipelined = run(True, True)
    assert got == want and pipelined > 0


def check_stop_strings_and_abort(on, off, prompts, max_tokens: int = 20, abort_after: int = 4) -> None:
    """A pipelined session `on` against the same session without pipelining, `off`. Stop strings
    (the Python side aborts a request while a step is in flight, drained first) give the same
    tokens, texts and finish reasons. Then request 1 of `prompts` is aborted through the core API
    after `abort_after` steps of `on`: it ends with "abort", and the others emit, step by step and
    in their results, what `off` generates for them alone."""
    import dflash

    texts = [o.text for o in off.generate(prompts, dflash.SamplingParams(max_tokens=24, ignore_eos=True))]
    stops = [t[len(t) // 2: len(t) // 2 + 2] for t in texts if len(t) > 4][:2]
    params = dflash.SamplingParams(max_tokens=24, ignore_eos=True, stop=stops)
    got = [(o.token_ids, o.text, o.finish_reason) for o in on.generate(prompts, params)]
    assert got == [(o.token_ids, o.text, o.finish_reason) for o in off.generate(prompts, params)]

    ids = [on._core.add_request(core_request(p, max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    seen = {i: [] for i in ids}
    steps = 0
    while on._core.has_unfinished():
        for out in on._core.step():
            seen[out.request_id].extend(out.new_tokens)
        steps += 1
        if steps == abort_after:
            assert on._core.abort(ids[1])
    results = {i: on._core.take_result(i) for i in ids}
    assert results[ids[1]].finish_reason == "abort"
    kept = [i for k, i in enumerate(ids) if k != 1]
    alone = off.generate([p for k, p in enumerate(prompts) if k != 1],
                         dflash.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    for i, o in zip(kept, alone):
        assert list(results[i].token_ids) == o.token_ids == seen[i]
    assert on.stats()["num_free_blocks"] == on.stats()["num_blocks"]


def assert_no_leaks(session) -> None:
    """Every KV block is back in the allocator and nothing is queued."""
    st = session.stats()
    assert st["num_free_blocks"] == st["num_blocks"], st
    assert not session._core.has_unfinished()


def greedy_hf(model, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids=None) -> list[int]:
    """transformers' greedy generate (on the model's device); returns only the new tokens."""
    import torch

    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=model.device)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                  attention_mask=torch.ones_like(ids))
    if eos_ids is not None:
        kwargs["eos_token_id"] = list(eos_ids) if eos_ids else None
    if eos_ids == []:
        kwargs["eos_token_id"] = None
    with torch.no_grad():
        out = model.generate(ids, pad_token_id=0, **kwargs)
    return out[0, len(prompt_ids):].tolist()


def max_abs(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def sampled_second_tokens(session, prompt: Sequence[int], first: int, *, temperature: float, top_p: float,
                          num_seeds: int, oracle_drafts: Sequence[int] | None = None):
    """One request per seed 0..num_seeds-1: `first` forced as the prefill's token, then one token
    sampled through the speculative step (its first draft goes through acceptance). Returns the
    finished results, in seed order."""
    from dflash import _core

    ids = []
    for seed in range(num_seeds):
        req = _core.RequestInput()
        req.prompt = list(prompt)
        req.forced_tokens = [first]
        if oracle_drafts is not None:
            req.oracle_drafts = list(oracle_drafts)
        sc = _core.SamplingConfig()
        sc.max_tokens = 2
        sc.temperature = temperature
        sc.top_p = top_p
        sc.seed = seed
        sc.ignore_eos = True
        req.sampling = sc
        ids.append(session._core.add_request(req))
    while session._core.has_unfinished():
        session._core.step()
    return [session._core.take_result(i) for i in ids]


def target_config(target) -> dict:
    """A model directory's config.json as a dict."""
    import json
    from pathlib import Path

    return json.loads((Path(target) / "config.json").read_text())


# Prompts of the DFlash2 runtime tests (CPU and GPU).
DRAFT_PROMPTS = [[17, 42, 99, 7, 250, 31], [5, 6, 7, 8], list(range(40, 70)), [300, 2, 301, 3, 302]]


def small_dflash2(tmp_path, target, name: str = "d2", **kw):
    """A random one-layer DFlash2 drafter for the tiny target `target` in tmp_path / name (block
    4, taps [0, 1], group 8, rank 8, K 8 unless `kw` says otherwise)."""
    from dflash.drafter_format import write_dflash2_drafter

    for key, value in (("num_layers", 1), ("target_layer_ids", [0, 1]), ("block_size", 4), ("conv_group_size", 8),
                       ("selector_rank", 8), ("selector_top_k", 8)):
        kw.setdefault(key, value)
    return write_dflash2_drafter(tmp_path / name, target_config=target_config(target), **kw)


def small_drafter_pair(root, target, *, dflash_layers: int, dflash_block_size: int, dflash_seed: int,
                       dflash2_block_size: int, dflash2_top_k: int) -> dict:
    """Random tiny drafters of both kinds for `target` under root: {"dflash": DIR (taps [0, 1]),
    "dflash2": DIR (small_dflash2)}."""
    from dflash.drafter_format import write_dflash_drafter

    v1 = write_dflash_drafter(root / "dflash", target_config=target_config(target), num_layers=dflash_layers,
                              target_layer_ids=[0, 1], block_size=dflash_block_size, seed=dflash_seed)
    v2 = small_dflash2(root, target, block_size=dflash2_block_size, selector_top_k=dflash2_top_k)
    return {"dflash": v1, "dflash2": v2}


def greedy_ids(session, prompts, max_tokens: int = 20) -> list[list[int]]:
    """The token ids of a greedy generate() of `prompts` (ignoring EOS)."""
    import dflash

    params = dflash.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in session.generate(prompts, params)]


def assert_greedy_like_target(spec, ar, prompts, max_tokens: int = 20) -> None:
    """Greedy speculative output of `spec` equals target-only greedy output of `ar`, batched and
    each prompt alone; speculative steps ran and no KV block is left held."""
    expected = greedy_ids(ar, prompts, max_tokens)
    assert greedy_ids(spec, prompts, max_tokens) == expected  # batched
    for prompt, want in zip(prompts, expected):
        assert greedy_ids(spec, [prompt], max_tokens) == [want]  # alone
    assert spec.stats()["num_spec_steps"] > 0
    assert_no_leaks(spec)


def assert_greedy_walk_like_walk(greedy, walk, prompts) -> None:
    """A draft_sampling="greedy" DFlash2 session proposes the default walk's drafts (propose runs
    at T = 0) with realized rows one-hot at the walked candidate: 0 there, -inf elsewhere."""
    for prompt in prompts:
        g, w = greedy.propose_details(prompt), walk.propose_details(prompt)
        assert np.array_equal(g["draft_ids"], w["draft_ids"])
        realized = np.asarray(g["realized"]).reshape(-1, g["k"])
        for slot, tok in enumerate(g["draft_ids"]):
            idx = int(np.argmax(g["candidate_ids"][slot] == tok))
            assert realized[slot, idx] == 0.0 and np.all(np.isneginf(np.delete(realized[slot], idx)))

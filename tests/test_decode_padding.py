# tests/test_decode_padding.py
#
# The decode programs' padding path on the CPU. On CUDA, decode steps are padded to the graph
# batch sizes (1, 2, 4, 8, ...) and the padding rows write reserved "trash" KV blocks past the
# allocator's range; the CPU normally runs exact sizes, but the test hook pad_decode_batches
# turns the same padding on, so CI checks that padding rows never disturb real ones: AR and
# DFlash (random drafter; oracle drafts for full acceptance), greedy and sampled, padded ==
# unpadded token for token, while continuous batching changes the batch; no leaked blocks.
from __future__ import annotations

import json

import numpy as np
import pytest

from dflash import _core

MODEL = "qwen3"


def _session(model_dir, pad, draft=None, draft_sampling="greedy"):
    cfg = _core.SessionConfig()
    cfg.num_threads = 2
    cfg.max_num_seqs = 4
    cfg.kv_cache_tokens = 4096
    cfg.pad_decode_batches = pad
    if draft is not None:
        cfg.draft_dir = str(draft)
        cfg.draft_sampling = draft_sampling  # oracle drafts (full acceptance) need one-hot proposals
    return _core.Session(str(model_dir), cfg)


def _run(sess, prompts, temperature, oracle=None):
    ids = []
    for i, p in enumerate(prompts):
        req = _core.RequestInput()
        req.prompt = p
        if oracle is not None:
            req.oracle_drafts = oracle[i]
        s = _core.SamplingConfig()
        s.max_tokens, s.temperature, s.top_p, s.seed, s.ignore_eos = 9 + 4 * (i % 3), temperature, 0.9, 50 + i, True
        req.sampling = s
        ids.append(sess.add_request(req))
    while sess.has_unfinished():
        sess.step()
    out = [list(sess.take_result(i).token_ids) for i in ids]
    st = sess.stats()
    assert st.num_free_blocks == st.num_blocks
    return out


def _prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 200, size=int(rng.integers(3, 30)))] for _ in range(n)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs):
    return tiny_model_dirs[MODEL]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_ar_padding_changes_nothing(model_dir, temperature):
    padded, exact = _session(model_dir, True), _session(model_dir, False)
    for n in (1, 3, 7):
        prompts = _prompts(n, seed=n)
        assert _run(padded, prompts, temperature) == _run(exact, prompts, temperature)
    assert list(padded.stats().graph_batch_sizes) == [1, 2, 4] and list(exact.stats().graph_batch_sizes) == []


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_dflash_padding_changes_nothing(model_dir, temperature, tmp_path):
    from dflash.drafter_format import write_dflash_drafter

    cfg = json.loads((model_dir / "config.json").read_text())
    dr = write_dflash_drafter(tmp_path / "d", target_config=cfg, num_layers=1, target_layer_ids=[0, 1], block_size=4)
    padded, exact = _session(model_dir, True, dr), _session(model_dir, False, dr)
    prompts = _prompts(6, seed=11)
    assert _run(padded, prompts, temperature) == _run(exact, prompts, temperature)
    # full acceptance: oracle drafts = the target's own continuation (several tokens per step)
    want = _run(_session(model_dir, False), prompts, 0.0)
    assert _run(padded, prompts, 0.0, oracle=want) == want
    # probabilistic drafts (the default): padding rows change nothing either
    padded, exact = (_session(model_dir, pad, dr, draft_sampling="auto") for pad in (True, False))
    assert padded.stats().draft_sampling == "probabilistic"
    assert _run(padded, prompts, temperature) == _run(exact, prompts, temperature)

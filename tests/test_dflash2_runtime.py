# tests/test_dflash2_runtime.py
#
# DFlash2 speculative decoding on the CPU backend (fp32), end to end through the runtime:
# greedy output equals target-only greedy output (alone and batched, several drafter
# geometries); at T > 0 the emitted token follows the target's distribution with the walk's
# K-candidate proposal q (chi-squared, with and without top-p); seeded runs are identical alone
# and in a batch; Session.propose_details equals the plain-PyTorch reference
# (tests/reference/dflash2_reference.py: ids equal, scores within 1e-4); a DFlash2 drafter at its training-time init (identity conv, zero successor
# codebook) drafts exactly what the same backbone drafts as DFlash v1; no KV block leaks.
from __future__ import annotations

import json

import numpy as np
import pytest

import dflash
from dflash.drafter_format import write_dflash_drafter
from tests.reference.dflash2_reference import load_drafter2, propose2_ref, spec_generate2_ref
from tests.runtime_helpers import DRAFT_PROMPTS, assert_greedy_like_target, assert_greedy_walk_like_walk, assert_no_leaks, greedy_ids, small_dflash2, target_config
from tests.test_dflash_sampling import check_sampled_second_token

PROMPTS = DRAFT_PROMPTS








@pytest.fixture
def target(tiny_model_dirs):
    return tiny_model_dirs["llama_gqa"]


@pytest.mark.parametrize("geometry", [
    dict(block_size=4, conv_kernel_size=2, conv_group_size=8, selector_top_k=4),
    dict(block_size=5, conv_kernel_size=3, conv_group_size=4, selector_top_k=16),
    dict(block_size=8, conv_kernel_size=2, conv_group_size=16, selector_top_k=32, output_multiplier=0.5,
         final_logit_softcapping=3.0, input_embedding_scale=1.5),
    dict(block_size=6, num_layers=2, dtype="bfloat16", selector_top_k=5),
])
def test_greedy_speculative_output_equals_target_greedy(tmp_path, target, geometry):
    d = small_dflash2(tmp_path, target, **geometry)
    spec = dflash.Session(target, draft=d, device="cpu", num_threads=2)
    ar = dflash.Session(target, device="cpu", num_threads=2)
    assert_greedy_like_target(spec, ar, PROMPTS)


@pytest.mark.parametrize("preset, geometry", [
    ("llama_gqa", dict(block_size=4, conv_kernel_size=2, conv_group_size=8, selector_top_k=4)),
    ("qwen3", dict(block_size=5, conv_kernel_size=3, conv_group_size=4, selector_top_k=16, num_layers=2)),
    ("llama_gqa", dict(block_size=8, conv_kernel_size=2, conv_group_size=16, selector_top_k=32,
                       output_multiplier=0.3, final_logit_softcapping=4.0, input_embedding_scale=1.25)),
    ("qwen3", dict(block_size=16, conv_kernel_size=2, conv_group_size=16, selector_top_k=8, dtype="bfloat16")),
    ("llama_gqa", dict(block_size=6, layer_types=["sliding_attention"], sliding_window=5, is_causal=True,
                       selector_top_k=6)),
    # The published DFlash2 layout: sliding layers with is_causal false (a symmetric window).
    ("qwen3", dict(block_size=8, num_layers=2, layer_types=["sliding_attention"] * 2, sliding_window=4,
                   is_causal=False, selector_top_k=8)),
])
def test_propose_matches_the_reference(tmp_path, tiny_model_dirs, hf_model, preset, geometry):
    target = tiny_model_dirs[preset]
    d = small_dflash2(tmp_path, target, seed=7, **geometry)
    sess = dflash.Session(target, draft=d, device="cpu", num_threads=2)
    ref = load_drafter2(d)
    model = hf_model(target)
    for prompt in PROMPTS[:3]:
        got = sess.propose_details(prompt)
        want = propose2_ref(model, ref, prompt)
        assert got["candidate_ids"].tolist() == want.candidate_ids.tolist()
        for key, ref_value in (("unary", want.unary), ("edges", want.edges), ("realized", want.realized_rows)):
            err = float(np.max(np.abs(got[key] - ref_value.numpy())))
            assert err <= 1e-4, (key, err)
        assert got["draft_ids"].tolist() == want.draft_ids.tolist()
    assert_no_leaks(sess)


def test_greedy_output_equals_the_reference_loop(tmp_path, tiny_model_dirs, hf_model):
    target = tiny_model_dirs["qwen3"]
    d = small_dflash2(tmp_path, target, block_size=6, selector_top_k=8, seed=2)
    sess = dflash.Session(target, draft=d, device="cpu", num_threads=2)
    tokens, _ = spec_generate2_ref(hf_model(target), load_drafter2(d), PROMPTS[0], 16)
    assert greedy_ids(sess, [PROMPTS[0]], max_tokens=16) == [tokens[:16]]


def test_identity_init_drafts_like_its_dflash_backbone(tmp_path, target):
    """With the conv an exact no-op and the successor codebook zero, every edge row is the
    unary row, so the greedy walk picks each slot's top candidate: the DFlash v1 argmax."""
    d2 = small_dflash2(tmp_path, target, block_size=6, identity_init=True, seed=3, init_std=0.5)
    cfg2 = json.loads((d2 / "config.json").read_text())
    from safetensors.numpy import load_file

    weights = {k: v for k, v in load_file(str(d2 / "model.safetensors")).items()
               if "_conv." not in k and not k.startswith("candidate_selector.")}
    d1 = write_dflash_drafter(tmp_path / "d1", target_config=target_config(target), num_layers=1, target_layer_ids=[0, 1],
                              block_size=6, weights=weights)
    assert json.loads((d1 / "config.json").read_text())["hidden_size"] == cfg2["hidden_size"]
    s1 = dflash.Session(target, draft=d1, device="cpu", num_threads=1)
    s2 = dflash.Session(target, draft=d2, device="cpu", num_threads=1)
    for prompt in PROMPTS:
        drafts1, logits1 = s1.propose(prompt)
        details = s2.propose_details(prompt)
        np.testing.assert_allclose(details["draft_logits"], logits1, rtol=1e-5, atol=1e-5)
        assert list(details["draft_ids"]) == list(drafts1)
        # Edges of an identity selector: every row equals the unary scores.
        np.testing.assert_allclose(details["edges"], np.broadcast_to(details["unary"][:, None, :],
                                                                     details["edges"].shape), atol=1e-6)


def test_candidates_are_the_lm_head_top_k_with_multiplier_and_cap(tmp_path, target):
    d = small_dflash2(tmp_path, target, block_size=5, selector_top_k=6, output_multiplier=0.25,
                 final_logit_softcapping=2.0)
    sess = dflash.Session(target, draft=d, device="cpu", num_threads=1)
    details = sess.propose_details(PROMPTS[0])
    logits = details["draft_logits"]
    for s in range(logits.shape[0]):
        order = np.lexsort((np.arange(logits.shape[1]), -logits[s]))[:6]  # by value, then lowest id
        assert list(details["candidate_ids"][s]) == list(order)
        want = 2.0 * np.tanh(logits[s, order] * 0.25 / 2.0)
        np.testing.assert_allclose(details["unary"][s], want, rtol=1e-5, atol=1e-6)
    # Slot 0's predecessor is the anchor for every row: its K edge rows are identical.
    e0 = details["edges"][0]
    assert np.allclose(e0, e0[0][None, :])
    # The greedy walk: each slot takes the argmax of the row of the candidate chosen before.
    prev = 0
    for s in range(logits.shape[0]):
        row = details["edges"][s, prev]
        np.testing.assert_array_equal(details["realized"][s], row)
        prev = int(np.argmax(row))
        assert details["draft_ids"][s] == details["candidate_ids"][s, prev]


N = 2000


@pytest.mark.parametrize("top_p, draft_sampling", [(1.0, "auto"), (0.8, "auto"), (1.0, "greedy")])
def test_k_candidate_sampling_matches_target_distribution(tmp_path, target, top_p, draft_sampling):
    # draft_sampling="greedy": the argmax walk at T > 0, proposed one-hot, must be exact too.
    # A large K relative to the tiny vocabulary and nearly flat scores (a small output multiplier
    # and small codebooks), so q is spread over most of the vocabulary and drafts are accepted
    # often enough that both branches of the rejection sampler are exercised.
    d = small_dflash2(tmp_path, target, block_size=4, selector_top_k=256, seed=5, init_std=0.02,
                 output_multiplier=1e-3)
    spec = dflash.Session(target, draft=d, device="cpu", num_threads=2, draft_sampling=draft_sampling)
    ar = dflash.Session(target, device="cpu", num_threads=2)
    # (the greedy walk drafts one fixed token here, of target probability ~ 1/V: it is rarely
    # accepted, so that case checks the residual branch of one-hot candidate proposals)
    check_sampled_second_token(spec, ar, [17, 42, 99, 7, 250, 31], 120, 0.8, top_p, N, f"DFlash2 {draft_sampling}",
                               min_accepted=10 if draft_sampling == "auto" else 0)


def test_seeded_sampling_is_identical_alone_and_batched(tmp_path, target):
    d = small_dflash2(tmp_path, target, block_size=5, selector_top_k=16)
    spec = dflash.Session(target, draft=d, device="cpu", num_threads=2)
    params = [dflash.SamplingParams(max_tokens=16, temperature=0.9, top_k=40, seed=11 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    batched = [o.token_ids for o in spec.generate(PROMPTS, params)]
    alone = [spec.generate([p], [pp])[0].token_ids for p, pp in zip(PROMPTS, params)]
    assert batched == alone
    again = [o.token_ids for o in spec.generate(PROMPTS, params)]
    assert again == batched
    assert_no_leaks(spec)


def test_greedy_walk_drafts_the_argmax_walk_one_hot(tmp_path, target):
    """draft_sampling="greedy" with a DFlash2 drafter: the same drafts as the default walk at
    T = 0 (propose), realized rows one-hot at the walked candidate (0 there, -inf elsewhere), and
    the same greedy output (its exactness at T > 0: the chi-squared test above)."""
    d = small_dflash2(tmp_path, target, block_size=5, selector_top_k=16)
    walk = dflash.Session(target, draft=d, device="cpu", num_threads=2)
    greedy = dflash.Session(target, draft=d, device="cpu", num_threads=2, draft_sampling="greedy")
    assert greedy.stats()["draft_sampling"] == "greedy_walk"
    assert_greedy_walk_like_walk(greedy, walk, PROMPTS[:3])
    assert greedy_ids(walk, PROMPTS, 12) == greedy_ids(greedy, PROMPTS, 12)
    assert_no_leaks(greedy)

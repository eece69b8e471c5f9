# tests/test_drafter_tensor_set.py
#
# Drafter checkpoints load only as exactly what they are: every tensor of the checkpoint is one
# its architecture uses (a DFlash2 checkpoint relabelled DFlashDraftModel, or a 2-layer
# checkpoint whose config says 1 layer, is refused), DFlash2DraftModel configs are parsed and
# validated field by field (errors name the file and the field), a valid DFlash2 checkpoint
# runs with its selector, and a top-level `is_causal` takes precedence over the sliding-window
# rule.
from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import dflash
from dflash.drafter_format import write_dflash_drafter


@pytest.fixture
def target(tiny_model_dirs):
    return tiny_model_dirs["llama_gqa"]


def _target_cfg(target):
    return json.loads((target / "config.json").read_text())


def _drafter(tmp_path, target, name="d", **kw):
    kw.setdefault("num_layers", 1)
    kw.setdefault("target_layer_ids", [0, 1])
    kw.setdefault("block_size", 4)
    return write_dflash_drafter(tmp_path / name, target_config=_target_cfg(target), **kw)


def _edit(d, fn):
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def _add_tensors(d, extra):
    tensors = load_file(str(d / "model.safetensors"))
    tensors.update(extra)
    save_file(tensors, str(d / "model.safetensors"))


def _dflash2_tensors(cfg, vocab, *, taps=2, group=8, rank=4):
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    rng = np.random.default_rng(0)
    out = {}
    for i in range(layers):
        for side in ("attention_conv", "mlp_conv"):
            out[f"layers.{i}.{side}.base_kernel"] = rng.standard_normal((2, taps, h)).astype(np.float32)
            out[f"layers.{i}.{side}.kernel_projection.weight"] = rng.standard_normal(
                (2 * taps * h // group, h)).astype(np.float32)
    out["candidate_selector.predecessor_codebook"] = rng.standard_normal((vocab, rank)).astype(np.float32)
    out["candidate_selector.successor_codebook"] = rng.standard_normal((vocab, rank)).astype(np.float32)
    out["candidate_selector.hidden_projection.weight"] = rng.standard_normal((rank, h)).astype(np.float32)
    return out


def _make_dflash2(tmp_path, target, *, taps=2, group=8, rank=4, top_k=4, name="d2"):
    d = _drafter(tmp_path, target, name=name)
    cfg = json.loads((d / "config.json").read_text())
    _add_tensors(d, _dflash2_tensors(cfg, cfg["vocab_size"], taps=taps, group=group, rank=rank))

    def relabel(c):
        c["architectures"] = ["DFlash2DraftModel"]
        c["dflash_config"].update(conv_kernel_size=taps, conv_group_size=group, selector_rank=rank,
                                  selector_top_k=top_k)
    _edit(d, relabel)
    return d


def test_plain_drafter_still_loads(tmp_path, target):
    dflash.Session(target, draft=_drafter(tmp_path, target), device="cpu", num_threads=1)


def test_dflash2_tensors_under_a_dflash_label_are_refused(tmp_path, target):
    d = _make_dflash2(tmp_path, target)
    _edit(d, lambda c: c.update(architectures=["DFlashDraftModel"]))
    with pytest.raises(dflash.DFlashError, match=r"(_conv|candidate_selector)\..*not used by a DFlashDraftModel.*it is a DFlash2 tensor.*DFlash2DraftModel"):
        dflash.Session(target, draft=d, device="cpu", num_threads=1)


def test_more_layers_than_the_config_says_are_refused(tmp_path, target):
    d = _drafter(tmp_path, target, num_layers=2)
    _edit(d, lambda c: c.update(num_hidden_layers=1, layer_types=["full_attention"], max_window_layers=1))
    with pytest.raises(dflash.DFlashError, match=r"tensor 'layers\.1\..*not used by a DFlashDraftModel with 1 layers"):
        dflash.Session(target, draft=d, device="cpu", num_threads=1)


def test_missing_tensor_is_named(tmp_path, target):
    d = _drafter(tmp_path, target)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["layers.0.mlp.down_proj.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(dflash.DFlashError, match=r"layers\.0\.mlp\.down_proj\.weight"):
        dflash.Session(target, draft=d, device="cpu", num_threads=1)


def test_valid_dflash2_checkpoint_loads_and_runs_with_its_selector(tmp_path, target):
    d = _make_dflash2(tmp_path, target, top_k=4)
    sess = dflash.Session(target, draft=d, num_threads=1, device="cpu")
    details = sess.propose_details(list(range(3, 15)))
    n = 3  # block_size 4: 3 drafts per step
    assert details["k"] == 4 and len(details["draft_ids"]) == n
    assert details["candidate_ids"].shape == (n, 4) and details["edges"].shape == (n, 4, 4)
    # The drafts are walked candidates (not the LM head's argmax rows of a DFlash v1 draft).
    for s in range(n):
        assert details["draft_ids"][s] in details["candidate_ids"][s]


@pytest.mark.parametrize("field, value, message", [
    ("conv_group_size", 7, r"'dflash_config\.conv_group_size' \(7\) must divide hidden_size"),
    ("selector_top_k", 10**6, r"'dflash_config\.selector_top_k' .* must be in \[1, vocab_size"),
    ("selector_top_k", 0, r"'dflash_config\.selector_top_k'"),
    ("selector_rank", 0, r"'dflash_config\.selector_rank' must be >= 1"),
    ("conv_kernel_size", 9, r"'dflash_config\.conv_kernel_size' must be in \[1, block_size=4\]"),
    ("conv_kernel_size", None, r"needs the integer field 'dflash_config\.conv_kernel_size'"),
    ("output_multiplier", -1.0, r"'dflash_config\.output_multiplier' must be a positive number"),
    ("final_logit_softcapping", -2.0, r"'dflash_config\.final_logit_softcapping' must be >= 0"),
    ("input_embedding_scale", "x", r"'input_embedding_scale' must be a number"),
])
def test_dflash2_config_fields_are_validated(tmp_path, target, field, value, message):
    d = _make_dflash2(tmp_path, target)

    def change(c):
        if value is None:
            c["dflash_config"].pop(field)
        else:
            c["dflash_config"][field] = value
    _edit(d, change)
    with pytest.raises(dflash.DFlashError, match=message):
        dflash.Session(target, draft=d, device="cpu", num_threads=1)


def test_dflash2_tensor_of_the_wrong_shape_is_named(tmp_path, target):
    d = _make_dflash2(tmp_path, target, rank=4)
    _edit(d, lambda c: c["dflash_config"].update(selector_rank=8))  # the codebooks hold rank 4
    with pytest.raises(dflash.DFlashError, match=r"candidate_selector\.\w+.*shape"):
        dflash.Session(target, draft=d, device="cpu", num_threads=1)


def test_architectures_message_says_what_is_accepted(tmp_path, target):
    d = _drafter(tmp_path, target)
    _edit(d, lambda c: c.update(architectures=["EagleDraftModel"]))
    with pytest.raises(dflash.DFlashError, match=r"EagleDraftModel.*DFlashDraftModel.*DFlash2DraftModel"):
        dflash.Session(target, draft=d, device="cpu", num_threads=1)


def test_non_causal_sliding_window_is_symmetric(tmp_path, target):
    """is_causal: false on a sliding layer is a symmetric window |query - key| < window: the draft
    differs from the causal window's (the rule without is_causal), and from full attention."""
    prompt = list(range(3, 30))
    d = _drafter(tmp_path, target, layer_types=["sliding_attention"], sliding_window=3, block_size=6, init_std=0.5)
    causal = dflash.Session(target, draft=d, device="cpu", num_threads=1).propose(prompt)[1]
    _edit(d, lambda c: c.update(is_causal=False))
    symmetric = dflash.Session(target, draft=d, device="cpu", num_threads=1).propose(prompt)[1]
    _edit(d, lambda c: c.update(layer_types=["full_attention"], use_sliding_window=False))
    full = dflash.Session(target, draft=d, device="cpu", num_threads=1).propose(prompt)[1]
    assert not np.allclose(causal, symmetric) and not np.allclose(symmetric, full)


def test_is_causal_takes_precedence_for_full_layers(tmp_path, target):
    """A full-attention drafter with is_causal: true drafts with a causal block, so its draft
    logits differ from the same weights' non-causal ones (where each mask row sees the whole
    block)."""
    prompt = list(range(3, 15))
    d = _drafter(tmp_path, target, block_size=6, init_std=0.5)
    plain = dflash.Session(target, draft=d, device="cpu", num_threads=1)
    drafts_plain, logits_plain = plain.propose(prompt)
    _edit(d, lambda c: c.update(is_causal=True))
    causal = dflash.Session(target, draft=d, device="cpu", num_threads=1)
    drafts_causal, logits_causal = causal.propose(prompt)
    lp, lc = np.asarray(logits_plain), np.asarray(logits_causal)
    assert not np.allclose(lp, lc)
    assert lp.shape == lc.shape and len(drafts_plain) == len(drafts_causal)

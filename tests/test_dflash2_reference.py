# tests/test_dflash2_reference.py
#
# Checks of the DFlash2 drafter writer (dflash.drafter_format.write_dflash2_drafter)
# and of the plain-PyTorch DFlash2 reference (tests/reference/dflash2_reference.py)
# on their own: the grouped conv against a vectorised form and its block
# boundaries, an identity-initialised drafter against its DFlash backbone, the
# attention masks, candidates / edges / walk against explicit formulas, the
# sampled walk's distribution (chi-square), Philox against cpp/common/philox.h,
# and exact rejection sampling with a sparse q.  CPU only, tiny geometries.
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import shutil
import subprocess
from typing import Any

import numpy as np
import pytest
import torch

from dflash.drafter_format import dflash2_tensor_shapes, write_dflash2_drafter, write_dflash_drafter
from tests.fixtures.tiny_models import write_preset
from tests.reference import dflash2_reference as R2
from tests.reference import dflash_reference as R

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMPT = [250, 3, 81, 64, 128, 9, 33, 140, 2, 77, 210]
PER_LAYER = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
SMALL = {"num_layers": 2, "target_layer_ids": [0, 1], "block_size": 8, "conv_group_size": 8, "selector_rank": 16,
         "selector_top_k": 8}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Any]:
    """(config dict, fp32 HF model) of the tiny qwen3 preset (H 64, V 359, 2 layers)."""
    from transformers import AutoModelForCausalLM

    d = write_preset("qwen3", tmp_path_factory.mktemp("dflash2_ref_target") / "qwen3")
    cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
    return cfg, AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()


def _drafter2(cfg: dict[str, Any], out: pathlib.Path, **kw: Any) -> R2.Draft2Ref:
    return R2.load_drafter2(write_dflash2_drafter(out, target_config=cfg, **{**SMALL, **kw}))


def _chi2_critical(dof: int, z: float = 3.0902) -> float:
    """Upper 0.1 % point of chi-square(dof) (Wilson-Hilferty)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a zero-probability outcome was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# --------------------------------------------------------------------------------------
# Grouped dynamic conv


@pytest.mark.parametrize("block_size", [4, 5, 8])
@pytest.mark.parametrize("taps", [2, 3])
@pytest.mark.parametrize("group_size", [4, 8])
def test_conv_loop_equals_vectorized(block_size: int, taps: int, group_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size * 100 + taps * 10 + group_size)
    hidden, n = 32, 3 * block_size
    y = torch.randn(n, hidden, generator=gen)
    base = torch.randn(taps, hidden, generator=gen)
    delta = torch.randn(n, taps, hidden // group_size, generator=gen)
    loop = R2.grouped_conv(y, base, delta, group_size, block_size)
    vectorized = R2.grouped_conv_vectorized(y, base, delta, group_size, block_size)
    assert loop.shape == (n, hidden)
    assert torch.allclose(loop, vectorized, atol=1e-5, rtol=1e-5)
    # every row's first tap is its own (base + group delta) scaling
    first = (base[0] + delta[:, 0].repeat_interleave(group_size, dim=-1)) * y
    block_starts = torch.arange(0, n, block_size)
    assert torch.allclose(loop[block_starts], first[block_starts], atol=1e-6)


def test_conv_taps_never_cross_block_boundaries() -> None:
    gen = torch.Generator().manual_seed(0)
    block_size, taps, group_size, hidden, n = 5, 3, 4, 16, 15
    base = torch.randn(taps, hidden, generator=gen)
    delta = torch.randn(n, taps, hidden // group_size, generator=gen)
    y = torch.randn(n, hidden, generator=gen)
    out = R2.grouped_conv(y, base, delta, group_size, block_size)
    for source in range(n):
        moved = y.clone()
        moved[source] += 1.0
        changed = (R2.grouped_conv(moved, base, delta, group_size, block_size) != out).any(dim=1)
        same_block = torch.arange(n) // block_size == source // block_size
        lag = torch.arange(n) - source
        assert torch.equal(changed, same_block & (lag >= 0) & (lag < taps)), source
    # a delta only scales its own row's tap within its group of g channels
    moved_delta = delta.clone()
    moved_delta[7, 1, 2] += 1.0
    diff = R2.grouped_conv(y, base, moved_delta, group_size, block_size) != out
    assert diff.nonzero()[:, 0].unique().tolist() == [7]
    assert diff[7].nonzero()[:, 0].tolist() == list(range(2 * group_size, 3 * group_size))


def test_identity_conv_is_exact_noop() -> None:
    gen = torch.Generator().manual_seed(1)
    taps, hidden, group_size, block_size = 3, 16, 4, 4
    base = torch.zeros(2, taps, hidden)
    base[:, 0] = 1.0
    conv = R2.GroupedConvRef(base, torch.zeros(2 * taps * hidden // group_size, hidden), group_size, block_size)
    x, y = torch.randn(8, hidden, generator=gen), torch.randn(8, hidden, generator=gen)
    conv_in, out_deltas = conv.prepare(x)
    assert torch.equal(conv_in, x) and out_deltas.shape == (8, taps, hidden // group_size)
    assert torch.equal(conv.finish(y, out_deltas), y)


def test_conv_out_side_deltas_come_from_the_input() -> None:
    """prepare(x) projects x once: side 0 convolves x, side 1 deltas are kept for finish(y)."""
    gen = torch.Generator().manual_seed(2)
    taps, hidden, group_size, block_size = 2, 16, 8, 4
    groups = hidden // group_size
    conv = R2.GroupedConvRef(torch.randn(2, taps, hidden, generator=gen),
                             torch.randn(2 * taps * groups, hidden, generator=gen), group_size, block_size)
    x, y = torch.randn(8, hidden, generator=gen), torch.randn(8, hidden, generator=gen)
    conv_in, out_deltas = conv.prepare(x)
    projected = x @ conv.kernel_projection.T  # [N, 2*T*G], laid out (side, tap, group)
    for side, expected_out in ((0, conv_in), (1, None)):
        deltas = torch.stack([projected[:, (side * taps + t) * groups:(side * taps + t + 1) * groups]
                              for t in range(taps)], dim=1)
        if expected_out is None:
            assert torch.allclose(out_deltas, deltas, atol=1e-6)
        else:
            assert torch.allclose(expected_out, R2.grouped_conv(x, conv.base_kernel[0], deltas, group_size,
                                                                block_size), atol=1e-6)
    assert torch.allclose(conv.finish(y, out_deltas),
                          R2.grouped_conv_vectorized(y, conv.base_kernel[1], out_deltas, group_size, block_size),
                          atol=1e-5)


# --------------------------------------------------------------------------------------
# Writer


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_writer_published_tensor_set_and_config(target: tuple, tmp_path: pathlib.Path, dtype: str) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig

    cfg, _ = target
    n_layers, taps, group, rank, top_k = 5, 2, 16, 12, 6
    out = write_dflash2_drafter(tmp_path / "d", target_config=cfg, num_layers=n_layers, target_layer_ids=[0, 1],
                                block_size=8, conv_kernel_size=taps, conv_group_size=group, selector_rank=rank,
                                selector_top_k=top_k, output_multiplier=0.25, final_logit_softcapping=20.0,
                                dtype=dtype)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        assert {f.get_tensor(k).dtype for k in f.keys()} == {getattr(torch, dtype)}
    dflash_names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    dflash_names |= {f"layers.{i}.{n}" for i in range(n_layers) for n in PER_LAYER}
    added = {f"layers.{i}.{c}.base_kernel": (2, taps, h) for i in range(n_layers) for c in ("attention_conv", "mlp_conv")}
    added |= {f"layers.{i}.{c}.kernel_projection.weight": (2 * taps * h // group, h)
              for i in range(n_layers) for c in ("attention_conv", "mlp_conv")}
    added |= {"candidate_selector.predecessor_codebook": (v, rank), "candidate_selector.successor_codebook": (v, rank),
              "candidate_selector.hidden_projection.weight": (rank, h)}
    assert len(dflash_names) == 58 and len(added) == 23  # the published 58 + 23 at 5 layers
    assert set(shapes) == dflash_names | set(added)
    assert all(shapes[name] == shape for name, shape in added.items())
    assert shapes["fc.weight"] == (h, 2 * h) and shapes["layers.4.mlp.down_proj.weight"] == (h, cfg["intermediate_size"])
    assert shapes == dflash2_tensor_shapes(num_layers=n_layers, hidden_size=h, num_heads=cfg["num_attention_heads"],
                                           num_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
                                           intermediate_size=cfg["intermediate_size"],
                                           fc_in_features=2 * h, vocab_size=v, conv_kernel_size=taps,
                                           conv_group_size=group, selector_rank=rank)

    c = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert c["architectures"] == ["DFlash2DraftModel"] and c["model_type"] == "qwen3"
    assert c["is_causal"] is False and c["dtype"] == dtype and c["block_size"] == 8
    assert c["dflash_config"] == {
        "target_layer_ids": [0, 1], "mask_token_id": v - 1, "block_size": 8, "conv_kernel_size": taps,
        "conv_group_size": group, "selector_rank": rank, "selector_top_k": top_k, "output_multiplier": 0.25,
        "final_logit_softcapping": 20.0,
    }  # input_embedding_scale not given -> not written
    assert AutoConfig.from_pretrained(str(out)).head_dim == 32  # still a valid Qwen3Config

    d = R2.load_drafter2(out)
    assert (d.conv_kernel_size, d.conv_group_size, d.selector_rank, d.selector_top_k) == (taps, group, rank, top_k)
    assert (d.output_multiplier, d.final_logit_softcapping, d.input_embedding_scale) == (0.25, 20.0, 1.0)
    assert d.is_causal is False and d.num_layers == n_layers and d.block_size == 8
    if dtype == "bfloat16":  # same seed, written in fp32: bf16 file = fp32 values rounded to nearest even
        f32 = R2.load_drafter2(write_dflash2_drafter(
            tmp_path / "f32", target_config=cfg, num_layers=n_layers, target_layer_ids=[0, 1], block_size=8,
            conv_kernel_size=taps, conv_group_size=group, selector_rank=rank, selector_top_k=top_k))
        assert all(torch.equal(d.w(k), w.to(torch.bfloat16).float()) for k, w in f32.weights.items())


def test_writer_random_and_identity_init(target: tuple, tmp_path: pathlib.Path) -> None:
    cfg, _ = target
    kw = {"target_config": cfg, "num_layers": 2, "target_layer_ids": [0, 1], "seed": 5}
    v1 = R.load_drafter(write_dflash_drafter(tmp_path / "v1", **kw))
    rand = R2.load_drafter2(write_dflash2_drafter(tmp_path / "rand", conv_kernel_size=3, selector_rank=32, **kw))
    ident = R2.load_drafter2(write_dflash2_drafter(tmp_path / "id", conv_kernel_size=3, selector_rank=32,
                                                   identity_init=True, **kw))
    for name, w in v1.weights.items():  # the shared DFlash tensors are drawn first: same seed, same values
        assert torch.equal(rand.w(name), w) and torch.equal(ident.w(name), w), name
    base = torch.stack([rand.w(f"layers.{i}.{c}.base_kernel") for i in range(2) for c in ("attention_conv", "mlp_conv")])
    assert abs(float(base[:, :, 0].mean()) - 1.0) < 0.05 and abs(float(base[:, :, 0].std()) - 0.1) < 0.03
    assert abs(float(base[:, :, 1:].mean())) < 0.05 and abs(float(base[:, :, 1:].std()) - 0.1) < 0.03
    for name in ("layers.1.attention_conv.kernel_projection.weight", "candidate_selector.successor_codebook",
                 "candidate_selector.predecessor_codebook", "candidate_selector.hidden_projection.weight"):
        assert abs(float(rand.w(name).std()) - 0.2) < 0.03, name

    expected_base = torch.zeros(2, 3, cfg["hidden_size"])
    expected_base[:, 0] = 1.0
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            assert torch.equal(ident.w(f"layers.{i}.{conv}.base_kernel"), expected_base)
            assert not ident.w(f"layers.{i}.{conv}.kernel_projection.weight").any()
    assert not ident.w("candidate_selector.successor_codebook").any()
    assert float(ident.w("candidate_selector.predecessor_codebook").std()) > 0.1  # A and H stay random
    assert float(ident.w("candidate_selector.hidden_projection.weight").std()) > 0.1


def test_writer_refusals(target: tuple, tmp_path: pathlib.Path) -> None:
    cfg, _ = target
    good = write_dflash2_drafter(tmp_path / "good", target_config=cfg, **SMALL)
    for bad in ({"conv_group_size": 24}, {"conv_group_size": 0}, {"selector_top_k": cfg["vocab_size"]},
                {"selector_top_k": 0}, {"conv_kernel_size": 0}, {"selector_rank": 0}, {"output_multiplier": 0.0},
                {"final_logit_softcapping": -1.0}, {"input_embedding_scale": float("nan")}, {"dtype": "int8"},
                {"num_layers": 0}, {"hidden_size": 32}):
        with pytest.raises(ValueError):
            write_dflash2_drafter(tmp_path / "bad", target_config=cfg, **{**SMALL, **bad})
    with pytest.raises(TypeError):
        write_dflash2_drafter(tmp_path / "bad", target_config=cfg, is_causal=1, **SMALL)
    weights = dict(R2.load_drafter2(good).weights)
    with pytest.raises(ValueError):  # a DFlash (v1) tensor set is not a DFlash2 one
        write_dflash2_drafter(tmp_path / "bad", target_config=cfg, **SMALL,
                              weights={k: v.numpy() for k, v in weights.items() if "conv" not in k})
    with pytest.raises(ValueError):
        write_dflash2_drafter(tmp_path / "bad", target_config=cfg, **SMALL, weights={
            **{k: v.numpy() for k, v in weights.items()}, "candidate_selector.successor_codebook": np.zeros((3, 16))})
    with pytest.raises(ValueError):  # the DFlash loader refuses the extra tensors, and vice versa
        R.load_drafter(good)
    with pytest.raises(ValueError):
        R2.load_drafter2(write_dflash_drafter(tmp_path / "v1", target_config=cfg, num_layers=2, target_layer_ids=[0, 1]))


# --------------------------------------------------------------------------------------
# Backbone


@pytest.mark.parametrize(("layer_types", "is_causal"), [(None, False), (["sliding_attention"] * 2, True)])
def test_identity_drafter_is_its_dflash_backbone(target: tuple, tmp_path: pathlib.Path, layer_types: Any,
                                                 is_causal: bool) -> None:
    """identity_init: the convs are no-ops and the selector adds nothing, so DFlash2 == DFlash v1.

    The v1 drafter is written from the same 58 tensors and run through
    dflash_reference (its sliding layers are causal, full ones unmasked).
    """
    cfg, model = target
    d2 = _drafter2(cfg, tmp_path / "v2", layer_types=layer_types, sliding_window=6, is_causal=is_causal,
                   identity_init=True, output_multiplier=0.5, final_logit_softcapping=3.0, seed=11)
    added = R2.dflash2_added_shapes(2, cfg["hidden_size"], cfg["vocab_size"], 2, 8, 16)
    dflash_weights = {k: w.numpy() for k, w in d2.weights.items() if k not in added}
    assert len(dflash_weights) == 11 * 2 + 3 and len(added) == 4 * 2 + 3
    d1 = R.load_drafter(write_dflash_drafter(tmp_path / "v1", target_config=cfg, num_layers=2, target_layer_ids=[0, 1],
                                             block_size=8, layer_types=layer_types, sliding_window=6,
                                             weights=dflash_weights))
    p = len(PROMPT)
    _, feats = R.target_features(model, PROMPT, d1.target_layer_ids)
    block, positions = torch.tensor([11] + [d1.mask_token_id] * 7), torch.arange(p, p + 8)
    hidden = {}
    for name, drafter in (("v1", d1), ("v2", d2)):
        cache = R.ContextKV.empty(drafter)
        R.append_context(drafter, cache, feats, torch.arange(p))
        hidden[name] = R.draft_hidden(drafter, model, cache, block, positions)
    assert torch.equal(hidden["v1"], hidden["v2"])

    v1_drafts, v1_logits = R.propose_ref(model, d1, PROMPT)
    proposal = R2.propose2_ref(model, d2, PROMPT)
    assert torch.equal(proposal.edges, proposal.unary[:, None, :].expand(-1, 8, -1))  # B = 0: edges = unary
    assert torch.equal(proposal.draft_ids, proposal.candidate_ids[torch.arange(7), proposal.unary.argmax(dim=-1)])
    assert torch.equal(proposal.draft_ids, v1_drafts)  # the unary top-1 (monotonic scale + cap) = v1's argmax
    assert torch.equal(proposal.candidate_ids[:, 0], v1_logits.argmax(dim=-1))
    assert R2.spec_generate2_ref(model, d2, PROMPT, 12, num_spec=5) == R.spec_generate_ref(model, d1, PROMPT, 12,
                                                                                           num_spec=5)


def test_attention_mask_definitions() -> None:
    q_pos, k_pos, window = torch.arange(10, 18), torch.arange(0, 18), 4
    for layer_type in ("full_attention", "sliding_attention"):
        for is_causal in (False, True):
            mask = R.attention_mask(layer_type, is_causal, q_pos, k_pos, window)
            expected = [[(not is_causal or k <= q) and (layer_type == "full_attention" or abs(q - k) < window)
                         for k in k_pos.tolist()] for q in q_pos.tolist()]
            if layer_type == "full_attention" and not is_causal:
                assert mask is None
            else:
                assert mask.tolist() == expected, (layer_type, is_causal)


def test_causality_precedence(target: tuple, tmp_path: pathlib.Path) -> None:
    cfg, model = target
    d = _drafter2(cfg, tmp_path / "d", layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    assert d.is_causal is False and [d.layer_is_causal(i) for i in range(2)] == [False, False]
    assert [dataclasses.replace(d, is_causal=True).layer_is_causal(i) for i in range(2)] == [True, True]
    absent = dataclasses.replace(d, is_causal=None)
    assert [absent.layer_is_causal(i) for i in range(2)] == [True, False]  # DFlash / z-lab rule: sliding = causal
    assert dataclasses.replace(absent, dflash_causal=True).layer_is_causal(1) is True  # vLLM: dflash_config.causal

    # behaviour: one sliding layer (window 3, 2 taps); which block rows a change reaches
    window, taps, num_rows = 3, 2, 8
    swa = _drafter2(cfg, tmp_path / "s", num_layers=1, target_layer_ids=[0, 1],
                    layer_types=["sliding_attention"], sliding_window=window, conv_kernel_size=taps)
    p = len(PROMPT)
    _, feats = R.target_features(model, PROMPT, swa.target_layer_ids)
    block = torch.tensor([7] + [swa.mask_token_id] * 7)
    moved_block = block.clone()
    moved_block[3] = 100  # block row 3 (position p + 3)
    moved_feats = feats.clone()
    moved_feats[p - 1] += 1.0  # context position p - 1

    def hidden_rows(drafter: R2.Draft2Ref, f: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        cache = R.ContextKV.empty(drafter)
        R.append_context(drafter, cache, f, torch.arange(p))
        return R.draft_hidden(drafter, model, cache, b, torch.arange(p, p + num_rows))

    for drafter in (swa, dataclasses.replace(swa, is_causal=True)):
        def attends(q: int, k: int, causal: bool = bool(drafter.is_causal)) -> bool:  # block-relative rows
            return (k <= q or not causal) and abs(q - k) < window

        base = hidden_rows(drafter, feats, block)
        changed = (hidden_rows(drafter, feats, moved_block) != base).any(dim=1)
        assert changed.nonzero()[:, 0].tolist() == _rows_reached({3}, set(), attends, taps, num_rows)
        # context position p - 1 = block row -1: only attention reads it
        from_context = {q for q in range(num_rows) if attends(q, -1)}
        changed = (hidden_rows(drafter, moved_feats, block) != base).any(dim=1)
        assert changed.nonzero()[:, 0].tolist() == _rows_reached(set(), from_context, attends, taps, num_rows)


def _rows_reached(changed: set[int], attention_also: set[int], attends: Any, taps: int, num_rows: int) -> list[int]:
    """Block rows of one layer's output that depend on `changed` input rows (dependency propagation).

    Each sublayer s is x + finish(s(prepare(norm x))): prepare / finish reach rows
    i - t -> i (t < taps, one block), the deltas are per row, attention row q
    reads key rows k with attends(q, k), and `attention_also` are rows whose
    attention output changes through the context keys.
    """
    def conv(rows: set[int]) -> set[int]:
        return {i for i in range(num_rows) for t in range(taps) if i - t in rows}

    x = set(changed)
    attn_in = conv(x)
    attn_out = {q for q in range(num_rows) if q in attn_in or any(attends(q, k) for k in attn_in)} | attention_also
    x |= conv(attn_out | x)
    x |= conv(conv(x) | x)  # MLP: row-wise between its two convs
    return sorted(x)


def test_input_embedding_scale_multiplies_block_embeddings(target: tuple, tmp_path: pathlib.Path) -> None:
    cfg, model = target
    scale = 2.5
    scaled = _drafter2(cfg, tmp_path / "d", input_embedding_scale=scale)
    assert json.loads((tmp_path / "d" / "config.json").read_text())["dflash_config"]["input_embedding_scale"] == scale
    unscaled = dataclasses.replace(scaled, input_embedding_scale=1.0)

    class ScaledEmbeddings:
        """The target with embed_tokens * scale (same lm_head)."""

        def get_input_embeddings(self) -> Any:
            return torch.nn.Embedding.from_pretrained(model.get_input_embeddings().weight * scale)

        def get_output_embeddings(self) -> Any:
            return model.get_output_embeddings()

    p = len(PROMPT)
    _, feats = R.target_features(model, PROMPT, scaled.target_layer_ids)
    block, positions = torch.tensor([11] + [scaled.mask_token_id] * 7), torch.arange(p, p + 8)
    out = {}
    for name, drafter, tgt in (("scaled", scaled, model), ("unscaled", unscaled, model),
                               ("scaled_target", unscaled, ScaledEmbeddings())):
        cache = R.ContextKV.empty(drafter)
        R.append_context(drafter, cache, feats, torch.arange(p))
        out[name] = R.draft_hidden(drafter, tgt, cache, block, positions)
    assert torch.allclose(out["scaled"], out["scaled_target"], atol=1e-5)
    assert not torch.allclose(out["scaled"], out["unscaled"], atol=1e-2)


# --------------------------------------------------------------------------------------
# Candidates, edges, walk


def test_top_k_prefers_lower_ids_on_ties() -> None:
    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0, 1.0, -3.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    values, ids = R2.top_k_lowest_index(logits, 4)
    assert ids.tolist() == [[1, 3, 2, 4], [0, 1, 2, 3]]
    assert torch.equal(values, logits.gather(1, ids))


def test_candidates_and_unary(target: tuple, tmp_path: pathlib.Path) -> None:
    cfg, model = target
    d = _drafter2(cfg, tmp_path / "d", output_multiplier=0.3, final_logit_softcapping=2.0)
    hidden = torch.randn(5, cfg["hidden_size"], generator=torch.Generator().manual_seed(3))
    ids, unary = R2.candidates_ref(d, model, hidden)
    logits = model.lm_head(hidden).detach()
    assert ids.shape == unary.shape == (5, 8) and unary.dtype == torch.float32
    assert torch.equal(ids, logits.topk(8, dim=-1).indices)  # no ties in random logits
    capped_full = torch.tanh(logits * 0.3 / 2.0) * 2.0  # z-lab's order: scale and cap the whole row, then top-K
    assert torch.allclose(unary, capped_full.gather(1, ids), atol=1e-6)
    assert (unary[:, :-1] >= unary[:, 1:]).all() and unary.abs().max() < 2.0


def test_edge_scores_match_the_formula(target: tuple, tmp_path: pathlib.Path) -> None:
    cfg, model = target
    d = _drafter2(cfg, tmp_path / "d", selector_top_k=4, selector_rank=6)
    proposal = R2.propose2_ref(model, d, PROMPT, num_spec=3)
    anchor = int(R.target_features(model, PROMPT, [0])[0][-1].argmax())
    a, b = d.w("candidate_selector.predecessor_codebook"), d.w("candidate_selector.successor_codebook")
    cand = proposal.candidate_ids
    p = len(PROMPT)
    _, feats = R.target_features(model, PROMPT, d.target_layer_ids)
    cache = R.ContextKV.empty(d)
    R.append_context(d, cache, feats, torch.arange(p))
    slot_hidden = R.draft_hidden(d, model, cache, [anchor] + [d.mask_token_id] * 3, torch.arange(p, p + 4))[1:]
    hid = slot_hidden @ d.w("candidate_selector.hidden_projection.weight").T
    assert proposal.edges.shape == (3, 4, 4)
    for s in range(3):
        for pr in range(4):
            predecessor = anchor if s == 0 else int(cand[s - 1, pr])
            for c in range(4):
                bilinear = sum(float(a[predecessor, r] * hid[s, r] * b[int(cand[s, c]), r]) for r in range(6))
                assert math.isclose(float(proposal.edges[s, pr, c]), float(proposal.unary[s, c]) + bilinear,
                                    rel_tol=1e-5, abs_tol=1e-5)
    assert torch.equal(proposal.edges[0], proposal.edges[0, :1].expand(4, -1))  # slot 0: every row has the anchor
    assert not torch.allclose(proposal.edges[1], proposal.edges[1, :1].expand(4, -1))


def test_greedy_walk_follows_the_realized_rows() -> None:
    gen = torch.Generator().manual_seed(4)
    num_slots, k = 6, 5
    edges = torch.randn(num_slots, k, k, generator=gen)
    candidate_ids = torch.randint(0, 300, (num_slots, k), generator=gen)
    walk = R2.walk_ref(edges, candidate_ids)
    prev = 0
    for s in range(num_slots):
        row = edges[s, prev]
        assert torch.equal(walk.realized_rows[s], row)
        assert int(walk.chosen[s]) == int(row.argmax()) and int(walk.draft_ids[s]) == int(candidate_ids[s, walk.chosen[s]])
        assert torch.equal(walk.proposal_probs[s], torch.nn.functional.one_hot(walk.chosen[s], k).float())
        prev = int(walk.chosen[s])

    inf, nan = float("inf"), float("nan")
    special = torch.stack([  # every predecessor row of a slot equal, so the walk's path does not matter
        torch.tensor([1.0, 3.0, nan, 3.0, 2.0]).expand(k, k),  # tie -> lowest index; NaN never wins
        torch.tensor([nan, -inf, -inf, nan, -inf]).expand(k, k),  # nothing finite -> index 0
        torch.tensor([0.0, inf, 1.0, inf, 5.0]).expand(k, k),  # the first +inf
    ])
    assert R2.walk_ref(special, candidate_ids[:3]).chosen.tolist() == [1, 0, 1]
    for seed in range(10):
        sampled = R2.walk_ref(special, candidate_ids[:3], temperature=0.7, seed=seed)
        assert sampled.chosen[0] != 2 and sampled.chosen.tolist()[1:] == [0, 1]
        assert sampled.proposal_probs[1].tolist() == [1, 0, 0, 0, 0] and sampled.proposal_probs[2].tolist() == [0, 1, 0, 0, 0]
        assert sampled.proposal_probs[0, 2] == 0 and math.isclose(float(sampled.proposal_probs[0].sum()), 1, rel_tol=1e-6)


def test_sampled_walk_matches_softmax(target: tuple, tmp_path: pathlib.Path) -> None:
    """Over 2500 seeds, slot 0 follows softmax(row / T), and slot 1 softmax(edges[1, prev] / T) given prev."""
    cfg, model = target
    d = _drafter2(cfg, tmp_path / "d", selector_top_k=6)
    proposal = R2.propose2_ref(model, d, PROMPT, num_spec=2)
    temperature, anchor_position, num_seeds = 0.75, len(PROMPT), 2500
    edges = proposal.edges / proposal.edges.std()  # moderate spread: every candidate gets drawn
    chosen = torch.stack([R2.walk_ref(edges, proposal.candidate_ids, temperature=temperature, seed=seed,
                                      anchor_position=anchor_position).chosen for seed in range(num_seeds)])
    q0 = torch.softmax(edges[0, 0].double() / temperature, dim=-1)
    counts0 = torch.bincount(chosen[:, 0], minlength=6).double()
    assert (counts0 > 0).sum() >= 4
    assert _chi2(counts0, q0) < _chi2_critical(5)
    prev = int(counts0.argmax())
    given = chosen[chosen[:, 0] == prev, 1]
    q1 = torch.softmax(edges[1, prev].double() / temperature, dim=-1)
    assert _chi2(torch.bincount(given, minlength=6).double(), q1) < _chi2_critical(5)
    walk = R2.walk_ref(edges, proposal.candidate_ids, temperature=temperature, seed=0, anchor_position=anchor_position)
    assert torch.allclose(walk.proposal_probs[0], q0.float()) and torch.allclose(walk.realized_rows[0], edges[0, 0])


def test_sampled_walk_noise_is_keyed_by_position_and_token_id() -> None:
    gen = torch.Generator().manual_seed(5)
    num_slots, k, temperature = 3, 6, 1.25  # exact in fp32
    edges = torch.randn(num_slots, k, k, generator=gen)
    edges[0] = edges[0, :1].clone()  # slot 0: every row has the anchor as predecessor
    candidate_ids = torch.stack([torch.randperm(300, generator=gen)[:k] for _ in range(num_slots)])
    order = torch.randperm(k, generator=gen)
    permuted_edges = edges[:, order][:, :, order]  # candidates listed in another order, same scores per token pair
    moved_differs = 0
    for seed in range(40):
        walk = R2.walk_ref(edges, candidate_ids, temperature=temperature, seed=seed, anchor_position=17)
        # explicit Gumbel-max at slot 0, keyed (seed, position 18, token id, stream 1)
        scores = [float(edges[0, 0, c]) / temperature + R2.gumbel_noise(seed, 18, int(candidate_ids[0, c]))
                  for c in range(k)]
        assert int(walk.chosen[0]) == max(range(k), key=lambda c: scores[c])
        permuted = R2.walk_ref(permuted_edges, candidate_ids[:, order], temperature=temperature, seed=seed,
                               anchor_position=17)
        assert torch.equal(permuted.draft_ids, walk.draft_ids)  # same tokens: noise follows ids, not slots
        moved = R2.walk_ref(edges, candidate_ids, temperature=temperature, seed=seed, anchor_position=18)
        moved_differs += int(not torch.equal(moved.draft_ids, walk.draft_ids))
    assert moved_differs > 5
    u = R2.philox_uniform(7, 18, 3, R2.DRAFT_SAMPLE_STREAM)
    assert u != R2.philox_uniform(7, 18, 3, 0) and 0.0 < u < 1.0


def test_philox_matches_cpp_header(tmp_path: pathlib.Path) -> None:
    """The pure-Python Philox equals cpp/common/philox.h compiled with the system C++ compiler."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    source = tmp_path / "philox_dump.cpp"
    source.write_text(
        '#include "philox.h"\n#include <cstdio>\n'
        "int main() { unsigned long long seed, pos; unsigned idx, stream;\n"
        '  while (std::scanf("%llu %llu %u %u", &seed, &pos, &idx, &stream) == 4)\n'
        '    std::printf("%u %a\\n", dflash::philox_u32(seed, pos, idx, stream),\n'
        "                (double)dflash::philox_uniform(seed, pos, idx, stream));\n}\n", encoding="utf-8")
    binary = tmp_path / "philox_dump"
    subprocess.run([compiler, "-std=c++17", "-O1", f"-I{REPO_ROOT / 'cpp' / 'common'}", str(source), "-o",
                    str(binary)], check=True)
    cases = [(0, 0, 0, 0), (1, 2, 3, 1), (2**64 - 1, 2**40 + 5, 2**32 - 1, 2), (123456789, 17, 248319, 1)]
    cases += [(seed, 9 + seed, 40 * seed + 3, 1) for seed in range(20)]
    stdin = "".join(f"{s} {p} {i} {st}\n" for s, p, i, st in cases)
    lines = subprocess.run([str(binary)], input=stdin, capture_output=True, text=True, check=True).stdout.split("\n")
    for (seed, pos, idx, stream), line in zip(cases, lines):
        word, uniform = line.split()
        assert int(word) == R2.philox_u32(seed, pos, idx, stream)
        assert float.fromhex(uniform) == R2.philox_uniform(seed, pos, idx, stream)


# --------------------------------------------------------------------------------------
# Rejection sampling and loops


def test_accept_with_q_is_lossless() -> None:
    """x ~ q, then accept_with_q: the first emitted token is distributed as p (chi-square)."""
    gen = torch.Generator().manual_seed(6)
    vocab, trials = 7, 6000
    p_rows = torch.softmax(torch.randn(2, vocab, generator=gen) * 1.5, dim=-1)
    q_ids = torch.tensor([[5, 1, 2]])
    q_probs = torch.softmax(torch.randn(1, 3, generator=gen), dim=-1)
    first = torch.zeros(vocab, dtype=torch.float64)
    accepted = 0
    for _ in range(trials):
        u = torch.rand(3, generator=gen, dtype=torch.float64)
        x = int(q_ids[0, R2.draw_inverse_cdf(q_probs[0], float(u[0]))])
        a, token = R2.accept_with_q(p_rows, torch.tensor([x]), q_ids, q_probs, u[1:])
        first[x if a == 1 else token] += 1
        accepted += a
    assert _chi2(first, p_rows[0]) < _chi2_critical(vocab - 1)
    dense_q = torch.zeros(vocab).index_add_(0, q_ids[0], q_probs[0])
    expected_rate = float(torch.minimum(p_rows[0], dense_q).sum())  # P(accept) = sum_x min(p, q)
    assert abs(accepted / trials - expected_rate) < 4 * math.sqrt(expected_rate * (1 - expected_rate) / trials)


def test_accept_with_q_rules() -> None:
    p_rows = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 1.0, 0.0]])
    q_ids = torch.tensor([[0, 1], [3, 2]])
    q_probs = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    drafts = torch.tensor([1, 3])
    # u*q(x) < p(x): 0.5*0.5 < 0.3 accepts, 0.95*0.5 >= 0.3 rejects -> residual max(p - q, 0) = [0, 0, .2, 0]
    assert R2.accept_with_q(p_rows, drafts, q_ids, q_probs, torch.tensor([0.5, 0.0, 0.9])) == (2, 2)  # bonus from p_2
    assert R2.accept_with_q(p_rows, drafts, q_ids, q_probs, torch.tensor([0.95, 0.0, 0.1])) == (0, 2)
    # q = one-hot at 3 (greedy draft), p(3) = 0.4: accepted iff u < 0.4; residual = p without 3
    assert R2.accept_with_q(p_rows, drafts, q_ids, q_probs, torch.tensor([0.1, 0.39, 0.5]))[0] == 2
    a, token = R2.accept_with_q(p_rows, drafts, q_ids, q_probs, torch.tensor([0.1, 0.41, 0.99]))
    assert (a, token) == (1, 2)  # residual [0.1, 0.2, 0.3, 0] / 0.6: u=0.99 lands on id 2
    with pytest.raises(ValueError):
        R2.accept_with_q(p_rows, drafts, q_ids, q_probs, torch.tensor([0.1, 0.2]))


def test_propose2_shapes_and_walk_consistency(target: tuple, tmp_path: pathlib.Path) -> None:
    cfg, model = target
    d = _drafter2(cfg, tmp_path / "d", conv_kernel_size=3)
    for temperature in (0.0, 1.0):
        prop = R2.propose2_ref(model, d, PROMPT, temperature=temperature, seed=1)
        assert prop.draft_ids.shape == (7,) and prop.candidate_ids.shape == prop.unary.shape == (7, 8)
        assert prop.edges.shape == (7, 8, 8) and prop.realized_rows.shape == prop.proposal_probs.shape == (7, 8)
        chosen = (prop.candidate_ids == prop.draft_ids[:, None]).float().argmax(dim=1)
        assert torch.equal(prop.candidate_ids.gather(1, chosen[:, None])[:, 0], prop.draft_ids)
        prev = torch.cat((torch.zeros(1, dtype=torch.long), chosen[:-1]))
        assert torch.equal(prop.realized_rows, prop.edges[torch.arange(7), prev])
        assert torch.allclose(prop.proposal_probs.sum(dim=1), torch.ones(7))
    assert R2.propose2_ref(model, d, PROMPT, num_spec=3).draft_ids.shape == (3,)


def test_spec_generate2_equals_greedy(target: tuple, tmp_path: pathlib.Path) -> None:
    cfg, model = target
    d = _drafter2(cfg, tmp_path / "d", layer_types=["sliding_attention", "full_attention"], sliding_window=5,
                  output_multiplier=0.7, final_logit_softcapping=15.0, input_embedding_scale=1.5)
    for prompt, num_spec in ((PROMPT, None), ([5, 17, 99, 200, 31, 44], 3)):
        greedy = R.greedy_generate_ref(model, prompt, 16)
        tokens, per_step = R2.spec_generate2_ref(model, d, prompt, 16, num_spec=num_spec)
        assert tokens == greedy and len(tokens) == 16
        assert len(tokens) == 1 + len(per_step) + sum(per_step)
        assert all(0 <= a <= (num_spec or 7) for a in per_step)

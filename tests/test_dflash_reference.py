# tests/test_dflash_reference.py
#
# Checks of the DFlash drafter checkpoint writer (dflash.drafter_format) and of
# the plain-PyTorch reference (tests/reference/dflash_reference.py), so that
# the C++ drafter / loop can be validated against the reference.
from __future__ import annotations

import json
import pathlib
from typing import Any

import numpy as np
import pytest
import torch

from dflash.drafter_format import build_target_layer_ids, write_dflash_drafter
from tests.fixtures.tiny_models import write_preset
from tests.reference import dflash_reference as R

TARGETS = ("llama_gqa", "qwen3")
PROMPTS = ([5, 17, 99, 200, 31, 44], [1, 300, 12, 12, 7], [250, 3, 81, 64, 128, 9, 33, 140, 2, 77, 210])
PER_LAYER = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[pathlib.Path, dict[str, Any], Any]]:
    """{preset: (dir, config dict, fp32 HF model)} for the two tiny targets used here."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("dflash_ref_targets")
    out = {}
    for name in TARGETS:
        d = write_preset(name, root / name)
        cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
        out[name] = (d, cfg, model)
    return out


def _drafter(targets: dict, name: str, tmp_path: pathlib.Path, **kw: Any) -> R.DraftRef:
    _, cfg, _ = targets[name]
    kw.setdefault("num_layers", 2)
    kw.setdefault("target_layer_ids", [0, 1])  # includes the last target layer (2-layer targets)
    return R.load_drafter(write_dflash_drafter(tmp_path / "drafter", target_config=cfg, **kw))


# --------------------------------------------------------------------------------------
# Writer / loader


def test_build_target_layer_ids_published_values() -> None:
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-4B/8B
    assert build_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]  # Llama-3.1-8B
    assert build_target_layer_ids(24, 5) == [1, 6, 11, 16, 21]  # gpt-oss-20b
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # Qwen3.5-27B
    assert build_target_layer_ids(60, 6) == [1, 12, 23, 35, 46, 57]  # gemma-4-31B
    assert build_target_layer_ids(2, 1) == [1]
    for t in range(4, 70):
        for d in range(1, 9):
            assert build_target_layer_ids(t, d) == R.build_target_layer_ids(t, d)
    with pytest.raises(ValueError):
        build_target_layer_ids(2, 2)  # the published rule gives [1, -1]
    with pytest.raises(ValueError):
        build_target_layer_ids(36, 0)


def test_writer_tensor_set_config_and_loader(targets: dict, tmp_path: pathlib.Path) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig

    _, cfg, _ = targets["qwen3"]
    n_layers = 3
    out = write_dflash_drafter(tmp_path / "d", target_config=cfg, num_layers=n_layers, target_layer_ids=[0, 1],
                               block_size=8)
    h, hd, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    assert hd == 32 and hd != h // cfg["num_attention_heads"]  # head_dim copied, not derived
    with safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{n}" for i in range(n_layers) for n in PER_LAYER}
    assert set(shapes) == expected and len(shapes) == 11 * n_layers + 3
    assert shapes["fc.weight"] == (h, 2 * h)
    assert shapes["layers.0.self_attn.q_proj.weight"] == (cfg["num_attention_heads"] * hd, h)
    assert shapes["layers.2.self_attn.k_proj.weight"] == (cfg["num_key_value_heads"] * hd, h)
    assert shapes["layers.1.self_attn.o_proj.weight"] == (h, cfg["num_attention_heads"] * hd)
    assert shapes["layers.1.self_attn.q_norm.weight"] == (hd,)
    assert shapes["layers.0.mlp.down_proj.weight"] == (h, inter)

    c = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
    assert c["block_size"] == 8 and c["num_target_layers"] == 2
    assert c["dflash_config"] == {"target_layer_ids": [0, 1], "mask_token_id": cfg["vocab_size"] - 1}
    assert c["num_hidden_layers"] == n_layers and c["vocab_size"] == cfg["vocab_size"] == 359
    assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (h, 4, 2, 32)
    assert c["rope_theta"] == 1e6 and c["rms_norm_eps"] == cfg["rms_norm_eps"]
    assert c["intermediate_size"] == inter and c["max_position_embeddings"] == cfg["max_position_embeddings"]
    assert c["hidden_act"] == "silu" and c["attention_bias"] is False and c["tie_word_embeddings"] is False
    assert c["layer_types"] == ["full_attention"] * n_layers
    assert c["dtype"] == c["torch_dtype"] == "float32"
    assert AutoConfig.from_pretrained(str(out)).head_dim == 32  # a valid Qwen3Config

    d = R.load_drafter(out)
    assert (d.num_layers, d.block_size, d.mask_token_id, d.target_layer_ids) == (3, 8, 358, [0, 1])
    assert (d.hidden_size, d.num_heads, d.num_kv_heads, d.head_dim, d.rope_theta) == (h, 4, 2, 32, 1e6)
    norm = d.w("layers.0.input_layernorm.weight")
    assert abs(float(norm.mean()) - 1.0) < 0.1 and 0.02 < float(norm.std()) < 0.3
    assert abs(float(d.w("layers.1.mlp.up_proj.weight").std()) - 0.2) < 0.03


def test_writer_defaults_and_weights_argument(targets: dict, tmp_path: pathlib.Path) -> None:
    _, cfg, _ = targets["llama_gqa"]
    a = R.load_drafter(write_dflash_drafter(tmp_path / "a", target_config=cfg, seed=3))
    assert a.target_layer_ids == [1] and a.num_layers == 1 and a.block_size == 16  # rule: [T // 2]
    assert a.rope_theta == 10000.0 and a.head_dim == cfg["hidden_size"] // cfg["num_attention_heads"]
    weights = {k: v.numpy() * 0.5 for k, v in a.weights.items()}
    b = R.load_drafter(write_dflash_drafter(tmp_path / "b", target_config=cfg, weights=weights))
    for k, v in weights.items():
        assert torch.equal(b.w(k), torch.from_numpy(v))
    bad = dict(weights)
    bad.pop("norm.weight")
    with pytest.raises(ValueError):
        write_dflash_drafter(tmp_path / "c", target_config=cfg, weights=bad)
    with pytest.raises(ValueError):
        write_dflash_drafter(tmp_path / "c", target_config=cfg, weights={**weights, "fc.weight": np.zeros((2, 2))})
    with pytest.raises(ValueError):
        write_dflash_drafter(tmp_path / "c", target_config=cfg, weights={**weights, "lm_head.weight": np.zeros(1)})
    for kw in ({"dtype": "int8"}, {"hidden_size": 32}, {"mask_token_id": 359}, {"target_layer_ids": [2]},
               {"num_layers": 0}, {"layer_types": ["sliding_attention"]}, {"num_kv_heads": 3}):
        with pytest.raises(ValueError):
            write_dflash_drafter(tmp_path / "c", target_config=cfg, **kw)


def test_bf16_written_files_load(targets: dict, tmp_path: pathlib.Path) -> None:
    from safetensors import safe_open

    _, cfg, _ = targets["qwen3"]
    f32 = R.load_drafter(write_dflash_drafter(tmp_path / "f32", target_config=cfg, seed=7))
    out = write_dflash_drafter(tmp_path / "bf16", target_config=cfg, seed=7, dtype="bfloat16")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    bf16 = R.load_drafter(out)
    for k, v in f32.weights.items():  # our encoder rounds to nearest even, like torch
        assert torch.equal(bf16.w(k), v.to(torch.bfloat16).float()), k


# --------------------------------------------------------------------------------------
# Target features


def test_target_features_last_layer_is_pre_norm(targets: dict) -> None:
    _, cfg, model = targets["llama_gqa"]
    ids = torch.tensor(PROMPTS[2])
    logits, feats = R.target_features(model, ids, [0, 1])
    out = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
    ht = cfg["hidden_size"]
    assert feats.shape == (ids.numel(), 2 * ht)
    assert torch.allclose(logits, out.logits[0], atol=1e-5)
    assert torch.equal(feats[:, :ht], out.hidden_states[1][0])  # output of layer 0
    last = feats[:, ht:]
    hs_last = out.hidden_states[-1][0]  # transformers 5.x: replaced by last_hidden_state (post final norm)
    assert not torch.allclose(last, hs_last, atol=1e-2)
    with torch.no_grad():
        assert torch.allclose(model.model.norm(last), hs_last, atol=1e-5)
    with pytest.raises(ValueError):
        R.target_features(model, ids, [2])


# --------------------------------------------------------------------------------------
# Drafter forward


@pytest.mark.parametrize("layer_types", [None, ["sliding_attention", "full_attention"]])
def test_chunked_context_equals_whole(targets: dict, tmp_path: pathlib.Path, layer_types: Any) -> None:
    _, _, model = targets["qwen3"]
    drafter = _drafter(targets, "qwen3", tmp_path, layer_types=layer_types, sliding_window=5, block_size=8)
    ids = torch.tensor(PROMPTS[2] + PROMPTS[0])
    p = ids.numel()
    _, feats = R.target_features(model, ids, drafter.target_layer_ids)
    block = torch.tensor([11] + [drafter.mask_token_id] * 7)
    bpos = torch.arange(p, p + 8)
    whole = R.draft_forward(drafter, model, feats, torch.arange(p), block, bpos)
    assert whole.shape == (7, 359)

    cache = R.ContextKV.empty(drafter)
    c1 = 9  # first call drafts at positions 9.. ; its block K/V must not stay in the cache
    first_block = torch.tensor([int(ids[c1])] + [drafter.mask_token_id] * 7)
    R.draft_forward(drafter, model, feats[:c1], torch.arange(c1), first_block, torch.arange(c1, c1 + 8),
                    cached_ctx_kv=cache)
    assert len(cache) == c1
    chunked = R.draft_forward(drafter, model, feats[c1:], torch.arange(c1, p), block, bpos, cached_ctx_kv=cache)
    assert len(cache) == p
    assert torch.allclose(chunked, whole, atol=1e-5, rtol=1e-5)


def test_draft_forward_matches_transformers_qwen3_layers(targets: dict, tmp_path: pathlib.Path) -> None:
    """Independent check of the drafter math against transformers' own Qwen3 layers.

    Like the z-lab HF reference: the context K/V are put into a DynamicCache,
    the block runs through Qwen3Model layers with an all-zero (non-causal)
    mask over [context ++ block], then the target lm_head on rows 1..B-1.
    """
    import inspect

    from transformers import Qwen3Config, Qwen3Model
    from transformers.cache_utils import DynamicCache

    _, _, model = targets["qwen3"]
    drafter = _drafter(targets, "qwen3", tmp_path, block_size=8)
    ids = torch.tensor(PROMPTS[2])
    p, b = ids.numel(), 8
    _, feats = R.target_features(model, ids, drafter.target_layer_ids)
    block, bpos = torch.tensor([11] + [drafter.mask_token_id] * (b - 1)), torch.arange(p, p + b)
    ctx = R.ContextKV.empty(drafter)
    ours = R.draft_forward(drafter, model, feats, torch.arange(p), block, bpos, cached_ctx_kv=ctx)

    hc = Qwen3Config(
        hidden_size=drafter.hidden_size, intermediate_size=drafter.intermediate_size,
        num_hidden_layers=drafter.num_layers, num_attention_heads=drafter.num_heads,
        num_key_value_heads=drafter.num_kv_heads, head_dim=drafter.head_dim, rms_norm_eps=drafter.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": drafter.rope_theta},
        vocab_size=model.config.vocab_size, max_position_embeddings=512)
    hc._attn_implementation = "eager"
    hf = Qwen3Model(hc).eval()
    state = {k: v for k, v in drafter.weights.items() if k.startswith("layers.") or k == "norm.weight"}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert missing == ["embed_tokens.weight"] and not unexpected
    kv = DynamicCache(config=hc)
    for i in range(drafter.num_layers):
        kv.update(ctx.keys[i].transpose(0, 1)[None], ctx.values[i].transpose(0, 1)[None], i)
    cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = hf(inputs_embeds=model.get_input_embeddings()(block)[None], position_ids=bpos[None],
                 attention_mask={"full_attention": torch.zeros(1, 1, b, p + b)}, use_cache=True,
                 **{cache_kw: kv})
        theirs = model.lm_head(out.last_hidden_state[0, 1:])
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_attention_pattern_full_vs_sliding(targets: dict, tmp_path: pathlib.Path) -> None:
    _, _, model = targets["llama_gqa"]
    full = _drafter(targets, "llama_gqa", tmp_path / "f", num_layers=1, block_size=8)
    swa = _drafter(targets, "llama_gqa", tmp_path / "s", num_layers=1, block_size=8,
                   layer_types=["sliding_attention"], sliding_window=4)
    ids = torch.tensor(PROMPTS[2])
    p = ids.numel()
    _, feats = R.target_features(model, ids, [0, 1])
    feats2 = feats.clone()
    feats2[p - 1] += 1.0  # perturb the context row just before the anchor
    block = torch.tensor([7] + [full.mask_token_id] * 7)
    block2 = block.clone()
    block2[-1] = 100  # change the last block token
    pos, bpos = torch.arange(p), torch.arange(p, p + 8)

    base = R.draft_forward(full, model, feats, pos, block, bpos)
    assert not torch.allclose(R.draft_forward(full, model, feats2, pos, block, bpos)[-1], base[-1])
    assert not torch.allclose(R.draft_forward(full, model, feats, pos, block2, bpos)[0], base[0])  # non-causal

    base = R.draft_forward(swa, model, feats, pos, block, bpos)
    moved = R.draft_forward(swa, model, feats2, pos, block, bpos)
    # row r predicts position p+1+r; key p-1 is visible iff (p+1+r) - (p-1) < 4, i.e. r <= 1
    assert not torch.allclose(moved[:2], base[:2])
    assert torch.equal(moved[2:], base[2:])
    assert torch.equal(R.draft_forward(swa, model, feats, pos, block2, bpos)[:-1], base[:-1])  # causal


def test_propose_ref(targets: dict, tmp_path: pathlib.Path) -> None:
    _, _, model = targets["qwen3"]
    drafter = _drafter(targets, "qwen3", tmp_path, block_size=6)
    ids, logits = R.propose_ref(model, drafter, PROMPTS[0])
    assert ids.shape == (5,) and logits.shape == (5, 359) and torch.equal(ids, logits.argmax(-1))
    ids3, logits3 = R.propose_ref(model, drafter, PROMPTS[0], num_spec=3)
    assert ids3.shape == (3,) and logits3.shape == (3, 359)


# --------------------------------------------------------------------------------------
# Draft-verify loop


@pytest.mark.parametrize("name", TARGETS)
def test_spec_generate_equals_greedy(targets: dict, tmp_path: pathlib.Path, name: str) -> None:
    _, _, model = targets[name]
    drafter = _drafter(targets, name, tmp_path, block_size=8)
    for prompt, num_spec in zip(PROMPTS, (None, 3, 12)):
        greedy = R.greedy_generate_ref(model, prompt, 40)
        tokens, per_step = R.spec_generate_ref(model, drafter, prompt, 40, num_spec=num_spec)
        assert tokens == greedy
        assert len(tokens) == 40
        assert len(tokens) == 1 + len(per_step) + sum(per_step)  # prefill token + (accepted + bonus) per step
        assert all(0 <= a <= (num_spec if num_spec is not None else 7) for a in per_step)


def test_spec_generate_stops_at_eos(targets: dict, tmp_path: pathlib.Path) -> None:
    _, _, model = targets["llama_gqa"]
    drafter = _drafter(targets, "llama_gqa", tmp_path, block_size=8)
    prompt = PROMPTS[1]
    free = R.greedy_generate_ref(model, prompt, 30)
    eos = free[12]
    greedy = R.greedy_generate_ref(model, prompt, 30, eos_ids=(eos,))
    tokens, per_step = R.spec_generate_ref(model, drafter, prompt, 30, eos_ids=(eos,))
    assert tokens == greedy and tokens[-1] == eos and tokens.count(eos) == 1
    assert len(tokens) == 1 + len(per_step) + sum(per_step)


def test_loop_bookkeeping_with_oracle_drafter(targets: dict, tmp_path: pathlib.Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Replace the drafter by an oracle that is right except at positions == 3 (mod 7).

    Checks exact per-step acceptance, the block/context positions handed to the
    drafter, and that the context rows are the target features of exactly the
    committed tokens before the anchor.
    """
    _, _, model = targets["qwen3"]
    drafter = _drafter(targets, "qwen3", tmp_path, block_size=16)
    prompt, n, max_new = PROMPTS[0], 15, 40
    p = len(prompt)
    full = prompt + R.greedy_generate_ref(model, prompt, max_new + n + 1)
    _, full_feats = R.target_features(model, full, drafter.target_layer_ids)
    vocab = model.config.vocab_size
    calls: list[int] = []

    def oracle(_d: Any, _t: Any, ctx_feats: torch.Tensor, ctx_positions: Any, block_ids: Any,
               block_positions: Any, cached_ctx_kv: Any = None) -> torch.Tensor:
        start = int(block_positions[0])
        calls.append(start)
        assert torch.equal(torch.as_tensor(ctx_positions), torch.arange(start))
        assert torch.equal(torch.as_tensor(block_positions), torch.arange(start, start + n + 1))
        assert int(block_ids[0]) == full[start] and all(int(t) == drafter.mask_token_id for t in block_ids[1:])
        assert torch.allclose(ctx_feats, full_feats[:start], atol=1e-4)
        logits = torch.zeros(n, vocab)
        for j in range(1, n + 1):
            pos = start + j
            tok = full[pos] if pos % 7 != 3 else (full[pos] + 1) % vocab
            logits[j - 1, tok] = 1.0
        return logits

    monkeypatch.setattr(R, "draft_forward", oracle)
    tokens, per_step = R.spec_generate_ref(model, drafter, prompt, max_new, num_spec=n)
    assert tokens == full[p:p + max_new]

    expected, start, emitted = [], p, 1
    while emitted < max_new:
        a = 0
        while a < n and (start + a + 1) % 7 != 3:
            a += 1
        keep = min(a + 1, max_new - emitted)
        expected.append(keep - 1)
        emitted += keep
        start += a + 1
    assert per_step == expected and max(per_step) >= 5
    assert calls[0] == p and len(calls) == len(per_step)
    assert len(tokens) == 1 + len(per_step) + sum(per_step)

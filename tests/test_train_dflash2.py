# tests/test_train_dflash2.py
#
# `dflash train --arch dflash2` on the CPU with the tiny Qwen3 target and the data
# set of tests/test_train.py (its fixtures and helpers are imported, not copied):
# - a fresh DFlash2 (identity init) is exactly its DFlash backbone (same unary
#   logits) and its selector scores equal the unary logits (B = 0);
# - a short run lowers the total and the selector loss, moves every new parameter
#   off its init, and the export loads in the runtime: Session.propose_details
#   equals the trainer model's own forward (candidates equal, unary / edges within
#   1e-4) and the plain-PyTorch reference (tests/reference/dflash2_reference.py);
# - resume is exact (N steps == N/2 + --resume N/2);
# - a warm start from a DFlash drafter drafts exactly what that drafter drafts, one
#   from a DFlash2 export loads everything;
# - the selector loss at init recomputed by hand (top-K index or true-token injection);
# - bf16/SDPA, compact int8 state, --max-minutes, held-out eval, the CLI and device_run;
# - refusals: group not dividing hidden, K >= vocab, unknown --arch.
from __future__ import annotations

import dflash
import numpy as np
import pytest
import torch
from dflash.drafter_format import write_dflash_drafter
from dflash.train import data as D
from dflash.train import trainer as T
from dflash.train.dflash2_model import DFlash2Drafter, is_dflash2_parameter
from dflash.train.model import DFlashDrafter, DrafterConfig, frozen_target_tensors

from tests import test_train as TT
from tests.reference import dflash2_reference as R2
from tests.test_train import QUESTIONS, _config, _losses, _small_config

target, dataset = TT.target, TT.dataset  # the fixtures of tests/test_train.py (module scope here too)

V2 = dict(arch="dflash2", selector_rank=32, selector_top_k=8, conv_group_size=16, conv_kernel_size=2)


def _v2_config(target, out, data, **kw):
    return _small_config(target, out, data, **{**V2, **kw})


def test_identity_init_is_the_dflash_backbone(target, dataset, hf_model):
    tm = hf_model(target)
    base = DrafterConfig.from_target(_config(target), num_layers=2, block_size=4, mask_token_id=352,
                                     target_layer_ids=[0, 1])
    v1 = DFlashDrafter(base, *frozen_target_tensors(tm))
    v1.reset_parameters(3)
    cfg2 = DrafterConfig.from_dict({**base.to_dict(), "arch": "dflash2", "selector_rank": 32, "selector_top_k": 8})
    v2 = DFlash2Drafter(cfg2, *frozen_target_tensors(tm))
    v2.reset_parameters(3)
    s1, s2 = v1.state_dict(), v2.state_dict()
    assert set(s2) - set(s1) == {k for k in s2 if is_dflash2_parameter(k)}
    assert all(torch.equal(s1[k], s2[k]) for k in s1)  # the backbone is drawn exactly as DFlash draws it
    prompt = D.load_dataset(dataset)[0].prompt_ids
    ids1, logits1 = v1.propose(tm, prompt)
    ids2, logits2 = v2.propose(tm, prompt)
    assert torch.equal(logits1, logits2) and torch.equal(ids1, ids2)
    det = v2.propose_details(tm, prompt)
    assert torch.equal(det["edges"], det["unary"][:, None, :].expand_as(det["edges"]))  # B = 0: a no-op
    assert torch.equal(det["draft_ids"], ids1)


@pytest.fixture(scope="module")
def trained(target, dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("dflash2_run")
    small = out / "small.jsonl"
    D.save_dataset(small, D.load_dataset(dataset)[:8])
    res = T.train(_v2_config(target, out / "run", small, steps=24), log=None)
    return out / "run", res


def test_training_lowers_losses_and_export_matches_runtime(target, dataset, hf_model, trained):
    import json

    run, res = trained
    assert res["stopped"] == "done" and res["step"] == 24
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    losses, sel = [r["loss"] for r in rows], [r["selector_loss"] for r in rows]
    assert np.mean(losses[-3:]) < 0.5 * losses[0] and np.mean(sel[-3:]) < 0.7 * sel[0]
    assert rows[0]["acc_head"] == "unary" and all(0.0 <= r["unary_recall_at_k"] <= 1.0 for r in rows)
    assert rows[-1]["unary_recall_at_k"] > rows[0]["unary_recall_at_k"]
    model, tm = res["model"], hf_model(target)
    sd = model.state_dict()
    assert sd["candidate_selector.successor_codebook"].abs().max() > 0
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            assert sd[f"layers.{i}.{conv}.kernel_projection.weight"].abs().max() > 0
            assert sd[f"layers.{i}.{conv}.base_kernel"][:, 1].abs().max() > 0

    exported = run / "drafter"
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["dflash_config"]["selector_top_k"] == 8
    sess = dflash.Session(target, draft=exported, device="cpu", num_threads=2)
    ref = R2.load_drafter2(exported)
    for s in D.load_dataset(dataset)[8:11]:
        got = sess.propose_details(s.prompt_ids)
        mine = model.propose_details(tm, s.prompt_ids)
        assert got["candidate_ids"].tolist() == mine["candidate_ids"].tolist()
        assert np.max(np.abs(np.asarray(got["unary"]).reshape(mine["unary"].shape) - mine["unary"].numpy())) <= 1e-4
        assert np.max(np.abs(got["edges"] - mine["edges"].numpy())) <= 1e-4
        assert got["draft_ids"].tolist() == mine["draft_ids"].tolist()
        r = R2.propose2_ref(tm, ref, s.prompt_ids)
        assert r.candidate_ids.tolist() == mine["candidate_ids"].tolist()
        assert torch.max(torch.abs(r.edges - mine["edges"])) <= 1e-4
    # the trained drafter is a valid speculative drafter: lossless greedy output
    plain = dflash.Session(target, device="cpu", num_threads=2)
    p = dflash.SamplingParams(max_tokens=16)
    prompt = D.load_dataset(dataset)[0].prompt_ids
    assert sess.generate([prompt], p)[0].token_ids == plain.generate([prompt], p)[0].token_ids
    # a warm start from a DFlash2 export loads everything
    again = DFlash2Drafter.from_published(exported, tm)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in sd.items())


def test_resume_is_exact(target, dataset, tmp_path):
    kw = dict(steps=4, batch_size=4, num_anchors=8)
    straight = T.train(_v2_config(target, tmp_path / "a", dataset, **kw), log=None)
    first = T.train(_v2_config(target, tmp_path / "b", dataset, **kw), log=None, stop_after_steps=2)
    assert first["step"] == 2
    with pytest.raises(ValueError, match="differs"):
        T.train(_v2_config(target, tmp_path / "b", dataset, **{**kw, "selector_rank": 16}), resume=True, log=None)
    second = T.train(_v2_config(target, tmp_path / "b", dataset, **kw), resume=True, log=None)
    assert second["step"] == 4 and isinstance(second["model"], DFlash2Drafter)
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
    sa, sb = straight["model"].state_dict(), second["model"].state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    # the checkpoint exports as DFlash2 without the model object
    out = T.export_from_checkpoint(tmp_path / "b" / "checkpoint", tmp_path / "exp", dtype="float32")
    assert R2.load_drafter2(out).selector_rank == 32


def test_warm_start_from_dflash_drafter(target, dataset, tmp_path):
    src = write_dflash_drafter(tmp_path / "v1", target_config=_config(target), num_layers=2, block_size=4,
                               target_layer_ids=[0, 1], mask_token_id=352, seed=5, init_std=0.1)
    res = T.train(_v2_config(target, tmp_path / "run", dataset, init_from=str(src), steps=4), log=None,
                  stop_after_steps=0)
    assert res["step"] == 0 and isinstance(res["model"], DFlash2Drafter)
    v1 = dflash.Session(target, draft=src, device="cpu", num_threads=2)
    v2 = dflash.Session(target, draft=tmp_path / "run" / "drafter", device="cpu", num_threads=2)
    for s in D.load_dataset(dataset)[:4]:
        assert v2.propose(s.prompt_ids)[0].tolist() == v1.propose(s.prompt_ids)[0].tolist()
    with pytest.raises(ValueError, match="arch dflash2"):  # a DFlash2 drafter cannot seed a DFlash run
        T.train(_small_config(target, tmp_path / "x", dataset, init_from=str(tmp_path / "run" / "drafter")),
                log=None)


@pytest.mark.parametrize("bad, match", [
    (dict(conv_group_size=24), "does not divide the hidden size"),
    (dict(selector_top_k=359), "top-K"),
    (dict(arch="dflash3"), "unknown drafter architecture"),
])
def test_refusals(target, dataset, tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        T.train(_v2_config(target, tmp_path / "r", dataset, **bad), log=None)


def test_compact_state_bf16_sdpa_time_budget_and_eval(target, dataset, tmp_path):
    """The CUDA-style paths on the CPU (bf16 autocast, grouped SDPA), a compact int8 state that
    carries the DFlash2 parameters and arch across a resume, held-out evaluation with the
    DFlash2 metrics, and a spent --max-minutes budget (no step, yet checkpoint + DFlash2 export)."""
    import json

    kw = dict(steps=3, batch_size=4, num_anchors=8, amp="bf16", attention="sdpa", sdpa_group_blocks=2,
              state_format="int8", holdout=2)
    first = T.train(_v2_config(target, tmp_path / "a", dataset, **kw), log=None, stop_after_steps=2)
    assert first["step"] == 2 and set(first["eval"]) >= {"selector_loss", "unary_recall_at_k", "selector_acc",
                                                         "target_mass_at_k"}
    assert 0.0 < first["eval"]["target_mass_at_k"] <= 1.0
    state = json.loads((tmp_path / "a" / "checkpoint" / "state.json").read_text())
    assert "candidate_selector.successor_codebook" in state["param_names"]
    assert state["payload"]["drafter_config"]["arch"] == "dflash2"
    second = T.train({"out": str(tmp_path / "a"), "device": "cpu"}, resume=True, log=None)  # arch etc. from the state
    assert second["step"] == 3 and isinstance(second["model"], DFlash2Drafter)
    timed = T.train(_v2_config(target, tmp_path / "c", dataset, steps=3, max_minutes=1e-4, reserve_seconds=0.0),
                    log=None)
    assert timed["stopped"] == "time" and timed["step"] == 0
    assert R2.load_drafter2(tmp_path / "c" / "drafter").selector_top_k == 8


def test_cli_and_device_run_dflash2(target, dataset, tmp_path):
    """`dflash train --arch dflash2` and `python -m dflash.train.device_run run --arch dflash2`
    (a carried-state second call resumes it), then the driver's export of the state."""
    import json

    from dflash.cli import main
    from dflash.train import device_run

    args = ["train", "--target", str(target), "--out", str(tmp_path / "cli"), "--data", str(dataset), "--arch",
            "dflash2", "--selector-top-k", "4", "--selector-rank", "8", "--conv-group-size", "32",
            "--conv-kernel-size", "3", "--selector-alpha", "0.5", "--num-layers", "1", "--block-size", "4",
            "--target-layer-ids", "0,1", "--steps", "2", "--batch-size", "4", "--num-anchors", "8", "--device",
            "cpu", "-q"]
    assert main(args) == 0
    ref = R2.load_drafter2(tmp_path / "cli" / "drafter")
    assert (ref.selector_top_k, ref.selector_rank, ref.conv_group_size, ref.conv_kernel_size) == (4, 8, 32, 3)
    bad = ["train", "--target", str(target), "--out", str(tmp_path / "bad"), "--data", str(dataset), "--arch",
           "dflash3", "--device", "cpu", "-q"]
    assert main(bad) == 2  # "unknown drafter architecture"

    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(QUESTIONS[:6]) + "\n", encoding="utf-8")
    common = ["run", "--target", str(target), "--device", "cpu", "--threads", "2", "--minutes", "6",
              "--prompts", str(prompts), "--max-new-tokens", "12", "--arch", "dflash2",
              "--selector-rank", "8", "--selector-top-k", "4", "--num-layers", "1", "--block-size", "4",
              "--target-layer-ids", "0,1", "--steps", "4", "--batch-size", "2", "--num-anchors", "8",
              "--holdout", "1", "--tau-prompts", "1", "--tau-max-tokens", "8", "--warmup-steps", "1"]
    out1, out2 = tmp_path / "out1", tmp_path / "out2"
    assert device_run.main(common + ["--work", str(tmp_path / "w1"), "--out", str(out1), "--return-data",
                                     "--max-steps-here", "2"]) == 0
    assert json.loads((out1 / "report.json").read_text())["train"]["step"] == 2
    assert device_run.main(common + ["--work", str(tmp_path / "w2"), "--out", str(out2), "--state-in",
                                     str(out1 / "state"), "--data-in", str(out1 / "data" / "data.npz.xz")]) == 0
    assert json.loads((out2 / "report.json").read_text())["train"]["step"] == 4
    exported = tmp_path / "exported"
    assert device_run.main(["export", "--state", str(out2 / "state"), "--out", str(exported)]) == 0
    assert R2.load_drafter2(exported).selector_rank == 8
    sess = dflash.Session(target, draft=exported, device="cpu", num_threads=2)
    assert sess.propose_details([5, 6, 7])["k"] == 4


def test_selector_loss_rule_at_init(target, dataset, hf_model):
    """At init (B = 0) the selector scores are the unary top-K logits, so the selector loss is a
    K-way CE that can be recomputed by hand: the true token's index among the top-K, or -- when it
    misses -- slot K-1 holding the true token's own logit; K = 1 leaves nothing to select."""
    from dflash.train import objective as O

    tm = hf_model(target)
    base = DrafterConfig.from_target(_config(target), num_layers=1, block_size=4, mask_token_id=352,
                                     target_layer_ids=[0, 1])
    batch = O.collate([(s.ids, len(s.prompt_ids)) for s in D.load_dataset(dataset)[:3]])
    anchors, keep = O.eval_anchors(batch, 16)
    with torch.no_grad():
        _check_selector_rule(tm, base, batch, anchors, keep)
        _check_target_mass(tm, base, batch, anchors, keep)


def test_selector_detach_unary_leaves_the_unary_head_to_the_dflash_loss(target, dataset, hf_model):
    """selector_detach_unary: with the selector's hidden projection at zero (its only other path
    into the backbone), the backbone's gradients of unary + alpha * selector loss equal those of
    the unary loss alone, while the selector's own parameters still get gradients; without the
    detach the selector loss moves the backbone (it trains the unary top-K logits)."""
    from dflash.train import objective as O
    from dflash.train.dflash2_objective import dflash2_loss

    tm = hf_model(target)
    base = DrafterConfig.from_target(_config(target), num_layers=1, block_size=4, mask_token_id=352,
                                     target_layer_ids=[0, 1])
    cfg = DrafterConfig.from_dict({**base.to_dict(), "arch": "dflash2", "selector_rank": 8, "selector_top_k": 8})
    batch = O.collate([(s.ids, len(s.prompt_ids)) for s in D.load_dataset(dataset)[:3]])
    anchors, keep = O.eval_anchors(batch, 16)
    model = DFlash2Drafter(cfg, *frozen_target_tensors(tm))
    model.reset_parameters(0, std=0.3)
    with torch.no_grad():
        model.candidate_selector.successor_codebook.normal_(0.0, 0.5)  # a selector that selects
        model.candidate_selector.hidden_projection.weight.zero_()

    def grads(alpha, detach):
        model.zero_grad(set_to_none=True)
        loss, _ = dflash2_loss(model, tm, batch, anchors, keep, gamma=2.0, alpha=alpha, detach_unary=detach)
        loss.backward()
        return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                for n, p in model.named_parameters() if p.requires_grad}

    unary_only = grads(0.0, True)
    detached, attached = grads(1.0, True), grads(1.0, False)
    backbone = [n for n in unary_only if not n.startswith("candidate_selector.")]
    assert backbone and all(torch.allclose(detached[n], unary_only[n], atol=1e-6) for n in backbone)
    assert max(float((attached[n] - unary_only[n]).abs().max()) for n in backbone) > 1e-4
    assert float(detached["candidate_selector.hidden_projection.weight"].abs().max()) > 0


def test_selector_detach_unary_reaches_the_trainer(target, dataset, tmp_path):
    """The option is a TrainConfig field (saved in the checkpoint, so a resume keeps it) and a
    `dflash train` flag; a default run keeps the published recipe (off)."""
    assert T.TrainConfig().selector_detach_unary is False
    cfg, _ = T.resolve_config({"target": str(target), "out": str(tmp_path / "o"), "arch": "dflash2",
                               "selector_detach_unary": True}, resume=False)
    assert cfg.selector_detach_unary is True
    from dflash.cli import build_parser

    args = build_parser().parse_args(["train", "--target", str(target), "--out", str(tmp_path / "o2"),
                                      "--arch", "dflash2", "--selector-detach-unary"])
    assert args.selector_detach_unary is True
    assert build_parser().parse_args(["train", "--target", "t", "--out", "o"]).selector_detach_unary is None


def _check_target_mass(tm, base, batch, anchors, keep):
    """target mass@K (evaluation): the target's softmax at each slot's predecessor position,
    summed over the slot's unary top-K, equals the same from the target's full logits."""
    from dflash.train import objective as O
    from dflash.train.dflash2_objective import dflash2_loss

    cfg = DrafterConfig.from_dict({**base.to_dict(), "arch": "dflash2", "selector_rank": 8, "selector_top_k": 8})
    model = DFlash2Drafter(cfg, *frozen_target_tensors(tm))
    model.reset_parameters(0, std=0.3)
    _, st = dflash2_loss(model, tm, batch, anchors, keep, gamma=2.0, target_mass=True, chunk_rows=7)
    t = O.unary_terms(model, tm, batch, anchors, keep, gamma=2.0, top_k=8)
    probs = torch.softmax(tm(input_ids=batch.input_ids).logits.float(), dim=-1)  # [b, S, V]
    seq = torch.nonzero(t.supervised)[:, 0]
    pos = t.blocks["block_pos"][t.supervised] - 1
    mass = probs[seq, pos].gather(1, t.top_ids).sum(-1)
    assert 0 < float(mass.mean()) < 1
    assert abs(st["target_mass_num"] - float(mass.sum())) < 1e-3 * max(1.0, float(mass.sum()))


def _check_selector_rule(tm, base, batch, anchors, keep):
    import torch.nn.functional as F

    from dflash.train import objective as O
    from dflash.train.dflash2_objective import dflash2_loss

    for k in (1, 8):
        cfg = DrafterConfig.from_dict({**base.to_dict(), "arch": "dflash2", "selector_rank": 8, "selector_top_k": k})
        model = DFlash2Drafter(cfg, *frozen_target_tensors(tm))
        model.reset_parameters(0, std=0.3)
        loss, st = dflash2_loss(model, tm, batch, anchors, keep, gamma=2.0, alpha=0.5)
        t = O.unary_terms(model, tm, batch, anchors, keep, gamma=2.0)
        logits = model.logits(t.rows)
        labels = t.blocks["labels"][t.supervised]
        top = torch.sort(logits, dim=-1, descending=True, stable=True)
        vals, ids = top.values[:, :k].clone(), top.indices[:, :k]
        hit = ids == labels[:, None]
        miss = ~hit.any(-1)
        vals[miss, k - 1] = logits[miss, labels[miss]]
        index = torch.where(miss, k - 1, hit.long().argmax(-1))
        sel = (t.weights * F.cross_entropy(vals, index, reduction="none")).sum() / t.weights.sum()
        assert st["recall_hits"] == int((~miss).sum()) and st["selector_rows"] == labels.numel()
        assert abs(float(loss) - (float(t.loss) + 0.5 * float(sel))) < 1e-4
        if k == 1:
            assert st["selector_num"] == 0.0 and st["recall_hits"] == sum(st["correct"])
        else:
            assert 0 < int(miss.sum()) < labels.numel()  # both branches of the rule occur


def test_top_k_lowest_index_equals_the_full_stable_sort():
    """The trainer's candidate top-K (topk of K + spare, then a stable re-sort; full sort where a
    tie group reaches past the spare values) equals the stable full sort bit for bit, ties
    broken by the lower id, also when most values tie (integer and bf16-rounded logits), and
    passes gradients to the picked logits."""
    from dflash.train.objective import top_k_lowest_index

    gen = torch.Generator().manual_seed(3)
    cases = [torch.randint(0, 4, (64, 300), generator=gen).float(),  # tie groups far past K + spare
             torch.randn(64, 997, generator=gen).bfloat16().float(),  # bf16 logits: ties common
             torch.randn(64, 40, generator=gen)]  # K + spare >= V: the full sort
    cases[1][:8, :] = 1.5  # whole rows equal
    for logits in cases:
        for k in (1, 4, 16, 24):
            vals, ids = top_k_lowest_index(logits, k)
            ref = torch.sort(logits, dim=-1, descending=True, stable=True)
            assert torch.equal(ids, ref.indices[:, :k]) and torch.equal(vals, ref.values[:, :k])
    x = cases[1].clone().requires_grad_(True)
    vals, ids = top_k_lowest_index(x, 16)
    vals.sum().backward()
    expect = torch.zeros_like(x).scatter_(1, ids, 1.0)
    assert torch.equal(x.grad, expect)

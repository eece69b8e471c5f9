#!/usr/bin/env python3
"""Issue 13 benchmark: DFlash2 on the GPU, in ONE job so every ratio compares figures of one run.

Target: the Qwen3-8B geometry with random bf16 weights. Drafters: the published DFlash2 b8
geometry scaled to it (5 layers, target layers [1, 9, 17, 25, 33], block 8, sliding layers with
is_causal false and window 2048, K 16, rank 256, group 16, taps 2) and the DFlash (v1) drafter
of the same backbone weights (same layers, no conv, no selector). Sections (--sections):
  copy     device-to-device copy bandwidth (the roofline every byte figure is compared with).
  kernels  each DFlash2 kernel against its PyTorch eager equivalent on the same inputs, both
           timed as CUDA-graph replays (and eagerly for torch): the grouped conv (20 calls of one
           side over [8, 4096] and [8, 5120], as vLLM's PR counts them), the radix top-K over the
           Qwen3 vocabulary (rows = batch x 7 slots at batch 1, 8, 32) vs torch.topk, the edge
           scores vs gather + einsum, the lattice walk vs a torch loop over the slots.
  steps    our speculative step, DFlash2 vs DFlash, at batch 1, 8, 32 (context 512, CUDA graphs,
           greedy; random drafts are rejected, so this measures step time): median step time,
           and DFlash2 step / DFlash step.
  profile  CUPTI (torch.profiler) kernel activity of the DFlash2 step at the same batches: time
           per step of the conv, top-K, edge, walk and acceptance kernels; their share of the step.
  fp8      the FP8 candidate head's GEMM (linear_fp8, e4m3 weights [151936, 4096] = 622 MB) against
           the exact bf16 head through the backend's linear (cuBLASLt at this weight size; the
           skinny kernel too where it runs, M <= 32) at 7, 56 and 224 rows (batch 1, 8, 32 x 7
           slots), timed as CUDA-graph replays; bytes read per second of each against the copy
           bandwidth; and the exact re-score of the K = 16 candidates of those rows.
The steps section also times DFlash2 with draft_head="fp8" (its step against the exact head's);
the FP8 head's effect on τ needs a trained drafter and is measured by `dflash bench acceptance`.
Headline keys: dflash2_step_over_dflash_step_bs1, dflash2_extras_share_bs1,
topk_speedup_vs_torch_bs1, fp8_head_speedup_vs_bf16_bs1.

Usage (GPU machine, dflash installed): python bench/bench_gpu_dflash2.py --out DIR [--quick]
Writes DIR/gpu_h200_dflash2.json, DIR/gpu_h200_dflash2.png and updates DIR/headline.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import (  # noqa: E402
    QWEN3_8B,
    copy_bandwidth,
    cuda_kernel_totals,
    free_cuda_memory,
    graph_time,
    qwen3_config,
    run_record,
    update_headline,
    write_json,
    write_random_model,
)

RESULT_NAME = "gpu_h200_dflash2"
DFLASH2_B8 = {"num_layers": 5, "target_layer_ids": [1, 9, 17, 25, 33], "block_size": 8, "mask_token_id": 151669,
              "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16,
              "sliding_window": 2048}
BATCHES = (1, 8, 32)
CONTEXT = 512
GOAL_EXTRAS_SHARE_BS1 = 0.02  # conv + top-K + edges + walk <= 2 % of the step at batch 1
# Kernel families of the DFlash2 extras in CUPTI kernel names (first match wins).
FAMILIES = [("conv", ("grouped_conv",)), ("topk", ("topk",)), ("edges", ("edge_scores",)),
            ("walk", ("lattice_walk",)), ("accept_candidates", ("accept_candidates",)),
            ("scale", ("scale_bf16",))]


def log(t0: float, msg: str) -> None:
    print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)


# --------------------------------------------------------------------------------------------
# Timing helpers


def stream() -> int:
    import torch

    return torch.cuda.current_stream().cuda_stream


def eager_time(fn: Callable[[], Any], trials: int = 20, reps: int = 5) -> float:
    """Seconds per call of `fn` run eagerly (median of `trials` timings of `reps` calls)."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / reps)
    return statistics.median(times)


# --------------------------------------------------------------------------------------------
# Kernels vs PyTorch eager


def torch_conv(x, base, deltas, side: int, block: int, group: int):
    """One side of the grouped dynamic conv in plain torch ops (what an eager module runs)."""
    import torch

    n, h = x.shape
    taps = base.shape[1]
    d = deltas.view(n, 2, taps, h // group)[:, side].repeat_interleave(group, dim=2)  # [N, T, H]
    coef = base[side].unsqueeze(0) + d
    pos = (torch.arange(n, device=x.device) % block).unsqueeze(1)
    out = coef[:, 0] * x
    for t in range(1, taps):
        shifted = torch.nn.functional.pad(x[: n - t], (0, 0, t, 0))
        out = out + coef[:, t] * shifted * (pos >= t)
    return out


def bench_conv(K, hidden: int) -> dict[str, Any]:
    import torch

    rows, block, group, taps, calls = 8, 8, 16, 2, 20
    g = torch.Generator(device="cuda").manual_seed(hidden)
    x = torch.randn(rows, hidden, device="cuda", generator=g).to(torch.bfloat16)
    base = torch.randn(2, taps, hidden, device="cuda", generator=g).to(torch.bfloat16)
    deltas = torch.randn(rows, 2 * taps * hidden // group, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty_like(x)
    ours = graph_time([lambda s=s: K.cuda_grouped_conv(x, base, deltas, s % 2, block, group, False, out, stream=stream())
                       for s in range(calls)])
    eager = eager_time(lambda: [torch_conv(x, base, deltas, s % 2, block, group) for s in range(calls)])
    graphed = graph_time([lambda s=s: torch_conv(x, base, deltas, s % 2, block, group) for s in range(calls)])
    return {"shape": [rows, hidden], "calls": calls, "ours_graph_s": ours, "torch_eager_s": eager,
            "torch_graph_s": graphed, "speedup_vs_torch_eager": eager / ours, "speedup_vs_torch_graph": graphed / ours}


def bench_topk(K, rows: int, vocab: int, k: int) -> dict[str, Any]:
    import torch

    g = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, vocab, device="cuda", generator=g) * 3
    ids = torch.empty(rows, k, device="cuda", dtype=torch.int32)
    unary = torch.empty(rows, k, device="cuda")
    ws = torch.empty(K.cuda_topk_workspace_bytes(rows, vocab, k), device="cuda", dtype=torch.uint8)
    counters = torch.zeros(rows, device="cuda", dtype=torch.int32)
    ours = graph_time([lambda: K.cuda_topk_candidates(logits, k, 1.0, 0.0, ids, unary, ws, counters, stream=stream())])
    torch_graph = graph_time([lambda: torch.topk(logits, k, dim=-1, sorted=True)])
    torch_eager = eager_time(lambda: torch.topk(logits, k, dim=-1, sorted=True))
    K.cuda_topk_candidates(logits, k, 1.0, 0.0, ids, unary, ws, counters)
    want = torch.topk(logits, k, dim=-1, sorted=True)
    same = bool(torch.equal(want.values, unary))
    floor = rows * vocab * 4 / (copy_bw_gbs() * 1e9) if copy_bw_gbs() else None
    return {"rows": rows, "vocab": vocab, "k": k, "ours_graph_s": ours, "torch_topk_graph_s": torch_graph,
            "torch_topk_eager_s": torch_eager, "speedup_vs_torch_graph": torch_graph / ours,
            "speedup_vs_torch_eager": torch_eager / ours, "values_equal_torch": same,
            "read_floor_s": floor}


def torch_edges(ids, unary, gate, anchors, A, B):
    import torch

    pred = torch.cat([anchors.view(-1, 1, 1).expand(-1, 1, ids.shape[2]), ids[:, :-1]], dim=1)
    a = A[pred.long()].float()
    b = B[ids.long()].float()
    return unary.unsqueeze(2) + torch.einsum("bspj,bsj,bscj->bspc", a, gate, b)


def bench_edges(K, reqs: int, slots: int = 7, k: int = 16, rank: int = 256, vocab: int = 151936) -> dict[str, Any]:
    import torch

    g = torch.Generator(device="cuda").manual_seed(reqs)
    ids = torch.randint(0, vocab, (reqs, slots, k), device="cuda", generator=g, dtype=torch.int32)
    unary = torch.randn(reqs, slots, k, device="cuda", generator=g)
    gate = torch.randn(reqs, slots, rank, device="cuda", generator=g)
    anchors = torch.randint(0, vocab, (reqs,), device="cuda", generator=g, dtype=torch.int32)
    A = (torch.randn(vocab, rank, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    B = (torch.randn(vocab, rank, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    edges = torch.empty(reqs, slots, k, k, device="cuda")
    ours = graph_time([lambda: K.cuda_edge_scores(ids, unary, gate, anchors, A, B, edges, stream=stream())])
    eager = eager_time(lambda: torch_edges(ids, unary, gate, anchors, A, B))
    graphed = graph_time([lambda: torch_edges(ids, unary, gate, anchors, A, B)])
    return {"reqs": reqs, "slots": slots, "k": k, "rank": rank, "ours_graph_s": ours, "torch_eager_s": eager,
            "torch_graph_s": graphed, "speedup_vs_torch_eager": eager / ours, "speedup_vs_torch_graph": graphed / ours}


def torch_walk(edges, ids):
    """The greedy walk as a torch loop over the slots (what a Python selector runs)."""
    import torch

    r, s, k, _ = edges.shape
    prev = torch.zeros(r, dtype=torch.long, device=edges.device)
    drafts = []
    ar = torch.arange(r, device=edges.device)
    for j in range(s):
        row = edges[ar, j, prev]
        idx = torch.argmax(row, dim=-1)
        drafts.append(ids[ar, j, idx])
        prev = idx
    return torch.stack(drafts, dim=1)


def packed_params(reqs: int, temperature: float = 0.0):
    """SampleRow (cpp/common/sample_row.h) of `reqs` requests as bytes: temperature, top_k, top_p, seed
    lo/hi, padding, position (the first draft's)."""
    import numpy as np

    rec = np.zeros(reqs, dtype=[("temperature", "<f4"), ("top_k", "<i4"), ("top_p", "<f4"), ("seed_lo", "<u4"),
                                ("seed_hi", "<u4"), ("pad", "<u4"), ("position", "<i8")])
    rec["temperature"], rec["top_p"], rec["seed_lo"], rec["position"] = temperature, 1.0, np.arange(reqs), 100
    return rec.view(np.uint8).copy()


def bench_walk(K, reqs: int, slots: int = 7, k: int = 16) -> dict[str, Any]:
    import torch

    g = torch.Generator(device="cuda").manual_seed(reqs)
    edges = torch.randn(reqs, slots, k, k, device="cuda", generator=g)
    ids = torch.randint(0, 151936, (reqs, slots, k), device="cuda", generator=g, dtype=torch.int32)
    drafts = torch.empty(reqs, slots, device="cuda", dtype=torch.int32)
    realized = torch.empty(reqs, slots, k, device="cuda")
    params = torch.from_numpy(packed_params(reqs)).cuda()
    ours = graph_time([lambda: K.triton_lattice_walk(edges, ids, params, drafts, realized, stream=stream())])
    eager = eager_time(lambda: torch_walk(edges, ids))
    graphed = graph_time([lambda: torch_walk(edges, ids)])
    return {"reqs": reqs, "slots": slots, "k": k, "ours_graph_s": ours, "torch_eager_s": eager,
            "torch_graph_s": graphed, "speedup_vs_torch_eager": eager / ours}


FP8_ROWS = (7, 56, 224)


def bench_fp8(K, rows_list=FP8_ROWS, vocab: int = 151936, hidden: int = 4096) -> dict[str, Any]:
    """linear_fp8 vs the exact bf16 head (cuBLASLt, and the skinny kernel where it runs) and the
    exact re-score, per row count; one bf16 head and its FP8 copy shared by all points."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(13)
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    q = torch.empty(vocab, hidden, device="cuda", dtype=torch.uint8)
    scale = torch.empty(vocab, device="cuda")
    K.cuda_fp8_quantize_rows(w, q, scale)
    fp8_bytes, bf16_bytes = q.numel() + scale.numel() * 4, w.numel() * 2
    bw = copy_bw_gbs()
    out: dict[str, Any] = {"vocab": vocab, "hidden": hidden, "fp8_weight_bytes": fp8_bytes,
                           "bf16_weight_bytes": bf16_bytes, "copy_bw_gbs": bw}
    for rows in rows_list:
        x = torch.randn(rows, hidden, device="cuda", generator=g).to(torch.bfloat16)
        o8 = torch.empty(rows, vocab, device="cuda")
        o16 = torch.empty(rows, vocab, device="cuda")
        fp8_s = graph_time([lambda: K.cuda_linear_fp8(x, q, scale, o8, stream=stream())])
        lt_s = graph_time([lambda: K.cuda_cublaslt_gemm(x, w, o16, stream=stream())])
        r: dict[str, Any] = {"rows": rows, "fp8_graph_s": fp8_s, "cublaslt_bf16_graph_s": lt_s,
                             "fp8_gbs": fp8_bytes / fp8_s / 1e9, "cublaslt_gbs": bf16_bytes / lt_s / 1e9,
                             "speedup_vs_cublaslt": lt_s / fp8_s}
        if rows <= 32:
            sk_s = graph_time([lambda: K.cuda_skinny_gemm(x, w, o16, stream=stream())])
            r.update({"skinny_bf16_graph_s": sk_s, "skinny_gbs": bf16_bytes / sk_s / 1e9,
                      "speedup_vs_skinny": sk_s / fp8_s})
        if bw:
            r["fp8_share_of_copy_bw"] = r["fp8_gbs"] / bw
        # accuracy of the FP8 logits against the exact head, and the re-score of 16 candidates
        K.cuda_linear_fp8(x, q, scale, o8)
        K.cuda_cublaslt_gemm(x, w, o16)
        r["max_abs_logit_diff"] = float((o8 - o16).abs().max())
        top_fp8 = torch.topk(o8, 16, dim=-1).indices
        top_exact = torch.topk(o16, 16, dim=-1).indices
        r["top16_shared"] = float(torch.tensor([len(set(a.tolist()) & set(b.tolist())) / 16
                                                for a, b in zip(top_fp8, top_exact)]).mean())
        ids = top_fp8.to(torch.int32).contiguous()
        unary = torch.empty(rows, 16, device="cuda")
        r["rescore_graph_s"] = graph_time([lambda: K.cuda_rescore_candidates(x, w, ids, unary, 1.0, 0.0,
                                                                             stream=stream())])
        out[f"rows{rows}"] = r
        del o8, o16
    del w, q
    free_cuda_memory()
    return out


_COPY_BW: dict[str, float] = {}


def copy_bw_gbs() -> float | None:
    return _COPY_BW.get("gbs")


# --------------------------------------------------------------------------------------------
# Whole steps


def dflash2_shapes(target_cfg: dict, geo: dict = DFLASH2_B8) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a DFlash2 drafter of geometry `geo` for the target."""
    from dflash.drafter_format import dflash2_tensor_shapes

    c = target_cfg
    return dflash2_tensor_shapes(
        num_layers=geo["num_layers"], hidden_size=c["hidden_size"], num_heads=c["num_attention_heads"],
        num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"], intermediate_size=c["intermediate_size"],
        fc_in_features=len(geo["target_layer_ids"]) * c["hidden_size"], vocab_size=c["vocab_size"],
        conv_kernel_size=geo["conv_kernel_size"], conv_group_size=geo["conv_group_size"],
        selector_rank=geo["selector_rank"])


def write_drafters(work: Path, target_cfg: dict, seed: int = 1, with_v1: bool = True) -> tuple[Path, Path | None]:
    """The DFlash2 b8 drafter (published layout) in work/dflash2 and, with_v1, the DFlash drafter of
    the same backbone in work/dflash (else None)."""
    import numpy as np
    import torch

    from dflash.drafter_format import write_dflash2_drafter, write_dflash_drafter

    geo = DFLASH2_B8
    shapes = dflash2_shapes(target_cfg, geo)
    try:  # bf16 files through ml_dtypes when importable, else fp32 holding bf16 values
        import ml_dtypes

        bf16 = ml_dtypes.bfloat16
    except ImportError:
        bf16 = None
    g = torch.Generator(device="cuda").manual_seed(seed)
    weights: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, device="cuda")
        elif name.endswith("base_kernel"):
            t = torch.randn(*shape, generator=g, device="cuda") * 0.05
            t[:, 0] += 1.0  # near the identity conv
        else:
            t = torch.randn(*shape, generator=g, device="cuda") * 0.02
        t = t.to(torch.bfloat16)
        weights[name] = t.view(torch.int16).cpu().numpy().view(bf16) if bf16 is not None else t.float().cpu().numpy()
    dtype = "bfloat16" if bf16 is not None else "float32"
    common = dict(target_config=target_cfg, num_layers=geo["num_layers"], target_layer_ids=geo["target_layer_ids"],
                  block_size=geo["block_size"], mask_token_id=geo["mask_token_id"],
                  layer_types=["sliding_attention"] * geo["num_layers"], sliding_window=geo["sliding_window"],
                  dtype=dtype)
    d2 = write_dflash2_drafter(work / "dflash2", **common, weights=weights, conv_kernel_size=geo["conv_kernel_size"],
                               conv_group_size=geo["conv_group_size"], selector_rank=geo["selector_rank"],
                               selector_top_k=geo["selector_top_k"], is_causal=False)
    if not with_v1:
        del weights
        free_cuda_memory()
        return Path(d2), None
    v1_names = set(shapes) - {n for n in shapes if "_conv." in n or n.startswith("candidate_selector.")}
    common["layer_types"] = None  # DFlash v1: sliding layers would be causal; full attention (ctx 512 < window)
    common.pop("sliding_window")
    d1 = write_dflash_drafter(work / "dflash", **common, weights={n: weights[n] for n in v1_names})
    del weights
    free_cuda_memory()
    return Path(d2), Path(d1)


def make_session(model_dir: Path, draft_dir: Path, max_num_seqs: int, draft_head: str = "exact"):
    from dflash import _core

    cfg = _core.SessionConfig()
    cfg.device = "cuda"
    cfg.draft_head = draft_head
    cfg.max_model_len = 2048
    cfg.kv_cache_tokens = max_num_seqs * 1024 + 4096
    cfg.max_num_seqs = max_num_seqs
    cfg.draft_dir = str(draft_dir)
    return _core.Session(str(model_dir), cfg)


def start_requests(sess, batch: int, max_tokens: int) -> list[int]:
    from dflash import _core

    ids = []
    for r in range(batch):
        req = _core.RequestInput()
        req.prompt = [(7 * r + 13 * i) % 150000 + 10 for i in range(CONTEXT)]
        s = _core.SamplingConfig()
        s.max_tokens, s.ignore_eos, s.temperature = max_tokens, True, 0.0
        req.sampling = s
        ids.append(sess.add_request(req))
    for _ in range(8):  # prefill (one step for these sizes) + warm-up decode steps
        sess.step()
    return ids


def stop_requests(sess, ids: list[int]) -> None:
    for rid in ids:
        sess.abort(rid)
        try:
            sess.take_result(rid)
        except ValueError:
            pass


def step_times(sess, batch: int, steps: int) -> dict[str, Any]:
    ids = start_requests(sess, batch, max_tokens=4 * steps + 64)
    times = []
    try:
        for _ in range(steps):
            t = time.perf_counter()
            sess.step()
            times.append(time.perf_counter() - t)
    finally:
        stop_requests(sess, ids)
    return {"batch": batch, "context": CONTEXT, "steps": steps, "step_s_median": statistics.median(times),
            "step_s_mean": statistics.fmean(times), "step_s_min": min(times)}


def profile_step(sess, batch: int, steps: int) -> dict[str, Any]:
    import torch

    ids = start_requests(sess, batch, max_tokens=4 * steps + 64)
    try:
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(steps):
                sess.step()
            torch.cuda.synchronize()
    finally:
        stop_requests(sess, ids)
    fams: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"us_per_step": 0.0, "launches_per_step": 0.0})
    total = 0.0
    for name, (us, n) in cuda_kernel_totals(prof).items():
        total += us
        fam = next((f for f, keys in FAMILIES if any(k in name for k in keys)), None)
        if fam is not None:
            fams[fam]["us_per_step"] += us / steps
            fams[fam]["launches_per_step"] += n / steps
    return {"batch": batch, "steps": steps, "gpu_busy_us_per_step": total / steps,
            "families": {k: dict(v) for k, v in fams.items()}}


SECTION_KEYS = {"copy": ["copy_bw_gbs"], "kernels": ["kernels"], "fp8": ["fp8"], "steps": ["steps"],
                "profile": ["profile"]}


def carry_over_sections(res: dict[str, Any], path: Path, sections: set[str]) -> None:
    """A run of some sections keeps the other sections' figures from the previous result file
    (`path`, else the repository's copy), each stamped with the date and command it came from in
    res["section_runs"], so one JSON holds the latest figure of every section."""
    prev_path = path if path.is_file() else Path(__file__).resolve().parent / "results" / path.name
    if not prev_path.is_file():
        return
    prev = json.loads(prev_path.read_text())
    runs = dict(prev.get("section_runs", {}))
    for sec, keys in SECTION_KEYS.items():
        if sec in sections:
            runs[sec] = {"date": res["date"], "command": res["command"]}
            continue
        if any(k in prev for k in keys):
            for k in keys:
                if k in prev:
                    res[k] = prev[k]
            runs.setdefault(sec, {"date": prev.get("date"), "command": prev.get("command")})
    res["section_runs"] = runs


def extras_goals(res: dict[str, Any]) -> dict[str, Any]:
    """The <= 2 % goal for the DFlash2 extras at batch 1, read two ways: the CUPTI sum of the
    extras' kernel durations over the step time, and the step-time difference DFlash2 - DFlash
    over the DFlash2 step (which also holds the conv projection GEMMs). With programmatic
    dependent launch a kernel starts before the one ahead ends and waits inside, so CUPTI
    durations overlap (gpu_busy / step > 1) and their sum overstates a kernel's own time."""
    p = res.get("profile", {}).get("bs1")
    if p is None:
        return {}
    step_s = res["steps"]["dflash2"]["bs1"]["step_s_median"]
    busy_over_step = p["gpu_busy_us_per_step"] * 1e-6 / step_s
    out = {"extras_share_bs1": {"goal": GOAL_EXTRAS_SHARE_BS1, "measured": p["extras_share_of_step"],
                                "met": p["extras_share_of_step"] <= GOAL_EXTRAS_SHARE_BS1,
                                "how": "CUPTI: sum of conv, top-K, edge and walk kernel durations / step",
                                "gpu_busy_over_step": busy_over_step},
           "step_difference_share_bs1": {"goal": GOAL_EXTRAS_SHARE_BS1, "measured": p["step_difference_share"],
                                         "met": p["step_difference_share"] <= GOAL_EXTRAS_SHARE_BS1,
                                         "how": "(DFlash2 step - DFlash step) / DFlash2 step, medians of one run"}}
    return out


# --------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--sections", default="copy,kernels,fp8,steps,profile")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="fewer steps and kernel points")
    args = ap.parse_args(argv)
    sections = set(args.sections.split(","))
    out_dir = Path(args.out)
    path = out_dir / f"{RESULT_NAME}.json"
    res: dict[str, Any] = {**run_record(RESULT_NAME), "geometry": {"target": QWEN3_8B, "dflash2": DFLASH2_B8},
                           "fp8_candidate_head": "the fp8 section: linear_fp8 vs the exact bf16 head and the "
                                                 "re-score, kernel level; steps.dflash2_fp8_head: whole DFlash2 "
                                                 "steps with draft_head='fp8'; its effect on tau is measured by "
                                                 "dflash bench acceptance on a trained drafter"}
    carry_over_sections(res, path, sections)
    t0 = time.perf_counter()
    steps = 10 if args.quick else args.steps

    def save() -> None:
        write_json(path, res)

    from dflash._core import testing as K

    if "copy" in sections:
        _COPY_BW["gbs"] = res["copy_bw_gbs"] = copy_bandwidth()
        log(t0, f"copy bandwidth {res['copy_bw_gbs']:.0f} GB/s")
        save()
    if "kernels" in sections:
        kr = res.setdefault("kernels", {})
        for name, fn in [("conv_8x4096", lambda: bench_conv(K, 4096)), ("conv_8x5120", lambda: bench_conv(K, 5120))] + \
                [(f"topk_bs{b}", lambda b=b: bench_topk(K, 7 * b, QWEN3_8B["vocab_size"], 16)) for b in BATCHES] + \
                [(f"edges_bs{b}", lambda b=b: bench_edges(K, b)) for b in BATCHES] + \
                [(f"walk_bs{b}", lambda b=b: bench_walk(K, b)) for b in BATCHES]:
            try:
                kr[name] = fn()
                log(t0, f"{name}: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                                for k, v in kr[name].items()))
            except Exception as e:  # noqa: BLE001 - record and go on
                kr[name] = {"error": f"{type(e).__name__}: {e}"}
                log(t0, f"{name}: FAILED {e}")
                traceback.print_exc()
            save()
    if "fp8" in sections:
        try:
            res["fp8"] = bench_fp8(K)
            for n in FP8_ROWS:
                r = res["fp8"][f"rows{n}"]
                log(t0, f"fp8 rows {n}: linear_fp8 {r['fp8_graph_s'] * 1e6:.1f} us ({r['fp8_gbs']:.0f} GB/s), "
                        f"cuBLASLt bf16 {r['cublaslt_bf16_graph_s'] * 1e6:.1f} us ({r['cublaslt_gbs']:.0f} GB/s), "
                        f"speedup {r['speedup_vs_cublaslt']:.2f}, re-score {r['rescore_graph_s'] * 1e6:.1f} us, "
                        f"top-16 shared {r['top16_shared'] * 100:.1f} %")
        except Exception as e:  # noqa: BLE001 - record and go on
            res["fp8"] = {"error": f"{type(e).__name__}: {e}"}
            log(t0, f"fp8: FAILED {e}")
            traceback.print_exc()
        save()
    if sections & {"steps", "profile"}:
        work = Path(tempfile.mkdtemp(prefix="dflash2_bench_"))
        model = work / "target"
        write_random_model(model)
        d2, d1 = write_drafters(work, qwen3_config(QWEN3_8B))
        log(t0, f"wrote the random target and drafters under {work}")
        sess2 = make_session(model, d2, max(BATCHES))
        sess1 = make_session(model, d1, max(BATCHES))
        sess2_fp8 = make_session(model, d2, max(BATCHES), draft_head="fp8")
        log(t0, "sessions loaded")
        st = res.setdefault("steps", {})
        for b in BATCHES:
            # interleaved: same conditions for the three
            for label, sess in (("dflash", sess1), ("dflash2", sess2), ("dflash2_fp8_head", sess2_fp8)):
                st.setdefault(label, {})[f"bs{b}"] = step_times(sess, b, steps)
            med = {label: st[label][f"bs{b}"]["step_s_median"] for label in ("dflash", "dflash2", "dflash2_fp8_head")}
            r = med["dflash2"] / med["dflash"]
            st.setdefault("dflash2_over_dflash", {})[f"bs{b}"] = r
            st.setdefault("fp8_head_over_exact_head", {})[f"bs{b}"] = med["dflash2_fp8_head"] / med["dflash2"]
            log(t0, f"batch {b}: dflash {med['dflash'] * 1e3:.3f} ms, dflash2 {med['dflash2'] * 1e3:.3f} ms "
                    f"(ratio {r:.4f}), dflash2 with the fp8 head {med['dflash2_fp8_head'] * 1e3:.3f} ms")
            save()
        del sess2_fp8
        if "profile" in sections:
            pr = res.setdefault("profile", {})
            for b in BATCHES:
                p = profile_step(sess2, b, min(steps, 10))
                step_s = st["dflash2"][f"bs{b}"]["step_s_median"]
                extras = sum(p["families"].get(f, {}).get("us_per_step", 0.0) for f in ("conv", "topk", "edges", "walk"))
                p["extras_us_per_step"] = extras
                p["extras_share_of_step"] = extras * 1e-6 / step_s
                p["step_difference_share"] = (step_s - st["dflash"][f"bs{b}"]["step_s_median"]) / step_s
                pr[f"bs{b}"] = p
                log(t0, f"profile batch {b}: {p['families']}, extras {extras:.1f} us/step = "
                        f"{p['extras_share_of_step'] * 100:.2f} % of the step")
                save()
        del sess1, sess2
        free_cuda_memory()
    headline: dict[str, Any] = {}
    st = res.get("steps", {})
    if "dflash2_over_dflash" in st:
        headline["dflash2_step_over_dflash_step_bs1"] = round(st["dflash2_over_dflash"]["bs1"], 4)
    if "bs1" in res.get("profile", {}):
        headline["dflash2_extras_share_bs1"] = round(res["profile"]["bs1"]["extras_share_of_step"], 5)
    if "fp8_head_over_exact_head" in st:
        headline["dflash2_fp8_head_step_over_exact_bs1"] = round(st["fp8_head_over_exact_head"]["bs1"], 4)
    topk = res.get("kernels", {}).get("topk_bs1", {})
    if "speedup_vs_torch_graph" in topk:
        headline["topk_speedup_vs_torch_bs1"] = round(topk["speedup_vs_torch_graph"], 3)
    fp8 = res.get("fp8", {}).get("rows7", {})
    if "speedup_vs_cublaslt" in fp8:
        headline["fp8_head_speedup_vs_bf16_bs1"] = round(fp8["speedup_vs_cublaslt"], 3)
    goals = extras_goals(res)
    if goals:
        res["goals"] = goals
    res["headline"] = headline
    save()
    if headline:
        update_headline(out_dir, headline, stamp_prefix="dflash2_")
    plot(res, out_dir / f"{RESULT_NAME}.png")
    log(t0, f"wrote {path}; headline {headline}")


def plot(res: dict[str, Any], png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    st = res.get("steps", {})
    if "dflash" not in st:
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    bs = [b for b in BATCHES if f"bs{b}" in st.get("dflash2", {})]
    x = range(len(bs))
    ax[0].bar([i - 0.2 for i in x], [st["dflash"][f"bs{b}"]["step_s_median"] * 1e3 for b in bs], 0.4, label="DFlash")
    ax[0].bar([i + 0.2 for i in x], [st["dflash2"][f"bs{b}"]["step_s_median"] * 1e3 for b in bs], 0.4, label="DFlash2")
    ax[0].set_xticks(list(x), [f"batch {b}" for b in bs])
    ax[0].set_ylabel("step time (ms)")
    ax[0].set_title("Qwen3-8B geometry, context 512, H200")
    ax[0].legend()
    kr = res.get("kernels", {})
    names = [n for n in kr if "speedup_vs_torch_graph" in kr[n]]
    ax[1].barh(names, [kr[n]["speedup_vs_torch_graph"] for n in names])
    ax[1].set_xlabel("speedup vs the same torch ops in a CUDA graph")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main()

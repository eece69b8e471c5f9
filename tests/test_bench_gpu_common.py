# tests/test_bench_gpu_common.py
#
# The pure-Python parts of the GPU benchmarks (bench/gpu_common.py, bench/bench_gpu_qwen3.py,
# bench/ab_gpu_step.py, bench_gpu_attention_small.py's plan, bench_gpu_launch_modes.py's modes) on
# the CPU: byte counts of a decode step against the figures of the first H200 run, the KV plan,
# the projection and goal fields, argument parsing, the shared headline file (merged, never
# replaced), the A/B runner's variant syntax, medians and ratios, the launch-mode selection
# and medians, bench_gpu_qwen3's DFlash2 / GEMV figures and carry-over, and bench_gpu_smollm2's
# AR and speculative timing run on the CPU (its fields, not its speed), and bench_cpu_decode's headline
# figure. Nothing here needs a GPU.
from __future__ import annotations

import importlib
import json
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"


def _bench_module(name):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def test_qwen3_bench_self_check(capsys):
    _bench_module("bench_gpu_qwen3").self_check()
    assert "self-check passed" in capsys.readouterr().out


def test_qwen3_bench_arguments():
    b = _bench_module("bench_gpu_qwen3")
    args = b.parse_args(["--sections", "copy,ar", "--batches", "1,8", "--contexts", "512,1024"])
    assert args.sections == ["copy", "ar"] and args.batches == [1, 8] and args.contexts == [512, 1024]
    assert b.parse_args([]).sections == list(b.SECTIONS)
    with pytest.raises(SystemExit):
        b.parse_args(["--sections", "copy,nope"])
    with pytest.raises(SystemExit):  # the goals are defined at batch 1, context 512
        b.parse_args(["--contexts", "4096"])


def _gemv_row(name, m, skinny_s, stream_s, cublaslt_s, read_s=None, w_bytes=1e8, bw=4e12):
    def fig(t):
        return None if t is None else {"s": t, "fraction_of_copy_bw": w_bytes / t / bw}
    return {"name": name, "m": m, "skinny": fig(skinny_s), "stream": fig(stream_s), "cublaslt": fig(cublaslt_s),
            "torch": fig(cublaslt_s), "read": fig(read_s)}


def test_qwen3_bench_gemv_summary_and_headline():
    q = _bench_module("bench_gpu_qwen3")
    gemv = {"shapes": [_gemv_row("qkv", 1, 30e-6, 27e-6, 33e-6, 25e-6), _gemv_row("qkv", 16, 40e-6, 38e-6, 34e-6),
                       _gemv_row("o", 1, 12e-6, None, 15e-6), _gemv_row("down", 1, None, None, 20e-6)],
            "step_m1": {**_gemv_row("step", 1, 5e-3, 4.2e-3, 4.25e-3), "name": None}}
    s = q.gemv_summary(gemv)
    assert set(s) == {"qkv_m1", "qkv_m16", "o_m1", "step_m1"}  # down: none of ours ran
    assert s["qkv_m1"]["best_ours"] == "stream" and s["qkv_m1"]["cublaslt_over_best_ours"] == pytest.approx(33 / 27)
    assert s["qkv_m1"]["read_fraction"] == pytest.approx(1e8 / 25e-6 / 4e12)
    assert s["qkv_m16"]["cublaslt_over_best_ours"] < 1 and s["o_m1"]["best_ours"] == "skinny"
    assert "stream_fraction" not in s["o_m1"]
    head = q.gemv_headline(s)
    assert set(head) == {"gemv_qkv_m1_ours_fraction", "gemv_qkv_m1_cublaslt_fraction", "gemv_o_m1_ours_fraction",
                         "gemv_o_m1_cublaslt_fraction", "gemv_step_m1_ours_fraction", "gemv_step_m1_cublaslt_fraction"}
    assert head["gemv_step_m1_ours_fraction"] == pytest.approx(1e8 / 4.2e-3 / 4e12)


def test_qwen3_bench_dflash2_bytes_and_ratios(tmp_path):
    q = _bench_module("bench_gpu_qwen3")
    # DFlash2 streams its backbone plus conv and selector projection, not the [V, rank] codebooks
    d2 = q.dflash2_drafter_weight_bytes()
    assert q.drafter_weight_bytes() < d2 < q.drafter_weight_bytes() + 0.2e9
    # 8 verify rows instead of 16; the sliding drafter reads at most 2048 context keys per sequence
    kv = q.kv_bytes_per_token(q.QWEN3_8B)
    assert q.spec_step_min_bytes(1, 512, mode="spec") - q.spec_step_min_bytes(1, 512, mode="dflash2") == (
        8 * kv + q.drafter_weight_bytes() - d2)
    long = q.spec_step_min_bytes(1, 4096, mode="dflash2") - q.spec_step_min_bytes(1, 2048, mode="dflash2")
    assert long == 2048 * kv  # the target's keys only
    args = q.parse_args(["--out", str(tmp_path), "--batches", "1", "--contexts", "512"])
    run = q.Run(args)
    run.res["copy_bw_gbs"] = 4000.0
    run.res["ours"] = {m: {"graphs_on": {"b1_ctx512": {"step_s": t}}}
                       for m, t in (("ar", 0.005), ("spec", 0.0065), ("dflash2", 0.006))}
    run.res["ours"]["ar"]["graphs_on"]["b1_ctx512"]["fraction_of_copy_bw"] = 0.75
    run.res["gemv"] = {"shapes": [_gemv_row("o", 1, 12e-6, 11e-6, 15e-6)]}
    run.derive()
    assert run.res["dflash2_step_over_ar_step"] == {"b1_ctx512": pytest.approx(1.2)}
    assert run.res["dflash2_step_over_dflash_step"] == {"b1_ctx512": pytest.approx(0.006 / 0.0065)}
    assert run.res["goals"]["dflash2_step_over_ar_bs1_ctx512"]["met"]
    assert not run.res["goals"]["spec_step_over_ar_bs1_ctx512"]["met"]
    head = json.loads((tmp_path / "headline.json").read_text())
    assert head["dflash2_step_over_ar_bs1"] == pytest.approx(1.2) and head["spec_step_over_ar_bs1"] == pytest.approx(1.3)
    assert head["gemv_o_m1_ours_fraction"] == pytest.approx(1e8 / 11e-6 / 4e12)


def test_qwen3_bench_carry_over_keeps_what_this_run_does_not_measure():
    q = _bench_module("bench_gpu_qwen3")
    prev = {"date": "d0", "command": "c0", "copy_bw_gbs": 4200.0, "gemv": {"shapes": []}, "peers": {"x": 1},
            "ours": {"ar": {"graphs_on": {"b1_ctx512": 1}, "graphs_off": {"b1_ctx512": 2}},
                     "spec": {"graphs_on": {"b1_ctx512": 3}}, "dflash2": {"graphs_on": {"b1_ctx512": 4}}}}
    res = {}
    q.carry_over(res, prev, {"dflash2", "gemv", "graphs_off"})
    assert res["ours"] == {"ar": {"graphs_on": {"b1_ctx512": 1}}, "spec": {"graphs_on": {"b1_ctx512": 3}}}
    assert res["copy_bw_gbs"] == 4200.0 and res["peers"] == {"x": 1} and "gemv" not in res
    assert res["carried_over"]["date"] == "d0" and "ours.ar.graphs_on" in res["carried_over"]["keys"]
    res = {}
    q.carry_over(res, {"date": "d0"}, {"ar"})
    assert res == {}
    assert q.parse_args(["--carry-over"]).carry_over and not q.parse_args([]).carry_over


def test_smollm2_bench_times_ar_and_speculative_decoding():
    """bench_gpu_smollm2's timing of our AR and speculative decoding (shipped drafter), on the CPU."""
    from dflash.default_model import default_drafter_dir, default_model_dir

    b = _bench_module("bench_gpu_smollm2")
    drafter = default_drafter_dir()
    if drafter is None:
        pytest.skip("no shipped drafter")
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6]]
    ar = b.ours(default_model_dir(), prompts, 10, device="cpu", kv_cache_tokens=1024)
    spec = b.ours(default_model_dir(), prompts, 10, draft_dir=drafter, device="cpu", kv_cache_tokens=1024)
    assert ar["steps"] == 9 and ar["tokens_per_step_per_request"] == 1.0 and not ar["speculative"]
    assert ar["spec_steps"] == 0 and ar["decode_tokens_per_s"] == pytest.approx(2 * 9 / ar["decode_s"])
    assert spec["speculative"] and 0 < spec["spec_steps"] and spec["steps"] <= 9
    assert spec["tokens_per_step_per_request"] >= 1.0
    r = b.spec_ratios(spec, ar, {"decode_tokens_per_s": 2.0})
    assert r["spec_step_over_ar_step"] == pytest.approx(spec["ms_per_step"] / ar["ms_per_step"])
    assert r["spec_speedup_vs_hf"] == pytest.approx(spec["decode_tokens_per_s"] / 2.0)
    assert b.spec_ratios(None, ar, {"decode_tokens_per_s": 2.0}) == {}


def test_cpu_decode_headline_is_the_batch_1_ratio():
    c = _bench_module("bench_cpu_decode")
    results = [{"batch_size": 8, "decode_tok_s_ratio_ours_over_transformers": 3.8},
               {"batch_size": 1, "decode_tok_s_ratio_ours_over_transformers": 2.9}]
    assert c.headline_figures(results) == {"cpu_ar_speedup_vs_hf_bs1": 2.9}
    assert c.headline_figures([{"batch_size": 1}]) == {}  # --skip-transformers: no ratio, no key


def test_result_header_records_kernel_switches(monkeypatch):
    g = _bench_module("gpu_common")
    monkeypatch.setenv("DFLASH_ROPE_ATTENTION", "1")
    monkeypatch.setenv("DFLASH_GEMM", "stream")
    monkeypatch.delenv("DFLASH_PDL", raising=False)
    rec = g.run_record("test")
    assert rec["kernel_switches"]["DFLASH_ROPE_ATTENTION"] == "1"
    assert rec["kernel_switches"]["DFLASH_GEMM"] == "stream"
    assert "DFLASH_PDL" not in rec["kernel_switches"]
    assert all(k.startswith("DFLASH_") for k in rec["kernel_switches"])


def test_headline_is_merged_not_replaced(tmp_path):
    g = _bench_module("gpu_common")
    (tmp_path / "headline.json").write_text(json.dumps({"smollm2_ar_speedup_vs_hf": 14.5, "date": "old"}))
    g.update_headline(tmp_path, {"ar_step_bw_fraction_bs1": 0.8})
    h = json.loads((tmp_path / "headline.json").read_text())
    assert h["smollm2_ar_speedup_vs_hf"] == 14.5 and h["ar_step_bw_fraction_bs1"] == 0.8
    assert h["date"] != "old" and "command" in h


def test_other_benchmarks_stamp_their_own_date(tmp_path):
    g = _bench_module("gpu_common")
    (tmp_path / "headline.json").write_text(json.dumps({"date": "qwen3 run", "command": "qwen3 cmd"}))
    g.update_headline(tmp_path, {"smollm2_ar_speedup_vs_hf": 30.0}, stamp_prefix="smollm2_")
    h = json.loads((tmp_path / "headline.json").read_text())
    assert h["date"] == "qwen3 run" and h["command"] == "qwen3 cmd"
    assert h["smollm2_ar_speedup_vs_hf"] == 30.0 and "smollm2_date" in h and "smollm2_command" in h


def test_peer_ratios_use_median_steps():
    q = _bench_module("bench_gpu_qwen3")
    assert q.typical_step_s({"step_s": 9.0, "step_ms_all": [61.0, 30.0, 31.0]}) == pytest.approx(0.031)
    assert q.typical_step_s({"step_s": 0.005}) == 0.005


def test_acceptance_headline_keys(tmp_path):
    u = _bench_module("update_headline_acceptance")
    report = {"date": "d", "command": "dflash bench acceptance ...", "results": [
        {"dataset": "gsm8k", "temperature": 0.0, "tau": 3.8}, {"dataset": "gsm8k", "temperature": 1.0, "tau": 1.3},
        {"dataset": "humaneval", "temperature": 0.0, "tau": 2.9}, {"dataset": "mtbench", "temperature": 0.0, "tau": 2.6},
        {"dataset": "math", "temperature": 1.0, "tau": 1.2}]}
    figs = u.acceptance_figures(report)
    assert figs["tau_gsm8k_t0"] == 3.8 and figs["tau_gsm8k_t1"] == 1.3 and figs["tau_humaneval_t0"] == 2.9
    assert figs["tau_mtbench_t0"] == 2.6 and "tau_math_t1" not in figs and figs["acceptance_date"] == "d"
    e2e = u.e2e_figures({"speedup": 2.5, "date": "e", "command": "c"}, "gpu")
    assert e2e == {"smollm2_dflash_speedup_gpu": 2.5, "e2e_gpu_date": "e", "e2e_gpu_command": "c"}


def test_split_idle_time_separates_step_gaps_from_kernel_gaps():
    # 3 steps of 3 kernels (1 us gaps inside a step), 20 us between steps; one overlap merges
    steps = []
    t = 0.0
    for _ in range(3):
        for _ in range(3):
            steps.append((t, t + 10.0))
            t += 11.0
        t += 19.0  # 20 us after the last kernel's end (incl. the 1 us already added)
    steps.append((5.0, 12.0))  # overlaps the first two kernels of step 1: merged, no gap lost
    C = _bench_module("gpu_common")
    r = C.split_idle_time(steps, 3)
    assert abs(r["busy_us_per_step"] - 91.0 / 3) < 1e-9  # the overlap also fills step 1's first 1 us gap
    assert r["between_steps_us_per_step"] == 20.0 and r["smallest_between_us"] == 20.0
    assert abs(r["within_steps_us_per_step"] - 5.0 / 3) < 1e-9  # 2 x 1 us per step, one closed by the overlap
    assert r["largest_within_us"] == 1.0
    assert C.split_idle_time([], 3) == {}
    assert r["span_us_per_step"] == (steps[-2][1] - 0.0) / 3


def test_ab_variants_parse():
    ab = _bench_module("ab_gpu_step")
    assert ab.parse_variant("default=") == ("default", {})
    assert ab.parse_variant("tc=DFLASH_ATTENTION=tensor_cores,DFLASH_PDL=0") == (
        "tc", {"DFLASH_ATTENTION": "tensor_cores", "DFLASH_PDL": "0"})
    for bad in ("nolabel", "=DFLASH_PDL=0", "x=PATH=/bin", "x=DFLASH_PDL", "a b=DFLASH_PDL=0", "x=--fast"):
        with pytest.raises(ValueError):
            ab.parse_variant(bad)
    label, env = ab.parse_variant("pipe=--async-decode,DFLASH_ROPE_ATTENTION=1")
    assert label == "pipe" and ab.split_variant(env) == ({"DFLASH_ROPE_ATTENTION": "1"}, ["--async-decode"])
    label, env = ab.parse_variant("fp8head=--draft-head=fp8")
    assert ab.split_variant(env) == ({}, ["--draft-head=fp8"])
    q = _bench_module("bench_gpu_qwen3")
    assert q.parse_args(["--async-decode"]).async_decode and not q.parse_args([]).async_decode
    assert q.parse_args(["--draft-head=fp8"]).draft_head == "fp8" and q.parse_args([]).draft_head == "exact"
    assert q.default_sessions(q.parse_args([]))
    assert not q.default_sessions(q.parse_args(["--draft-head=fp8"]))
    assert not q.default_sessions(q.parse_args(["--async-decode"]))


def test_ab_deadline_keeps_runs_that_fit():
    ab = _bench_module("ab_gpu_step")
    assert ab.run_fits(500.0, 80.0, None)
    assert ab.run_fits(0.0, 0.0, 10.0)  # the first run: nothing measured yet
    assert ab.run_fits(400.0, 80.0, 480.0)
    assert not ab.run_fits(401.0, 80.0, 480.0)


def test_ab_summary_medians_and_ratios():
    ab = _bench_module("ab_gpu_step")
    result = {"ours": {"ar": {"graphs_on": {"b1_ctx512": {"step_s_median": 0.005}}},
                       "spec": {"graphs_on": {"b1_ctx512": {"step_s_median": 0.007}, "b16_ctx512": None}}}}
    assert ab.step_points(result) == {"ar_b1_ctx512": 5.0, "spec_b1_ctx512": 7.0}
    runs = [{"label": "a", "points_ms": {"ar_b1_ctx512": 5.0, "spec_b1_ctx512": 7.0}},
            {"label": "b", "points_ms": {"ar_b1_ctx512": 4.0}},
            {"label": "a", "points_ms": {"ar_b1_ctx512": 5.2, "spec_b1_ctx512": 7.4}},
            {"label": "b", "points_ms": {"ar_b1_ctx512": 4.4}},
            {"label": "a", "points_ms": {"ar_b1_ctx512": 6.0}},
            {"label": "b"}]  # a failed run: no points
    s = ab.summarize(runs, ["a", "b"])
    assert s["median_ms"] == {"a": {"ar_b1_ctx512": 5.2, "spec_b1_ctx512": 7.2}, "b": {"ar_b1_ctx512": 4.2}}
    assert s["ratio_to_first"] == {"a": {"ar_b1_ctx512": 1.0, "spec_b1_ctx512": 1.0},
                                   "b": {"ar_b1_ctx512": round(4.2 / 5.2, 4)}}


def test_attention_bench_plan():
    b = _bench_module("bench_gpu_attention_small")
    cases = b.plan(b.parse_args([]))
    impls = {c[0] for c in cases}
    assert impls == set(b.IMPLS)
    assert all(c[2] == 1 for c in cases if c[0] in ("cuda_tc", "cuda_staged", "cuda_rope", "rope_pair",
                                                    "cuda_staged_rope"))
    # every implementation's own split count twice (exact max_kv_len, a graph's 4096 + 16), then the forced ones
    point = [c for c in cases if c[1:4] == (1, 1, 512)]
    assert [(c[0], c[4], c[5]) for c in point if c[0] == "cuda_rope"] == [
        ("cuda_rope", 0, 512), ("cuda_rope", 0, 4112), ("cuda_rope", 1, 512)]
    narrow = b.plan(b.parse_args(["--impls", "cuda,cuda_rope", "--batches", "1", "--qlens", "1", "--contexts", "512",
                                  "--splits", "2,4"]))
    assert [(c[0], c[4]) for c in narrow] == [("cuda", 0), ("cuda", 0), ("cuda", 2), ("cuda", 4),
                                              ("cuda_rope", 0), ("cuda_rope", 0), ("cuda_rope", 2), ("cuda_rope", 4)]
    verify = b.plan(b.parse_args(["--impls", "triton,cuda", "--batches", "1", "--qlens", "16", "--contexts", "512",
                                  "--splits", "2", "--triton-splits", "2,4"]))
    assert [(c[0], c[2], c[4]) for c in verify] == [("triton", 16, 0), ("triton", 16, 0), ("triton", 16, 2),
                                                    ("triton", 16, 4), ("cuda", 16, 0), ("cuda", 16, 0),
                                                    ("cuda", 16, 2)]
    # the batch-invariant kernels: the chunked one on its own choice and folded in the kernel, the
    # prefill one unsplit only
    inv = b.plan(b.parse_args(["--impls", "triton_prefill,triton_chunked", "--batches", "1", "--qlens", "1",
                               "--contexts", "4096"]))
    assert [(c[0], c[4], c[5]) for c in inv] == [("triton_prefill", 0, 4096), ("triton_prefill", 0, 4112),
                                                 ("triton_chunked", 0, 4096), ("triton_chunked", 0, 4112),
                                                 ("triton_chunked", 1, 4096)]
    with pytest.raises(SystemExit):
        b.parse_args(["--impls", "cuda,nope"])


def test_launch_modes_selection_and_medians():
    b = _bench_module("bench_gpu_launch_modes")
    assert list(b.select_modes(None)) == list(b.MODES)
    assert list(b.select_modes("pdl+fused+rope,pdl+fused")) == ["pdl+fused", "pdl+fused+rope"]  # MODES order
    with pytest.raises(ValueError, match="nope"):
        b.select_modes("pdl+fused,nope")
    runs = [{"a": {"wall_ms_per_step_unprofiled": t, "run": i}} for i, t in enumerate([3.0, 1.0, 2.0, 4.0])]
    merged = b.median_runs(runs)
    assert merged["a"]["run"] == 2 and merged["a"]["wall_ms_per_step_unprofiled"] == 2.0  # lower middle of 4
    assert merged["a"]["wall_ms_per_step_unprofiled_runs"] == [1.0, 2.0, 3.0, 4.0]
    assert b.median_runs(runs[:1])["a"]["run"] == 0


def test_profile_host_split():
    p = _bench_module("profile_gpu_step")
    before = {"decode_time_s": 1.0, "host_stage_s": 0.1, "host_launch_s": 0.2, "host_wait_s": 0.5}
    after = {"decode_time_s": 1.0 + 10 * 800e-6, "host_stage_s": 0.1 + 10 * 20e-6, "host_launch_s": 0.2 + 10 * 30e-6,
             "host_wait_s": 0.5 + 10 * 700e-6}
    h = p.host_split(before, after, wall_s=10 * 900e-6, steps=10)
    assert h == {"stage": 20.0, "launch": 30.0, "wait": 700.0, "results": 50.0, "outside_decode": 100.0,
                 "not_waiting": 200.0}


def test_e2e_variants():
    e = _bench_module("bench_dflash_e2e")
    assert e.parse_variant("default") == ("default", {})
    assert e.parse_variant("fixed:3") == ("fixed:3", {"speculation": "fixed", "num_speculative_tokens": 3})
    assert e.parse_variant("fixed+async") == ("fixed+async", {"speculation": "fixed", "async_decode": True})
    assert e.parse_variant("default+async") == ("default+async", {"async_decode": True})
    for bad in ("fixed+fast", "fixed:0", "nope"):
        with pytest.raises(SystemExit):
            e.parse_variant(bad)

#!/usr/bin/env python3
"""Summary of the SmolLM2-135M drafter training on the H200, from the device_run reports in
bench/results/train_smollm2/:

- tau versus training data seen: the held-out teacher-forced simulated acceptance (sim_al) and
  the real greedy tau (128 held-out prompts, 256 tokens, the runtime) at the end of each call
  of the shipped run (run1_call*_report.json), against the sequences trained on (step x 32)
  and epochs over the 39,837 training rows;
- the shape probe (shape_probe/study_*.json): 1 vs 2 layers and B = 8 vs 16, each trained
  from scratch for the same wall time (about 48 s of training) on the same data;
- run 2 (run2/): the 63,856-prompt set (ShareGPT, GSM8K, stdlib and self-written code, 25 %
  answered by sampling at T=1) and three trainings run side by side on one H200: (a) the
  shipped v1 drafter warm-started for 1,700 steps (shipped as v2), (b) 2 layers and (c) 3
  layers from scratch with identical schedules (1,350 steps, warmup 200, cosine, lr 6e-4): the
  depth comparison. Its cost side comes from gpu_h200_step_profile_smollm2_geometry.json (the
  speculative step with random 2-, 3- and 5-layer drafters on SmolLM2's geometry), its
  acceptance side from acceptance_smollm2_h200{_v1,}.json.

Writes bench/results/train_smollm2/summary.json, tau_vs_data.png and depth_comparison.png
(matplotlib). Reads JSON only; nothing is rerun. Usage: python bench/train_summary_smollm2.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "train_smollm2"
RUN2 = RESULTS / "run2"
BATCH = 32  # sequences per step of the run


def curve() -> list[dict]:
    points = []
    for path in sorted(RESULTS.glob("run1_call*_report.json")):
        r = json.loads(path.read_text())
        t = r.get("train") or {}
        if "step" not in t:
            continue
        points.append({"report": path.name, "date": r.get("date"), "step": t["step"],
                       "sequences_seen": t["step"] * BATCH, "epochs": round(t["epoch"], 3),
                       "heldout_sim_al": (t.get("eval") or {}).get("sim_al"),
                       "heldout_loss": (t.get("eval") or {}).get("loss"),
                       "tau_128_heldout": (r.get("tau") or {}).get("tau"),
                       "tau_per_source": (r.get("tau") or {}).get("tau_per_source")})
    return points


def probe() -> list[dict]:
    rows = []
    for path in sorted((RESULTS / "shape_probe").glob("study_*.json")):
        r = json.loads(path.read_text())
        t, argv = r["train"], r["argv"]
        rows.append({"variant": path.stem.removeprefix("study_"),
                     "num_layers": int(argv[argv.index("--num-layers") + 1]),
                     "block_size": int(argv[argv.index("--block-size") + 1]),
                     "steps": t["step"], "train_seconds": t["train_seconds_here"],
                     "s_per_step": round(t["train_seconds_here"] / t["step"], 4),
                     "heldout_sim_al": t["eval"]["sim_al"], "heldout_loss": t["eval"]["loss"],
                     "tau_64_heldout": r["tau"]["tau"], "date": r["date"]})
    return rows


def _run2_variant(name: str) -> dict:
    d = RUN2 / name
    cfg = json.loads((d / "train_config.json").read_text())
    last = json.loads((d / "call2_report.json").read_text())
    tau_report = d / "call3_tau_report.json"  # b's tau ran in a later call (GPU memory, see note)
    tau = json.loads((tau_report if tau_report.is_file() else d / "call2_report.json").read_text())["tau"]
    t = last["train"]
    return {"num_layers": cfg["num_layers"], "block_size": cfg["block_size"], "init_from": cfg.get("init_from"),
            "lr": cfg["lr"], "warmup_steps": cfg["warmup_steps"], "steps": t["step"], "epochs": round(t["epoch"], 3),
            "heldout_loss": t["eval"]["loss"], "heldout_sim_al": t["eval"]["sim_al"],
            "heldout_acc_by_position": t["eval"]["acc"], "tau_128_heldout": tau["tau"],
            "tau_per_source": tau["tau_per_source"]}


def _acceptance(path: Path) -> dict:
    r = json.loads(path.read_text())
    out = {}
    for row in r.get("results", []):
        out[f"{row['dataset']}_t{row['temperature']:g}"] = round(row["tau"], 3)
    return out


def run2() -> dict:
    if not RUN2.is_dir():
        return {}
    data = json.loads((RUN2 / "data_report.json").read_text())["data"]
    a, b, c = (_run2_variant(x) for x in "abc")
    prof = json.loads((RESULTS.parent / "gpu_h200_step_profile_smollm2_geometry.json").read_text())
    step_ms = {2: prof["spec"]["wall_ms_per_step_unprofiled"], 3: prof["spec_3_layers"]["wall_ms_per_step_unprofiled"],
               5: prof["spec_5_layers"]["wall_ms_per_step_unprofiled"]}
    gain = {n: round(v["tau_128_heldout"] / step_ms[n], 4) for n, v in ((2, b), (3, c))}
    return {
        "data": {"prompts": data["num_prompts"], "counts": data["counts"], "sources": data["sources"],
                 "sampled_share": data["params"]["sampled_share"], "packed_bytes": data["bytes"],
                 "generate_seconds": data["generate_seconds"]},
        "a_warm_start_shipped_v2": a,
        "b_two_layers_scratch": b,
        "c_three_layers_scratch": c,
        "depth_comparison": {
            "tau_ratio_3_over_2": round(c["tau_128_heldout"] / b["tau_128_heldout"], 4),
            "spec_step_ms_by_drafter_layers": step_ms,
            "spec_step_ratio_3_over_2": round(step_ms[3] / step_ms[2], 4),
            "spec_step_ratio_5_over_2": round(step_ms[5] / step_ms[2], 4),
            "tau_per_ms": gain, "net_ratio_3_over_2": round(gain[3] / gain[2], 4),
            "note": ("b and c trained side by side from scratch on the same set with identical schedules (1,350 "
                     "steps of 32 sequences, 0.69 epoch); tau on the same 128 held-out prompts; step times are the "
                     "SmolLM2-geometry speculative step at batch 1 (random weights, graphs) with 2/3/5-layer drafters"),
        },
        "acceptance_v1": _acceptance(RESULTS.parent / "acceptance_smollm2_h200_v1.json"),
        "acceptance_v2": _acceptance(RESULTS.parent / "acceptance_smollm2_h200.json"),
    }


def main() -> None:
    summary = {
        "what": "SmolLM2-135M-Instruct DFlash drafter training on one H200 (device_run)",
        "tau_vs_data": curve(),
        "tau_vs_data_note": ("one run over one 40K-prompt set: the x axis is sequences trained on (with repeats "
                             "after epoch 1), not distinct prompts; the curve is still rising at the end"),
        "shape_probe": probe(),
        "shape_probe_note": ("equal wall time from scratch (~48 s of training, 0.1-0.14 epoch): an early-training "
                             "probe only, not a converged comparison"),
        "run2": run2(),
        "command": "python bench/train_summary_smollm2.py",
    }
    (RESULTS / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary["tau_vs_data"], indent=1))
    print(json.dumps(summary["shape_probe"], indent=1))
    print(json.dumps({k: v for k, v in summary["run2"].items() if k.startswith(("depth", "accept"))}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    pts = summary["tau_vs_data"]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [p["sequences_seen"] / 1000 for p in pts]
    ax.plot(xs, [p["tau_128_heldout"] for p in pts], "o-", label="real greedy tau (128 held-out prompts)")
    ax.plot(xs, [p["heldout_sim_al"] for p in pts], "s--", label="simulated acceptance (teacher-forced)")
    for p, x in zip(pts, xs):
        ax.annotate(f"{p['epochs']:.1f} ep", (x, p["tau_128_heldout"]), textcoords="offset points", xytext=(0, -14),
                    ha="center", fontsize=8)
    _finish(fig, ax, "training sequences seen (thousands; 39.8K distinct rows)", "acceptance length tau",
            "SmolLM2-135M drafter (2 layers, B=8) on the H200", "tau_vs_data.png")
    if summary["run2"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, label in (("b", "2 layers"), ("c", "3 layers")):
            rows = [json.loads(x) for x in (RUN2 / name / "metrics.jsonl").read_text().splitlines()]
            rows = [r for r in rows if "sim_al" in r]
            ax.plot([r["step"] for r in rows], [r["sim_al"] for r in rows], "o-", ms=3,
                    label=f"{label} (held-out tau {summary['run2'][{'b': 'b_two_layers_scratch', 'c': 'c_three_layers_scratch'}[name]]['tau_128_heldout']:.2f})")
        _finish(fig, ax, "step (32 sequences)", "training-batch simulated acceptance",
                "SmolLM2 drafter depth, from scratch, same schedule (H200)", "depth_comparison.png")


def _finish(fig, ax, xlabel: str, ylabel: str, title: str, name: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / name, dpi=120)
    print(f"wrote {RESULTS / name}")


if __name__ == "__main__":
    main()

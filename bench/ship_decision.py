#!/usr/bin/env python3
"""The ship decision of issue 14 from measured files: tau-weighted tokens/s of a DFlash2 drafter
over the shipped DFlash drafter, per data set and temperature.

tokens/s of a batch-1 decode is tau / (seconds per draft-verify step). tau per cell comes from a
merged acceptance file (bench/merge_acceptance_modes.py; the runs of that file may have shared
the GPU, so their own tokens/s are not used); seconds per step come from runs that had the GPU
alone: at T = 0 the two bench_dflash_e2e.py reports (DFlash wall seconds / spec steps, prefill
included), at T > 0 two `dflash bench acceptance` reports of the same prompts (wall seconds /
spec steps). The ratio per cell is (tau ratio) / (step-time ratio); the summary is the geometric
mean over the cells of each temperature and over all cells.

Usage: python bench/ship_decision.py --modes MERGED.json --shipped-mode M --candidate-mode M
           --e2e-shipped A.json --e2e-candidate B.json --t1-shipped C.json --t1-candidate D.json --out FILE
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def _load(path: str) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def e2e_step_s(report: dict) -> float:
    d = report["dflash"]
    return d["seconds"] / d["spec_steps"]


def acceptance_step_s(report: dict) -> float:
    wall = sum(c["wall_time_s"] for c in report["results"])
    steps = sum(c["num_spec_steps"] for c in report["results"])
    return wall / steps


def decide(merged: dict, shipped: str, candidate: str, step_ratio: dict) -> dict:
    cells = []
    for row in merged["tau_table"]:
        t = float(row["temperature"])
        key = "t0" if t == 0 else "t_pos"
        if f"tau_{shipped}" not in row or f"tau_{candidate}" not in row:
            continue
        tau_ratio = row[f"tau_{candidate}"] / row[f"tau_{shipped}"]
        cells.append({"dataset": row["dataset"], "temperature": t, "tau_shipped": row[f"tau_{shipped}"],
                      "tau_candidate": row[f"tau_{candidate}"], "tau_ratio": tau_ratio,
                      "step_time_ratio": step_ratio[key], "tokens_per_s_ratio": tau_ratio / step_ratio[key]})

    def gmean(xs):
        return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None

    by_t = {}
    for t in sorted({c["temperature"] for c in cells}):
        by_t[f"{t:g}"] = gmean([c["tokens_per_s_ratio"] for c in cells if c["temperature"] == t])
    overall = gmean([c["tokens_per_s_ratio"] for c in cells])
    return {"cells": cells, "tokens_per_s_ratio_by_temperature": by_t, "tokens_per_s_ratio_overall": overall,
            "candidate_wins": bool(overall is not None and overall > 1.0 and all(v > 1.0 for v in by_t.values()))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", required=True)
    ap.add_argument("--shipped-mode", default="dflash_v2_probabilistic")
    ap.add_argument("--candidate-mode", default="dflash2_sampled_walk")
    ap.add_argument("--e2e-shipped", required=True)
    ap.add_argument("--e2e-candidate", required=True)
    ap.add_argument("--t1-shipped", required=True)
    ap.add_argument("--t1-candidate", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    merged = _load(args.modes)
    e2e_s, e2e_c = _load(args.e2e_shipped), _load(args.e2e_candidate)
    t1_s, t1_c = _load(args.t1_shipped), _load(args.t1_candidate)
    steps = {"t0": {"shipped_s": e2e_step_s(e2e_s), "candidate_s": e2e_step_s(e2e_c)},
             "t_pos": {"shipped_s": acceptance_step_s(t1_s), "candidate_s": acceptance_step_s(t1_c)}}
    ratio = {k: v["candidate_s"] / v["shipped_s"] for k, v in steps.items()}
    out = {"what": "tau-weighted tokens/s of the candidate drafter over the shipped one (batch 1): tau ratio per "
                   "cell / seconds-per-step ratio measured with the GPU alone",
           "rule": "ship the candidate only if it is faster overall and at every temperature",
           "shipped_mode": args.shipped_mode, "candidate_mode": args.candidate_mode,
           "sources": {"modes": args.modes, "e2e_shipped": args.e2e_shipped, "e2e_candidate": args.e2e_candidate,
                       "t1_shipped": args.t1_shipped, "t1_candidate": args.t1_candidate},
           "step_seconds": steps, "step_time_ratio": ratio, **decide(merged, args.shipped_mode, args.candidate_mode,
                                                                      ratio)}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    for c in out["cells"]:
        print(f"{c['dataset']:<10} T={c['temperature']:g}  tau {c['tau_shipped']:.3f} -> {c['tau_candidate']:.3f}  "
              f"tok/s x{c['tokens_per_s_ratio']:.3f}")
    print("by temperature", {k: round(v, 4) for k, v in out["tokens_per_s_ratio_by_temperature"].items()},
          "overall", round(out["tokens_per_s_ratio_overall"], 4), "candidate wins:", out["candidate_wins"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

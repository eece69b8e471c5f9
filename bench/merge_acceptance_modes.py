#!/usr/bin/env python3
"""Merges `dflash bench acceptance` reports of several drafting modes into one JSON and one plot of
acceptance rate by draft position (a panel per dataset and temperature, a line per mode), with a
tau table and each mode's tau over a reference mode.

A mode is LABEL=REPORT[,REPORT...]: the reports' cells (dataset, temperature) are that mode's.
A T = 0 cell may be shared by two modes (at T = 0 greedy and probabilistic drafts are the same
argmax drafts, and the greedy and sampled DFlash2 walks are the same walk), so one measured
report can be named by both.  Each report is stored once (per-request records included), under its
file name; a mode lists its files.

Usage: python bench/merge_acceptance_modes.py --mode "dflash_v2_greedy=a.json,b.json" ...
           --reference dflash_v2_probabilistic --what "..." --out merged.json --plot merged.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Tuple

Cell = Tuple[str, float]


def load_mode(spec: str) -> Tuple[str, List[dict]]:
    label, _, paths = spec.partition("=")
    if not label or not paths:
        raise SystemExit(f"--mode wants LABEL=REPORT[,REPORT...], got {spec!r}")
    return label, [json.loads(Path(p).read_text(encoding="utf-8")) | {"_path": p} for p in paths.split(",")]


def cells_of(reports: List[dict]) -> Dict[Cell, dict]:
    cells: Dict[Cell, dict] = {}
    for rep in reports:
        for c in rep["results"]:
            key = (c["dataset"], float(c["temperature"]))
            if key in cells:
                raise SystemExit(f"cell {key} appears twice in one mode")
            cells[key] = c
    return cells


def merge(modes: Dict[str, List[dict]], reference: str, what: str) -> dict:
    cells = {label: cells_of(reps) for label, reps in modes.items()}
    keys = sorted({k for c in cells.values() for k in c}, key=lambda k: (k[1], k[0]))
    table = []
    for ds, t in keys:
        row = {"dataset": ds, "temperature": t}
        for label, c in cells.items():
            if (ds, t) in c:
                row[f"tau_{label}"] = c[(ds, t)]["tau"]
                row[f"accept_pos1_{label}"] = c[(ds, t)]["acceptance_rate_per_position"][0]
        ref = cells.get(reference, {}).get((ds, t))
        if ref is not None:
            for label, c in cells.items():
                if label != reference and (ds, t) in c:
                    row[f"tau_{label}_over_{reference}"] = c[(ds, t)]["tau"] / ref["tau"]
        table.append(row)
    reports = {}  # each measured report once, by file name; a mode lists the files it is made of
    for reps in modes.values():
        for rep in reps:
            reports[Path(rep["_path"]).name] = {k: v for k, v in rep.items() if k != "_path"}
    mode_files = {label: [Path(rep["_path"]).name for rep in reps] for label, reps in modes.items()}
    return {"what": what, "reference_mode": reference, "modes": mode_files, "tau_table": table, "reports": reports}


def plot(merged: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [(r["dataset"], r["temperature"]) for r in merged["tau_table"]]
    datasets = sorted({k[0] for k in keys}, key=[k[0] for k in keys].index)
    temps = sorted({k[1] for k in keys})
    fig, axes = plt.subplots(len(temps), len(datasets), figsize=(4.2 * len(datasets), 3.4 * len(temps)),
                             squeeze=False, sharey=True)
    for label, files in merged["modes"].items():
        for name in files:
            for c in merged["reports"][name]["results"]:
                ax = axes[temps.index(float(c["temperature"]))][datasets.index(c["dataset"])]
                rates = c["acceptance_rate_per_position"]
                ax.plot(range(1, len(rates) + 1), rates, marker="o", ms=3, label=f"{label} (tau {c['tau']:.2f})")
    for i, t in enumerate(temps):
        for j, ds in enumerate(datasets):
            ax = axes[i][j]
            ax.set_title(f"{ds}, T = {t:g}")
            ax.set_xlabel("draft position")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        axes[i][0].set_ylabel("acceptance rate")
    fig.suptitle(merged["what"][:160], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", action="append", required=True, help="LABEL=REPORT[,REPORT...]")
    ap.add_argument("--reference", required=True, help="the mode the tau ratios divide by")
    ap.add_argument("--what", required=True, help="one line saying what was measured, where")
    ap.add_argument("--out", required=True)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    modes = dict(load_mode(s) for s in args.mode)
    if args.reference not in modes:
        raise SystemExit(f"--reference {args.reference!r} is not one of the modes {list(modes)}")
    merged = merge(modes, args.reference, args.what)
    Path(args.out).write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")
    if args.plot:
        plot(merged, args.plot)
    for row in merged["tau_table"]:
        taus = "  ".join(f"{k[4:]} {v:.3f}" for k, v in row.items() if k.startswith("tau_") and "_over_" not in k)
        print(f"{row['dataset']:<10} T={row['temperature']:g}  {taus}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

# bench/ab_gpu_step.py
#
# A/B of CUDA backend switches on the Qwen3-8B-geometry decode steps, side by side in one job.
#
# The switches (DFLASH_GEMM, DFLASH_ATTENTION, DFLASH_L2_PREFETCH, DFLASH_PDL, ...) are read once
# per process, so each variant runs bench/bench_gpu_qwen3.py in a process of its own, on the same
# random models (one --work-dir, written by the first run), and the variants are interleaved
# (A B C A B C ...) so that a drift of the machine spreads over all of them. One JSON comes out:
# every run's step medians, per variant and point the median over the repeats, and every
# variant's ratio to the first one (< 1: faster than the first).
#
#   python bench/ab_gpu_step.py --out DIR --repeats 2 --batches 1,16 --contexts 512 \
#       --variant default= --variant prefetch=DFLASH_L2_PREFETCH=all \
#       --variant tc=DFLASH_ATTENTION=tensor_cores,DFLASH_L2_PREFETCH=off
#
# A variant is LABEL=[NAME=VALUE[,NAME=VALUE...]]: the environment it adds to this process's
# (LABEL= runs with the environment as it is). Pure Python but for the child runs; the parsing and
# the summary are tested on the CPU (tests/test_bench_gpu_common.py).
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu_common import BENCH_DIR, command_line, now_iso

RESULT_NAME = "gpu_h200_qwen3_8b.json"  # what bench_gpu_qwen3.py writes into its --out


# bench_gpu_qwen3.py flags a variant may add (session options, not environment switches).
BENCH_FLAGS = ("--async-decode", "--draft-head=fp8")


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """'label=A=1,B=x' -> ('label', {'A': '1', 'B': 'x'}); 'label=' -> ('label', {}). An item that is
    one of BENCH_FLAGS (e.g. 'label=--async-decode') is kept under its own name with the value
    'flag' and passed to the child bench instead of its environment."""
    label, sep, rest = text.partition("=")
    if not sep or not label or not label.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"a variant is LABEL=[NAME=VALUE,...] with a plain label, got {text!r}")
    env: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        if item in BENCH_FLAGS:
            env[item] = "flag"
            continue
        name, eq, value = item.partition("=")
        if not eq or not name.isidentifier() or not name.startswith("DFLASH_"):
            raise ValueError(f"variant {label!r}: {item!r} is not DFLASH_NAME=VALUE or one of {BENCH_FLAGS}")
        env[name] = value
    return label, env


def split_variant(env: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """A parsed variant's environment additions and its bench flags."""
    return ({k: v for k, v in env.items() if k not in BENCH_FLAGS}, [k for k in env if k in BENCH_FLAGS])


def step_points(result: dict[str, Any]) -> dict[str, float]:
    """{'ar_b1_ctx512': ms, 'spec_b1_ctx512': ms, ...}: the graph-mode step medians of one run."""
    out: dict[str, float] = {}
    for section in ("ar", "spec"):
        for point, v in result.get("ours", {}).get(section, {}).get("graphs_on", {}).items():
            if isinstance(v, dict) and v.get("step_s_median") is not None:
                out[f"{section}_{point}"] = round(v["step_s_median"] * 1e3, 4)
    return out


def summarize(runs: list[dict[str, Any]], labels: list[str]) -> dict[str, Any]:
    """Per variant and point the median over its runs; each variant's ratio to the first label's."""
    median: dict[str, dict[str, float]] = {}
    for label in labels:
        per_point: dict[str, list[float]] = {}
        for run in runs:
            if run["label"] != label:
                continue
            for point, ms in run.get("points_ms", {}).items():
                per_point.setdefault(point, []).append(ms)
        median[label] = {p: round(statistics.median(v), 4) for p, v in sorted(per_point.items())}
    first = median.get(labels[0], {}) if labels else {}
    ratio = {label: {p: round(ms / first[p], 4) for p, ms in pts.items() if first.get(p)}
             for label, pts in median.items()}
    return {"median_ms": median, "ratio_to_first": ratio,
            "ratio_meaning": f"variant median / {labels[0] if labels else '?'} median, per point (< 1: faster)"}


def run_fits(elapsed_s: float, longest_run_s: float, deadline_s: float | None) -> bool:
    """Whether another child run may start: no deadline, or the longest run so far still ends
    before it (a run killed by the device's command limit would leave nothing)."""
    return deadline_s is None or elapsed_s + longest_run_s <= deadline_s


def child_command(args, out_dir: Path, work_dir: Path) -> list[str]:
    cmd = [sys.executable, str(BENCH_DIR / "bench_gpu_qwen3.py"), "--out", str(out_dir), "--work-dir", str(work_dir),
           "--sections", args.sections, "--batches", args.batches, "--contexts", args.contexts,
           "--budget-s", str(args.run_budget_s)]
    if args.steps is not None:
        cmd += ["--steps", str(args.steps)]
    return cmd


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True, help="LABEL=[DFLASH_NAME=VALUE,...] (repeatable)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per variant, interleaved (default 1)")
    ap.add_argument("--out", default="bench/results", help="directory of the combined JSON")
    ap.add_argument("--name", default="gpu_h200_ab_step.json", help="file name of the combined JSON")
    ap.add_argument("--note", default="", help="what the variants differ in, recorded in the JSON")
    ap.add_argument("--sections", default="copy,ar,spec", help="bench_gpu_qwen3.py sections (default copy,ar,spec)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--contexts", default="512")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--run-budget-s", type=float, default=150.0, help="each child run's --budget-s")
    ap.add_argument("--work-dir", default=None, help="the random models (default: a temp dir)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no run that would end (by the longest run so far) past this many seconds; the "
                         "runs left out are listed under 'skipped'")
    args = ap.parse_args(argv)
    variants = [parse_variant(v) for v in args.variant]
    labels = [label for label, _ in variants]
    if len(set(labels)) != len(labels):
        ap.error(f"variant labels repeat: {labels}")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="dflash_ab_"))
    res: dict[str, Any] = {"benchmark": "gpu_ab_step", "date": now_iso(), "command": command_line(),
                           "note": args.note, "method": __doc__, "variants": dict(variants), "runs": []}
    t0 = time.perf_counter()
    longest = 0.0
    for repeat in range(args.repeats):
        for label, env in variants:
            if not run_fits(time.perf_counter() - t0, longest, args.deadline_s):
                res.setdefault("skipped", []).append({"label": label, "repeat": repeat})
                print(f"{label} #{repeat}: skipped (the deadline of {args.deadline_s} s)", flush=True)
                (out / args.name).write_text(json.dumps(res, indent=1))
                continue
            run_dir = Path(tempfile.mkdtemp(prefix=f"ab_{label}_"))
            extra_env, flags = split_variant(env)
            cmd = child_command(args, run_dir, work) + flags
            t = time.perf_counter()
            p = subprocess.run(cmd, env={**os.environ, **extra_env}, capture_output=True, text=True, check=False)
            run: dict[str, Any] = {"label": label, "repeat": repeat, "env": env, "rc": p.returncode,
                                   "wall_s": round(time.perf_counter() - t, 1)}
            longest = max(longest, time.perf_counter() - t)
            result_path = run_dir / RESULT_NAME
            if result_path.is_file():
                result = json.loads(result_path.read_text())
                run["date"] = result.get("date")
                run["copy_bw_gbs"] = result.get("copy_bw_gbs")
                run["points_ms"] = step_points(result)
                run["ar_fraction_of_copy_bw"] = result.get("ar_fraction_of_copy_bw")
                res.setdefault("machine", result.get("machine"))
                res.setdefault("versions", result.get("versions"))
            if p.returncode != 0:
                run["stderr_tail"] = p.stderr[-2000:]
            res["runs"].append(run)
            print(f"{label} #{repeat}: rc {p.returncode}, {run.get('points_ms')}", flush=True)
            res.update(summarize(res["runs"], labels))
            res["wall_s"] = round(time.perf_counter() - t0, 1)
            (out / args.name).write_text(json.dumps(res, indent=1))
    res.update(summarize(res["runs"], labels))
    (out / args.name).write_text(json.dumps(res, indent=1))
    print(json.dumps({"median_ms": res["median_ms"], "ratio_to_first": res["ratio_to_first"]}, indent=1))
    print(f"wrote {out / args.name}")


if __name__ == "__main__":
    main()

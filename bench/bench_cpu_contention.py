#!/usr/bin/env python3
"""CPU decode under shared cores: dflash (SmolLM2-135M-Instruct, fp32, batch 1, target-only).

Each case runs fresh worker processes (this script with --worker) that open a Session, warm up,
then decode --new-tokens tokens (ignore_eos) and report the runtime's decode tok/s:

  alone            one dflash process, default thread count (every core)
  two_default      two dflash processes at once, each with the default thread count
  two_threads1     two dflash processes at once, each with num_threads=1
  busy_load        one dflash process (default threads) beside one busy-looping process per
                   core (unrelated load)

Workers of one case start together (a barrier file) so their decodes overlap. The JSON holds
the machine, the command, the date, every worker's figure and the load average.

Usage:
  python bench/bench_cpu_contention.py [--new-tokens 64] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]


def worker(args: argparse.Namespace) -> None:
    import dflash
    from dflash.default_model import default_model_dir

    kwargs = {"device": "cpu", "max_model_len": 1024}
    if args.threads:
        kwargs["num_threads"] = args.threads
    sess = dflash.Session(str(default_model_dir()), **kwargs)
    params = dflash.SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    sess.generate([PROMPT], dflash.SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    Path(args.ready).touch()
    while not Path(args.go).exists():
        time.sleep(0.005)
    out = sess.generate([PROMPT], params)[0]
    print(json.dumps({"decode_tok_s": out.metrics.decode_tokens_per_s,
                      "generated": out.metrics.generated_tokens}))


def busy_loop(stop_file: str) -> None:
    while not os.path.exists(stop_file):
        for _ in range(100000):
            pass


def run_case(name: str, threads: list[int], busy: int, new_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        go, stop = os.path.join(tmp, "go"), os.path.join(tmp, "stop")
        procs, readies = [], []
        for i, t in enumerate(threads):
            ready = os.path.join(tmp, f"ready{i}")
            readies.append(ready)
            cmd = [sys.executable, __file__, "--worker", "--ready", ready, "--go", go,
                   "--new-tokens", str(new_tokens), "--threads", str(t)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
        while not all(os.path.exists(r) for r in readies):
            if any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(f"{name}: a worker failed")
            time.sleep(0.05)
        loaders = [subprocess.Popen([sys.executable, "-c",
                                     f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                                     f"import bench_cpu_contention as b; b.busy_loop({stop!r})"])
                   for _ in range(busy)]
        time.sleep(0.2 if busy else 0.0)
        load_before = os.getloadavg()[0]
        Path(go).touch()
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=900)
            if p.returncode != 0:
                raise RuntimeError(f"{name}: a worker exited with {p.returncode}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        Path(stop).touch()
        for p in loaders:
            p.wait(timeout=60)
    return {"case": name, "threads": threads, "busy_processes": busy,
            "decode_tok_s": [r["decode_tok_s"] for r in results], "loadavg_before": load_before}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO_ROOT / "bench" / "results" / "cpu_smollm2_contention.json"))
    ap.add_argument("--label", default="", help="what build this is (recorded in the JSON)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ready", help=argparse.SUPPRESS)
    ap.add_argument("--go", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    cores = os.cpu_count() or 1
    cases = [("alone", [0], 0), ("two_default", [0, 0], 0), ("two_threads1", [1, 1], 0),
             ("busy_load", [0], cores)]
    runs = []
    for rep in range(args.repeats):
        for name, threads, busy in cases:
            r = run_case(name, threads, busy, args.new_tokens)
            r["repeat"] = rep
            runs.append(r)
            print(f"{name:13s} repeat {rep}: " + ", ".join(f"{x:.1f}" for x in r["decode_tok_s"]) + " tok/s",
                  flush=True)
    summary = {}
    for name, _, _ in cases:
        per_proc = [x for r in runs if r["case"] == name for x in r["decode_tok_s"]]
        summary[name] = {"median_decode_tok_s_per_process": statistics.median(per_proc),
                         "min": min(per_proc), "max": max(per_proc)}
    result = {
        "benchmark": "cpu_contention",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "machine": {"cpu_count": cores, "platform": platform.platform(), "processor": platform.processor()},
        "label": args.label,
        "dflash_module": __import__("dflash").__file__,
        "new_tokens": args.new_tokens,
        "summary": summary,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for name, s in summary.items():
        print(f"{name:13s} median {s['median_decode_tok_s_per_process']:.1f} tok/s per process "
              f"(min {s['min']:.1f}, max {s['max']:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

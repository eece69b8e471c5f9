#!/usr/bin/env python3
# bench/fuzz_loaders.py
#
# Structured-mutation fuzzing of dflash's file readers at the Python boundary: the safetensors
# reader (checked against the reference `safetensors` library), the target and drafter
# config.json parsers plus the tokenizer's config reader, and the GGUF converter (its output
# must pass the runtime's config and tensor-set checks). Seeds, mutators and checkers live in
# tests/fixtures/loader_fuzz.py; case i of a reader is generated from random.Random(f"{seed}-
# {reader}-{i}"), so any case can be regenerated from the report.
#
# Cases run in forked worker processes, in chunks. A finding is a crash (the worker died: the
# case it was on is recorded and the chunk resumes after it), an exception that is not
# dflash.DFlashError, a safetensors file accepted that the reference refuses or read
# differently, or a parsed integer that differs from the file's. Every finding is listed in
# the JSON report with the (first 4 KiB of the) input in hex; the run's exit status is 1 when
# there is any.
#
#   python bench/fuzz_loaders.py                        # 150,000 cases, 2 workers
#   python bench/fuzz_loaders.py --safetensors 500 --config 500 --gguf 50 --out /tmp/f.json
from __future__ import annotations

import argparse
import collections
import datetime
import json
import multiprocessing as mp
import os
import pathlib
import platform
import random
import sys
import tempfile
import time
import traceback
from typing import Any

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.fixtures import loader_fuzz as F  # noqa: E402

READERS = ("safetensors", "config", "gguf")
CHUNK = 500


def _case(reader: str, seed: int, index: int, seeds: dict[str, Any], workdir: pathlib.Path) -> bytes:
    rng = random.Random(f"{seed}-{reader}-{index}")
    if reader == "safetensors":
        return F.mutate_safetensors(rng, seeds["safetensors"])
    if reader == "config":
        return F.mutate_config(rng, F.CONFIG_SEEDS[rng.choice(sorted(F.CONFIG_SEEDS))])
    return F.mutate_gguf(rng, seeds["gguf"], workdir)


def _check(reader: str, data: bytes, workdir: pathlib.Path) -> tuple[dict[str, str], dict[str, Any] | None]:
    return {"safetensors": F.check_safetensors, "config": F.check_config, "gguf": F.check_gguf}[reader](data, workdir)


def _seeds(workdir: pathlib.Path) -> dict[str, Any]:
    return {"safetensors": F.safetensors_seed(), "gguf": F.write_gguf(workdir / "seed.gguf").read_bytes()}


def _worker(reader: str, seed: int, start: int, stop: int, current: Any, queue: Any) -> None:
    """Runs cases [start, stop) of `reader`; `current` holds the case being run (for crashes)."""
    import warnings

    warnings.simplefilter("ignore")
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="dflash-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                                            else None))
    seeds = _seeds(workdir)
    findings, outcomes = [], collections.Counter()
    for i in range(start, stop):
        current.value = i
        try:
            data = _case(reader, seed, i, seeds, workdir)
        except Exception:  # a mutator bug is the fuzzer's, not the reader's: report it loudly
            queue.put(("error", reader, i, traceback.format_exc()))
            return
        results, finding = _check(reader, data, workdir)
        if finding:
            findings.append({**finding, "case": i})
        for name, outcome in results.items():
            outcomes[(name, outcome)] += 1
    queue.put(("done", reader, (start, stop), findings, list(outcomes.items())))


def run(counts: dict[str, int], seed: int, workers: int) -> dict[str, Any]:
    """Fuzzes each reader for counts[reader] cases; returns the report (without machine info)."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    pending = [(r, s, min(s + CHUNK, counts[r])) for r in READERS for s in range(0, counts[r], CHUNK)]
    running: list[tuple[Any, Any, str, int, int]] = []  # (process, current, reader, start, stop)
    per = {r: {"cases_run": 0, "findings": 0, "crashes": 0} for r in READERS}
    outcomes: collections.Counter = collections.Counter()  # (reader run, outcome) -> cases
    findings: list[dict[str, Any]] = []
    t0 = time.time()

    def drain(block: bool) -> None:
        while True:
            try:
                msg = queue.get(timeout=0.2) if block else queue.get_nowait()
            except Exception:  # queue.Empty
                return
            block = False
            if msg[0] == "error":
                raise RuntimeError(f"fuzzer error in {msg[1]} case {msg[2]}:\n{msg[3]}")
            _, reader, (a, b), found, counted = msg
            findings.extend(found)
            per[reader]["findings"] += len(found)
            per[reader]["cases_run"] += b - a
            for key, n in counted:
                outcomes[tuple(key)] += n

    while pending or running:
        while pending and len(running) < workers:
            reader, a, b = pending.pop(0)
            current = ctx.Value("q", a)
            p = ctx.Process(target=_worker, args=(reader, seed, a, b, current, queue))
            p.start()
            running.append((p, current, reader, a, b))
        drain(block=True)
        for item in list(running):
            p, current, reader, start, stop = item
            if p.is_alive():
                continue
            p.join()
            running.remove(item)
            if p.exitcode != 0:  # a crash: record the case, resume after it
                i = current.value
                with tempfile.TemporaryDirectory() as d:
                    data = _case(reader, seed, i, _seeds(pathlib.Path(d)), pathlib.Path(d))
                findings.append({"reader": reader, "kind": "crash", "case": i, "detail": f"exit code {p.exitcode}",
                                 "input_hex": data[:4096].hex(), "input_bytes": len(data)})
                per[reader]["findings"] += 1
                per[reader]["crashes"] += 1
                per[reader]["cases_run"] += 1
                # The results of [start, i) died with the worker: run them again, then the rest.
                for a, b in ((start, i), (i + 1, stop)):
                    if a < b:
                        pending.insert(0, (reader, a, b))
    drain(block=False)
    runs: dict[str, dict[str, Any]] = {}  # each reader run: accepted count and the commonest refusals
    for (name, outcome), n in sorted(outcomes.items(), key=lambda kv: -kv[1]):
        entry = runs.setdefault(name, {"accepted": 0, "refused": 0, "top_refusals": {}})
        if outcome == "accepted":
            entry["accepted"] += n
            continue
        entry["refused"] += n
        if len(entry["top_refusals"]) < 12:
            entry["top_refusals"][outcome] = n
    return {"seed": seed, "counts": per, "reader_runs": runs, "total_cases": sum(p["cases_run"] for p in per.values()),
            "total_findings": len(findings), "findings": findings, "seconds": round(time.time() - t0, 1)}


def _machine() -> dict[str, Any]:
    from importlib.metadata import version

    import safetensors

    from dflash import _core

    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "dflash_core": _core.__file__, "safetensors": safetensors.__version__, "gguf": version("gguf"),
            "numpy": version("numpy"), "tokenizers": version("tokenizers")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--safetensors", type=int, default=60000, help="cases for the safetensors reader")
    ap.add_argument("--config", type=int, default=60000, help="cases for the config.json readers")
    ap.add_argument("--gguf", type=int, default=30000, help="cases for the GGUF converter")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "fuzz_loaders_cpu.json"))
    args = ap.parse_args(argv)
    report = {
        "benchmark": "fuzz_loaders",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": _machine(),
        "method": "structured mutation of valid seeds (tests/fixtures/loader_fuzz.py); findings = crashes, "
                  "non-DFlashError exceptions, safetensors accepted although the reference library refuses "
                  "them or read differently, parsed integers differing from the file",
        **run({"safetensors": args.safetensors, "config": args.config, "gguf": args.gguf}, args.seed,
              args.workers),
    }
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    for r in READERS:
        c = report["counts"][r]
        print(f"{r:12s} {c['cases_run']:7d} cases  {c['findings']} findings")
    for name, entry in report["reader_runs"].items():
        print(f"  {name:15s} accepted {entry['accepted']:6d}  refused (DFlashError) {entry['refused']:6d}")
    print(f"total {report['total_cases']} cases, {report['total_findings']} findings, {report['seconds']} s "
          f"-> {args.out}")
    return 1 if report["total_findings"] else 0


if __name__ == "__main__":
    sys.exit(main())

# bench/bench_nan_containment.py
#
# NaN containment, recorded: the injection scenarios of tests/nonfinite_helpers.py (a tiny model
# whose embedding row of one token is NaN or +inf; the request that meets it must end with
# finish_reason "error", every other request of the batch, before and after, must generate what
# it does on the clean model; a verify step must not read rows behind a rejected draft) on the
# CPU and, when a CUDA build sees a GPU, on the GPU (graphs + pipelined AR, eager, DFlash and
# DFlash2 drafters); each scenario's outcome and the poisoned session's stats go to the JSON.
# On the GPU it also measures what the check costs: the nonfinite_rows kernel (one read of the
# step's fp32 logits) by CUPTI kernel time at vocab 151936 for 1..256 rows, beside the copy
# bandwidth of the same run.
#
#   python bench/bench_nan_containment.py [--out bench/results/nan_containment_<machine>.json]
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

REPO = pathlib.Path(__file__).resolve().parent.parent
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import dflash  # noqa: E402
from gpu_common import run_record, write_json  # noqa: E402
from tests.fixtures.tiny_models import write_preset  # noqa: E402
from tests.nonfinite_helpers import check_nan_containment, check_spec_reads_only_consulted_rows  # noqa: E402
from tests.runtime_helpers import small_drafter_pair, small_dflash2  # noqa: E402

STAT_KEYS = ("num_nonfinite_requests", "num_requests_finished", "graph_steps", "pipelined_steps", "num_spec_steps", "num_drafted")


def _scenario(name: str, fn: Callable[[], Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        stats = fn()
        out: dict[str, Any] = {"scenario": name, "passed": True}
        if isinstance(stats, dict):
            out["poisoned_session_stats"] = {k: stats[k] for k in STAT_KEYS if k in stats}
    except Exception as e:  # noqa: BLE001 - a failed scenario is a finding, recorded
        out = {"scenario": name, "passed": False, "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc(limit=4)}
    out["seconds"] = round(time.perf_counter() - t0, 2)
    print(f"{'ok  ' if out['passed'] else 'FAIL'} {name} ({out['seconds']} s)", flush=True)
    return out


def cpu_scenarios(root: pathlib.Path) -> list[dict[str, Any]]:
    target = write_preset("llama_gqa", root / "llama_gqa")
    pair = small_drafter_pair(root / "drafters", target, dflash_layers=1, dflash_block_size=4, dflash_seed=3,
                              dflash2_block_size=4, dflash2_top_k=4)
    results = []
    for draft in (None, "dflash", "dflash2"):
        for value in (float("nan"), float("inf")):
            drafter = str(pair[draft]) if draft else "none"
            make = lambda model, d=drafter: dflash.Session(model, device="cpu", draft=d, num_threads=2)  # noqa: E731
            tmp = pathlib.Path(tempfile.mkdtemp(dir=root))
            results.append(_scenario(f"cpu draft={draft} embedding={value}",
                                     lambda m=make, t=tmp, v=value: check_nan_containment(m, target, t, v)))
    make = lambda model: dflash.Session(model, device="cpu", draft=str(pair["dflash"]), draft_sampling="greedy",  # noqa: E731
                                        num_threads=2)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=root))
    results.append(_scenario("cpu verify reads no row behind a rejected draft",
                             lambda: check_spec_reads_only_consulted_rows(make, target, tmp)))
    return results


def cuda_scenarios(root: pathlib.Path) -> list[dict[str, Any]]:
    from dflash.drafter_format import write_dflash_drafter

    target = write_preset("qwen3_hd128", root / "qwen3_hd128")
    cfg = json.loads((target / "config.json").read_text())
    drafters = {"dflash": write_dflash_drafter(root / "d1", target_config=cfg, num_layers=1, target_layer_ids=[0, 1],
                                               block_size=4),
                "dflash2": small_dflash2(root, target, "d2", block_size=4, selector_top_k=8, conv_group_size=16,
                                         selector_rank=16)}
    kv = dict(kv_cache_tokens=4096, max_num_seqs=8)
    cases = [(None, dict(cuda_graphs=True, async_decode=True)), (None, dict(cuda_graphs=False)),
             ("dflash", dict(cuda_graphs=True)), ("dflash2", dict(cuda_graphs=True)),
             ("dflash2", dict(cuda_graphs=False))]
    results = []
    for draft, kw in cases:
        drafter = str(drafters[draft]) if draft else "none"
        make = lambda model, d=drafter, k=kw: dflash.Session(model, device="cuda", draft=d, **k, **kv)  # noqa: E731
        tmp = pathlib.Path(tempfile.mkdtemp(dir=root))
        results.append(_scenario(f"cuda draft={draft} {kw}", lambda m=make, t=tmp: check_nan_containment(m, target, t)))
    make = lambda model: dflash.Session(model, device="cuda", draft=str(drafters["dflash"]), draft_sampling="greedy",  # noqa: E731
                                        **kv)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=root))
    results.append(_scenario("cuda verify reads no row behind a rejected draft",
                             lambda: check_spec_reads_only_consulted_rows(make, target, tmp)))
    return results


def kernel_cost(vocab: int = 151936, rows_list=(1, 4, 16, 64, 256), reps: int = 50) -> dict[str, Any]:
    """CUPTI time of the nonfinite_rows kernel per launch, and its bytes over the copy bandwidth."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from dflash import _core
    from gpu_common import copy_bandwidth

    bw = copy_bandwidth()
    out: dict[str, Any] = {"vocab": vocab, "copy_bandwidth_gbs": round(bw, 1), "rows": {}}
    for rows in rows_list:
        logits = torch.randn(rows, vocab, device="cuda")
        flags = torch.zeros(rows, device="cuda", dtype=torch.int32)
        for _ in range(5):
            _core.testing.cuda_nonfinite_rows(logits, flags)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                _core.testing.cuda_nonfinite_rows(logits, flags)
        times = [e.device_time for e in prof.events() if "nonfinite" in e.name]  # microseconds
        assert len(times) >= reps, f"profiler saw {len(times)} nonfinite kernels of {reps}"
        us = sorted(times)[len(times) // 2]
        nbytes = rows * vocab * 4
        out["rows"][str(rows)] = {"kernel_us_median": round(us, 2), "bytes": nbytes,
                                  "roofline_us": round(nbytes / (bw * 1e3), 2),
                                  "fraction_of_copy_bandwidth": round(nbytes / (us * 1e-6) / (bw * 1e9), 3)}
        print(f"nonfinite_rows rows {rows}: {us:.2f} us", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    record = run_record("nan_containment")
    root = pathlib.Path(tempfile.mkdtemp(prefix="nan_bench_"))
    record["method"] = ("tests/nonfinite_helpers.py scenarios: NaN (or +inf) in the embedding row of one token t0 "
                        "of an untied tiny model; a probe request meets NaN logits in its first decode step, a second "
                        "holds t0 in its prompt; three other requests (greedy, seeded temperature 0.8, top-p 0.9) run "
                        "before, beside and after them and must match the clean model token for token")
    record["scenarios"] = cpu_scenarios(root)
    gpu = False
    try:
        import torch

        gpu = torch.cuda.is_available() and hasattr(dflash._core, "testing") and hasattr(dflash._core.testing,
                                                                                          "cuda_nonfinite_rows")
    except ImportError:
        pass
    if gpu:
        record["scenarios"] += cuda_scenarios(root)
        record["nonfinite_rows_kernel"] = kernel_cost()
    record["passed"] = sum(s["passed"] for s in record["scenarios"])
    record["failed"] = sum(not s["passed"] for s in record["scenarios"])
    name = "nan_containment_h200.json" if gpu else "nan_containment_cpu.json"
    out = pathlib.Path(args.out) if args.out else REPO / "bench" / "results" / name
    write_json(out, record)
    print(f"{record['passed']} passed, {record['failed']} failed -> {out}")
    return 0 if record["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())

# tests/test_bench_serve_load.py
#
# bench/bench_serve_load.py end to end on a tiny model (CPU): two `dflash serve` processes
# (target-only, and a second with other options) started and stopped by the benchmark, two
# concurrency levels of streamed chat requests with ignore_eos, the engine baseline and the
# ratios. Checks the report's counts, not its speed.
from __future__ import annotations

import importlib
import json
import pathlib
import sys

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"


def _bench_module(name):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def test_percentiles():
    mod = _bench_module("bench_serve_load")
    p = mod._percentiles([float(x) for x in range(1, 101)])
    assert (p["p50"], p["p90"], p["p99"], p["mean"]) == (51.0, 90.0, 99.0, 50.5)
    assert mod._percentiles([])["p50"] is None


def test_load_run_on_a_tiny_model(tmp_path, long_context_model):
    mod = _bench_module("bench_serve_load")
    prompts = tmp_path / "p.txt"
    prompts.write_text("Why is the sea blue?\nName three colours.\nCount to five.\n")
    out = tmp_path / "load.json"
    common = f"--model {long_context_model} --device cpu --threads 1 --max-model-len 512"
    rc = mod.main(["--datasets", "prompts", "--prompts", str(prompts),
                   "--server", f"ar=dflash:{common}", "--server", f"small=dflash:{common} --max-num-seqs 1",
                   "--concurrency", "1,3", "--requests", "3", "--max-tokens", "6", "--ignore-eos",
                   "--engine-baseline", "--log-dir", str(tmp_path / "logs"), "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report["servers"]) == {"ar", "small"} and report["num_prompts"] == 3
    for res in report["servers"].values():
        assert [lv["concurrency"] for lv in res["levels"]] == [1, 3]
        for lv in res["levels"]:
            assert lv["requests"] == 3 and lv["completion_tokens"] == 18 and lv["tokens_from_usage"]
            assert lv["output_tokens_per_s"] > 0 and lv["ttft_s"]["p50"] > 0
            # no gaps when every request came as one merged chunk (the tiny model outruns the server)
            assert lv["itl_s"]["p50"] is None or lv["itl_s"]["p50"] >= 0
        assert res["engine_c1"]["completion_tokens"] == 18
        assert "server_overhead_c1" in res
        assert res["startup_s"] > 0 and res["gpu_memory_mib"] is None  # no GPU here
        stats = res["engine_c1"]["stats"]
        assert stats["device"] == "cpu" and stats["speculation"] is None and stats["weight_bytes"] > 0
    assert set(report["ratios_over_ar"]["small"]) == {"c1", "c3"}


def test_level_time_limit_stops_new_requests(tmp_path, long_context_model):
    """--level-time-limit 0: each of the 2 clients sends its first request and no other, so the
    level has exactly 2 of its 8 planned requests, both complete."""
    mod = _bench_module("bench_serve_load")
    prompts = tmp_path / "p.txt"
    prompts.write_text("Why is the sea blue?\nName three colours.\n")
    out = tmp_path / "load.json"
    rc = mod.main(["--datasets", "prompts", "--prompts", str(prompts),
                   "--server", f"ar=dflash:--model {long_context_model} --device cpu --threads 1 --max-model-len 512",
                   "--concurrency", "2", "--requests", "8", "--max-tokens", "4", "--ignore-eos",
                   "--level-time-limit", "0", "--log-dir", str(tmp_path / "logs"), "--out", str(out)])
    assert rc == 0
    (lv,) = json.loads(out.read_text())["servers"]["ar"]["levels"]
    assert lv["requests_planned"] == 8 and lv["requests"] == 2
    assert lv["completion_tokens"] == 4 * lv["requests"]

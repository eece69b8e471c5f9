# tests/test_bench_gpu_common.py
#
# The pure-Python parts of the GPU benchmarks (bench/gpu_common.py, bench/bench_gpu_qwen3.py) on
# the CPU: byte counts of a decode step against the figures of the first H200 run, the KV plan,
# the projection and goal fields, argument parsing, and the shared headline file (merged, never
# replaced). Nothing here times anything or needs a GPU.
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


def test_headline_is_merged_not_replaced(tmp_path):
    g = _bench_module("gpu_common")
    (tmp_path / "headline.json").write_text(json.dumps({"smollm2_ar_speedup_vs_hf": 14.5, "date": "old"}))
    g.update_headline(tmp_path, {"ar_step_bw_fraction_bs1": 0.8})
    h = json.loads((tmp_path / "headline.json").read_text())
    assert h["smollm2_ar_speedup_vs_hf"] == 14.5 and h["ar_step_bw_fraction_bs1"] == 0.8
    assert h["date"] != "old" and "command" in h

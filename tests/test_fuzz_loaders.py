# tests/test_fuzz_loaders.py
#
# The CI run of the loader fuzzer (bench/fuzz_loaders.py; the long run's report is
# bench/results/fuzz_loaders_cpu.json): a few thousand structured mutations of the safetensors,
# config.json and GGUF seeds, zero findings (no crash, every failure a dflash.DFlashError,
# nothing accepted that the reference safetensors library refuses); and the fuzzer's own
# machinery: a worker that dies is reported as a crash of the case it was on, and the rest
# of its chunk still runs.
from __future__ import annotations

import importlib
import json
import os
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"


def _fuzz_module():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("fuzz_loaders")


def test_short_fuzz_run_has_no_findings(tmp_path):
    out = tmp_path / "fuzz.json"
    proc = subprocess.run([sys.executable, str(BENCH / "fuzz_loaders.py"), "--safetensors", "2000", "--config", "2000",
                           "--gguf", "200", "--seed", "7", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    report = json.loads(out.read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr + json.dumps(report["findings"])[:2000]
    assert report["total_findings"] == 0 and report["total_cases"] == 4200
    assert {r: c["cases_run"] for r, c in report["counts"].items()} == {"safetensors": 2000, "config": 2000,
                                                                         "gguf": 200}
    runs = report["reader_runs"]
    # The mutants reach past the first check: some are accepted, most are refused for many reasons.
    for name in ("safetensors", "config_target", "config_drafter", "gguf"):
        assert runs[name]["accepted"] > 0 and runs[name]["refused"] > 0, (name, runs[name])
        assert len(runs[name]["top_refusals"]) >= 5, (name, runs[name])


def test_a_crashing_case_is_reported_and_the_chunk_resumes(monkeypatch):
    mod = _fuzz_module()
    real = mod._check
    doomed = mod._case("config", 1, 3, {}, pathlib.Path("."))  # config cases need no seed files

    def crash_on_case_3(reader, data, workdir):
        if data == doomed:
            os._exit(139)  # what a segfault looks like to the parent
        return real(reader, data, workdir)

    monkeypatch.setattr(mod, "_check", crash_on_case_3)
    report = mod.run({"safetensors": 0, "config": 10, "gguf": 0}, seed=1, workers=1)
    assert report["total_findings"] == 1 and report["counts"]["config"]["crashes"] == 1
    (crash,) = report["findings"]
    assert (crash["reader"], crash["kind"], crash["case"]) == ("config", "crash", 3)
    assert bytes.fromhex(crash["input_hex"]) == doomed
    assert report["counts"]["config"]["cases_run"] == 10
    judged = report["reader_runs"]["config_target"]
    assert judged["accepted"] + judged["refused"] == 9  # every case but the crashed one

# tests/test_shipped_drafter.py
#
# The DFlash drafter shipped in the package for the default model (SmolLM2-135M-Instruct), on the
# CPU, greedy: the outputs equal target-only greedy token for token (on the default GEMM kernels
# and on each other CPU GEMM kernel, DFLASH_CPU_GEMM), and the acceptance length tau over a fixed
# prompt set stays above a floor set from measurement.
#
# Measured on the 2-vCPU AMD EPYC workplace machine (2026-11-29, drafter of training step 5063):
# tau 2.86 over these 6 prompts at 96 new tokens (per request 3.65, 3.52, 3.52, 4.75, 1.41, 2.33).
# The floor, 2.5, leaves room for BLAS differences between CPUs; a drafter that lost its training
# (or a runtime that broke acceptance) lands near 1.
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

TAU_FLOOR = 2.5
REASON = " Please reason step by step, and put your final answer within \\boxed{}."
PROMPTS = [
    "A baker makes 24 muffins in the morning and 18 in the afternoon. He sells 30 of them. "
    "How many muffins are left?" + REASON,
    "Tom has 3 boxes with 12 pencils each. He gives 7 pencils to his sister. How many pencils does he have now?"
    + REASON,
    "A train travels 60 miles per hour for 2.5 hours. How far does it go?" + REASON,
    "Write a Python function that returns the sum of the even numbers in a list.",
    "Explain in two sentences why the sky is blue.",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def shipped():
    from dflash.default_model import SHIPPED_DRAFTER_DIR, default_model_dir

    assert (SHIPPED_DRAFTER_DIR / "model.safetensors").is_file(), "the package ships no drafter"
    return default_model_dir(), SHIPPED_DRAFTER_DIR


def test_shipped_drafter_is_the_published_format(shipped):
    _, drafter = shipped
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["num_target_layers"] == 30 and cfg["hidden_size"] == 576
    assert cfg["block_size"] >= 2 and len(cfg["dflash_config"]["target_layer_ids"]) >= 1


def test_shipped_drafter_is_lossless_and_accepts(shipped):
    import dflash

    model, drafter = shipped
    msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = dflash.SamplingParams(max_tokens=96)
    target_only = dflash.Session(model, device="cpu").generate(msgs, params)
    spec_session = dflash.Session(model, draft=str(drafter), device="cpu")
    spec = spec_session.generate(msgs, params)
    for i, (a, b) in enumerate(zip(target_only, spec)):
        assert a.token_ids == b.token_ids, f"prompt {i}: DFlash output differs from target-only greedy"
    st = spec_session.stats()
    tau = st["acceptance_length"]
    per_request = [round(o.metrics.acceptance_length, 2) for o in spec]
    print(f"shipped drafter on the CPU: tau {tau:.3f} over {st['num_spec_steps']} steps; per request {per_request}")
    assert tau >= TAU_FLOOR, f"tau {tau:.3f} below the floor {TAU_FLOOR} (per request {per_request})"


LOSSLESS_CODE = """
import json, sys, dflash
from dflash.default_model import SHIPPED_DRAFTER_DIR, default_model_dir
msgs = [[{"role": "user", "content": p}] for p in json.loads(sys.argv[1])]
params = dflash.SamplingParams(max_tokens=48)
a = dflash.Session(default_model_dir(), draft="none", device="cpu").generate(msgs, params)
s = dflash.Session(default_model_dir(), draft=str(SHIPPED_DRAFTER_DIR), device="cpu")
b = s.generate(msgs, params)
print(json.dumps({"same": [x.token_ids == y.token_ids for x, y in zip(a, b)], "steps": s.stats()["num_spec_steps"]}))
"""


@pytest.mark.parametrize("kernel", ["avx512", "avx2", "blas"])
def test_shipped_drafter_is_lossless_on_each_cpu_gemm_kernel(kernel):
    """Greedy DFlash equals target-only greedy whichever GEMM kernel runs the verify rows (a kernel
    this CPU lacks is a ValueError when the session opens, and the case is skipped)."""
    run = subprocess.run([sys.executable, "-c", LOSSLESS_CODE, json.dumps(PROMPTS[:3])], capture_output=True,
                         text=True, env=dict(os.environ, DFLASH_CPU_GEMM=kernel))
    if run.returncode != 0 and "this CPU has no" in run.stderr:
        pytest.skip(f"this CPU has no {kernel}")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["same"] == [True] * 3 and out["steps"] > 0, out

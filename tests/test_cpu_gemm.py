# tests/test_cpu_gemm.py
#
# The CPU backend's linear layer against numpy (float64) for the row counts of decode and verify
# steps, where the AVX2 skinny kernel runs (2..4 rows, when the CPU has AVX2/FMA) and BLAS runs
# otherwise; odd N and K (tails of the 3-row weight tile and of the 8-lane k loop); the skinny
# rows are batch-invariant (a row's result does not depend on the other rows); DFLASH_CPU_GEMM
# selects the kernel and rejects unknown values.
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from dflash._core import testing


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16])
@pytest.mark.parametrize("n,k", [(1, 8), (7, 13), (64, 576), (193, 1000)])
def test_linear_matches_numpy(m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    got = testing.cpu_linear(x, w)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    err = np.max(np.abs(got - want)) / np.sqrt(k)
    assert got.shape == (m, n)
    assert err < 2e-6, f"M={m} N={n} K={k}: max error / sqrt(K) = {err:.3g}"


def test_skinny_rows_are_batch_invariant():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 576), dtype=np.float32)
    w = rng.standard_normal((300, 576), dtype=np.float32)
    full = testing.cpu_linear(x, w)
    for m in (2, 3):
        assert np.array_equal(testing.cpu_linear(x[:m].copy(), w), full[:m])
    # the thread split does not change the result either
    assert np.array_equal(testing.cpu_linear(x, w, num_threads=1), full)


def test_cpu_gemm_env():
    code = ("import numpy as np\nfrom dflash._core import testing\n"
            "x = np.ones((2, 16), np.float32); w = np.ones((3, 16), np.float32)\n"
            "print(testing.cpu_linear(x, w)[0, 0])")
    env = dict(os.environ, DFLASH_CPU_GEMM="blas")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "16.0"
    env["DFLASH_CPU_GEMM"] = "bogus"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "DFLASH_CPU_GEMM=bogus is not one of auto, blas" in bad.stderr

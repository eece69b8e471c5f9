# tests/test_cpu_gemm.py
#
# The CPU backend's linear layer against numpy (float64) for the row counts of decode and verify
# steps, where the AVX2 skinny kernel runs (2..4 rows, when the CPU has AVX2/FMA) and BLAS runs
# otherwise; odd N and K (tails of the 3-row weight tile and of the 8-lane k loop); the skinny
# rows are batch-invariant (a row's result does not depend on the other rows); the cpu_gemm kernel
# option (DFLASH_CPU_GEMM when a session opens) selects the kernel and rejects unknown values.
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


def test_cpu_gemm_option_picks_the_kernel():
    x = np.ones((2, 16), np.float32)
    w = np.ones((3, 16), np.float32)
    assert testing.cpu_linear(x, w, cpu_gemm="blas")[0, 0] == 16.0
    with pytest.raises(ValueError, match=r"kernels.cpu_gemm \(DFLASH_CPU_GEMM\) must be auto or blas, got 'bogus'"):
        testing.cpu_linear(x, w, cpu_gemm="bogus")


def test_cpu_gemm_environment_overrides_the_session(tiny_model):
    """DFLASH_CPU_GEMM is read when a session opens (the session layer) and reaches the backend:
    "blas" generates what the default does, a bad value is a ValueError naming the variable."""
    code = ("import sys, dflash\n"
            "s = dflash.Session(sys.argv[1], device='cpu')\n"
            "print(s.generate([[1, 2, 3]], dflash.SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids)")
    run = lambda value: subprocess.run([sys.executable, "-c", code, str(tiny_model)],  # noqa: E731
                                       env=dict(os.environ, DFLASH_CPU_GEMM=value), capture_output=True, text=True)
    default, blas = run(""), run("blas")
    assert default.returncode == 0 and blas.returncode == 0, default.stderr + blas.stderr
    assert blas.stdout == default.stdout and default.stdout.strip().startswith("[")
    bad = run("bogus")
    assert bad.returncode != 0 and "ValueError" in bad.stderr and "DFLASH_CPU_GEMM" in bad.stderr, bad.stderr

# tests/test_cpu_gemm.py
#
# The CPU backend's linear layer against numpy (float64) for the row counts of decode and verify
# steps and beyond, on every kernel this CPU has: the AVX-512 skinny kernel (every row count), the
# AVX2 one (2..16 rows), OpenBLAS split over the backend's threads (the AVX2 kernel's other rows) and OpenBLAS on its own
# threads ("blas"); odd N and K (tails of every weight tile and of the k loop); the skinny rows
# are batch-invariant (a row's result does not depend on the other rows or the thread split);
# the cpu_gemm kernel option (DFLASH_CPU_GEMM when a session opens) selects the kernel and
# rejects unknown values.
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from dflash._core import testing


def _has(kernel):
    try:
        testing.cpu_linear(np.ones((1, 16), np.float32), np.ones((1, 16), np.float32), cpu_gemm=kernel)
    except ValueError:
        return False
    return True


KERNELS = ["auto", "blas"] + [k for k in ("avx512", "avx2") if _has(k)]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 40, 256, 257])
@pytest.mark.parametrize("n,k", [(1, 8), (7, 13), (64, 576), (193, 1000), (100, 17)])
def test_linear_matches_numpy(kernel, m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    got = testing.cpu_linear(x, w, cpu_gemm=kernel)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    err = np.max(np.abs(got - want)) / np.sqrt(k)
    assert got.shape == (m, n)
    assert err < 5e-6, f"{kernel} M={m} N={n} K={k}: max error / sqrt(K) = {err:.3g}"


@pytest.mark.parametrize("kernel,rows", [("avx512", [*range(1, 18), 40, 64]), ("avx2", range(2, 17))])
def test_skinny_rows_are_batch_invariant(kernel, rows):
    """Every row count a skinny kernel serves gives each row the same bits (and so does the
    thread split): a verify row is computed exactly as the AR step computes it alone."""
    if kernel not in KERNELS:
        pytest.skip(f"this CPU has no {kernel}")
    rows = list(rows)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((rows[-1], 577), dtype=np.float32)
    w = rng.standard_normal((301, 577), dtype=np.float32)
    full = testing.cpu_linear(x, w, cpu_gemm=kernel)
    for m in rows:
        assert np.array_equal(testing.cpu_linear(x[:m].copy(), w, cpu_gemm=kernel), full[:m]), m
        # the last rows alone (a row's place in the row groups does not matter either)
        assert np.array_equal(testing.cpu_linear(x[-m:].copy(), w, cpu_gemm=kernel), full[-m:]), m
    assert np.array_equal(testing.cpu_linear(x, w, num_threads=1, cpu_gemm=kernel), full)


def test_auto_takes_the_best_skinny_kernel():
    """auto is the AVX-512 kernel where the CPU has it (bit for bit), else the AVX2 one."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((8, 576), dtype=np.float32)
    w = rng.standard_normal((200, 576), dtype=np.float32)
    best = "avx512" if "avx512" in KERNELS else "avx2" if "avx2" in KERNELS else None
    if best is None:
        pytest.skip("this CPU has neither AVX-512 nor AVX2")
    m = 8 if best == "avx512" else 4
    assert np.array_equal(testing.cpu_linear(x[:m].copy(), w), testing.cpu_linear(x[:m].copy(), w, cpu_gemm=best))


def test_cpu_gemm_option_picks_the_kernel():
    x = np.ones((2, 16), np.float32)
    w = np.ones((3, 16), np.float32)
    assert testing.cpu_linear(x, w, cpu_gemm="blas")[0, 0] == 16.0
    with pytest.raises(ValueError, match=r"kernels.cpu_gemm \(DFLASH_CPU_GEMM\) must be auto, avx512, avx2 or blas, "
                                         r"got 'bogus'"):
        testing.cpu_linear(x, w, cpu_gemm="bogus")
    for kernel in ("avx512", "avx2"):
        if kernel not in KERNELS:
            with pytest.raises(ValueError, match=rf"is {kernel} but this CPU has no"):
                testing.cpu_linear(x, w, cpu_gemm=kernel)


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

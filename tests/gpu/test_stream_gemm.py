# tests/gpu/test_stream_gemm.py
#
# The streaming skinny GEMM (cuda/stream_gemm.cu, through dflash._core.testing.cuda_stream_gemm):
# persistent CTAs with a per-warp cp.async ring of weight stages. Checked against fp64 torch
# (plain product, bf16 and fp32 outputs) and against torch doing the unfused steps (RMSNorm,
# silu * up, residual add) with the tolerances of test_skinny_gemm.py / test_skinny_gemm_fused.py
# (their references are reused), over odd M, N, K (K tails that zero-fill whole rounds, N tails,
# tiles per CTA from 1 to many), every built launch shape, bit-identical reruns, batch-invariant
# rows (NT 2 for every M, warps from K: a row's bits do not depend on the other rows), the LM-head
# shape on a stream, refusals of unsupported arguments, and the CUDA backend with
# DFLASH_GEMM=stream and =routed on tiny models (same tolerance as the skinny kernel against cuBLASLt).
# Skipped without a CUDA device or a CUDA build of dflash.
from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.gpu_helpers import kernel_ops, requires_cuda, torch
from tests.gpu.test_skinny_gemm import check
from tests.gpu.test_skinny_gemm_fused import EPS, bf16, compare, rms_norm_bf16, silu_mul_bf16

pytestmark = requires_cuda

DEV = "cuda"


def run(x, w, out_dtype=torch.bfloat16, **kw):
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), device=DEV, dtype=out_dtype)
    kernel_ops().cuda_stream_gemm(x, w, out, **kw)
    return out


@pytest.mark.parametrize("out_dtype", ["bf16", "f32"])
@pytest.mark.parametrize("k", [64, 576, 1000, 4096, 12288])
@pytest.mark.parametrize("n", [1, 17, 576, 1000, 6144])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 9, 15, 16])
def test_stream_gemm_vs_torch(m, n, k, out_dtype):
    dt = torch.bfloat16 if out_dtype == "bf16" else torch.float32
    x, w = bf16(m, k, seed=m), bf16(n, k, seed=1000 + n)
    check(f"stream_gemm M={m} N={n} K={k} out={out_dtype}", run(x, w, dt), x, w)


# (unroll, stages) built; unroll 8 for M <= 8 plain with at most 8 warps.
SHAPES = [(4, 3), (4, 4), (4, 6), (8, 3), (8, 4), (8, 6)]


@pytest.mark.parametrize("m", [1, 6, 8, 13, 16])
@pytest.mark.parametrize("warps", [1, 3, 8, 16])
@pytest.mark.parametrize("n,k", [(33, 1000), (1000, 4104), (4096, 576)])
def test_stream_gemm_every_shape(m, warps, n, k):
    x, w = bf16(m, k, seed=7), bf16(n, k, seed=8)
    max_smem = getattr(torch.cuda.get_device_properties(0), "shared_memory_per_block_optin", 227 * 1024) - 1024
    for unroll, stages in SHAPES:
        if unroll == 8 and (m > 8 or warps > 8):
            continue
        nt = 1 if m <= 8 else 2
        smem = warps * stages * unroll * 1024 + 2 * warps * 8 * nt * 20 * 4  # ring + reduction buffers
        if smem > max_smem:  # the launcher refuses shapes whose shared memory does not fit
            with pytest.raises(ValueError, match="stream_gemm"):
                run(x, w, warps=warps, unroll=unroll, stages=stages)
            continue
        for dt in (torch.bfloat16, torch.float32):
            got = run(x, w, dt, warps=warps, unroll=unroll, stages=stages)
            check(f"M={m} N={n} K={k} warps={warps} unroll={unroll} stages={stages} {dt}", got, x, w)


@pytest.mark.parametrize("ctas_per_sm", [1, 2])
def test_stream_gemm_many_tiles_per_cta(ctas_per_sm):
    # 1 CTA per SM on N = 24576: each CTA walks ~12 tiles, so the ring runs across tile ends and
    # the double-buffered reduction is reused many times.
    x, w = bf16(4, 4096, seed=11), bf16(24576, 4096, seed=12)
    check(f"gate_up shape ctas_per_sm={ctas_per_sm}", run(x, w, torch.float32, ctas_per_sm=ctas_per_sm), x, w)


FUSED = [(m, n, k) for m in (1, 2, 7, 8, 9, 16) for n, k in ((17, 64), (576, 576), (1000, 1000), (576, 1536),
                                                             (300, 4096))]


@pytest.mark.parametrize("m,n,k", FUSED)
def test_stream_rms_norm_staged(m, n, k):
    x, w, gamma = bf16(m, k, seed=1, scale=3.0), bf16(n, k, seed=2), bf16(k, seed=3)
    out = run(x, w, mode="rms_norm", gamma=gamma, eps=EPS)
    compare(f"rms_norm m{m} n{n} k{k}", out, rms_norm_bf16(x, gamma).double() @ w.double().T, k)


@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("m,n,k", FUSED)
def test_stream_silu_mul_staged(m, n, k, add):
    gate_up, w = bf16(m, 2 * k, seed=4), bf16(n, k, seed=5)
    residual = bf16(m, n, seed=6, scale=4.0)
    out = residual.clone() if add else torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)
    kernel_ops().cuda_stream_gemm(gate_up, w, out, mode="silu_mul", add=add)
    want = silu_mul_bf16(gate_up).double() @ w.double().T
    compare(f"silu_mul add={add} m{m} n{n} k{k}", out, want + residual.double() if add else want, k)


@pytest.mark.parametrize("m,n,k", FUSED + [(1, 4096, 12288), (4, 4096, 12288)])
def test_stream_residual_add(m, n, k):
    x, w, residual = bf16(m, k, seed=7), bf16(n, k, seed=8), bf16(m, n, seed=9, scale=4.0)
    out = residual.clone()
    kernel_ops().cuda_stream_gemm(x, w, out, add=True)
    compare(f"add m{m} n{n} k{k}", out, residual.double() + x.double() @ w.double().T, k)


def test_stream_silu_mul_down_projection_shape():
    # The Qwen3-8B down projection at batch 1: K = 12288 staged from gate/up [1, 24576].
    gate_up, w, residual = bf16(1, 2 * 12288, seed=21), bf16(4096, 12288, seed=22), bf16(1, 4096, seed=23)
    out = residual.clone()
    kernel_ops().cuda_stream_gemm(gate_up, w, out, mode="silu_mul", add=True)
    want = silu_mul_bf16(gate_up).double() @ w.double().T + residual.double()
    compare("down m1", out, want, 12288)


@pytest.mark.parametrize("m,n,k", [(1, 6144, 4096), (16, 1000, 12288), (7, 17, 1000), (3, 24576, 4096)])
def test_stream_gemm_is_deterministic(m, n, k):
    x, w = bf16(m, k, seed=3), bf16(n, k, seed=4)
    for dt in (torch.bfloat16, torch.float32):
        a, b = run(x, w, dt), run(x, w, dt)
        iv = torch.int16 if dt == torch.bfloat16 else torch.int32
        assert torch.equal(a.view(iv), b.view(iv))


@pytest.mark.parametrize("mode", ["plain", "rms_norm", "silu_mul"])
@pytest.mark.parametrize("n,k", [(1000, 576), (4096, 4096)])
def test_stream_gemm_batch_invariant_rows(mode, n, k):
    # Each row of an M-row launch has the bits of the same row launched alone or with others.
    m_max = 16
    in_cols = 2 * k if mode == "silu_mul" else k
    x, w, gamma = bf16(m_max, in_cols, seed=31, scale=2.0), bf16(n, k, seed=32), bf16(k, seed=33)
    kw = {"mode": mode, "batch_invariant": True}
    if mode == "rms_norm":
        kw.update(gamma=gamma, eps=EPS)
    full = run(x, w, **kw)
    for m in (1, 2, 5, 8, 9, 15):
        for rows in (slice(0, m), slice(m_max - m, m_max)):
            part = run(x[rows].contiguous(), w, **kw)
            assert torch.equal(part.view(torch.int16), full[rows].view(torch.int16)), (mode, m, rows)


def test_stream_gemm_lm_head_on_a_stream():
    x, w = bf16(3, 4096, seed=1), bf16(151936, 4096, seed=2)
    out = torch.empty(3, 151936, device=DEV, dtype=torch.float32)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kernel_ops().cuda_stream_gemm(x, w, out, stream=s.cuda_stream)
    s.synchronize()
    check("stream_gemm lm_head M=3 on a stream", out, x, w)


def test_stream_gemm_refusals():
    K = kernel_ops()
    out = torch.empty(2, 5, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="stream_gemm"):  # K % 8 != 0
        K.cuda_stream_gemm(bf16(2, 12), bf16(5, 12), out)
    with pytest.raises(ValueError, match="stream_gemm"):  # M > 16
        K.cuda_stream_gemm(bf16(17, 64), bf16(5, 64), torch.empty(17, 5, device=DEV, dtype=torch.bfloat16))
    buf = bf16(2 * 64 + 8)
    with pytest.raises(ValueError, match="stream_gemm"):  # misaligned x
        K.cuda_stream_gemm(buf[1:1 + 2 * 64].view(2, 64), bf16(5, 64), out)
    for bad in ({"unroll": 3}, {"stages": 5}, {"warps": 17}, {"warps": -1}, {"unroll": 8, "warps": 16}):
        with pytest.raises(ValueError, match="stream_gemm"):
            K.cuda_stream_gemm(bf16(2, 64), bf16(5, 64), out, **bad)
    with pytest.raises(ValueError, match="stream_gemm"):  # unroll 8 is plain only
        K.cuda_stream_gemm(bf16(2, 64), bf16(5, 64), out, add=True, unroll=8)
    with pytest.raises(ValueError, match="fp32"):
        K.cuda_stream_gemm(bf16(2, 64), bf16(5, 64), torch.empty(2, 5, device=DEV, dtype=torch.float32), add=True)
    with pytest.raises(ValueError, match="gamma"):
        K.cuda_stream_gemm(bf16(2, 64), bf16(5, 64), out, mode="rms_norm")
    # min_warps (the routed backend's fused forms): silu * up staged for 8 rows of K = 12288 leaves
    # the launcher 2 warps; at M = 1 it keeps at least 8
    gate_up, w_down, out8 = bf16(8, 2 * 12288), bf16(64, 12288), torch.empty(8, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="stream_gemm"):
        K.cuda_stream_gemm(gate_up, w_down, out8, mode="silu_mul", min_warps=8)
    K.cuda_stream_gemm(gate_up, w_down, out8, mode="silu_mul")  # without the floor it runs
    K.cuda_stream_gemm(gate_up[:1], w_down, out8[:1], mode="silu_mul", min_warps=8)
    # the process is fine afterwards
    x, w = bf16(2, 64, seed=5), bf16(5, 64, seed=6)
    check("after refusals", run(x, w, torch.float32), x, w)


def test_backend_gemm_stream(tiny_model_dirs, monkeypatch):
    import gc

    import dflash

    from tests.gpu.test_cuda_models import LOGIT_ABS, TOL_FACTOR, bf16_floor
    from tests.runtime_helpers import forced_run

    name = "qwen3_hd128"
    prompt, forced = [5, 17, 42, 7, 99, 3], [11, 12, 13, 14, 15, 16, 17]

    def logits(env):
        monkeypatch.setenv("DFLASH_GEMM", env)
        sess = dflash.Session(tiny_model_dirs[name], device="cuda", kv_cache_tokens=1024)
        out, _, _ = forced_run(sess, prompt, forced)
        del sess
        gc.collect()
        return out

    lt, streamed = logits("cublaslt"), logits("stream")
    cpu = dflash.Session(tiny_model_dirs[name], device="cpu", num_threads=2)
    tol = LOGIT_ABS + TOL_FACTOR * bf16_floor(name, tiny_model_dirs, cpu)
    err = float(np.max(np.abs(streamed - lt)))
    print(f"{name}: max |logit(stream) - logit(cublaslt)| = {err:.4g} (tolerance {tol:.4g})")
    assert err <= tol
    assert not np.array_equal(streamed, lt)  # the stream kernel really ran (other rounding)


def test_backend_gemm_routed(tmp_path):
    """DFLASH_GEMM=routed on a model whose QKV / O / down weights fall in the routed range (K >= 2048,
    N x K <= 8192^2) and whose gate/up weight does not: decode logits within the bf16 tolerance of
    cuBLASLt's, and the streaming kernel runs there (and not under auto, on the same model)."""
    import gc

    import dflash

    from tests.fixtures.tiny_models import write_tiny_model
    from tests.gpu.session_runs import session_process
    from tests.gpu.test_cuda_models import LOGIT_ABS, TOL_FACTOR, bf16_floor
    from tests.runtime_helpers import forced_run

    model = write_tiny_model(tmp_path / "routed", arch="qwen3", hidden_size=2048, num_layers=1, num_heads=16,
                             num_kv_heads=4, head_dim=128, intermediate_size=17408, vocab_size=512,
                             dtype="bfloat16", seed=21)
    prompt, forced = [5, 17, 42, 7, 99, 3], [11, 12, 13, 14, 15, 16, 17]

    def logits(env, monkeypatch_env):
        monkeypatch_env.setenv("DFLASH_GEMM", env)
        sess = dflash.Session(model, device="cuda", kv_cache_tokens=1024)
        out, _, _ = forced_run(sess, prompt, forced)
        del sess
        gc.collect()
        return out

    with pytest.MonkeyPatch.context() as mp:
        lt, routed = logits("cublaslt", mp), logits("routed", mp)
    cpu = dflash.Session(model, device="cpu", num_threads=2)
    tol = LOGIT_ABS + TOL_FACTOR * bf16_floor("routed_2048", {"routed_2048": model}, cpu)
    err = float(np.max(np.abs(routed - lt)))
    print(f"max |logit(routed) - logit(cublaslt)| = {err:.4g} (tolerance {tol:.4g})")
    assert err <= tol

    def kernels(mode):
        r = session_process(model, env={"DFLASH_GEMM": mode}, kernels="_", prompts=2, max_tokens=8)
        assert r.returncode == 0, r.stderr[-3000:]
        import json

        return json.loads(r.stdout.strip().splitlines()[-1])["kernels"]

    assert any("stream_gemm_kernel" in k for k in kernels("routed"))
    assert not any("stream_gemm_kernel" in k for k in kernels("auto"))

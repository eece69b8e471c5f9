# tests/gpu/test_cuda_launch_modes.py
#
# The CUDA backend's launch switches, read once per process (so each run is a subprocess):
# - DFLASH_PDL=0 launches the kernels plainly instead of with programmatic dependent launch. The
#   kernels and their order are the same, so the tokens and the logits must be bit-identical.
# - DFLASH_FUSED=0 runs a decoder layer's norm / activation / residual add as separate kernels
#   instead of the fused skinny GEMM variants. That changes roundings (one bf16 rounding of the
#   residual add instead of two), so logits are compared within the bf16 noise of these tiny
#   models (|delta| <= 0.05 at |logit| ~ 1), and greedy tokens are only printed.
# - DFLASH_ATTENTION=triton runs every attention launch on the Triton kernels instead of the
#   CUDA decode kernels for few-row launches (AR decode steps on CUDA cores, verify and drafter
#   blocks on tensor cores). Another summation order, so the same tolerance as DFLASH_FUSED.
# - DFLASH_ATTENTION=tensor_cores runs every launch of up to 64 rows per KV head on the
#   tensor-core kernel (AR steps too): compared with Triton the same way.
# AR and DFlash decoding, graphs on, a few prompts. Skipped without a usable Hopper GPU.
from __future__ import annotations

import numpy as np
import pytest

from dflash import _core

from .session_runs import run_session, tiny_drafter

pytestmark = pytest.mark.skipif(not _core.cuda_usable(), reason="needs the CUDA backend and a Hopper GPU")

SESSION = {"kv_cache_tokens": 8192, "max_num_seqs": 8, "seed": 3, "prompts": 5, "max_prompt": 30, "max_tokens": 24}


def _run(target, draft, **env):
    return run_session(target, draft, env, **SESSION)


def _drafter(tmp_path, target):
    return tiny_drafter(tmp_path / "d", target)


CASES = pytest.mark.parametrize("name,spec", [(n, s) for n in ("llama_hd64", "qwen3_hd128") for s in (False, True)])


def _pair(tiny_model_dirs, tmp_path, name, spec, **env):
    """The default run and one with `env`, on the same target (and drafter)."""
    target = tiny_model_dirs[name]
    draft = _drafter(tmp_path, target) if spec else None
    return _run(target, draft), _run(target, draft, **env)


@CASES
def test_pdl_off_is_bit_identical(name, spec, tiny_model_dirs, tmp_path):
    on, off = _pair(tiny_model_dirs, tmp_path, name, spec, DFLASH_PDL="0")
    assert on["tokens"] == off["tokens"]
    assert on["logits"] == off["logits"]


def _assert_close_runs(name, spec, ours, other):
    a, b = np.asarray(ours["logits"]), np.asarray(other["logits"])
    same = sum(x == y for x, y in zip(ours["tokens"], other["tokens"]))
    print(f"{name} spec={spec}: max |logit delta| {np.abs(a - b).max():.4f} (max |logit| {np.abs(b).max():.3f}); "
          f"{same}/{len(ours['tokens'])} greedy outputs identical")
    assert np.abs(a - b).max() <= 0.05 * max(1.0, np.abs(b).max())


@CASES
def test_fused_layers_match_unfused(name, spec, tiny_model_dirs, tmp_path):
    fused, unfused = _pair(tiny_model_dirs, tmp_path, name, spec, DFLASH_FUSED="0")
    _assert_close_runs(name, spec, fused, unfused)


@CASES
def test_cuda_decode_attention_matches_triton(name, spec, tiny_model_dirs, tmp_path):
    ours, triton = _pair(tiny_model_dirs, tmp_path, name, spec, DFLASH_ATTENTION="triton")
    _assert_close_runs(name, spec, ours, triton)


@CASES
def test_tensor_core_attention_matches_triton(name, spec, tiny_model_dirs, tmp_path):
    target = tiny_model_dirs[name]
    draft = _drafter(tmp_path, target) if spec else None
    tensor_cores = _run(target, draft, DFLASH_ATTENTION="tensor_cores")
    _assert_close_runs(name, spec, tensor_cores, _run(target, draft, DFLASH_ATTENTION="triton"))

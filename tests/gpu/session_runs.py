# tests/gpu/session_runs.py
#
# Runs a dflash.Session in a subprocess under DFLASH_* backend switches (which a process reads
# once, when its first session opens), for the GPU tests that compare whole decodes between
# switches: test_cuda_launch_modes.py, test_cuda_l2_prefetch.py, test_cuda_decode_attention_rope.py.
# The child decodes seeded random prompts greedily and prints one JSON line: the tokens, some
# logits (the drafter's proposal logits with a drafter, else the target's recorded logits of the
# first prompt), and optionally the names of the GPU kernels that ran (torch.profiler over the
# decode, which also sees the kernels inside CUDA graphs).
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import json, sys
import numpy as np
import dflash
from dflash import _core
target, draft, opts = sys.argv[1], (sys.argv[2] or None), json.loads(sys.argv[3])
sess = dflash.Session(target, draft=draft, device=opts["device"], kv_cache_tokens=opts["kv_cache_tokens"],
                      max_num_seqs=opts["max_num_seqs"])
rng = np.random.default_rng(opts["seed"])
prompts = [[int(x) for x in rng.integers(3, 352, size=int(rng.integers(5, opts["max_prompt"])))]
           for _ in range(opts["prompts"])]
params = dflash.SamplingParams(max_tokens=opts["max_tokens"], ignore_eos=True)
res = {}
if opts["kernels"]:
    import torch
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        outs = sess.generate(prompts, params)
        torch.cuda.synchronize()
    res["kernels"] = sorted({e.name for e in prof.events() if opts["kernels"] in e.name})
else:
    outs = sess.generate(prompts, params)
res["tokens"] = [o.token_ids for o in outs]
if draft is not None:
    ids, logits = sess.propose(prompts[0])
    res["logits"] = np.asarray(logits).ravel()[:4096].tolist()
else:
    req = _core.RequestInput()
    req.prompt = prompts[0]
    req.record_logits = True
    sc = _core.SamplingConfig()
    sc.max_tokens, sc.ignore_eos = 4, True
    req.sampling = sc
    rid = sess._core.add_request(req)
    while sess._core.has_unfinished():
        sess._core.step()
    vocab = sess._core.model_config.vocab_size
    res["logits"] = np.asarray(sess._core.take_result(rid).logits(vocab)).ravel()[:4096].tolist()
print(json.dumps(res))
"""

DEFAULTS = {
    "device": "cuda",
    "kv_cache_tokens": 4096,
    "max_num_seqs": 4,
    "seed": 5,
    "prompts": 3,
    "max_prompt": 40,
    "max_tokens": 20,
    "kernels": "",
}


def session_process(target, draft=None, env=None, **opts) -> subprocess.CompletedProcess:
    """The child run with `env` (DFLASH_NAME: value) added to this process's environment; opts
    override DEFAULTS (kernels: a substring of the kernel names to report, "" for none)."""
    unknown = set(opts) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown session options {sorted(unknown)}")
    args = [sys.executable, "-c", SCRIPT, str(target), str(draft or ""), json.dumps({**DEFAULTS, **opts})]
    return subprocess.run(
        args, check=False, env=dict(os.environ, **(env or {})), capture_output=True, text=True, timeout=600
    )


def run_session(target, draft=None, env=None, **opts) -> dict:
    """session_process, which must succeed: its JSON line (tokens, logits, kernels)."""
    p = session_process(target, draft, env, **opts)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def tiny_drafter(directory: Path, target: Path, num_layers: int = 2, block_size: int = 8) -> Path:
    """A random DFlash drafter for `target` (tapping its layers 0 and 1)."""
    from dflash.drafter_format import write_dflash_drafter

    cfg = json.loads((Path(target) / "config.json").read_text())
    return write_dflash_drafter(
        directory, target_config=cfg, num_layers=num_layers, target_layer_ids=[0, 1], block_size=block_size
    )


def assert_switch_keeps_bits(target, draft, off_env: dict, on_env: dict, marker: str, runs: bool = True) -> None:
    """A session under on_env gives the tokens and logits of one under off_env, and only on_env's
    run shows a decode_attention_kernel whose demangled name contains `marker` (its template
    arguments, e.g. "true, false>" for <head_dim, rows, ROPE, STAGED>); runs=False: the switched
    kernel is expected in neither (every launch of the session is beyond its reach)."""
    off = run_session(target, draft, off_env, kernels="decode_attention_kernel")
    on = run_session(target, draft, on_env, kernels="decode_attention_kernel")
    assert on["tokens"] == off["tokens"]
    assert on["logits"] == off["logits"]
    assert any(marker in name for name in on["kernels"]) == runs, on["kernels"]
    assert not any(marker in name for name in off["kernels"]), off["kernels"]

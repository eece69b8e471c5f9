# tests/gpu/test_cuda_async_decode.py
#
# Pipelined target-only decoding on CUDA (async_decode=True): with graphs on and off, the tokens
# equal ordinary decoding exactly, greedy and seeded sampling, with requests ending at stop tokens
# the pipeline could not foresee and batch sizes that need padding; the stats show pipelined
# steps and dropped rows; no KV block leaks. Skipped without a usable Hopper GPU.
from __future__ import annotations

import numpy as np
import pytest

import dflash
from dflash import _core

pytestmark = pytest.mark.skipif(not _core.cuda_usable(), reason="needs the CUDA backend and a Hopper GPU")

KV = dict(kv_cache_tokens=16384, max_num_seqs=16)


def _prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 352, size=int(rng.integers(3, 40)))] for _ in range(n)]


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("name", ["llama_hd64", "qwen3_hd128"])
def test_cuda_async_equals_sync(name, graphs, tiny_model_dirs):
    target = tiny_model_dirs[name]
    on = dflash.Session(target, device="cuda", async_decode=True, cuda_graphs=graphs, **KV)
    off = dflash.Session(target, device="cuda", cuda_graphs=graphs, **KV)
    for n, temperature in [(1, 0.0), (3, 0.0), (5, 0.9), (11, 0.0)]:
        prompts = _prompts(n, seed=n)
        probe = off.generate(prompts, dflash.SamplingParams(max_tokens=30, ignore_eos=True))
        stops = sorted({o.token_ids[len(o.token_ids) // 2] for o in probe[:2]})
        params = [dflash.SamplingParams(max_tokens=12 + 5 * (i % 4), temperature=temperature, seed=100 + i,
                                        stop_token_ids=stops) for i in range(n)]
        got = [o.token_ids for o in on.generate(prompts, params)]
        want = [o.token_ids for o in off.generate(prompts, params)]
        assert got == want, f"{name} graphs={graphs}: {n} prompts at T={temperature}"
    s = on.stats()
    print(f"{name} graphs={graphs}: pipelined steps {s['pipelined_steps']}, dropped rows {s['dropped_rows']}")
    assert s["pipelined_steps"] > 0 and s["dropped_rows"] > 0
    assert s["num_free_blocks"] == s["num_blocks"]

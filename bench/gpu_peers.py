# bench/gpu_peers.py
#
# The PyTorch peers of bench_gpu_qwen3.py, each timed the way our step is (host wall time of one
# step, the result read back to the host): transformers AR step and 16-token verify forward with
# a DynamicCache, the plain-PyTorch reference drafter of tests/reference on the GPU in bf16, and
# transformers' static cache + torch.compile recipe under a time limit. DEVICE may be set to
# "cpu" to exercise this code on a tiny model without a GPU.
from __future__ import annotations

import contextlib
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from gpu_common import REPO_ROOT, free_cuda_memory

DEVICE = "cuda"


def load_hf(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    kw = {"dtype": torch.bfloat16, "attn_implementation": "eager"}
    try:
        m, how = AutoModelForCausalLM.from_pretrained(str(model_dir), device_map=DEVICE, **kw), f"device_map={DEVICE!r}"
    except Exception as e:  # noqa: BLE001 - e.g. accelerate absent: load on the CPU, then move
        m = AutoModelForCausalLM.from_pretrained(str(model_dir), **kw).to(DEVICE)
        how = f"CPU then .to({DEVICE!r}) (device_map failed: {type(e).__name__}: {e})"
    return m.eval(), how


def set_attn(m, impl: str) -> str:
    if hasattr(m, "set_attn_implementation"):
        m.set_attn_implementation(impl)
    else:
        m.config._attn_implementation = impl
    return m.config._attn_implementation


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _prefill(m, ids):
    out = m(input_ids=ids, use_cache=True, logits_to_keep=1)
    return out.past_key_values, out.logits[:, -1:].argmax(-1)


def hf_ar_step(m, batch: int, ctx: int, *, steps: int, warmup: int) -> dict[str, Any]:
    """One-token forwards with a DynamicCache after a prefill; greedy argmax read back each step."""
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(batch)
    ids = torch.randint(10, m.config.vocab_size - 10, (batch, ctx), device=DEVICE, generator=g)
    times = []
    with torch.inference_mode():
        cache, tok = _prefill(m, ids)
        for i in range(warmup + steps):
            _sync()
            t = time.perf_counter()
            out = m(input_ids=tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            tok.cpu()
            if i >= warmup:
                times.append(time.perf_counter() - t)
    del cache, out
    free_cuda_memory()
    return {"batch": batch, "context": ctx, "step_s": statistics.fmean(times), "step_s_min": min(times),
            "step_ms_all": [round(t * 1e3, 3) for t in times]}


def hf_verify(m, ctx: int, layer_ids, *, steps: int, warmup: int, rows: int = 16) -> dict[str, Any]:
    """The verify forward of a DFlash step in transformers: 16 tokens over a cached context with
    output_hidden_states, target features of the drafter's layers concatenated, greedy argmax read
    back; the cache is cropped back to the context after each forward (outside the timing)."""
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(7)
    ids = torch.randint(10, m.config.vocab_size - 10, (1, ctx), device=DEVICE, generator=g)
    block = torch.randint(10, m.config.vocab_size - 10, (1, rows), device=DEVICE, generator=g)
    times = []
    with torch.inference_mode():
        cache, _ = _prefill(m, ids)
        cropped = hasattr(cache, "crop")
        for i in range(warmup + steps):
            _sync()
            t = time.perf_counter()
            out = m(input_ids=block, past_key_values=cache, use_cache=True, output_hidden_states=True)
            feats = torch.cat([out.hidden_states[lid + 1][0] for lid in layer_ids], dim=-1)
            out.logits[0].argmax(-1).cpu()
            if i >= warmup:
                times.append(time.perf_counter() - t)
            del out, feats
            if cropped:
                cache.crop(-rows)  # negative: drop that many tokens (old and new transformers)
    cached_at_end = int(cache.get_seq_length())
    del cache
    free_cuda_memory()
    return {"rows": rows, "context": ctx, "step_s": statistics.fmean(times), "step_s_min": min(times),
            "cache_cropped_each_step": cropped, "cached_tokens_at_end": cached_at_end,
            "step_ms_all": [round(t * 1e3, 3) for t in times]}


def reference_drafter_step(m, draft_dir: Path, ctx: int, *, steps: int, warmup: int,
                           new_rows: int = 7) -> dict[str, Any]:
    """tests/reference/dflash_reference.py on the GPU: append_context of 7 new rows + draft_query of
    a 16-token block (+ LM head on 15 rows) + argmax read back, per step."""
    import torch
    import torch.nn.functional as F

    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from tests.reference import dflash_reference as ref

    dr = ref.load_drafter(draft_dir)
    dr.weights = {k: v.to(DEVICE, torch.bfloat16) for k, v in dr.weights.items()}
    emb, head = m.get_input_embeddings().weight, m.get_output_embeddings().weight
    saved = (ref.target_embed, ref.target_lm_head)
    # The reference converts the whole embedding / LM head to fp32 on every call (correctness over
    # speed); give it bf16 lookups instead so that it is timed as a plain bf16 implementation.
    ref.target_embed = lambda _tm, ids: emb[ids].float()
    ref.target_lm_head = lambda _tm, h: F.linear(h.to(torch.bfloat16), head).float()
    width = len(dr.target_layer_ids) * dr.hidden_size
    times = []
    try:
        with torch.inference_mode(), torch.device(DEVICE), torch.autocast(DEVICE, dtype=torch.bfloat16):
            cache = ref.ContextKV.empty(dr)
            ref.append_context(dr, cache, torch.randn(ctx, width), torch.arange(ctx))
            rows = torch.randn(new_rows, width)
            block = torch.tensor([12] + [dr.mask_token_id] * (dr.block_size - 1))
            for i in range(warmup + steps):
                pos = len(cache)
                _sync()
                t = time.perf_counter()
                ref.append_context(dr, cache, rows, torch.arange(pos, pos + new_rows))
                start = pos + new_rows
                logits = ref.draft_query(dr, None, cache, block, torch.arange(start, start + dr.block_size))
                logits.argmax(-1).cpu()
                if i >= warmup:
                    times.append(time.perf_counter() - t)
    finally:
        ref.target_embed, ref.target_lm_head = saved
    block_size = dr.block_size
    del dr, cache
    free_cuda_memory()
    return {"context_start": ctx, "new_context_rows": new_rows, "block": block_size,
            "step_s": statistics.fmean(times), "step_s_min": min(times),
            "step_ms_all": [round(t * 1e3, 3) for t in times],
            "how": "tests/reference/dflash_reference.py append_context + draft_query on the GPU under "
                   "torch.autocast(bfloat16), drafter weights bf16; its fp32 target_embed/target_lm_head helpers "
                   "replaced by bf16 lookups; the context K/V grows by 7 rows per step (torch.cat)"}


class SectionTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    def on_alarm(_signum, _frame):
        raise SectionTimeout(f"exceeded its time limit of {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(max(1, int(seconds)))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def hf_compiled_step(m, ctx: int, *, new_tokens: int, limit_s: float) -> dict[str, Any]:
    """transformers' static-cache recipe: generation_config.cache_implementation="static" and
    generate() compiles the decoding forward itself (its auto-compile for compileable caches;
    wrapping model.forward in torch.compile(mode="reduce-overhead") by hand failed on the H200
    with transformers 5.17: "accessing tensor output of CUDAGraphs that has been overwritten"),
    greedy; step = (t(new_tokens) - t(1)) / (new_tokens - 1)."""
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(3)
    ids = torch.randint(10, m.config.vocab_size - 10, (1, ctx), device=DEVICE, generator=g)
    forward, cache_impl = m.forward, m.generation_config.cache_implementation
    out: dict[str, Any] = {"recipe": "generation_config.cache_implementation='static'; generate() auto-compiles "
                                     "the forward (generation_config.compile_config, disable_compile=False)",
                           "attn_implementation": set_attn(m, "sdpa"), "time_limit_s": limit_s}

    def gen(k):
        _sync()
        t = time.perf_counter()
        with torch.inference_mode():
            m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                       do_sample=False, pad_token_id=0)
        _sync()
        return time.perf_counter() - t

    t0 = time.perf_counter()
    try:
        with time_limit(limit_s):
            m.generation_config.cache_implementation = "static"
            m.generation_config.disable_compile = False
            gen(new_tokens)  # compile
            gen(new_tokens)  # CUDA-graph recording
            out["compile_and_warmup_s"] = time.perf_counter() - t0
            t1 = min(gen(1) for _ in range(2))
            tn = min(gen(new_tokens) for _ in range(2))
        out.update(ok=True, step_s=(tn - t1) / (new_tokens - 1), generate_1_s=t1, generate_n_s=tn,
                   new_tokens=new_tokens)
    except Exception as e:  # noqa: BLE001 - record why it failed, keep the rest of the run
        out.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000],
                   traceback_tail=traceback.format_exc()[-3000:], failed_after_s=time.perf_counter() - t0)
    finally:
        m.forward, m.generation_config.cache_implementation = forward, cache_impl
        with contextlib.suppress(Exception):
            torch._dynamo.reset()
    return out

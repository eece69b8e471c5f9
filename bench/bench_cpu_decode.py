#!/usr/bin/env python3
"""CPU decode benchmark: dflash vs Hugging Face transformers on SmolLM2-135M-Instruct (fp32).

In ONE run, on the SAME prompt token ids and the SAME lengths, this measures:

  ours          dflash.Session(device="cpu") driven through the runtime hook
                (_core.add_request / step / take_result) with ignore_eos=True, so every
                request decodes exactly --new-tokens tokens. Each step() is timed from Python.
                  prefill_s   = wall time from the first step() until every request of the
                                batch has its first token (prompt forward + first sample)
                  decode_s    = wall time from there until the last request finishes
                  decode_tok_s (aggregate) = tokens emitted after prefill_s / decode_s
                                (= batch * (N-1) / decode_s when the batch prefills in one step)
                  per_request_decode_tok_s = the runtime's own per-request metric
                                (tokens after the first / time after the first), mean over requests
                  total_s     = wall time of the whole batch
  transformers  AutoModelForCausalLM.from_pretrained(model_dir, dtype=float32), greedy
                generate(do_sample=False, max_new_tokens=N, min_new_tokens=N) on the same ids,
                left-padded with the tokenizer's pad id plus an attention mask, under
                torch.inference_mode() and torch.set_num_threads(--threads).
                  prefill_s   = wall time of generate(..., max_new_tokens=1) (time to first token)
                  total_s     = wall time of generate(..., max_new_tokens=N, min_new_tokens=N)
                  decode_s    = total_s - prefill_s
                  decode_tok_s (aggregate) = batch * (N-1) / decode_s
                  per_request_decode_tok_s = (N-1) / decode_s (all rows advance in lock-step)
  ratio         ours / transformers aggregate decode tok/s, per batch size (median of repeats);
                the batch-1 ratio goes to headline.json beside --out as cpu_ar_speedup_vs_hf_bs1
                (with cpu_decode_date / cpu_decode_command).
  roofline      fp32 weight bytes read per decode step (every tensor except the token-embedding
                table; the LM head is tied to the embedding, so that matrix is counted once),
                and a memory-copy bandwidth measured in the same run (numpy copy of a 512 MiB
                array, best of 3, counting read + write bytes) -> the batch-1 decode tok/s the
                bandwidth allows (bandwidth / bytes per step), and our fraction of it.

Both systems are warmed up once per batch size with the exact shapes of the timed runs;
the timed repeats then alternate ours / transformers so background load hits both alike.
The load average is recorded before and after each phase: on a shared machine, read it
next to the spread between repeats.

Usage:
  python bench/bench_cpu_decode.py                       # batch 1 and 8, 64 new tokens
  python bench/bench_cpu_decode.py --batch-sizes 1,4,8 --new-tokens 32 --repeats 5
  python bench/bench_cpu_decode.py --prompt-len 128      # synthetic fixed-length prompts
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as _dt
import json
import math
import os
import platform
import shlex
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# Eight different chat prompts; batch b uses the first b of them (batch 1 = the first prompt).
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the ocean.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for learning a new programming language.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in a few lines.",
    "How do vaccines train the immune system?",
    "Suggest a name for a small bakery that sells sourdough bread.",
]

REPO_ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- helpers
def _median(xs):
    return statistics.median(xs) if xs else None


def _summary(xs):
    if not xs:
        return None
    return {
        "median": statistics.median(xs),
        "min": min(xs),
        "max": max(xs),
        "spread_pct": 100.0 * (max(xs) - min(xs)) / statistics.median(xs) if statistics.median(xs) else None,
        "values": xs,
    }


def _loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def machine_info():
    info = {
        "platform_processor": platform.processor(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "lscpu_model_name": None,
        "total_memory_bytes": None,
    }
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.strip().startswith("Model name:"):
                info["lscpu_model_name"] = line.split(":", 1)[1].strip()
                break
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        info["total_memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    return info


def git_commit():
    try:  # read-only
        r = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
                           capture_output=True, text=True, timeout=10)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# ----------------------------------------------------------------------------- roofline
_ST_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                   "I8": 1, "U8": 1, "BOOL": 1}


def _safetensors_tensors(model_dir: Path):
    files = sorted(model_dir.glob("*.safetensors"))
    tensors = {}
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            tensors[name] = (meta["dtype"], meta["shape"])
    return tensors


def weight_bytes_per_step(model_dir: Path, config: dict):
    """fp32 bytes of weights read per decode step (weights are held as fp32 on the CPU by
    both systems, whatever the file dtype)."""
    tensors = _safetensors_tensors(model_dir)
    embed_names = [k for k in tensors if k.endswith("embed_tokens.weight")]
    tied = bool(config.get("tie_word_embeddings", False)) or not any(
        k.endswith("lm_head.weight") for k in tensors)
    total = 0
    embed = 0
    for name, (_dtype, shape) in tensors.items():
        nbytes = 4 * math.prod(shape)
        if name in embed_names:
            embed += nbytes
            continue
        total += nbytes
    lm_head = embed if tied else 0  # untied: lm_head.weight is already in `total`
    return {
        "bytes_per_step": total + lm_head,
        "non_embedding_weight_bytes": total,
        "lm_head_bytes_counted": lm_head,
        "embedding_table_bytes": embed,
        "tied_embeddings": tied,
        "how": "sum of fp32 bytes of every tensor except the token-embedding table, plus the "
               "embedding matrix once for the tied LM head; the embedding-row gather and KV "
               "cache reads (small at these lengths) are not counted",
    }


def copy_bandwidth(size_bytes=512 << 20, repeats=3, threads=1):
    """numpy copy of a size_bytes array, best of `repeats`; bytes moved = read + write."""
    src = np.ones(size_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    chunks = np.array_split(np.arange(src.size), threads) if threads > 1 else None
    best = float("inf")
    pool = concurrent.futures.ThreadPoolExecutor(threads) if threads > 1 else None
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            if pool is None:
                np.copyto(dst, src)
            else:
                bounds = [(c[0], c[-1] + 1) for c in chunks]
                list(pool.map(lambda b: np.copyto(dst[b[0]:b[1]], src[b[0]:b[1]]), bounds))
            best = min(best, time.perf_counter() - t0)
    finally:
        if pool is not None:
            pool.shutdown()
    del src, dst
    return {"bytes_per_copy_read_plus_write": 2 * size_bytes, "best_s": best,
            "bandwidth_GBps": 2 * size_bytes / best / 1e9, "threads": threads, "repeats": repeats}


def read_bandwidth(size_bytes=512 << 20, repeats=3, threads=1):
    """Read-only bandwidth for context: np.dot(x, x) over a size_bytes fp32 array split across
    `threads` threads, best of `repeats`; bytes moved = size_bytes (a decode step mostly reads)."""
    a = np.ones(size_bytes // 4, dtype=np.float32)
    parts = np.array_split(a, threads)
    best = float("inf")
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda c: np.dot(c, c), parts))
        for _ in range(repeats):
            t0 = time.perf_counter()
            list(pool.map(lambda c: np.dot(c, c), parts))
            best = min(best, time.perf_counter() - t0)
    del a, parts
    return {"bytes_read": size_bytes, "best_s": best, "bandwidth_GBps": size_bytes / best / 1e9,
            "threads": threads, "repeats": repeats}


# ----------------------------------------------------------------------------- prompts
def build_prompt_ids(tokenizer, prompts, prompt_len):
    ids = []
    for p in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        t = list(tokenizer.encode(text, add_special_tokens=False))
        if prompt_len:
            # Synthetic fixed length: repeat the rendered prompt and keep the last prompt_len
            # tokens (so it still ends with the assistant header).
            t = (t * (prompt_len // len(t) + 1))[-prompt_len:]
        ids.append(t)
    return ids


# ----------------------------------------------------------------------------- ours
def run_ours(sess, core, prompt_ids, new_tokens):
    rids = []
    for ids in prompt_ids:
        req = core.RequestInput()
        req.prompt = list(ids)
        s = core.SamplingConfig()
        s.max_tokens = new_tokens
        s.temperature = 0.0
        s.ignore_eos = True
        req.sampling = s
        rids.append(sess._core.add_request(req))
    counts = {r: 0 for r in rids}
    pending_first = set(rids)
    t0 = time.perf_counter()
    t_prefill = None
    tokens_after_prefill = 0
    steps = 0
    while sess._core.has_unfinished():
        outs = sess._core.step()
        now = time.perf_counter()
        steps += 1
        for o in outs:
            if o.request_id not in counts:
                continue
            n = len(o.new_tokens)
            counts[o.request_id] += n
            if t_prefill is not None:
                tokens_after_prefill += n
            if n:
                pending_first.discard(o.request_id)
        if t_prefill is None and not pending_first:
            t_prefill = now
    t_end = time.perf_counter()
    results = [sess._core.take_result(r) for r in rids]
    total_s = t_end - t0
    prefill_s = t_prefill - t0
    decode_s = t_end - t_prefill
    for r in results:
        assert len(r.token_ids) == new_tokens, (len(r.token_ids), new_tokens)
    return {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "total_s": total_s,
        "decode_tokens": tokens_after_prefill,
        "decode_tok_s": tokens_after_prefill / decode_s if decode_s > 0 else None,
        "per_request_decode_tok_s": statistics.mean(r.metrics.decode_tokens_per_s for r in results),
        "per_request_ttft_s_mean": statistics.mean(r.metrics.time_to_first_token_s for r in results),
        "num_steps": steps,
        "token_ids": [list(r.token_ids) for r in results],
    }


# ----------------------------------------------------------------------------- transformers
def hf_inputs(torch, prompt_ids, pad_id):
    width = max(len(t) for t in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for i, t in enumerate(prompt_ids):
        ids[i, width - len(t):] = torch.tensor(t, dtype=torch.long)
        mask[i, width - len(t):] = 1
    return ids, mask


def run_hf(torch, model, ids, mask, new_tokens, pad_id):
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=pad_id)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(**kw, max_new_tokens=1, min_new_tokens=1)
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(**kw, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        total_s = time.perf_counter() - t0
    gen = out[:, ids.shape[1]:]
    assert gen.shape[1] == new_tokens, gen.shape
    b = ids.shape[0]
    decode_s = total_s - prefill_s
    return {
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "total_s": total_s,
        "decode_tokens": b * (new_tokens - 1),
        "decode_tok_s": b * (new_tokens - 1) / decode_s if decode_s > 0 else None,
        "per_request_decode_tok_s": (new_tokens - 1) / decode_s if decode_s > 0 else None,
        "token_ids": gen.tolist(),
    }


def _agreement(a, b, eos_ids):
    """Greedy-token agreement between the two systems, per request: the common prefix, and
    whether the tokens match up to ours' first EOS (after which they legitimately differ:
    transformers' min_new_tokens masks EOS, ours' ignore_eos does not)."""
    prefixes, comparable = [], []
    for x, y in zip(a, b):
        n = 0
        for u, v in zip(x, y):
            if u != v:
                break
            n += 1
        prefixes.append(n)
        comparable.append(next((i for i, t in enumerate(x) if t in eos_ids), len(x)))
    return {"common_prefix_len_per_request": prefixes,
            "tokens_before_first_eos_ours_per_request": comparable,
            "requests_identical_before_first_eos": sum(p >= c for p, c in zip(prefixes, comparable)),
            "requests": len(a)}


# ----------------------------------------------------------------------------- main
def headline_figures(results) -> dict:
    """{"cpu_ar_speedup_vs_hf_bs1": ours / transformers decode tok/s at batch 1} when measured."""
    for e in results:
        if e["batch_size"] == 1 and e.get("decode_tok_s_ratio_ours_over_transformers"):
            return {"cpu_ar_speedup_vs_hf_bs1": e["decode_tok_s_ratio_ours_over_transformers"]}
    return {}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,8", help="comma-separated (default 1,8; max %d "
                    "unless --prompts-file gives more)" % len(PROMPTS))
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per request (default 64)")
    ap.add_argument("--prompt-len", type=int, default=0,
                    help="0 (default): the chat prompts at their natural lengths; L>0: "
                         "synthetic prompts of exactly L tokens (each rendered prompt repeated, "
                         "last L tokens kept)")
    ap.add_argument("--prompts-file", default=None,
                    help="JSON list of user messages replacing the built-in 8 prompts")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="threads for both systems (default: all cores, %(default)s)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per system and batch size (default 5)")
    ap.add_argument("--model-dir", default=None, help="HF model dir (default: dflash default_model_dir())")
    ap.add_argument("--skip-transformers", action="store_true", help="only time dflash")
    ap.add_argument("--out", default=str(REPO_ROOT / "bench" / "results" / "cpu_smollm2_decode.json"))
    args = ap.parse_args(argv)

    import dflash
    from dflash import _core
    from dflash.default_model import default_model_dir

    t_start = time.perf_counter()
    prompts = PROMPTS
    if args.prompts_file:
        prompts = json.loads(Path(args.prompts_file).read_text())
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if max(batch_sizes) > len(prompts):
        ap.error(f"batch size {max(batch_sizes)} > number of prompts ({len(prompts)})")
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2")
    model_dir = Path(args.model_dir) if args.model_dir else Path(default_model_dir())
    config = json.loads((model_dir / "config.json").read_text())

    loads = {"start": _loadavg()}
    print(f"model: {model_dir}\nthreads: {args.threads}  new tokens: {args.new_tokens}  "
          f"repeats: {args.repeats}  load avg: {loads['start']}", flush=True)

    # Roofline inputs first, on a quiet process.
    roof_w = weight_bytes_per_step(model_dir, config)
    bw = copy_bandwidth(threads=1)
    bw_mt = copy_bandwidth(threads=args.threads) if args.threads > 1 else None
    bw_read = read_bandwidth(threads=args.threads)
    print(f"copy bandwidth: {bw['bandwidth_GBps']:.1f} GB/s (1 thread)"
          + (f", {bw_mt['bandwidth_GBps']:.1f} GB/s ({args.threads} threads)" if bw_mt else "")
          + f"; read-only {bw_read['bandwidth_GBps']:.1f} GB/s ({args.threads} threads)", flush=True)

    t = time.perf_counter()
    sess = dflash.Session(str(model_dir), device="cpu", num_threads=args.threads)
    ours_load_s = time.perf_counter() - t
    all_ids = build_prompt_ids(sess.tokenizer, prompts, args.prompt_len)
    eos_ids = set(sess.tokenizer.eos_token_ids or [])

    torch = model = None
    hf_load_s = None
    pad_id = None
    core_file = Path(_core.__file__)
    versions = {"dflash": getattr(dflash, "__version__", None),
                "dflash_core_file": str(core_file),
                "dflash_core_mtime": _dt.datetime.fromtimestamp(core_file.stat().st_mtime).astimezone()
                .isoformat(timespec="seconds"),
                "repo_git_commit": git_commit(),
                "numpy": np.__version__, "python": platform.python_version()}
    if not args.skip_transformers:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        transformers.logging.set_verbosity_error()
        torch.set_num_threads(args.threads)
        t = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        model.eval()
        hf_load_s = time.perf_counter() - t
        hf_tok = AutoTokenizer.from_pretrained(str(model_dir))
        pad_id = hf_tok.pad_token_id if hf_tok.pad_token_id is not None else hf_tok.eos_token_id
        versions.update({"torch": torch.__version__, "transformers": transformers.__version__,
                         "torch_num_threads": torch.get_num_threads()})

    results = []
    for b in batch_sizes:
        ids = all_ids[:b]
        entry = {"batch_size": b, "prompt_lens": [len(t) for t in ids],
                 "load_avg_before": _loadavg()}
        # Warm up once per batch size with the exact shapes of the timed runs.
        t = time.perf_counter()
        run_ours(sess, _core, ids, args.new_tokens)
        entry["ours_warmup_s"] = time.perf_counter() - t
        if model is not None:
            hid, hmask = hf_inputs(torch, ids, pad_id)
            t = time.perf_counter()
            run_hf(torch, model, hid, hmask, args.new_tokens, pad_id)
            entry["transformers_warmup_s"] = time.perf_counter() - t
        ours_runs, hf_runs = [], []
        for r in range(args.repeats):  # alternate so background load hits both alike
            ours_runs.append(run_ours(sess, _core, ids, args.new_tokens))
            if model is not None:
                hf_runs.append(run_hf(torch, model, hid, hmask, args.new_tokens, pad_id))
            print(f"  batch {b} repeat {r}: ours {ours_runs[-1]['decode_tok_s']:.1f} tok/s"
                  + (f", transformers {hf_runs[-1]['decode_tok_s']:.1f} tok/s" if hf_runs else ""),
                  flush=True)
        entry["load_avg_after"] = _loadavg()

        def agg(runs):
            keys = ["prefill_s", "decode_s", "total_s", "decode_tok_s", "per_request_decode_tok_s"]
            out = {k: _summary([x[k] for x in runs]) for k in keys}
            out["decode_tokens_per_run"] = runs[0]["decode_tokens"]
            if "num_steps" in runs[0]:
                out["num_steps_per_run"] = runs[0]["num_steps"]
                out["per_request_ttft_s_mean"] = _summary([x["per_request_ttft_s_mean"] for x in runs])
            return out

        entry["ours"] = agg(ours_runs)
        if hf_runs:
            entry["transformers"] = agg(hf_runs)
            o, h = entry["ours"]["decode_tok_s"]["median"], entry["transformers"]["decode_tok_s"]["median"]
            entry["decode_tok_s_ratio_ours_over_transformers"] = o / h if h else None
            entry["greedy_token_agreement"] = _agreement(ours_runs[0]["token_ids"], hf_runs[0]["token_ids"],
                                                         eos_ids)
        results.append(entry)

    loads["end"] = _loadavg()

    # Roofline at batch 1.
    roof = {"weights": roof_w, "copy_bandwidth_1_thread": bw, "copy_bandwidth_n_threads": bw_mt,
            "read_bandwidth_n_threads": bw_read}
    roof["bound_decode_tok_s_batch1_read_bw"] = bw_read["bandwidth_GBps"] * 1e9 / roof_w["bytes_per_step"]
    roof["bound_decode_tok_s_batch1"] = bw["bandwidth_GBps"] * 1e9 / roof_w["bytes_per_step"]
    if bw_mt:
        roof["bound_decode_tok_s_batch1_n_threads"] = bw_mt["bandwidth_GBps"] * 1e9 / roof_w["bytes_per_step"]
    b1 = next((e for e in results if e["batch_size"] == 1), None)
    if b1:
        ours_b1 = b1["ours"]["decode_tok_s"]["median"]
        roof["ours_batch1_fraction_of_bound"] = ours_b1 / roof["bound_decode_tok_s_batch1"]
        roof["ours_batch1_effective_GBps"] = ours_b1 * roof_w["bytes_per_step"] / 1e9
        roof["ours_batch1_fraction_of_bound_read_bw"] = ours_b1 / roof["bound_decode_tok_s_batch1_read_bw"]
        if bw_mt:
            roof["ours_batch1_fraction_of_bound_n_threads"] = ours_b1 / roof["bound_decode_tok_s_batch1_n_threads"]
        if "transformers" in b1:
            roof["transformers_batch1_fraction_of_bound"] = (
                b1["transformers"]["decode_tok_s"]["median"] / roof["bound_decode_tok_s_batch1"])
    roof["how"] = ("bound = copy bandwidth (1-thread numpy copy of 512 MiB, best of 3, read+write "
                   "bytes) / bytes_per_step; fraction = ours median batch-1 decode tok/s / bound. "
                   "The n-thread copy (array split across a thread pool) and an n-thread read-only "
                   "figure (np.dot(x, x), bytes read only) are given for context: a copy moves "
                   "2 bytes per byte copied and is usually slower than pure reads, so a decode "
                   "step that mostly reads can exceed the copy bound.")

    report = {
        "benchmark": "cpu_decode_smollm2",
        "date": _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
        "machine": machine_info(),
        "load_avg": loads,
        "versions": versions,
        "model": {"dir": str(model_dir), "name": "SmolLM2-135M-Instruct", "dtype": "float32",
                  "weight_bytes_reported_by_dflash": sess.stats()["weight_bytes"]},
        "settings": {"batch_sizes": batch_sizes, "new_tokens": args.new_tokens,
                     "prompt_len": args.prompt_len or "natural", "threads": args.threads,
                     "repeats": args.repeats, "prompts": prompts[:max(batch_sizes)],
                     "ours_load_s": ours_load_s, "transformers_load_s": hf_load_s,
                     "transformers_pad_token_id": pad_id},
        "method": {
            "summary": "median / min / max over --repeats timed runs after one warm-up run per "
                       "batch size; ours and transformers alternate; same prompt token ids "
                       "(chat template rendered by dflash's tokenizer) for both",
            "ours": {
                "api": "_core.add_request (ignore_eos=True, max_tokens=N, temperature=0) then "
                       "step() until done; each step timed in Python",
                "prefill_s": "first step() start -> every request has its first token",
                "decode_s": "end of prefill_s -> last request finished",
                "decode_tok_s": "tokens emitted after prefill_s (all requests) / decode_s",
                "per_request_decode_tok_s": "runtime metric (tokens after the first / time "
                                            "from first token to finish), mean over requests",
                "total_s": "first step() start -> last request finished",
            },
            "transformers": {
                "api": "model.generate(do_sample=False, max_new_tokens=N, min_new_tokens=N), "
                       "left padding with pad_token_id + attention_mask, torch.inference_mode()",
                "prefill_s": "wall time of generate(..., max_new_tokens=1) (time to first token)",
                "total_s": "wall time of generate(..., max_new_tokens=N, min_new_tokens=N)",
                "decode_s": "total_s - prefill_s",
                "decode_tok_s": "batch * (N-1) / decode_s",
                "per_request_decode_tok_s": "(N-1) / decode_s",
            },
            "ratio": "ours median decode_tok_s / transformers median decode_tok_s",
            "greedy_token_agreement": "sanity check that both decode the same thing: common "
                                      "prefix of the first timed run's tokens per request, "
                                      "compared up to ours' first EOS (transformers' "
                                      "min_new_tokens masks EOS, ours' ignore_eos does not)",
        },
        "results": results,
        "roofline": roof,
        "wall_time_s": time.perf_counter() - t_start,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    head = headline_figures(results)
    if head:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from gpu_common import update_headline

        print(f"headline {update_headline(out.parent, head, stamp_prefix='cpu_decode_')}: {head}")

    # Short table.
    print()
    hdr = f"{'batch':>5} {'system':<13} {'prefill s':>9} {'decode s':>9} {'total s':>8} " \
          f"{'decode tok/s':>12} {'per-req tok/s':>13} {'spread %':>8}"
    print(hdr)
    print("-" * len(hdr))
    for e in results:
        for name in ("ours", "transformers"):
            if name not in e:
                continue
            m = e[name]
            print(f"{e['batch_size']:>5} {name:<13} {m['prefill_s']['median']:>9.3f} "
                  f"{m['decode_s']['median']:>9.3f} {m['total_s']['median']:>8.3f} "
                  f"{m['decode_tok_s']['median']:>12.1f} {m['per_request_decode_tok_s']['median']:>13.1f} "
                  f"{m['decode_tok_s']['spread_pct']:>8.1f}")
        if "decode_tok_s_ratio_ours_over_transformers" in e:
            print(f"{e['batch_size']:>5} ratio ours/transformers decode tok/s: "
                  f"{e['decode_tok_s_ratio_ours_over_transformers']:.2f}")
    print(f"\nroofline: {roof_w['bytes_per_step'] / 1e6:.1f} MB/step, copy {bw['bandwidth_GBps']:.1f} GB/s "
          f"-> {roof['bound_decode_tok_s_batch1']:.1f} tok/s at batch 1", end="")
    if "ours_batch1_fraction_of_bound" in roof:
        print(f"; ours {100 * roof['ours_batch1_fraction_of_bound']:.0f}% of it", end="")
    print(f"\n          read-only {bw_read['bandwidth_GBps']:.1f} GB/s -> "
          f"{roof['bound_decode_tok_s_batch1_read_bw']:.1f} tok/s", end="")
    if "ours_batch1_fraction_of_bound_read_bw" in roof:
        print(f"; ours {100 * roof['ours_batch1_fraction_of_bound_read_bw']:.0f}% of it", end="")
    print(f"\nload avg start {loads['start']} end {loads['end']}; wall {report['wall_time_s']:.0f} s")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

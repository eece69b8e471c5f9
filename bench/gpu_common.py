# bench/gpu_common.py
#
# Helpers shared by the GPU benchmarks (bench_gpu_*.py): the run record (machine, date, command,
# versions), the device-to-device copy bandwidth that serves as each run's roofline, the
# random-weight model writer (Qwen3, or a tied Llama such as SmolLM2), byte counts of a decode
# step, a generic dump of the runtime's stats, and the shared headline file bench/results/headline.json (one flat object
# that several benchmarks update key by key). torch is imported inside the functions that need
# it, so the pure-Python parts import on any machine.
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
HEADLINE_NAME = "headline.json"

QWEN3_8B = {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936}


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv)


def versions() -> dict[str, Any]:
    """Versions of what is measured: torch, transformers, and the dflash._core that was imported."""
    out: dict[str, Any] = {"python": platform.python_version()}
    for name in ("torch", "transformers", "triton", "numpy"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - absent or broken: record it, do not fail the run
            out[name] = None
    try:
        from dflash import _core

        out["dflash_core"] = _core.__file__
        out["dflash_core_mtime"] = dt.datetime.fromtimestamp(os.path.getmtime(_core.__file__),
                                                             dt.timezone.utc).isoformat(timespec="seconds")
    except Exception as e:  # noqa: BLE001
        out["dflash_core"] = f"not importable: {e}"
    return out


def run_record(benchmark: str) -> dict[str, Any]:
    """The header every GPU result file starts with."""
    machine: dict[str, Any] = {"host": platform.node(), "cpu_count": os.cpu_count()}
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            machine.update(gpu=torch.cuda.get_device_name(0), gpu_memory_bytes=p.total_memory,
                           gpu_count=torch.cuda.device_count(), cuda=torch.version.cuda)
    except Exception as e:  # noqa: BLE001
        machine["gpu"] = f"unknown: {e}"
    return {"benchmark": benchmark, "date": now_iso(), "command": command_line(), "machine": machine,
            "versions": versions(), "kernel_switches": kernel_switches()}


def kernel_switches() -> dict[str, str]:
    """The DFLASH_* variables of this process (the backend switches a session reads when it opens),
    so that a result file says which kernels it timed."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("DFLASH_")}


def write_json(path: str | Path, obj: Any) -> None:
    """Writes through a temporary file, so a run killed mid-write leaves the previous version."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    tmp.replace(path)


def update_headline(out_dir: str | Path, updates: Mapping[str, Any], stamp_prefix: str = "") -> Path:
    """Reads `out_dir`/headline.json (else the repository's bench/results/headline.json, else {}),
    sets `updates` plus `<stamp_prefix>date` and `<stamp_prefix>command` (the main Qwen3 benchmark
    owns the bare `date`/`command`; other benchmarks stamp their own keys), and writes it to
    `out_dir`/headline.json."""
    path = Path(out_dir) / HEADLINE_NAME
    base: dict[str, Any] = {}
    for candidate in (path, BENCH_DIR / "results" / HEADLINE_NAME):
        if candidate.is_file():
            base = json.loads(candidate.read_text())
            break
    base.update(updates)
    if not stamp_prefix:  # a fresh main measurement: an earlier rederivation's stamp is stale
        base.pop("rederived_by", None)
        if "ar_speedup_vs_hf_static_compile_bs1" in updates:  # measured in this run, not a separate one
            base.pop("compile_peer_date", None)
            base.pop("compile_peer_command", None)
    base[f"{stamp_prefix}date"] = now_iso()
    base[f"{stamp_prefix}command"] = command_line()
    write_json(path, base)
    return path


# --------------------------------------------------------------------------------------------
# Byte counts (pure Python; checked on the CPU by tests/test_bench_gpu_common.py)


def layer_weight_count(cfg: Mapping[str, int]) -> int:
    """Parameters of one Qwen3 decoder layer (also a DFlash drafter layer)."""
    h, nh, nkv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    return (h * nh * hd + 2 * h * nkv * hd + nh * hd * h  # q, k, v, o
            + 3 * h * cfg["intermediate_size"]  # gate, up, down
            + 2 * h + 2 * hd)  # input/post-attention norms, q_norm, k_norm


def decoder_weight_bytes(cfg: Mapping[str, int], *, dtype_bytes: int = 2) -> int:
    """Bytes of every weight a decode step reads: all layers, final norm and LM head, not the
    embedding table (a step gathers a few of its rows). A tied LM head counts that matrix once."""
    h = cfg["hidden_size"]
    return (cfg["num_hidden_layers"] * layer_weight_count(cfg) + h + cfg["vocab_size"] * h) * dtype_bytes


def kv_bytes_per_token(cfg: Mapping[str, int], *, dtype_bytes: int = 2) -> int:
    """K and V of one token over all layers."""
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * dtype_bytes


def decode_step_bytes(weight_bytes: int, kv_tokens_read: int, cfg: Mapping[str, int]) -> int:
    """Bytes one decode step must read at least: the weights once + every cached K/V it attends to
    (kv_tokens_read = sum over the batch of each sequence's length)."""
    return weight_bytes + kv_tokens_read * kv_bytes_per_token(cfg)


# --------------------------------------------------------------------------------------------
# GPU helpers


def copy_bandwidth(nbytes: int = 4 << 30, reps: int = 6) -> float:
    """Device-to-device copy bandwidth in GB/s (read + write bytes, best of `reps`, CUDA events)."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        best = min(best, s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / best / 1e9


# SmolLM2-135M's geometry (a Llama with tied embeddings), for launch-bound profiles without the GGUF.
SMOLLM2_135M = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152}


def llama_config(cfg: Mapping[str, int] = SMOLLM2_135M) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **cfg, "rms_norm_eps": 1e-5,
            "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
            "hidden_act": "silu", "eos_token_id": 2, "bos_token_id": 1, "attention_bias": False,
            "mlp_bias": False, "torch_dtype": "bfloat16"}


def qwen3_config(cfg: Mapping[str, int] = QWEN3_8B) -> dict[str, Any]:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **cfg, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "max_position_embeddings": 40960, "tie_word_embeddings": False,
            "hidden_act": "silu", "eos_token_id": 151645, "bos_token_id": 151643,
            "attention_bias": False, "torch_dtype": "bfloat16"}


def write_random_model(out: Path, cfg: Mapping[str, int] = QWEN3_8B, seed: int = 0, arch: str = "qwen3") -> int:
    """A Qwen3 (or, with arch="llama", a tied-embedding Llama) model directory (config.json +
    model.safetensors) with random bf16 weights drawn on the GPU (std 0.02, norm gains 1);
    returns the bytes a decode step reads (decoder_weight_bytes; for the Llama, its own count)."""
    import torch
    from safetensors.torch import save_file

    h, nh, nkv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inter, v = cfg["intermediate_size"], cfg["vocab_size"]
    out.mkdir(parents=True, exist_ok=True)
    qwen3 = arch == "qwen3"
    (out / "config.json").write_text(json.dumps(qwen3_config(cfg) if qwen3 else llama_config(cfg)))
    g = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16) * std).cpu()

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    t = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": ones(h)}
    if qwen3:
        t["lm_head.weight"] = rnd(v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = ones(h)
        t[p + "post_attention_layernorm.weight"] = ones(h)
        t[p + "self_attn.q_proj.weight"] = rnd(nh * hd, h)
        t[p + "self_attn.k_proj.weight"] = rnd(nkv * hd, h)
        t[p + "self_attn.v_proj.weight"] = rnd(nkv * hd, h)
        t[p + "self_attn.o_proj.weight"] = rnd(h, nh * hd)
        if qwen3:
            t[p + "self_attn.q_norm.weight"] = ones(hd)
            t[p + "self_attn.k_norm.weight"] = ones(hd)
        t[p + "mlp.gate_proj.weight"] = rnd(inter, h)
        t[p + "mlp.up_proj.weight"] = rnd(inter, h)
        t[p + "mlp.down_proj.weight"] = rnd(h, inter)
    save_file(t, str(out / "model.safetensors"))
    weights_read = sum(x.numel() * 2 for k, x in t.items() if k != "model.embed_tokens.weight")
    if qwen3:
        assert weights_read == decoder_weight_bytes(cfg), (weights_read, decoder_weight_bytes(cfg))
    else:  # the tied LM head reads the embedding matrix once
        weights_read += v * h * 2
    del t
    torch.cuda.empty_cache()
    return weights_read


def public_attrs(obj: Any) -> dict[str, Any]:
    """Every public plain-valued attribute of a bound C++ struct (new fields appear by themselves)."""
    out: dict[str, Any] = {}
    for name in dir(obj):
        if name.startswith("_"):
            continue
        try:
            value = getattr(obj, name)
        except Exception:  # noqa: BLE001
            continue
        if isinstance(value, (bool, int, float, str)):
            out[name] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(x, (bool, int, float)) for x in value):
            out[name] = list(value)
    return out


def core_stats(core_session: Any) -> dict[str, Any]:
    """_core.Session.stats() as a flat dict: the session's fields plus its engine's (engine.*)."""
    st = core_session.stats()
    out = public_attrs(st)
    engine = getattr(st, "engine", None)
    if engine is not None:
        out.update({f"engine.{k}": v for k, v in public_attrs(engine).items()})
    return out


def stat(stats: Mapping[str, Any], name: str) -> Any:
    """A counter that may live on the session stats or on its engine stats (None if absent)."""
    return stats.get(name, stats.get(f"engine.{name}"))


def free_cuda_memory() -> None:
    import gc

    gc.collect()
    try:
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def cuda_kernel_totals(prof: Any) -> dict[str, list]:
    """Per kernel name of a torch.profiler run (CUPTI, so our own and graph kernels too):
    [total microseconds, launches]."""
    import collections

    import torch

    per: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            per[ev.name][1] += 1
    return dict(per)


def cuda_kernel_intervals(prof: Any) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every GPU activity (kernels, copies, sets) of a
    torch.profiler run, sorted by start."""
    import torch

    out = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            out.append((float(ev.time_range.start), float(ev.time_range.end)))
    return sorted(out)


def split_idle_time(intervals: list[tuple[float, float]], steps: int) -> dict[str, float]:
    """Idle time of the GPU between consecutive activities of `steps` back-to-back steps (pure
    Python). The `steps - 1` longest gaps are taken as the gaps between steps (host work, the
    synchronisation and the next launch); every other gap lies inside a step (launch gaps between
    the kernels of one graph). Per step, microseconds: busy (union of activity), span (first start
    to last end / steps), between_steps, within_steps, largest_within."""
    if not intervals or steps < 1:
        return {}
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    busy = sum(b - a for a, b in merged)
    gaps = sorted((merged[i + 1][0] - merged[i][1] for i in range(len(merged) - 1)), reverse=True)
    between = gaps[: steps - 1]
    within = gaps[steps - 1:]
    span = merged[-1][1] - merged[0][0]
    return {"busy_us_per_step": busy / steps, "span_us_per_step": span / steps,
            "between_steps_us_per_step": sum(between) / max(1, steps - 1),
            "within_steps_us_per_step": sum(within) / steps,
            "largest_within_us": within[0] if within else 0.0,
            "smallest_between_us": between[-1] if between else 0.0}


def graph_time(calls: list[Callable[[], Any]], trials: int = 20, replays: int = 10, best: bool = False) -> float:
    """Seconds per replay of one CUDA graph of `calls` (median of `trials` timings of `replays`;
    best=True: the fastest). The calls launch on torch's current stream (the capture stream while
    capturing)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(replays):
            g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3 / replays)
    del g
    return min(times) if best else statistics.median(times)

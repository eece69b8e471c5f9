#!/usr/bin/env python3
"""Load benchmark of OpenAI-compatible servers: GSM8K and MT-Bench prompts replayed at fixed
concurrencies against `dflash serve` (target-only, fixed and adaptive speculation, one server
process per configuration, started and stopped here) and optionally a peer server (e.g.
`transformers serve --continuous-batching`), all in one run on the same machine.

For every server and concurrency c, `--requests` chat requests (at least c; prompts taken in turn
from the interleaved data sets) are sent by c concurrent streaming clients (OpenAI's chat API,
stream=True with include_usage; by default over raw httpx with the events parsed here, as vLLM's
benchmark does, `--client openai` for the `openai` async client) and measured:
- output tokens/s: completion tokens of all requests / wall time of the level;
- time to first token (TTFT) and inter-token latency (ITL: the gaps between content chunks, as
  vLLM counts them) percentiles p50 / p90 / p99, and request latency;
- the speculative acceptance (usage.speculative of dflash) summed over the level.
With --engine-baseline, each dflash configuration's own Session also generates the c = 1
requests one at a time in this process (no HTTP): the server's overhead at concurrency 1 is
1 - server tokens/s / engine tokens/s.

Usage:
  python bench/bench_serve_load.py --gsm8k test.jsonl \\
      --server 'ar=dflash:--draft none' --server 'fixed=dflash:--draft default' \\
      [--server 'adaptive=dflash:--draft default --speculation adaptive'] \\
      [--server 'hf=cmd:transformers serve --continuous-batching --port {port}'] \\
      --concurrency 1,4,16,64 --requests 64 --max-tokens 256 --engine-baseline \\
      --out bench/results/serve_load_<machine>.json [--plot ...png]
--ignore-eos goes to dflash servers only (it is no OpenAI field; a peer that refuses it stops
at its EOS, and its tokens/s counts the tokens it did generate).
--level-time-limit S bounds a level for a slow peer: after S seconds a client sends no new
request (each sends at least one), and the level's figures are over the requests it did send.
Each server's startup_s (process start to /v1/models answering: loading, CUDA graph capture,
cost measurement) and GPU memory (nvidia-smi) are recorded; with --engine-baseline, so are the
Session's start-up stats (graph_capture_s, spec_cost_measure_s, the draft-length mix).
The report is rewritten after every level, so a run cut short keeps what it measured.
A `dflash:ARGS` server is `python -m dflash serve --port P ARGS`; a `cmd:COMMAND` server is any
command with `{port}` in it, and its model name is read from /v1/models (--peer-model overrides).
Ratios over the server named by --baseline (default `ar`) are in `ratios`; the headline keys
serve_<name>_over_<baseline>_c<c> follow from them (bench/README.md).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence

from dflash.bench_acceptance import default_gsm8k_path, load_gsm8k, load_mtbench, load_prompt_file, package_data_path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _percentiles(values: Sequence[float]) -> Dict[str, Optional[float]]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    v = sorted(values)

    def q(p: float) -> float:
        return v[min(len(v) - 1, int(round(p * (len(v) - 1))))]

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": sum(v) / len(v)}


def load_prompts(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Interleaved chat prompts of the chosen data sets: [{"dataset", "messages"}]."""
    sets: List[List[Dict[str, Any]]] = []
    for name in args.datasets.split(","):
        if name == "gsm8k":
            path = Path(args.gsm8k) if args.gsm8k else default_gsm8k_path()
            if path is None:
                raise SystemExit("GSM8K test.jsonl not found: pass --gsm8k")
            items = load_gsm8k(path)
        elif name == "mtbench":
            items = load_mtbench(package_data_path("mtbench"))
        elif name == "prompts":
            if not args.prompts:
                raise SystemExit("the data set 'prompts' needs --prompts FILE")
            items = load_prompt_file(Path(args.prompts))
        else:
            raise SystemExit(f"unknown data set {name!r} (gsm8k, mtbench, prompts)")
        sets.append([{"dataset": name, "messages": it["messages"]} for it in items])
    out: List[Dict[str, Any]] = []
    for i in range(max(len(s) for s in sets)):
        out += [s[i] for s in sets if i < len(s)]
    return out


# ------------------------------------------------------------------------------ servers
class Server:
    """A server process started for the benchmark (or none: an external URL)."""

    def __init__(self, name: str, spec: str, args: argparse.Namespace):
        self.name, self.spec = name, spec
        self.kind, _, rest = spec.partition(":")
        self.port = _free_port()
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = Path(args.log_dir) / f"server_{name}.log"
        if self.kind == "dflash":
            self.dflash_args = shlex.split(rest)
            self.argv = [sys.executable, "-m", "dflash", "serve", "--port", str(self.port), "--log-level", "warning",
                         *self.dflash_args]
        elif self.kind == "cmd":
            self.dflash_args = None
            self.argv = shlex.split(rest.replace("{port}", str(self.port)))
        else:
            raise SystemExit(f"server {name}: spec must start with 'dflash:' or 'cmd:', got {spec!r}")
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.model = args.peer_model if self.kind == "cmd" and args.peer_model else None
        self.startup_s: Optional[float] = None

    def gpu_memory_mib(self) -> Optional[int]:
        """GPU memory held by the server's processes (nvidia-smi), None without a GPU."""
        if self.proc is None:
            return None
        try:
            out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        if out.returncode != 0:
            return None
        try:
            group = os.getpgid(self.proc.pid)
        except OSError:
            return None
        total, found = 0, False
        for line in out.stdout.splitlines():
            parts = [x.strip() for x in line.split(",")]
            if len(parts) != 2 or not parts[0].isdigit() or not parts[1].isdigit():
                continue
            try:
                if os.getpgid(int(parts[0])) == group:
                    total, found = total + int(parts[1]), True
            except OSError:
                continue
        return total if found else None

    def start(self, timeout_s: float) -> None:
        """Start the process and wait for /v1/models; startup_s is the time that took (model load,
        CUDA graph capture, cost measurement)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise SystemExit(f"server {self.name} exited with {self.proc.returncode}; see {self.log_path}")
            if self._ready():
                self.startup_s = time.monotonic() - t0
                return
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"server {self.name} did not answer within {timeout_s:.0f} s; see {self.log_path}")

    def _ready(self) -> bool:
        """/v1/models answers (and names the model); with the model name given (--peer-model), a
        200 from /health is enough (transformers serve's /v1/models fails without a hub cache)."""
        try:
            with urllib.request.urlopen(self.base_url + "/v1/models", timeout=2) as r:
                models = json.load(r)["data"]
            if self.model is None:
                self.model = models[0]["id"]
            return True
        except (OSError, ValueError, KeyError, IndexError):
            pass
        if self.model is None:
            return False
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _acceptance(spec: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Acceptance counters summed over requests (usage.speculative), and tau = emitted tokens per
    draft-verify step (accepted drafts + the step's own token)."""
    out = {k: sum(int(x.get(k) or 0) for x in spec) for k in ("num_drafted", "num_accepted", "num_spec_steps")}
    steps = out["num_spec_steps"]
    out["tau"] = (out["num_accepted"] + steps) / steps if steps else None
    return out


# ------------------------------------------------------------------------------ clients
def _request_body(model: str, prompt: Dict[str, Any], args: argparse.Namespace) -> Dict[str, Any]:
    body: Dict[str, Any] = {"model": model, "messages": prompt["messages"], "max_tokens": args.max_tokens,
                            "temperature": args.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if args.seed is not None:
        body["seed"] = args.seed
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body


async def _chunks_httpx(client: Any, base_url: str, body: Dict[str, Any]) -> AsyncIterator[Dict[str, Any]]:
    """The server-sent events of one streamed request as dicts (httpx, no OpenAI client)."""
    async with client.stream("POST", base_url + "/v1/chat/completions", json=body,
                             headers={"Authorization": "Bearer bench"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


async def _chunks_openai(client: Any, body: Dict[str, Any]) -> AsyncIterator[Dict[str, Any]]:
    """The same through the `openai` client (its own per-chunk parsing costs included)."""
    extra = {"ignore_eos": True} if body.pop("ignore_eos", False) else None
    stream = await client.chat.completions.create(**body, extra_body=extra)
    async for chunk in stream:
        yield chunk.model_dump()


async def _one_request(client: Any, base_url: str, model: str, prompt: Dict[str, Any],
                       args: argparse.Namespace) -> Dict[str, Any]:
    body = _request_body(model, prompt, args)
    t0 = time.perf_counter()
    first: Optional[float] = None
    last: Optional[float] = None
    gaps: List[float] = []
    chunks = 0
    usage: Optional[Dict[str, Any]] = None
    events = _chunks_openai(client, body) if args.client == "openai" else _chunks_httpx(client, base_url, body)
    async for chunk in events:
        now = time.perf_counter()
        choices = chunk.get("choices") or []
        if choices and (choices[0].get("delta") or {}).get("content"):
            if first is None:
                first = now
            else:
                gaps.append(now - last)  # type: ignore[operator]
            last = now
            chunks += 1
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
    end = time.perf_counter()
    tokens = usage["completion_tokens"] if usage else chunks
    return {"ttft_s": (first - t0) if first is not None else None, "itl_s": gaps, "latency_s": end - t0,
            "completion_tokens": tokens, "tokens_from_usage": usage is not None,
            "speculative": (usage or {}).get("speculative"), "dataset": prompt["dataset"]}


async def run_level(base_url: str, model: str, prompts: List[Dict[str, Any]], concurrency: int,
                    args: argparse.Namespace) -> Dict[str, Any]:
    n = max(args.requests, concurrency)
    queue = [prompts[i % len(prompts)] for i in range(n)]
    if args.client == "openai":
        from openai import AsyncOpenAI

        client: Any = AsyncOpenAI(base_url=base_url + "/v1", api_key="bench", timeout=args.request_timeout,
                                  max_retries=0)
    else:
        import httpx

        client = httpx.AsyncClient(timeout=args.request_timeout,
                                   limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency))
    results: List[Dict[str, Any]] = []
    next_index = 0
    limit = args.level_time_limit

    async def worker() -> None:
        nonlocal next_index
        sent = 0
        while next_index < len(queue):
            if sent and limit is not None and time.perf_counter() - t0 > limit:
                return  # the level's time is up: no new requests (but one per worker), in-flight ones finish
            sent += 1
            p = queue[next_index]
            next_index += 1
            results.append(await _one_request(client, base_url, model, p, args))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    await (client.close() if args.client == "openai" else client.aclose())
    tokens = sum(r["completion_tokens"] for r in results)
    spec = [r["speculative"] for r in results if r["speculative"]]
    level: Dict[str, Any] = {
        "concurrency": concurrency, "requests": len(results), "requests_planned": n,
        "wall_s": wall, "completion_tokens": tokens,
        "output_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "ttft_s": _percentiles([r["ttft_s"] for r in results if r["ttft_s"] is not None]),
        "itl_s": _percentiles([g for r in results for g in r["itl_s"]]),
        "latency_s": _percentiles([r["latency_s"] for r in results]),
        "tokens_from_usage": all(r["tokens_from_usage"] for r in results),
    }
    if spec:
        level["speculative"] = _acceptance(spec)
    return level


def engine_baseline(server: Server, prompts: List[Dict[str, Any]], args: argparse.Namespace) -> Dict[str, Any]:
    """The dflash configuration's own Session, the c = 1 requests one at a time, no HTTP."""
    import dflash
    from dflash.serve.command import add_arguments, session_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    session = session_from_args(p.parse_args(server.dflash_args))
    try:
        n = max(args.requests, 1)
        params = dict(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos)
        session.generate([prompts[0]["messages"]], dflash.SamplingParams(**params))  # warm-up
        tokens, t0 = 0, time.perf_counter()
        for i in range(n):
            seeded = dict(params, seed=args.seed) if args.seed is not None else params
            out = session.generate([prompts[i % len(prompts)]["messages"]], dflash.SamplingParams(**seeded))[0]
            tokens += len(out.token_ids)
        wall = time.perf_counter() - t0
        st = session.stats()
    finally:
        session.close()
    stats = {k: st.get(k) for k in _ENGINE_STATS}
    stats["num_graphs"] = len(st.get("graph_batch_sizes") or []) * max(1, len(st.get("draft_lengths") or []))
    return {"requests": n, "completion_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
            "stats": stats}


# the Session.stats() keys kept with the engine baseline: start-up costs and the speculation mix
_ENGINE_STATS = ("device", "weight_bytes", "kv_cache_bytes", "draft_kv_cache_bytes", "workspace_bytes", "cuda_graphs",
                 "graph_batch_sizes", "graph_capture_s", "speculation", "draft_lengths", "spec_length_steps",
                 "spec_cost_table", "spec_cost_measure_s", "acceptance_length", "num_spec_steps", "graph_steps",
                 "eager_steps")


def _machine() -> Dict[str, Any]:
    info: Dict[str, Any] = {"hostname": platform.node(), "platform": platform.platform(), "cpu_count": os.cpu_count()}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            info["gpus"] = out.stdout.split("\n")[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def write_plot(report: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, res in report["servers"].items():
        levels = res["levels"]
        cs = [lv["concurrency"] for lv in levels]
        axes[0].plot(cs, [lv["output_tokens_per_s"] for lv in levels], marker="o", label=name)
        axes[1].plot(cs, [1e3 * (lv["ttft_s"]["p50"] or 0) for lv in levels], marker="o", label=name)
        axes[2].plot(cs, [1e3 * (lv["itl_s"]["p50"] or 0) for lv in levels], marker="o", label=name)
    for ax, title in zip(axes, ["output tokens/s", "TTFT p50 (ms)", "ITL p50 (ms)"]):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{report['machine'].get('gpus') or 'CPU'}: {report['datasets']}, {report['max_tokens']} tokens, "
                 f"T={report['temperature']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _write(report: Dict[str, Any], path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1) + "\n")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="append", required=True, help="NAME=dflash:ARGS or NAME=cmd:COMMAND")
    ap.add_argument("--baseline", default="ar", help="server the ratios are over (default ar)")
    ap.add_argument("--datasets", default="gsm8k,mtbench", help="comma-separated: gsm8k, mtbench, prompts")
    ap.add_argument("--gsm8k", help="GSM8K test.jsonl")
    ap.add_argument("--prompts", help="prompt file for the data set 'prompts' (as `dflash bench acceptance --prompts`)")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--requests", type=int, default=64, help="requests per level (at least the concurrency)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--ignore-eos", action="store_true", help="every request generates --max-tokens tokens")
    ap.add_argument("--client", choices=["httpx", "openai"], default="httpx",
                    help="load client: raw httpx SSE (default; as vLLM's benchmark uses a raw HTTP client) or the "
                         "openai client, whose own per-request cost (a few ms) then counts as latency")
    ap.add_argument("--peer-model", help="model name for cmd: servers (default: the first of /v1/models)")
    ap.add_argument("--engine-baseline", action="store_true", help="the c=1 requests through each dflash Session directly")
    ap.add_argument("--level-time-limit", type=float, default=None,
                    help="seconds after which a level starts no new requests (its in-flight ones finish); for slow peers")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--log-dir", default="/tmp/bench_serve_logs")
    ap.add_argument("--out", required=True)
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    if any(c < 1 for c in levels) or args.requests < 1 or args.max_tokens < 1:
        raise SystemExit("--concurrency, --requests and --max-tokens must be positive")
    prompts = load_prompts(args)
    servers: List[Server] = []
    for item in args.server:
        name, sep, spec = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--server wants NAME=SPEC, got {item!r}")
        servers.append(Server(name, spec, args))

    report: Dict[str, Any] = {
        "what": "OpenAI-compatible server load: streamed chat requests at fixed concurrency",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "machine": _machine(),
        "command": shlex.join([sys.executable, *sys.argv]), "datasets": args.datasets,
        "num_prompts": len(prompts), "max_tokens": args.max_tokens, "temperature": args.temperature,
        "ignore_eos": args.ignore_eos, "requests_per_level": args.requests, "servers": {},
    }
    for s in servers:
        s.start(args.start_timeout)
        print(f"[{s.name}] {s.argv} on {s.base_url} (model {s.model})", flush=True)
        try:
            # ignore_eos is not OpenAI's (transformers serve answers it with 422): dflash servers only
            largs = args if s.kind == "dflash" else argparse.Namespace(**{**vars(args), "ignore_eos": False})
            asyncio.run(run_level(s.base_url, s.model, prompts, 1, argparse.Namespace(**{**vars(largs), "requests": 2})))
            res: Dict[str, Any] = {"spec": s.spec, "model": s.model, "startup_s": s.startup_s,
                                   "gpu_memory_mib": s.gpu_memory_mib(), "ignore_eos": largs.ignore_eos, "levels": []}
            report["servers"][s.name] = res
            for c in levels:
                lv = asyncio.run(run_level(s.base_url, s.model, prompts, c, largs))
                res["levels"].append(lv)
                _write(report, args.out)  # a run cut short keeps the levels done
                print(f"[{s.name}] c={c}: {lv['output_tokens_per_s']:.1f} tok/s, TTFT p50 "
                      f"{1e3 * (lv['ttft_s']['p50'] or 0):.1f} ms, ITL p50 {1e3 * (lv['itl_s']['p50'] or 0):.2f} ms",
                      flush=True)
        finally:
            s.stop()
        if args.engine_baseline and s.kind == "dflash" and 1 in levels:
            eng = engine_baseline(s, prompts, args)
            server_c1 = next(lv for lv in res["levels"] if lv["concurrency"] == 1)["output_tokens_per_s"]
            res["engine_c1"] = eng
            res["server_overhead_c1"] = 1.0 - server_c1 / eng["output_tokens_per_s"]
            print(f"[{s.name}] engine alone: {eng['output_tokens_per_s']:.1f} tok/s; server overhead at c=1 "
                  f"{100 * res['server_overhead_c1']:.1f} %", flush=True)
        _write(report, args.out)
    base = report["servers"].get(args.baseline)
    if base:
        ratios: Dict[str, Dict[str, float]] = {}
        for name, res in report["servers"].items():
            if name == args.baseline:
                continue
            ratios[name] = {f"c{a['concurrency']}": a["output_tokens_per_s"] / b["output_tokens_per_s"]
                            for a, b in zip(res["levels"], base["levels"]) if b["output_tokens_per_s"] > 0}
        report["ratios_over_" + args.baseline] = ratios
    _write(report, args.out)
    if args.plot:
        write_plot(report, args.plot)
    print(json.dumps(report.get("ratios_over_" + args.baseline, {}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`dflash serve`: its command-line options, and the run: open the Session they describe, build
the app, and serve it with uvicorn until Ctrl-C / SIGTERM (then the engine thread stops).
Defining the options needs nothing beyond the standard library, so `dflash --help` works
without the serve extra."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

DEFAULT_PORT = 8000
_GRACEFUL_SHUTDOWN_S = 5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF model directory (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument("--served-model-name", help="the model's name in the API (default: the directory's name; "
                                               "SmolLM2-135M-Instruct for the default model)")
    p.add_argument("--draft", help="DFlash drafter directory: speculative decoding; 'default': the drafter shipped "
                                   "for the default model; 'none': none (default: as `dflash generate`)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="draft tokens per step (default: the drafter's block_size - 1)")
    p.add_argument("--speculation", choices=["fixed", "adaptive"], default=None,
                   help="with a drafter: 'fixed' (default) drafts the same number of tokens every step; 'adaptive' "
                        "picks the draft length per step (0: a plain step) from measured step costs and acceptance")
    p.add_argument("--async-decode", action="store_true",
                   help="pipelined decoding: each decode step is launched before the host reads the one before "
                        "(same outputs)")
    p.add_argument("--draft-head", default=None, choices=["exact", "fp8"],
                   help="the LM-head copy the drafter drafts on: exact (default) or fp8 (an FP8 copy made at load: fewer bytes per draft step; verification stays exact)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--api-key", default=None,
                   help="clients must send 'Authorization: Bearer KEY' on /v1/ routes (default: $DFLASH_API_KEY; "
                        "none: no check)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body (default 4 MiB); larger ones get a 413")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests decoded together at most")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (tokens)")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="size of the KV cache in tokens")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA: fraction of GPU memory for weights, workspaces and the KV cache (default 0.9)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: all)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def session_from_args(args: argparse.Namespace) -> Any:
    """The Session that `dflash serve` with these options serves (also used by the load
    benchmark for the engine's own tokens/s)."""
    import dflash

    kwargs: Any = {}
    for name in ("max_num_seqs", "gpu_memory_utilization", "num_speculative_tokens", "speculation", "draft_head"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    if args.threads:
        kwargs["num_threads"] = args.threads
    if args.async_decode:
        kwargs["async_decode"] = True
    return dflash.Session(args.model, draft=args.draft, device=args.device, max_model_len=args.max_model_len,
                          kv_cache_tokens=args.kv_cache_tokens, **kwargs)


def run(args: argparse.Namespace) -> int:
    for name in ("port", "max_body_bytes"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "port" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'port' else 'positive'}, "
                             f"got {value}")
    import uvicorn

    from dflash.default_model import DEFAULT_MODEL_NAME
    from dflash.serve.app import DEFAULT_MAX_BODY_BYTES, build_app

    session = session_from_args(args)
    api_key = args.api_key if args.api_key is not None else os.environ.get("DFLASH_API_KEY") or None
    model_name = args.served_model_name or (DEFAULT_MODEL_NAME if args.model is None else None)
    app = build_app(session, model_name=model_name, api_key=api_key,
                    max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES, close_session_on_shutdown=True)
    st = session.stats()
    drafter = f", drafter {session.draft_dir}" if session.draft_dir else ""
    print(f"dflash serve: {app.state.server.model_name} on {st['device']}{drafter}; max_model_len "
          f"{st['max_model_len']}, KV cache {st['kv_cache_tokens']} tokens; http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    try:
        # On Ctrl-C / SIGTERM, streams still open after a few seconds are cut (and aborted).
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S)
    finally:
        session.close()
    return 0

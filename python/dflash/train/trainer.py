# python/dflash/train/trainer.py
#
# The training loop of `dflash train` (training.md 4 and 7): AdamW over fp32
# master weights, linear warmup then cosine decay, gradient clipping, bf16
# autocast on CUDA (fp32 on the CPU), JSONL metrics, periodic checkpoints, a
# wall-clock budget, and the final export in the published format.
#
# One training run may span several short invocations: <out>/checkpoint/state.pt
# holds the model, optimizer, scheduler, step, RNG states (anchor generator,
# torch) and the data cursor (epoch, position in that epoch's permutation), so
# `resume=True` continues exactly where the previous invocation stopped (on the
# CPU the weights are bit-identical to an uninterrupted run).  `max_minutes`
# stops before a step that would not finish in time (keeping `reserve_seconds`
# for saving), then checkpoints and exports.  The export (<out>/drafter/:
# config.json + model.safetensors) is what `dflash.Session(target, draft=...)`
# loads.
#
# Files under <out>: data.jsonl (default data path), metrics.jsonl,
# checkpoint/state.pt, drafter/, train_summary.json.
from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from dflash.train.data import Sample, load_dataset
from dflash.train.model import DFlashDrafter, DrafterConfig, frozen_target_tensors
from dflash.train.objective import collate, default_gamma, dflash_loss, eval_anchors, sample_anchors

__all__ = ["TrainConfig", "DataCursor", "lr_lambda", "resolve_config", "train", "evaluate", "RUNTIME_KEYS"]


@dataclass
class TrainConfig:
    """Everything that defines a training run (saved in the checkpoint)."""

    target: str = ""
    out: str = ""
    data: str | None = None  # default <out>/data.jsonl
    eval_data: str | None = None  # held-out rows (same format), teacher-forced metrics
    # drafter
    num_layers: int = 5
    block_size: int = 8
    target_layer_ids: list[int] | None = None  # default: build_target_layer_ids(T, num_layers)
    mask_token_id: int | None = None  # default: tokenizer mask token, else the first unused row
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    init_from: str | None = None  # a published drafter directory (warm start)
    init_std: float = 0.02
    # objective
    gamma: float | None = None  # default by block size: 16->7, 10->5, 8->4, else B/2
    num_anchors: int = 512
    max_seq_len: int = 1024
    ce_chunk_rows: int = 8192
    # optimisation
    steps: int = 1000
    epochs: float | None = None  # when set, steps = ceil(epochs * rows / batch_size)
    batch_size: int = 32
    lr: float = 6e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    target_dtype: str | None = None  # default float32 on the CPU, bfloat16 on CUDA
    # run control (may change between invocations of one run)
    device: str = "auto"
    max_minutes: float | None = None
    reserve_seconds: float = 20.0
    save_every: int = 200
    log_every: int = 10
    eval_every: int = 0  # 0: evaluate at the end only
    export_dtype: str = "float32"
    attention: str = "auto"  # "eager" | "sdpa"; auto: sdpa on CUDA, eager on the CPU


# Fields that may differ when resuming; every other field must match the checkpoint.
RUNTIME_KEYS = frozenset({"device", "max_minutes", "reserve_seconds", "save_every", "log_every", "eval_every",
                          "export_dtype", "eval_data", "ce_chunk_rows", "attention"})

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _ckpt_path(out: str | os.PathLike) -> Path:
    return Path(out) / "checkpoint" / "state.pt"


def resolve_config(options: Mapping[str, Any] | TrainConfig, resume: bool) -> tuple[TrainConfig, dict | None]:
    """Final config and the loaded checkpoint (None for a fresh run).

    `options`: a TrainConfig, or a dict of explicitly given fields.  Resuming, the saved
    config is authoritative; an explicitly given value that differs is an error unless
    the field is in RUNTIME_KEYS.
    """
    if isinstance(options, TrainConfig):  # fields left at their defaults count as "not given"
        defaults = TrainConfig()
        opts = {f.name: getattr(options, f.name) for f in fields(TrainConfig)
                if getattr(options, f.name) != getattr(defaults, f.name)}
        opts["out"] = options.out
    else:
        opts = {k: v for k, v in options.items() if v is not None}
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(opts) - known)
    if unknown:
        raise ValueError(f"unknown training options {unknown}")
    if not opts.get("out"):
        raise ValueError("an output directory (--out) is required")
    ckpt_file = _ckpt_path(opts["out"])
    if ckpt_file.exists() and not resume:
        raise ValueError(f"{ckpt_file} exists: pass --resume to continue that run, or use another --out")
    if resume and ckpt_file.exists():
        state = torch.load(ckpt_file, map_location="cpu", weights_only=False)
        saved = dict(state["config"])
        for k, v in opts.items():
            if k in RUNTIME_KEYS or k == "out":
                continue
            if v is not None and _norm(v) != _norm(saved.get(k)):
                raise ValueError(f"--{k.replace('_', '-')} {v!r} differs from the checkpoint's {saved.get(k)!r}; "
                                 "only run-control options may change on --resume")
        saved.update({k: v for k, v in opts.items() if k in RUNTIME_KEYS})
        saved["out"] = opts["out"]
        return TrainConfig(**saved), state
    if not opts.get("target"):
        raise ValueError("a target model directory (--target) is required")
    cfg = TrainConfig(**opts)
    if cfg.data is None:
        cfg.data = str(Path(cfg.out) / "data.jsonl")
    return cfg, None


def _norm(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def lr_lambda(step: int, total: int, warmup_ratio: float, min_ratio: float) -> float:
    """LR multiplier after `step` optimizer steps: linear warmup, then cosine to min_ratio."""
    warm = max(1, int(round(warmup_ratio * total)))
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class DataCursor:
    """Epoch-wise seeded permutations; state = (epoch, position)."""

    def __init__(self, n: int, seed: int, epoch: int = 0, pos: int = 0) -> None:
        if n < 1:
            raise ValueError("the training set is empty")
        self.n, self.seed, self.epoch, self.pos = n, int(seed), int(epoch), int(pos)
        self._perm = self._permutation(self.epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def next(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
            take = min(k - len(out), self.n - self.pos)
            out += [int(i) for i in self._perm[self.pos:self.pos + take]]
            self.pos += take
        return out

    @property
    def epoch_float(self) -> float:
        return self.epoch + self.pos / self.n

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos, "n": self.n}


def _examples(samples: list[Sample], max_seq_len: int) -> list[tuple[list[int], int]]:
    """(ids, prompt length), truncated to max_seq_len, keeping rows with >= 2 response tokens."""
    out = []
    for s in samples:
        ids = s.ids[:max_seq_len]
        if len(ids) - len(s.prompt_ids) >= 2:
            out.append((ids, len(s.prompt_ids)))
    return out


def _resolve_mask_token(target_dir: str, vocab_size: int) -> int:
    """Tokenizer's mask token, else the first embedding row beyond the tokenizer (training.md 2.3)."""
    from dflash.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(target_dir)
    mask = tok.special_tokens.get("mask_token")
    if mask and tok.token_to_id(mask) is not None:
        return int(tok.token_to_id(mask))  # type: ignore[arg-type]
    if tok.vocab_size < vocab_size:
        return int(tok.vocab_size)
    raise ValueError(f"the target's embedding table has no unused row (vocab {vocab_size}) and no mask token: "
                     "pass --mask-token-id (a special token that never occurs in the data)")


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {name!r}")
    return torch.device(name)


def load_target(cfg: TrainConfig, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    dtype_name = cfg.target_dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if dtype_name not in _DTYPES:
        raise ValueError(f"target_dtype must be one of {sorted(_DTYPES)}, got {dtype_name!r}")
    model = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=_DTYPES[dtype_name]).to(device).eval()
    model.requires_grad_(False)
    return model


def _autocast(device: torch.device) -> Any:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


class _Window:
    """Statistics accumulated between two metric rows."""

    def __init__(self, block_size: int) -> None:
        self.num = self.den = self.al = 0.0
        self.blocks = self.tokens = self.supervised = self.steps = self.skipped = 0
        self.correct = [0] * (block_size - 1)
        self.total = [0] * (block_size - 1)
        self.grad_norm = 0.0
        self.t0 = time.monotonic()

    def add(self, st: Mapping[str, Any], grad_norm: float | None) -> None:
        self.num += st["loss_num"]
        self.den += st["loss_den"]
        self.al += st["al_sum"]
        self.blocks += st["blocks"]
        self.tokens += st["tokens"]
        self.supervised += st["supervised"]
        self.correct = [a + b for a, b in zip(self.correct, st["correct"])]
        self.total = [a + b for a, b in zip(self.total, st["total"])]
        self.steps += 1
        if grad_norm is None:
            self.skipped += 1
        else:
            self.grad_norm += grad_norm

    def row(self) -> dict[str, Any]:
        dt = max(1e-9, time.monotonic() - self.t0)
        return {
            "loss": self.num / max(self.den, 1e-12),
            "acc": [round(c / t, 5) if t else None for c, t in zip(self.correct, self.total)],
            "sim_al": self.al / max(self.blocks, 1),
            "grad_norm": self.grad_norm / max(1, self.steps - self.skipped),
            "tokens_per_s": self.tokens / dt,
            "supervised_per_s": self.supervised / dt,
            "skipped": self.skipped,
        }


@torch.no_grad()
def evaluate(drafter: DFlashDrafter, target: Any, examples: list[tuple[list[int], int]], cfg: TrainConfig,
             device: torch.device, gamma: float) -> dict[str, Any]:
    """Teacher-forced loss / per-position accuracy / simulated AL with deterministic anchors."""
    was_training = drafter.training
    drafter.eval()
    w = _Window(cfg.block_size)
    for i in range(0, len(examples), cfg.batch_size):
        batch = collate(examples[i:i + cfg.batch_size])
        anchors, keep = eval_anchors(batch, cfg.num_anchors)
        with _autocast(device):
            _, st = dflash_loss(drafter, target, batch.to(device), anchors, keep, gamma=gamma,
                                chunk_rows=cfg.ce_chunk_rows)
        w.add(st, 0.0)
    drafter.train(was_training)
    row = w.row()
    return {k: row[k] for k in ("loss", "acc", "sim_al")} | {"rows": len(examples)}


def _save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".pt.tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def _rng_state(device: torch.device) -> dict[str, Any]:
    st: dict[str, Any] = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def train(
    options: Mapping[str, Any] | TrainConfig,
    *,
    resume: bool = False,
    log: Callable[[str], None] | None = print,
    stop_after_steps: int | None = None,
    start_time: float | None = None,
) -> dict[str, Any]:
    """Run (or continue) a training run; returns a summary dict.

    stop_after_steps: end this invocation after that many optimizer steps (checkpointed, as
    with a time stop).  start_time: time.monotonic() of the process start, so that
    max_minutes also covers loading.  The summary (also written to OUT/train_summary.json)
    has step, steps, stopped ("done" | "time" | "signal" | "stop_after_steps"), epoch, rows,
    eval (when eval_data is set), drafter (the export directory); the returned dict also
    holds "model", the trained DFlashDrafter.
    """
    t_start = time.monotonic() if start_time is None else start_time
    say = log or (lambda _m: None)
    cfg, state = resolve_config(options, resume)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    device = _device(cfg.device)
    torch.manual_seed(cfg.seed)

    # ---------------------------------------------------------------- data, target, drafter
    if not cfg.data or not Path(cfg.data).exists():
        raise ValueError(f"training data {cfg.data!r} not found (build it with --gsm8k/--prompts/--sharegpt)")
    examples = _examples(load_dataset(cfg.data), cfg.max_seq_len)
    if not examples:
        raise ValueError(f"{cfg.data}: no usable rows (need >= 2 response tokens within max_seq_len)")
    eval_examples = _examples(load_dataset(cfg.eval_data), cfg.max_seq_len) if cfg.eval_data else []
    if state is not None and int(state["cursor"]["n"]) != len(examples):
        raise ValueError(f"{cfg.data} now has {len(examples)} usable rows, the checkpoint saw "
                         f"{state['cursor']['n']}: resume with the same data")
    if cfg.epochs is not None and state is None:
        cfg.steps = max(1, math.ceil(cfg.epochs * len(examples) / cfg.batch_size))
    target = load_target(cfg, device)
    tcfg = target.config.to_dict()
    if state is not None:
        dcfg = DrafterConfig.from_dict(state["drafter_config"])
    else:
        if cfg.mask_token_id is None:
            cfg.mask_token_id = _resolve_mask_token(cfg.target, int(tcfg["vocab_size"]))
        if cfg.init_from:
            dcfg = DrafterConfig.from_drafter_json(
                json.loads((Path(cfg.init_from) / "config.json").read_text(encoding="utf-8")), tcfg)
            cfg.num_layers, cfg.block_size = dcfg.num_layers, dcfg.block_size
            cfg.target_layer_ids, cfg.mask_token_id = dcfg.target_layer_ids, dcfg.mask_token_id
        else:
            dcfg = DrafterConfig.from_target(
                tcfg, num_layers=cfg.num_layers, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
                target_layer_ids=cfg.target_layer_ids, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size)
            cfg.target_layer_ids = dcfg.target_layer_ids
    if cfg.gamma is None:
        cfg.gamma = default_gamma(dcfg.block_size)
    hits = sum(ids.count(dcfg.mask_token_id) for ids, _ in examples)
    if hits:
        say(f"train: warning: the mask token {dcfg.mask_token_id} occurs {hits} times in the data; "
            "pick a --mask-token-id that never occurs")
    if cfg.init_from and state is None:
        drafter = DFlashDrafter.from_published(cfg.init_from, target)
    else:
        drafter = DFlashDrafter(dcfg, *frozen_target_tensors(target))
        drafter.reset_parameters(cfg.seed, std=cfg.init_std)
    drafter.set_attention(cfg.attention if cfg.attention != "auto" else ("sdpa" if device.type == "cuda" else "eager"))
    drafter.to(device).train()

    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            weight_decay=cfg.weight_decay)
    total = int(cfg.steps)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, total, cfg.warmup_ratio, cfg.min_lr_ratio))
    anchor_gen = torch.Generator().manual_seed(cfg.seed + 1)
    cursor = DataCursor(len(examples), cfg.seed)
    step = 0
    if state is not None:
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step = int(state["step"])
        anchor_gen.set_state(state["rng"]["anchors"])
        torch.set_rng_state(state["rng"]["torch"])
        if device.type == "cuda" and "cuda" in state["rng"]:
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        c = state["cursor"]
        cursor = DataCursor(len(examples), cfg.seed, c["epoch"], c["pos"])
        say(f"train: resuming {out} at step {step}/{total}")
    else:
        (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n", encoding="utf-8")
    n_params = sum(p.numel() for p in drafter.parameters())
    say(f"train: {len(examples)} rows, drafter {dcfg.num_layers} layers / {n_params / 1e6:.2f}M params, "
        f"block {dcfg.block_size}, taps {dcfg.target_layer_ids}, mask {dcfg.mask_token_id}, gamma {cfg.gamma}, "
        f"{total} steps x {cfg.batch_size} seqs on {device} ({drafter.attn_impl} attention)")

    def checkpoint(reason: str) -> None:
        _save_checkpoint(_ckpt_path(out), {
            "version": 1, "step": step, "config": asdict(cfg), "drafter_config": dcfg.to_dict(),
            "model": drafter.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "cursor": cursor.state(), "rng": {"anchors": anchor_gen.get_state(), **_rng_state(device)},
            "reason": reason,
        })

    # ---------------------------------------------------------------- stop conditions
    stop = {"signal": False}
    old_handler = None
    if threading.current_thread() is threading.main_thread():
        def on_term(_sig: int, _frame: Any) -> None:
            stop["signal"] = True
        old_handler = signal.signal(signal.SIGTERM, on_term)
    deadline = None if cfg.max_minutes is None else t_start + 60.0 * cfg.max_minutes - cfg.reserve_seconds
    metrics = open(out / "metrics.jsonl", "a", encoding="utf-8")
    window = _Window(dcfg.block_size)
    step_ema: float | None = None
    done_here = 0
    reason = "done"
    try:
        while step < total:
            if stop["signal"]:
                reason = "signal"
                break
            if stop_after_steps is not None and done_here >= stop_after_steps:
                reason = "stop_after_steps"
                break
            if deadline is not None and time.monotonic() + 1.5 * (step_ema or 0.0) > deadline:
                reason = "time"
                break
            t_step = time.monotonic()
            batch = collate([examples[i] for i in cursor.next(cfg.batch_size)])
            anchors, keep = sample_anchors(batch, cfg.num_anchors, anchor_gen)
            with _autocast(device):
                loss, st = dflash_loss(drafter, target, batch.to(device), anchors, keep, gamma=cfg.gamma,
                                       chunk_rows=cfg.ce_chunk_rows)
            opt.zero_grad(set_to_none=True)
            grad_norm: float | None = None
            if torch.isfinite(loss):
                loss.backward()
                grad_norm = float(torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip))
                if math.isfinite(grad_norm):
                    opt.step()
                else:
                    grad_norm = None
            sched.step()
            step += 1
            done_here += 1
            window.add(st, grad_norm)
            dt = time.monotonic() - t_step
            step_ema = dt if step_ema is None else 0.9 * step_ema + 0.1 * dt
            if step % max(1, cfg.log_every) == 0 or step == total:
                row = {"step": step, "epoch": round(cursor.epoch_float, 4), "lr": opt.param_groups[0]["lr"],
                       **window.row(), "elapsed_s": round(time.monotonic() - t_start, 2)}
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                say(f"step {step}/{total} loss {row['loss']:.4f} acc1 {row['acc'][0]} sim_al {row['sim_al']:.2f} "
                    f"lr {row['lr']:.2e} {row['tokens_per_s']:.0f} tok/s")
                window = _Window(dcfg.block_size)
            if cfg.save_every and step % cfg.save_every == 0 and step < total:
                checkpoint("periodic")
            if eval_examples and cfg.eval_every and step % cfg.eval_every == 0 and step < total:
                ev = evaluate(drafter, target, eval_examples, cfg, device, cfg.gamma)
                metrics.write(json.dumps({"step": step, "eval": ev}) + "\n")
                metrics.flush()
        checkpoint(reason)
        summary: dict[str, Any] = {"step": step, "steps": total, "stopped": reason,
                                   "epoch": cursor.epoch_float, "rows": len(examples)}
        if eval_examples and (step >= total or deadline is None or time.monotonic() < deadline):
            summary["eval"] = evaluate(drafter, target, eval_examples, cfg, device, cfg.gamma)
            metrics.write(json.dumps({"step": step, "eval": summary["eval"]}) + "\n")
        drafter_dir = drafter.export(out / "drafter", tcfg, dtype=cfg.export_dtype)
        summary["drafter"] = str(drafter_dir)
        summary["elapsed_s"] = round(time.monotonic() - t_start, 2)
        (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        say(f"train: stopped ({reason}) at step {step}/{total}; checkpoint {_ckpt_path(out)}; "
            f"drafter {drafter_dir}")
        summary["model"] = drafter
        return summary
    finally:
        metrics.close()
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)

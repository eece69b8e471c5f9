# python/dflash/train/trainer.py
#
# The training loop of `dflash train` (training.md 4 and 7): AdamW over fp32
# master weights, linear warmup then cosine decay, gradient clipping, bf16
# autocast on CUDA (fp32 on the CPU unless amp="bf16"), JSONL metrics, periodic
# checkpoints, a wall-clock budget, and the final export in the published format.
#
# One training run may span several short invocations: <out>/checkpoint/ holds the
# model, optimizer, scheduler, step, RNG states (anchor generator, torch) and the
# data cursor, so `resume=True` continues where the previous invocation stopped.
# state_format "torch" (state.pt) resumes bit-exactly (on the CPU the weights equal
# an uninterrupted run's); "bf16" / "int8" write a compact state (state.json +
# state.partNN files of at most state_part_mib MiB, see state.py) that travels
# through transfer limits and resumes approximately (weights rounded to bf16 once,
# 8-bit Adam moments).  `max_minutes` stops before a step that would not finish in
# time (keeping `reserve_seconds` for saving), then checkpoints and exports.  The
# export (<out>/drafter/: config.json + model.safetensors) is what
# `dflash.Session(target, draft=...)` loads.
#
# Data order: the cursor walks seeded permutations of the set's INDEX SPACE (the
# prompt indices 0..num_prompts-1, stable when a set is regenerated from the same
# prompts), skipping indices without a usable row, so a regenerated set whose rows
# differ slightly (bf16 noise, a row dropped) resumes at the same place.  With
# group_batches = k > 1, k*batch_size consecutive indices are sorted by length and
# cut into k batches that run in a seeded random order (less padding).  `holdout`
# keeps the last indices out of training for teacher-forced evaluation.
#
# plan_minutes: the total number of steps is set after a few calibration steps of
# the first invocation from the measured step time (plan_minutes of pure training
# spread over all invocations), so that the cosine schedule ends when the planned
# time is spent.
#
# Files under <out>: data.jsonl (default data path), metrics.jsonl, checkpoint/,
# drafter/, train_summary.json, train_config.json.
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

from dflash.train import state as ckpt
from dflash.train.data import Sample, load_dataset, read_meta
from dflash.train.dflash2_model import build_drafter, export_dflash2, load_published_drafter
from dflash.train.dflash2_objective import dflash2_loss
from dflash.train.model import DFlashDrafter, DrafterConfig
from dflash.train.objective import collate, default_gamma, dflash_loss, eval_anchors, sample_anchors

__all__ = ["TrainConfig", "DataCursor", "lr_lambda", "resolve_config", "train", "evaluate", "probe_attention",
           "export_from_checkpoint", "RUNTIME_KEYS"]


@dataclass
class TrainConfig:
    """Everything that defines a training run (saved in the checkpoint)."""

    target: str = ""
    out: str = ""
    data: str | None = None  # default <out>/data.jsonl
    eval_data: str | None = None  # held-out rows (same format), teacher-forced metrics
    holdout: int = 0  # the last `holdout` indices of the data set: not trained on, evaluated (without eval_data)
    # drafter
    arch: str = "dflash"  # "dflash" | "dflash2" (convs + candidate selector, training.md 3.4)
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
    # DFlash2 (arch "dflash2"; the published defaults)
    selector_top_k: int = 16  # K candidates per slot
    selector_rank: int = 256  # r
    conv_group_size: int = 16  # channels per dynamic correction; must divide the hidden size
    conv_kernel_size: int = 2  # conv taps
    selector_alpha: float = 1.0  # weight of the selector loss
    selector_detach_unary: bool = False  # the selector loss does not train the unary head (dflash2_loss)
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
    warmup_steps: int | None = None  # overrides warmup_ratio
    plan_minutes: float | None = None  # set `steps` from the step time measured at the start (see header)
    group_batches: int = 1  # sort k batches' worth of rows by length, then shuffle the batches
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
    attention: str = "auto"  # "eager" | "sdpa"; auto: the faster of the two on CUDA (timed), eager on the CPU
    sdpa_group_blocks: int = 32  # blocks per fused attention call of "sdpa" (0: all)
    amp: str = "auto"  # "bf16" | "off"; auto: bf16 autocast on CUDA, off on the CPU
    state_format: str = "torch"  # "torch" (exact) | "bf16" | "int8" (compact parts, see state.py)
    state_part_mib: float = 15.0  # largest compact-state part file


# Fields that may differ when resuming; every other field must match the checkpoint.  The
# target and data paths may move between machines (the data's index space is checked
# against the cursor; a different target fails at loading unless it has the same shapes).
# init_from only seeds a fresh run, so a resumed run ignores where it points now.
RUNTIME_KEYS = frozenset({"target", "data", "device", "max_minutes", "reserve_seconds", "save_every", "log_every", "eval_every",
                          "export_dtype", "eval_data", "ce_chunk_rows", "attention", "sdpa_group_blocks", "amp",
                          "state_format", "state_part_mib", "plan_minutes", "init_from"})

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _ckpt_dir(out: str | os.PathLike) -> Path:
    return Path(out) / "checkpoint"


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
    found = ckpt.find_checkpoint(_ckpt_dir(opts["out"]))
    if found is not None and not resume:
        raise ValueError(f"a checkpoint exists in {found[1]}: pass --resume to continue that run, "
                         "or use another --out")
    if resume and found is not None:
        state = ckpt.load_checkpoint(_ckpt_dir(opts["out"]))
        saved = dict(state["config"])
        for k, v in opts.items():
            if k in RUNTIME_KEYS or k == "out":
                continue
            if k == "steps" and saved.get("plan_minutes") is not None:
                continue  # set by the time plan
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


def lr_lambda(step: int, total: int, warmup_ratio: float, min_ratio: float, warmup_steps: int | None = None
              ) -> float:
    """LR multiplier after `step` optimizer steps: linear warmup, then cosine to min_ratio."""
    warm = max(1, int(warmup_steps) if warmup_steps is not None else int(round(warmup_ratio * total)))
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class DataCursor:
    """Which rows each batch takes (see the header): seeded permutations of the index space
    [0, n), unusable indices skipped, optional length grouping.  State: epoch, pos (in the
    epoch's permutation) and the batches still pending from the current group."""

    def __init__(self, n: int, lengths: Mapping[int, int], batch_size: int, seed: int, group: int = 1,
                 epoch: int = 0, pos: int = 0, pending: list[list[int]] | None = None) -> None:
        if not lengths:
            raise ValueError("the training set is empty")
        if n < 1 or max(lengths) >= n:
            raise ValueError(f"row indices must lie in [0, {n})")
        self.n, self.lengths, self.bs = int(n), dict(lengths), max(1, int(batch_size))
        self.seed, self.group = int(seed), max(1, int(group))
        self.epoch, self.pos = int(epoch), int(pos)
        self.pending = [list(b) for b in (pending or [])]
        self._perm = self._permutation(self.epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def _take(self, k: int) -> list[int]:
        out: list[int] = []
        scanned = 0
        while len(out) < k:
            if self.pos >= self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
            i = int(self._perm[self.pos])
            self.pos += 1
            scanned += 1
            if i in self.lengths:
                out.append(i)
            elif scanned > 2 * self.n and not out:  # two whole epochs without a usable row
                raise ValueError("no usable row in the index space")
        return out

    def next_batch(self) -> list[int]:
        while self.pending:
            batch = [i for i in self.pending.pop(0) if i in self.lengths]
            if batch:
                return batch
        if self.group == 1:
            return self._take(self.bs)
        start = (self.epoch, self.pos)
        rows = self._take(self.bs * self.group)
        rows.sort(key=lambda i: (self.lengths[i], i))
        batches = [rows[j:j + self.bs] for j in range(0, len(rows), self.bs)]
        order = np.random.default_rng([self.seed, start[0], start[1], 7]).permutation(len(batches))
        self.pending = [batches[int(j)] for j in order]
        return self.pending.pop(0)

    @property
    def epoch_float(self) -> float:
        return self.epoch + self.pos / self.n

    def state(self) -> dict[str, Any]:
        return {"version": 2, "epoch": self.epoch, "pos": self.pos, "n": self.n, "pending": self.pending,
                "usable": len(self.lengths)}


def _examples(samples: list[Sample], max_seq_len: int) -> dict[int, tuple[list[int], int]]:
    """index -> (ids, prompt length), truncated to max_seq_len, for rows with >= 2 response
    tokens left (rows without an index are numbered in file order)."""
    out: dict[int, tuple[list[int], int]] = {}
    for n, s in enumerate(samples):
        ids = s.ids[:max_seq_len]
        if len(ids) - len(s.prompt_ids) >= 2:
            out[s.index if s.index >= 0 else n] = (ids, len(s.prompt_ids))
    return out


def _index_space(path: str, samples: list[Sample]) -> int:
    meta = read_meta(path) or {}
    top = max((s.index if s.index >= 0 else n for n, s in enumerate(samples)), default=-1) + 1
    return max(int(meta.get("num_prompts") or 0), top)


def _resolve_mask_token(target_dir: str, vocab_size: int) -> int:
    """Tokenizer's mask token, else the first embedding row beyond the tokenizer (training.md 2.3)."""
    from dflash.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(target_dir)
    mask = tok.special_tokens.get("mask_token")
    if mask and tok.token_to_id(mask) is not None:
        return int(tok.token_to_id(mask))  # type: ignore[arg-type]
    if tok.vocab_size < vocab_size:
        return int(tok.vocab_size)
    # No spare row (SmolLM2: 49152 = 49152): the highest-id special token that is none of the
    # named ones (bos/eos/pad/unk...), e.g. SmolLM2's <empty_output> (16); its frozen
    # embedding row serves as the mask embedding (training.md 7).  The trainer warns when it
    # occurs in the data.
    named = {v for v in tok.special_tokens.values() if isinstance(v, str)}
    named_ids = {tok.token_to_id(v) for v in named} | set(getattr(tok, "eos_token_ids", ()) or ())
    try:
        added = tok.backend.get_added_tokens_decoder()
    except AttributeError:
        added = {}
    spare = [int(i) for i, a in added.items()
             if getattr(a, "special", False) and int(i) not in named_ids and 0 <= int(i) < vocab_size]
    if spare:
        return max(spare)
    raise ValueError(f"the target's embedding table has no unused row (vocab {vocab_size}) and no spare special "
                     "token: pass --mask-token-id (a special token that never occurs in the data)")


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


def _amp_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    if cfg.amp not in ("auto", "bf16", "off"):
        raise ValueError(f"amp must be auto, bf16 or off, got {cfg.amp!r}")
    if cfg.amp == "bf16" or (cfg.amp == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def _autocast(device: torch.device, dtype: torch.dtype | None = torch.bfloat16) -> Any:
    """bf16 autocast on `device` (dtype None: disabled)."""
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


_ARCHS = ("dflash", "dflash2")


def _loss(drafter: DFlashDrafter, target: Any, batch: Any, anchors: torch.Tensor, keep: torch.Tensor,
          cfg: TrainConfig, gamma: float | None, target_mass: bool = False) -> tuple[torch.Tensor, dict[str, Any]]:
    """The objective of the drafter's architecture: DFlash, or DFlash + alpha * selector
    (target_mass: also the target's mass on the candidates, evaluation only)."""
    if drafter.config.arch == "dflash2":
        return dflash2_loss(drafter, target, batch, anchors, keep, gamma=gamma, alpha=cfg.selector_alpha,
                            detach_unary=cfg.selector_detach_unary, chunk_rows=cfg.ce_chunk_rows, target_mass=target_mass)
    return dflash_loss(drafter, target, batch, anchors, keep, gamma=gamma, chunk_rows=cfg.ce_chunk_rows)


_DFLASH2_SUMS = ("unary_num", "selector_num", "recall_hits", "selector_correct", "selector_rows")


class _Window:
    """Statistics accumulated between two metric rows."""

    def __init__(self, block_size: int) -> None:
        self.v2: dict[str, float] = {}
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
        if "selector_num" in st:
            for k in _DFLASH2_SUMS + ("target_mass_num",):
                if k in st:
                    self.v2[k] = self.v2.get(k, 0.0) + st[k]
        self.steps += 1
        if grad_norm is None:
            self.skipped += 1
        else:
            self.grad_norm += grad_norm

    def row(self) -> dict[str, Any]:
        dt = max(1e-9, time.monotonic() - self.t0)
        v2 = {}
        if self.v2:  # DFlash2: "loss" is the total; "acc" is the UNARY head's accuracy (TorchSpec #177)
            n = max(1.0, self.v2["selector_rows"])
            v2 = {"unary_loss": self.v2["unary_num"] / max(self.den, 1e-12),
                  "selector_loss": self.v2["selector_num"] / max(self.den, 1e-12),
                  "unary_recall_at_k": self.v2["recall_hits"] / n, "selector_acc": self.v2["selector_correct"] / n,
                  "acc_head": "unary"}
            if "target_mass_num" in self.v2:
                v2["target_mass_at_k"] = self.v2["target_mass_num"] / n
        return v2 | {
            "loss": self.num / max(self.den, 1e-12),
            "acc": [round(c / t, 5) if t else None for c, t in zip(self.correct, self.total)],
            "sim_al": self.al / max(self.blocks, 1),
            "grad_norm": self.grad_norm / max(1, self.steps - self.skipped),
            "tokens_per_s": self.tokens / dt,
            "supervised_per_s": self.supervised / dt,
            "step_s": dt / max(1, self.steps),
            "skipped": self.skipped,
        }


@torch.no_grad()
def evaluate(drafter: DFlashDrafter, target: Any, examples: list[tuple[list[int], int]], cfg: TrainConfig,
             device: torch.device, gamma: float) -> dict[str, Any]:
    """Teacher-forced loss / per-position accuracy / simulated AL with deterministic anchors."""
    was_training = drafter.training
    drafter.eval()
    w = _Window(cfg.block_size)
    amp = _amp_dtype(cfg, device)
    for i in range(0, len(examples), cfg.batch_size):
        batch = collate(examples[i:i + cfg.batch_size])
        anchors, keep = eval_anchors(batch, cfg.num_anchors)
        with _autocast(device, amp):
            _, st = _loss(drafter, target, batch.to(device), anchors, keep, cfg, gamma, target_mass=True)
        w.add(st, 0.0)
    drafter.train(was_training)
    row = w.row()
    keys = ("loss", "acc", "sim_al", "unary_loss", "selector_loss", "unary_recall_at_k", "target_mass_at_k",
            "selector_acc", "acc_head")
    return {k: row[k] for k in keys if k in row} | {"rows": len(examples)}


def _rng_state(device: torch.device) -> dict[str, Any]:
    st: dict[str, Any] = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_attention(drafter: DFlashDrafter, target: Any, examples: list[tuple[list[int], int]], cfg: TrainConfig,
                    device: torch.device, gamma: float, impls: tuple[str, ...] = ("eager", "sdpa"),
                    repeats: int = 2, log: Callable[[str], None] | None = None) -> dict[str, float]:
    """Seconds per forward+backward of each attention implementation on one batch of the
    longest rows (inf when it fails, e.g. out of memory); parameters and the training RNG
    streams are left untouched (anchors come from a generator of their own)."""
    longest = sorted(examples, key=lambda e: -len(e[0]))[: cfg.batch_size]
    batch = collate(longest)
    anchors, keep = sample_anchors(batch, cfg.num_anchors, torch.Generator().manual_seed(12345))
    amp = _amp_dtype(cfg, device)
    times: dict[str, float] = {}
    for impl in impls:
        drafter.set_attention(impl, cfg.sdpa_group_blocks)
        try:
            for r in range(repeats + 1):
                if r == 1:
                    _sync(device)
                    t0 = time.monotonic()
                with _autocast(device, amp):
                    loss, _ = _loss(drafter, target, batch.to(device), anchors, keep, cfg, gamma)
                loss.backward()
                drafter.zero_grad(set_to_none=True)
            _sync(device)
            times[impl] = (time.monotonic() - t0) / repeats
        except (torch.cuda.OutOfMemoryError, RuntimeError) as e:  # noqa: PERF203
            drafter.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            times[impl] = float("inf")
            if log is not None:
                log(f"train: attention {impl} failed in the probe: {str(e).splitlines()[0][:200]}")
        if log is not None:
            log(f"train: attention probe {impl}: {times[impl]:.4f} s per forward+backward "
                f"({len(longest)} longest rows, {int(keep.sum())} blocks)")
    return times


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
    eval (when eval_data or holdout is set), drafter (the export directory), checkpoint (its
    files); the returned dict also holds "model", the trained DFlashDrafter.
    """
    t_start = time.monotonic() if start_time is None else start_time
    say = log or (lambda _m: None)
    cfg, state = resolve_config(options, resume)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    device = _device(cfg.device)
    if cfg.state_format not in ckpt.STATE_FORMATS:
        raise ValueError(f"state_format must be one of {ckpt.STATE_FORMATS}, got {cfg.state_format!r}")
    if cfg.arch not in _ARCHS:
        raise ValueError(f"unknown drafter architecture --arch {cfg.arch!r}: use one of {', '.join(_ARCHS)}")
    amp = _amp_dtype(cfg, device)
    torch.manual_seed(cfg.seed)

    # ---------------------------------------------------------------- data, target, drafter
    if not cfg.data or not (Path(cfg.data).exists() or Path(cfg.data + ".part00").exists()):
        raise ValueError(f"training data {cfg.data!r} not found (build it with --gsm8k/--prompts/--sharegpt)")
    samples = load_dataset(cfg.data)
    n_space = _index_space(cfg.data, samples)
    rows = _examples(samples, cfg.max_seq_len)
    held = set(range(max(0, n_space - int(cfg.holdout)), n_space)) if cfg.holdout else set()
    examples = {i: e for i, e in rows.items() if i not in held}
    if not examples:
        raise ValueError(f"{cfg.data}: no usable rows (need >= 2 response tokens within max_seq_len)")
    if cfg.eval_data:
        eval_examples = list(_examples(load_dataset(cfg.eval_data), cfg.max_seq_len).values())
    else:
        eval_examples = [rows[i] for i in sorted(held) if i in rows]
    if state is not None:
        c = state["cursor"]
        if int(c.get("version", 1)) < 2 or int(c["n"]) != n_space:
            raise ValueError(f"{cfg.data} has an index space of {n_space} rows, the checkpoint's data had "
                             f"{c['n']}: resume with the same data (the same prompts)")
        if int(c.get("usable", len(examples))) != len(examples):
            say(f"train: warning: {len(examples)} usable rows now, {c['usable']} when the checkpoint was written "
                "(regenerated data?); continuing at the same place of the index space")
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
            if dcfg.arch == "dflash2" and cfg.arch != "dflash2":
                raise ValueError(f"--init-from {cfg.init_from} is a DFlash2 drafter: train it with --arch dflash2")
            if dcfg.arch == "dflash2":  # a DFlash2 warm start keeps its own DFlash2 geometry
                cfg.selector_top_k, cfg.selector_rank = dcfg.selector_top_k, dcfg.selector_rank
                cfg.conv_group_size, cfg.conv_kernel_size = dcfg.conv_group_size, dcfg.conv_kernel_size
            cfg.num_layers, cfg.block_size = dcfg.num_layers, dcfg.block_size
            cfg.target_layer_ids, cfg.mask_token_id = dcfg.target_layer_ids, dcfg.mask_token_id
        else:
            dcfg = DrafterConfig.from_target(
                tcfg, num_layers=cfg.num_layers, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
                target_layer_ids=cfg.target_layer_ids, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size)
            cfg.target_layer_ids = dcfg.target_layer_ids
        dcfg.arch = cfg.arch
        dcfg.selector_top_k, dcfg.selector_rank = int(cfg.selector_top_k), int(cfg.selector_rank)
        dcfg.conv_group_size, dcfg.conv_kernel_size = int(cfg.conv_group_size), int(cfg.conv_kernel_size)
        dcfg.validate()
    if cfg.gamma is None:
        cfg.gamma = default_gamma(dcfg.block_size)
    hits = sum(ids.count(dcfg.mask_token_id) for ids, _ in examples.values())
    if hits:
        say(f"train: warning: the mask token {dcfg.mask_token_id} occurs {hits} times in the data; "
            "pick a --mask-token-id that never occurs")
    if cfg.init_from and state is None:
        drafter = load_published_drafter(
            cfg.init_from, target, dcfg.arch, seed=cfg.seed, std=cfg.init_std,
            conv_kernel_size=dcfg.conv_kernel_size, conv_group_size=dcfg.conv_group_size,
            selector_rank=dcfg.selector_rank, selector_top_k=dcfg.selector_top_k)
    else:
        drafter = build_drafter(dcfg, target)
        drafter.reset_parameters(cfg.seed, std=cfg.init_std)
    drafter.to(device).train()
    names = [n for n, _ in drafter.named_parameters()]

    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            weight_decay=cfg.weight_decay)
    plan = {"total": int(cfg.steps)}
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, plan["total"], cfg.warmup_ratio, cfg.min_lr_ratio, cfg.warmup_steps))
    anchor_gen = torch.Generator().manual_seed(cfg.seed + 1)
    lengths = {i: len(e[0]) for i, e in examples.items()}
    cursor = DataCursor(n_space, lengths, cfg.batch_size, cfg.seed, cfg.group_batches)
    step = 0
    calibrated = cfg.plan_minutes is None
    step_seconds = None if state is None else state.get("step_seconds")
    if state is not None:
        drafter.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step = int(state["step"])
        calibrated = calibrated or bool(state.get("calibrated", True))
        anchor_gen.set_state(state["rng"]["anchors"])
        torch.set_rng_state(state["rng"]["torch"])
        if device.type == "cuda" and "cuda" in state["rng"]:
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        c = state["cursor"]
        cursor = DataCursor(n_space, lengths, cfg.batch_size, cfg.seed, cfg.group_batches, c["epoch"], c["pos"],
                            c.get("pending"))
        enc = state.get("state_encoding", "torch")
        step_s = state.get("step_seconds")
        if cfg.plan_minutes is not None and step_s and state["config"].get("plan_minutes") != cfg.plan_minutes:
            cfg.steps = max(step + 1, int(60.0 * float(cfg.plan_minutes) / float(step_s)))
            say(f"train: new plan of {cfg.plan_minutes} minutes at {step_s:.4f} s/step: {cfg.steps} steps in all")
        say(f"train: resuming {out} at step {step}/{cfg.steps} (state {enc})")
    else:
        (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n", encoding="utf-8")
    total = int(cfg.steps)
    plan["total"] = total
    n_params = sum(p.numel() for p in drafter.parameters())
    impl = cfg.attention
    if impl == "auto":
        impl = "eager"
        if device.type == "cuda":
            times = probe_attention(drafter, target, list(examples.values()), cfg, device, cfg.gamma, log=say)
            impl = min(times, key=lambda k: times[k])
    drafter.set_attention(impl, cfg.sdpa_group_blocks)
    shapes = {n: list(p.shape) for n, p in drafter.named_parameters()}
    v2 = (f" (dflash2: K {dcfg.selector_top_k}, rank {dcfg.selector_rank}, conv taps {dcfg.conv_kernel_size} "
          f"group {dcfg.conv_group_size}, alpha {cfg.selector_alpha}"
          f"{', unary detached' if cfg.selector_detach_unary else ''})" if dcfg.arch == "dflash2" else "")
    say(f"train: {len(examples)} rows (index space {n_space}, {len(eval_examples)} held out), {dcfg.arch}{v2} "
        f"drafter {dcfg.num_layers} layers / {n_params / 1e6:.2f}M params, block {dcfg.block_size}, taps "
        f"{dcfg.target_layer_ids}, mask {dcfg.mask_token_id}, gamma {cfg.gamma}, {total} steps x {cfg.batch_size} "
        f"seqs on {device} ({drafter.attn_impl} attention, amp {amp}); state {cfg.state_format} "
        f"~{ckpt.state_bytes_estimate(shapes, cfg.state_format) / 2**20:.1f} MiB")

    target_json = json.loads(json.dumps(tcfg, default=str))

    def checkpoint(reason: str) -> None:
        ckpt.save_checkpoint(_ckpt_dir(out), {
            "version": 2, "step": step, "config": asdict(cfg), "drafter_config": dcfg.to_dict(),
            "model": drafter.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "cursor": cursor.state(), "rng": {"anchors": anchor_gen.get_state(), **_rng_state(device)},
            "reason": reason, "calibrated": calibrated, "step_seconds": step_seconds, "target_config": target_json,
        }, fmt=cfg.state_format, param_names=names, part_bytes=int(cfg.state_part_mib * 2**20))

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
    calib_t: list[float] = []
    done_here = 0
    reason = "done"
    t_loop = time.monotonic()
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
            batch = collate([examples[i] for i in cursor.next_batch()])
            anchors, keep = sample_anchors(batch, cfg.num_anchors, anchor_gen)
            with _autocast(device, amp):
                loss, st = _loss(drafter, target, batch.to(device), anchors, keep, cfg, cfg.gamma)
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
            if not calibrated:
                calib_t.append(dt)
                if len(calib_t) >= 25:  # the first 5 steps (allocator, kernels) are not typical
                    per_step = step_seconds = float(np.median(calib_t[5:]))
                    total = max(step + 1, int(60.0 * float(cfg.plan_minutes) / per_step))  # type: ignore[arg-type]
                    cfg.steps = plan["total"] = total
                    calibrated = True
                    say(f"train: {per_step:.4f} s per step -> {total} steps for the {cfg.plan_minutes} planned "
                        f"minutes (cosine schedule fixed)")
                    (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n",
                                                           encoding="utf-8")
            if step % max(1, cfg.log_every) == 0 or step == total:
                row = {"step": step, "epoch": round(cursor.epoch_float, 4), "lr": opt.param_groups[0]["lr"],
                       **window.row(), "elapsed_s": round(time.monotonic() - t_start, 2)}
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                sel = (f" selector_loss {row['selector_loss']:.4f} recall@K {row['unary_recall_at_k']:.3f} "
                       f"selector_acc {row['selector_acc']:.3f}" if "selector_loss" in row else "")
                say(f"step {step}/{total} loss {row['loss']:.4f}{sel} acc1 {row['acc'][0]} sim_al {row['sim_al']:.2f} "
                    f"lr {row['lr']:.2e} {row['step_s']:.3f} s/step {row['tokens_per_s']:.0f} tok/s")
                window = _Window(dcfg.block_size)
            if cfg.save_every and step % cfg.save_every == 0 and step < total:
                checkpoint("periodic")
            if eval_examples and cfg.eval_every and step % cfg.eval_every == 0 and step < total:
                ev = evaluate(drafter, target, eval_examples, cfg, device, cfg.gamma)
                metrics.write(json.dumps({"step": step, "eval": ev}) + "\n")
                metrics.flush()
        train_s = time.monotonic() - t_loop
        checkpoint(reason)
        summary: dict[str, Any] = {"step": step, "steps": total, "stopped": reason, "steps_here": done_here,
                                   "train_seconds_here": round(train_s, 2), "epoch": cursor.epoch_float,
                                   "rows": len(examples), "attention": drafter.attn_impl}
        if eval_examples and (step >= total or deadline is None or time.monotonic() < deadline + cfg.reserve_seconds / 2):
            summary["eval"] = evaluate(drafter, target, eval_examples, cfg, device, cfg.gamma)
            metrics.write(json.dumps({"step": step, "eval": summary["eval"]}) + "\n")
        drafter_dir = drafter.export(out / "drafter", tcfg, dtype=cfg.export_dtype)
        summary["drafter"] = str(drafter_dir)
        summary["checkpoint"] = [str(p) for p in ckpt.checkpoint_files(_ckpt_dir(out))]
        summary["elapsed_s"] = round(time.monotonic() - t_start, 2)
        (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        say(f"train: stopped ({reason}) at step {step}/{total}; checkpoint {_ckpt_dir(out)}; "
            f"drafter {drafter_dir}")
        summary["model"] = drafter
        return summary
    finally:
        metrics.close()
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)


def export_from_checkpoint(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "bfloat16",
                           target_config: Mapping[str, Any] | None = None) -> Path:
    """Write the drafter of a checkpoint (either format) in the published format, without
    the target's weights: its config comes from the checkpoint (or target_config)."""
    from dflash.drafter_format import write_dflash_drafter

    st = ckpt.load_checkpoint(ckpt_dir)
    tc = dict(target_config or st.get("target_config") or {})
    if not tc:
        raise ValueError(f"{ckpt_dir}: the checkpoint holds no target config; pass the target's config.json")
    c = DrafterConfig.from_dict(st["drafter_config"])
    weights = {k: v.detach().float().cpu().numpy() for k, v in st["model"].items()}
    if c.arch == "dflash2":
        return export_dflash2(out_dir, c, weights, tc, dtype)
    return write_dflash_drafter(
        out_dir, target_config=tc, num_layers=c.num_layers, target_layer_ids=c.target_layer_ids,
        block_size=c.block_size, mask_token_id=c.mask_token_id, hidden_size=c.hidden_size, num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, intermediate_size=c.intermediate_size,
        rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, dtype=dtype, weights=weights)

"""Shared parts of the held-out drafter measurements (train_recall_at_k.py, train_overlap_t1.py):
the frozen target, a drafter loaded with its architecture, the teacher-forced held-out
batches (the trainer's held-out rows: the last --holdout indices of a data set, deterministic
anchors), and the report file."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, List, Tuple

import torch


def add_arguments(ap: argparse.ArgumentParser, rows: int) -> None:
    ap.add_argument("--data", required=True, help="training set (.jsonl or packed .npz.xz)")
    ap.add_argument("--draft", action="append", required=True)
    ap.add_argument("--target", default="default", help="target dir (default: the converted SmolLM2)")
    ap.add_argument("--holdout", type=int, default=256, help="the set's last N rows are the held-out ones")
    ap.add_argument("--rows", type=int, default=rows, help="held-out rows measured (the first of them)")
    ap.add_argument("--anchors", type=int, default=64, help="deterministic anchors per row")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)


def load_target(target_dir: str) -> Any:
    """The frozen fp32 target (transformers); "default" is the converted SmolLM2."""
    from transformers import AutoModelForCausalLM

    if target_dir == "default":
        from dflash.default_model import default_model_dir

        target_dir = str(default_model_dir())
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    target.requires_grad_(False)
    return target


def load_drafter(draft_dir: str, target: Any) -> Tuple[Any, str]:
    """(the trainer's model of a published drafter, "dflash" or "dflash2")."""
    from dflash.train.dflash2_model import load_published_drafter

    cfg = json.loads((Path(draft_dir) / "config.json").read_text(encoding="utf-8"))
    arch = "dflash2" if "DFlash2DraftModel" in (cfg.get("architectures") or []) else "dflash"
    return load_published_drafter(draft_dir, target, arch).eval(), arch


def heldout_batches(args: argparse.Namespace) -> Tuple[List[tuple], int]:
    """([(batch, anchors, keep)], rows) of the first --rows held-out rows."""
    from dflash.train import data as D
    from dflash.train import objective as O
    from dflash.train.trainer import _examples

    samples = D.load_dataset(args.data)
    n = 1 + max(s.index for s in samples)
    held = sorted((s for s in samples if s.index >= n - args.holdout), key=lambda s: s.index)
    ex = list(_examples(held, 1024).values())[: args.rows]
    batches = []
    for i in range(0, len(ex), args.batch_size):
        b = O.collate(ex[i:i + args.batch_size])
        anchors, keep = O.eval_anchors(b, args.anchors)
        batches.append((b, anchors, keep))
    return batches, len(ex)


def write_report(args: argparse.Namespace, what: str, rows: int, seconds: float, results: list) -> dict:
    """The report of one measurement (what, date, command, machine, data, rows, results) to --out."""
    import platform
    import sys
    import time

    out = {"what": what, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv),
           "machine": f"{platform.machine()} CPU ({torch.get_num_threads()} threads)", "data": args.data,
           "rows": rows, "anchors_per_row": args.anchors, "seconds": round(seconds, 1), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return out


def setup(ap: argparse.ArgumentParser) -> Tuple[argparse.Namespace, Any, List[tuple], int]:
    """Parse the command line, set the threads, load the target and the held-out batches:
    (args, target, batches, rows)."""
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target)
    batches, rows = heldout_batches(args)
    return args, target, batches, rows

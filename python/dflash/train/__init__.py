# python/dflash/train/__init__.py
#
# `dflash train`: training DFlash drafters for a target (issue 6).  PyTorch and
# transformers are needed here (the runtime itself does not import them), so
# nothing is imported eagerly: use the submodules.
#
#   data.py       prompts -> target-generated responses (dflash runtime), .jsonl set
#   model.py      the trainable drafter (published parameter names), load/save
#   objective.py  target features, random anchors, block mask, decayed CE loss
#   trainer.py    AdamW + warmup/cosine, checkpoints/resume, time budget, export
#   state.py      checkpoints: exact (state.pt) or compact parts (bf16 / 8-bit moments)
#   device_run.py one bounded call of a multi-call run on a lent GPU machine
"""Training of DFlash drafters (see README "Training a drafter")."""

__all__ = ["data", "model", "objective", "trainer", "state", "device_run"]

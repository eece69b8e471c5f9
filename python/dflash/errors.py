# python/dflash/errors.py
#
# Exception types shared by the pure-Python side of dflash and the compiled
# extension (the C++ errors are mapped onto the same class), so callers can
# catch one type whichever layer detected the problem.
from __future__ import annotations

__all__ = ["DFlashError"]


class DFlashError(RuntimeError):
    """Raised for broken or inconsistent model files.

    Examples: a missing or unparsable tokenizer.json, a config.json whose
    fields contradict the weights, truncated safetensors shards.  Mistakes
    made by the caller (bad arguments, malformed chat messages) raise
    `ValueError` / `TypeError` instead.
    """

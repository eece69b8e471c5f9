"""dflash serve: an OpenAI-compatible HTTP server over a dflash.Session (FastAPI + uvicorn).

Needs the `serve` extra (pip install "dflash[serve]"). build_app(session, ...) makes the ASGI
app; `dflash serve` (dflash.serve.command) builds a Session from command-line options and runs
it with uvicorn. Importing this package needs no extra; build_app does."""

from __future__ import annotations

from typing import Any

__all__ = ["build_app", "require_serve_extra"]


def require_serve_extra() -> None:
    """Raises ImportError naming the install command when a package of the extra is missing."""
    import importlib.util

    for module, package in (("fastapi", "fastapi"), ("uvicorn", "uvicorn"), ("prometheus_client", "prometheus-client")):
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"dflash serve needs the serve extra ({package} is not installed): "
                              "pip install 'dflash[serve]'")


def __getattr__(name: str) -> Any:
    if name == "build_app":
        require_serve_extra()
        from dflash.serve.app import build_app

        return build_app
    raise AttributeError(f"module 'dflash.serve' has no attribute {name!r}")

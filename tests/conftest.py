# tests/conftest.py
#
# Shared pytest fixtures for dflash tests.
#
# * `tiny_model_dirs`: every preset of tests/fixtures/tiny_models.PRESETS,
#   written once per test session (dict preset name -> model directory).
# * `tiny_model`: one preset directory; parametrize it indirectly, e.g.
#       @pytest.mark.parametrize("tiny_model", ["llama_gqa", "qwen3"], indirect=True)
#   (unparametrized it yields the "llama_gqa" preset).
# * `hf_model`: a loader returning the transformers reference model in fp32
#   eval mode, cached per directory.
# * `long_context_model`: the llama_gqa geometry with 8192 positions (the
#   server tests keep requests running long enough to disconnect them).
# * `cpp_build_root`: one directory for the C++ builds of a test session (the
#   ctest suite and the example service, tests/cmake_helpers.py).
#
# Nothing here imports the compiled dflash extension, so tests that do not
# need it still collect when it has not been built.
from __future__ import annotations

import pathlib
import sys
from typing import Any, Callable

import pytest

# Make `dflash` (python/) and `tests.fixtures` importable without PYTHONPATH;
# appended, so an explicit PYTHONPATH still takes precedence.
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
for _path in (REPO_ROOT, REPO_ROOT / "python"):
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

from tests.fixtures.tiny_models import PRESETS, write_preset  # noqa: E402

DEFAULT_PRESET = "llama_gqa"


def _limit_torch_threads() -> None:
    """Tiny models run fastest with few threads; avoid oversubscription."""
    try:
        import torch
    except ImportError:  # torch is only needed by reference tests
        return
    torch.set_num_threads(2)


_limit_torch_threads()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """All tiny presets, written once: {preset name: model directory}."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {name: write_preset(name, root / name) for name in PRESETS}


@pytest.fixture
def tiny_model(request: pytest.FixtureRequest, tiny_model_dirs: dict[str, pathlib.Path]) -> pathlib.Path:
    """Directory of one preset, chosen by indirect parametrization."""
    name = getattr(request, "param", DEFAULT_PRESET)
    if name not in tiny_model_dirs:
        raise KeyError(f"unknown tiny-model preset {name!r}; known: {sorted(tiny_model_dirs)}")
    return tiny_model_dirs[name]


@pytest.fixture(scope="session")
def long_context_model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A tiny model with a long context, written once (tests/serve_helpers.py)."""
    from tests.serve_helpers import write_long_context_model

    return write_long_context_model(tmp_path_factory.mktemp("long_context") / "long")


@pytest.fixture(scope="session")
def cpp_build_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The build directories of the C++ tests (one per CMake project under it)."""
    return tmp_path_factory.mktemp("cpp_build")


@pytest.fixture(scope="session")
def hf_model() -> Callable[[str | pathlib.Path], Any]:
    """Loader for the transformers reference model (fp32, eval mode), cached per path."""
    cache: dict[str, Any] = {}

    def load(path: str | pathlib.Path) -> Any:
        key = str(pathlib.Path(path).resolve())
        if key not in cache:
            import torch
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32)
            cache[key] = model.eval()
        return cache[key]

    return load


@pytest.fixture(scope="session")
def hf_tokenizer() -> Callable[[str | pathlib.Path], Any]:
    """Loader for the transformers reference tokenizer, cached per path."""
    cache: dict[str, Any] = {}

    def load(path: str | pathlib.Path) -> Any:
        key = str(pathlib.Path(path).resolve())
        if key not in cache:
            from transformers import AutoTokenizer

            cache[key] = AutoTokenizer.from_pretrained(key)
        return cache[key]

    return load

# tests/test_triton_aot.py
#
# The ahead-of-time Triton generator (triton_kernels/aot.py) on the CPU: it compiles every
# manifest entry for sm_90a without a GPU and writes the fixed-name outputs; the launchers it
# emits avoid the defects of triton's stock AOT launcher (fp32 scalars as double, exit(),
# lazy loading, missing return on an empty grid); two runs give identical files; a missing or
# wrong triton fails with a clear message. Needs no GPU and no built extension; the compile test
# skips when triton is not installed.
from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
AOT = REPO / "triton_kernels" / "aot.py"
REQUIRED = "3.6.0"


def _triton_version() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None
    import triton

    return triton.__version__


TRITON = _triton_version()
needs_triton = pytest.mark.skipif(TRITON is None, reason="triton is not installed")


def _manifest():
    spec = importlib.util.spec_from_file_location("manifest_under_test",
                                                  REPO / "triton_kernels" / "manifest.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run(out_dir: pathlib.Path, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(AOT), "--out-dir", str(out_dir)],
                          capture_output=True, text=True, timeout=900, env=env)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    if TRITON != REQUIRED:
        pytest.skip(f"triton {TRITON} installed, the generator needs {REQUIRED}")
    out = tmp_path_factory.mktemp("triton_gen")
    result = _run(out)
    assert result.returncode == 0, result.stderr
    return out


@needs_triton
def test_wrong_triton_version_fails_clearly(tmp_path):
    if TRITON == REQUIRED:
        pytest.skip("the installed triton is the required one")
    result = _run(tmp_path)
    assert result.returncode != 0
    assert f"triton=={REQUIRED}" in result.stderr


def test_missing_or_wrong_triton_fails_clearly(tmp_path):
    # A fake `triton` package first on the path stands for a wrong install.
    for body, expected in (("raise ImportError('no triton here')", "cannot import triton"),
                           ("__version__ = '3.5.1'", "triton 3.5.1 found")):
        fake = tmp_path / body[:5].strip()
        (fake / "triton").mkdir(parents=True)
        (fake / "triton" / "__init__.py").write_text(body + "\n")
        env = dict(os.environ, PYTHONPATH=str(fake))
        result = _run(tmp_path / "out", env=env)
        assert result.returncode == 1, result.stderr
        assert expected in result.stderr and f"triton=={REQUIRED}" in result.stderr
        assert "Traceback" not in result.stderr
        check = subprocess.run([sys.executable, str(AOT), "--check"], capture_output=True,
                               text=True, env=env, timeout=60)
        assert check.returncode == 1 and f"triton=={REQUIRED}" in check.stderr


@needs_triton
def test_outputs_exist(generated):
    for name in ("triton_kernels_gen.h", "triton_kernels_gen.cpp"):
        assert (generated / name).stat().st_size > 0
    for kernel in _manifest().KERNELS:
        ptx = (generated / f"{kernel.name}.ptx").read_text()
        assert re.search(r"^\.target\s+sm_90a", ptx, re.M), kernel.name


@needs_triton
def test_launchers_avoid_stock_defects(generated):
    header = (generated / "triton_kernels_gen.h").read_text()
    source = (generated / "triton_kernels_gen.cpp").read_text()
    kernels = _manifest().KERNELS
    both = header + source
    # fp32 scalars are float (never double), i32 are int32_t.
    assert re.search(r"\bfloat scale\b", header)
    assert "double" not in both
    for kernel in kernels:
        for name, ty in kernel.params:
            cpp = {"fp32": "float", "i32": "int32_t"}.get(ty, "CUdeviceptr")
            assert re.search(rf"\b{cpp} {name}\b", header), (kernel.name, name)
    # No exit(), no printing, no lazy loading or module handling in the launch path.
    for banned in ("exit(", "abort(", "printf", "cuModuleLoad", "cuModuleGetFunction", "== NULL"):
        assert banned not in both, banned
    # Every launcher returns on an empty grid, passes the two hidden scratch pointers, and takes
    # its stream explicitly.
    assert source.count("if (grid_x == 0 || grid_y == 0 || grid_z == 0) return CUDA_SUCCESS;") \
        == len(kernels)
    assert len(re.findall(r"&global_scratch,\s*&profile_scratch\}", source)) == len(kernels)
    assert header.count("CUresult launch(CUfunction fn, CUstream stream,") == len(kernels)
    # The cubins are internal: static const arrays in an anonymous namespace.
    assert len(re.findall(r"static const unsigned char kCubin\d+\[", source)) == len(kernels)


@needs_triton
def test_generator_is_deterministic(generated, tmp_path):
    again = tmp_path / "again"
    result = _run(again)
    assert result.returncode == 0, result.stderr
    for path in generated.iterdir():
        if path.is_file():
            assert (again / path.name).read_bytes() == path.read_bytes(), path.name


@needs_triton
def test_generated_code_compiles(generated):
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    cuda_home = pathlib.Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    if cxx is None or not (cuda_home / "include" / "cuda.h").exists():
        pytest.skip("no C++ compiler or CUDA headers")
    cmd = [cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
           f"-I{REPO}", f"-I{REPO / 'cpp'}", f"-I{REPO / 'include'}", f"-I{generated}",
           f"-I{cuda_home / 'include'}"]
    for source in (generated / "triton_kernels_gen.cpp",
                   REPO / "triton_kernels" / "triton_attention.cpp",
                   REPO / "triton_kernels" / "lattice_walk.cpp",
                   REPO / "cpp" / "cuda_driver" / "driver_api.cpp"):
        result = subprocess.run(cmd + [str(source)], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{source.name}:\n{result.stderr}"

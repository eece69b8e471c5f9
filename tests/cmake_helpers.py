# tests/cmake_helpers.py
#
# Building C++ from the tests (tests/test_ctest.py, tests/test_cpp_example.py): the toolchain
# check (the tests skip only when cmake or a C++ compiler is missing), configure + build with
# CMake (-j2: CI machines have 2 cores), and the failure message with the build's output.
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
from typing import Mapping, Sequence

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def require_toolchain() -> None:
    """Skips the calling test when cmake or a C++ compiler is not installed."""
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    if not any(shutil.which(c) for c in (os.environ.get("CXX", ""), "c++", "g++", "clang++") if c):
        pytest.skip("no C++ compiler (c++, g++, clang++) is installed")


def run_checked(cmd: Sequence[str], what: str, *, timeout: float = 1200, **kwargs) -> subprocess.CompletedProcess:
    """Runs cmd; on failure, fails the test with the command's output (its end)."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, **kwargs)
    if proc.returncode != 0:
        out = (proc.stdout + proc.stderr)[-6000:]
        pytest.fail(f"{what} failed (exit {proc.returncode}): {' '.join(map(str, cmd))}\n{out}")
    return proc


def cmake_build(source: pathlib.Path, build: pathlib.Path, definitions: Mapping[str, str],
                targets: Sequence[str] = ()) -> None:
    """Configures `source` into `build` (reused if already configured) and builds `targets` (all
    when empty) with two jobs."""
    defs = [f"-D{k}={v}" for k, v in definitions.items()]
    run_checked(["cmake", "-S", source, "-B", build, "-DCMAKE_BUILD_TYPE=Release", *defs], f"configuring {source}")
    target_args = [a for t in targets for a in ("--target", t)]
    run_checked(["cmake", "--build", build, "-j2", *target_args], f"building {source}")

# tests/test_ctest.py
#
# The C++ unit tests (tests/cpp, GoogleTest) through ctest: configures the project CPU-only with
# DFLASH_TESTS=ON (no Python module), builds the two test executables, runs ctest and fails if any
# C++ test fails. ctest's summary is printed to the terminal. Needs GoogleTest (Debian:
# libgtest-dev, installed by .ci/run); skips only without cmake or a C++ compiler.
from __future__ import annotations

import re
import subprocess
import sys

from tests.cmake_helpers import REPO_ROOT, cmake_build, require_toolchain


def test_ctest_suite_passes(cpp_build_root, capsys):
    require_toolchain()
    build = cpp_build_root / "ctest"
    cmake_build(REPO_ROOT, build, {"DFLASH_CUDA": "OFF", "DFLASH_TESTS": "ON", "DFLASH_PYTHON": "OFF",
                                   "Python_EXECUTABLE": sys.executable},
                targets=["dflash_unit_tests", "dflash_api_tests"])
    proc = subprocess.run(["ctest", "--test-dir", str(build), "-j2", "--output-on-failure", "--timeout", "300"],
                          capture_output=True, text=True, timeout=900)
    lines = proc.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if "tests passed" in line), max(len(lines) - 20, 0))
    summary = "\n".join(lines[start:])
    with capsys.disabled():
        print(f"\nctest ({build}):\n{summary}")
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    m = re.search(r"100% tests passed(?:, 0 tests failed)? out of (\d+)", proc.stdout)
    assert m is not None, summary
    assert int(m.group(1)) >= 40, f"only {m.group(1)} C++ tests ran"

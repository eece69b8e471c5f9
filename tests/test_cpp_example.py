# tests/test_cpp_example.py
#
# The example C++ service (examples/cpp) built against the *installed* dflash package
# (find_package(dflash) with dflash_DIR from `python -m dflash --cmake-dir`), run on a tiny model:
# its streamed tokens equal the Python API's Session.generate for the same requests (greedy and
# seeded T > 0, target-only and with DFlash / DFlash2 drafters), including requests that arrive
# while others run; bad lines get error lines and the others go on; abort; metrics. Also: the
# installed libdflash exports the public API only. Skips only without cmake or a C++ compiler.
from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from tests.cmake_helpers import REPO_ROOT, cmake_build, require_toolchain, run_checked
from tests.runtime_helpers import small_drafter_pair

# Requests of the comparison: (id, fields). "c" and "d" are sent once "a" has produced tokens.
FIRST = [
    ("a", {"prompt_token_ids": [5, 17, 42, 99, 7], "max_tokens": 12, "temperature": 0}),
    ("b", {"prompt_token_ids": [300, 2, 301, 3], "max_tokens": 10, "temperature": 0.8, "seed": 3}),
]
LATER = [
    ("c", {"prompt_token_ids": [9, 8, 7, 6, 5, 4, 3], "max_tokens": 8, "temperature": 1.0, "top_p": 0.9,
           "top_k": 20, "seed": 5}),
    ("d", {"prompt_token_ids": [11, 12], "max_tokens": 6, "temperature": 0, "ignore_eos": True}),
]
LONG = ("long", {"prompt_token_ids": [1, 2, 3], "max_tokens": 400, "temperature": 0, "ignore_eos": True})


def _installed_cmake_dir() -> str:
    proc = run_checked([sys.executable, "-m", "dflash", "--cmake-dir"], "python -m dflash --cmake-dir")
    return proc.stdout.strip()


@pytest.fixture(scope="module")
def service(cpp_build_root):
    """The path of the dflash_service executable, built against the installed package."""
    require_toolchain()
    import nlohmann_json

    build = cpp_build_root / "example"
    cmake_build(REPO_ROOT / "examples" / "cpp", build,
                {"dflash_DIR": _installed_cmake_dir(), "NLOHMANN_JSON_INCLUDE_DIR": nlohmann_json.get_include()})
    return build / "dflash_service"


def test_cmake_dir_holds_the_package():
    import dflash

    path = _installed_cmake_dir()
    assert path == dflash.cmake_dir()
    assert dflash._core.__version__ == dflash.__version__  # the C++ library's version.h
    root = pathlib.Path(path).parents[2]  # .../dflash/lib/cmake/dflash -> .../dflash
    assert (root / "include" / "dflash" / "session.h").is_file()
    assert (root / "lib" / "libdflash.so").is_file()
    version = pathlib.Path(path, "dflashConfigVersion.cmake").read_text()
    assert f'set(PACKAGE_VERSION "{dflash.__version__}")' in version


def test_installed_library_exports_only_the_public_api():
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) is not installed")
    lib = pathlib.Path(_installed_cmake_dir()).parents[1] / "libdflash.so"
    out = run_checked(["nm", "-D", "-C", "--defined-only", str(lib)], "nm").stdout
    names = [line.split(" ", 2)[2] for line in out.splitlines() if line.count(" ") >= 2]
    assert "dflash::Session::step()" in names
    assert "typeinfo for dflash::InvalidArgument" in names
    prefixes = ("dflash::", "typeinfo for dflash::", "typeinfo name for dflash::", "vtable for dflash::")
    foreign = [n for n in names if not n.startswith(prefixes)]
    assert not foreign, foreign[:20]
    internal = [n for n in names if n.startswith(("dflash::runtime::", "dflash::Engine", "dflash::Scheduler",
                                                  "dflash::CpuBackend", "dflash::detail::"))]
    assert not internal, internal[:20]


class _Service:
    """A running dflash_service: JSON lines in, JSON lines out."""

    def __init__(self, exe, model, *extra):
        self.proc = subprocess.Popen([str(exe), str(model), "--device", "cpu", "--threads", "2", *map(str, extra)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.lines = []

    def send(self, line):
        self.proc.stdin.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
        self.proc.stdin.flush()

    def read_until(self, predicate):
        """Reads output lines until one satisfies predicate; returns it."""
        for raw in self.proc.stdout:
            item = json.loads(raw)
            self.lines.append(item)
            if predicate(item):
                return item
        pytest.fail(f"the service ended before the expected line; stderr:\n{self.proc.stderr.read()}")

    def finish(self):
        self.proc.stdin.close()
        for raw in self.proc.stdout:
            self.lines.append(json.loads(raw))
        assert self.proc.wait(timeout=120) == 0, self.proc.stderr.read()


def _streams(lines):
    """{id: (token ids concatenated over delta lines, final line)} and the error lines."""
    tokens, finals, errors = {}, {}, []
    for item in lines:
        if "error" in item:
            errors.append(item)
        elif "finish_reason" in item:
            assert item["id"] not in finals, f"two final lines for {item['id']}"
            finals[item["id"]] = item
        else:
            assert item["id"] not in finals, f"tokens after the final line of {item['id']}"
            tokens.setdefault(item["id"], []).extend(item["token_ids"])
    return tokens, finals, errors


def _python_outputs(model, requests, **session_kwargs):
    import dflash

    with dflash.Session(model, device="cpu", num_threads=2, **session_kwargs) as sess:
        params = [dflash.SamplingParams(max_tokens=r["max_tokens"], temperature=r["temperature"],
                                        top_p=r.get("top_p", 1.0), top_k=r.get("top_k", 0), seed=r.get("seed", 0),
                                        ignore_eos=r.get("ignore_eos", False))
                  for _, r in requests]
        outs = sess.generate([r["prompt_token_ids"] for _, r in requests], params)
    return {rid: o for (rid, _), o in zip(requests, outs)}


def _run_and_compare(service, model, python_kwargs, *service_args):
    svc = _Service(service, model, *service_args)
    for rid, fields in FIRST:
        svc.send({"id": rid, **fields})
    svc.send(LONG[1] | {"id": LONG[0]})
    svc.read_until(lambda item: item.get("id") == "a" and "token_ids" in item)
    for rid, fields in LATER:  # while a, b and long run
        svc.send({"id": rid, **fields})
    svc.read_until(lambda item: item.get("id") == "long" and "token_ids" in item)
    svc.send("this is not json")
    svc.send({"id": "x"})  # no prompt
    svc.send({"id": "y", "prompt_token_ids": [10 ** 6]})  # outside the vocabulary
    svc.send({"id": "z", "prompt_token_ids": [1, 2], "temperature": "hot"})
    svc.send({"id": "long", "prompt_token_ids": [4]})  # its id is live
    svc.send({"id": "long", "abort": True})
    svc.send({"id": "nobody", "abort": True})
    svc.finish()

    tokens, finals, errors = _streams(svc.lines)
    assert sorted(e["id"] for e in errors if e["id"] is not None) == ["long", "nobody", "x", "y", "z"], errors
    assert sum(e["id"] is None for e in errors) == 1, errors
    by_id = {e["id"]: e["error"] for e in errors}
    assert "prompt_token_ids" in by_id["x"] and "vocabulary" in by_id["y"] and "temperature" in by_id["z"]
    assert set(finals) == {"a", "b", "c", "d", "long"}

    requests = FIRST + LATER
    want = _python_outputs(model, requests + [LONG], **python_kwargs)
    for rid, fields in requests:
        assert tokens.get(rid, []) == want[rid].token_ids, rid
        assert finals[rid]["finish_reason"] == want[rid].finish_reason, rid
        m = finals[rid]["metrics"]
        assert m["generated_tokens"] == len(want[rid].token_ids), rid
        assert m["prompt_tokens"] == len(fields["prompt_token_ids"]), rid
        assert m["total_time_s"] > 0
    assert finals["long"]["finish_reason"] == "abort"
    assert 0 < len(tokens["long"]) < 400
    assert tokens["long"] == want["long"].token_ids[: len(tokens["long"])]
    return finals


def test_service_streams_what_python_generates(service, tiny_model):
    _run_and_compare(service, tiny_model, {})


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_service_with_a_drafter_streams_what_python_generates(service, tiny_model, tmp_path, kind):
    drafter = small_drafter_pair(tmp_path, tiny_model, dflash_layers=1, dflash_block_size=4, dflash_seed=3,
                                 dflash2_block_size=4, dflash2_top_k=4)[kind]
    finals = _run_and_compare(service, tiny_model, {"draft": str(drafter)}, "--draft", drafter)
    assert sum(f["metrics"]["num_spec_steps"] for f in finals.values()) > 0


def test_readme_cpp_example_compiles_against_the_installed_package(cpp_build_root):
    """The README's C++ example and CMake lines build as written (the program needs real model
    paths to run, so it is only compiled and linked)."""
    require_toolchain()
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Embedding in C++"):]
    cmake_lines = re.search(r"```cmake\n(.*?)```", section, re.DOTALL).group(1).replace("myapp", "readme_example")
    code = re.search(r"```cpp\n(.*?)```", section, re.DOTALL).group(1)
    src = cpp_build_root / "readme_example"
    src.mkdir(exist_ok=True)
    (src / "main.cpp").write_text(code)
    (src / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.20)\nproject(readme_example CXX)\n"
                                        "set(CMAKE_CXX_STANDARD 17)\nadd_executable(readme_example main.cpp)\n"
                                        + cmake_lines)
    cmake_build(src, cpp_build_root / "readme_example_build", {"dflash_DIR": _installed_cmake_dir()})
    assert (cpp_build_root / "readme_example_build" / "readme_example").is_file()

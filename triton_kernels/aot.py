#!/usr/bin/env python3
"""Ahead-of-time compiler of the Triton kernels listed in manifest.py, for sm_90a.

    python triton_kernels/aot.py --out-dir DIR [--jobs N] [--line-info]
    python triton_kernels/aot.py --check          # exit 0 iff triton==3.6.0 is importable

Compiles every manifest entry with triton.compile(ASTSource(...), target=GPUTarget("cuda", 90,
32)) (no GPU or driver needed) and writes into DIR, under fixed names:
  triton_kernels_gen.h    per kernel a namespace with its constexprs, launch shape and a typed
                          launcher (CUdeviceptr for pointers, int32_t for i32, float for fp32;
                          explicit stream; CUresult return; no globals, no lazy loading, no exit)
  triton_kernels_gen.cpp  the cubins as `static const unsigned char` arrays, the kernel table
                          (entry names, shared memory, block size, parameter sizes for the
                          load-time ABI check) and the launchers
  <kernel>.ptx            the PTX of every kernel, for review
The launchers call cuLaunchKernelEx through cpp/cuda_driver/driver_api.h (with programmatic dependent
launch unless DFLASH_PDL=0: every kernel starts with gdc_wait); the CUfunction comes
from triton_aot::Modules (triton_attention.cpp), which loads every image once.

Calling convention of triton 3.6.0 (read from triton/backends/nvidia/driver.py, make_launcher,
and triton/tools/compile.py): a kernel's parameters are its non-constexpr arguments in
declaration order, then two hidden CUdeviceptr, global_scratch and profile_scratch; the block is
num_warps * 32 threads and the dynamic shared memory metadata.shared bytes. This generator checks
that the PTX entry has exactly those parameters and refuses kernels that need either scratch
buffer, cooperative or PDL launches, clusters or tensor descriptors, so the launchers pass 0 for
both hidden pointers. Other triton versions are refused: the convention has changed before.

Output is deterministic: line info is off unless --line-info (it embeds source paths), fp
fusion is set per kernel from the manifest (on unless an entry says fp_fusion=False; the default
is pinned with TRITON_DEFAULT_FP_FUSION=1), and files are written in manifest order.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import importlib.util
import multiprocessing
import os
import re
import sys
import textwrap
import time
from pathlib import Path

REQUIRED_TRITON = "3.6.0"
HERE = Path(__file__).resolve().parent
GEN_H = "triton_kernels_gen.h"
GEN_CPP = "triton_kernels_gen.cpp"

# Triton type -> (C++ type, size in bytes of the kernel parameter).
CPP_TYPES = {
    "i32": ("int32_t", 4),
    "u32": ("uint32_t", 4),
    "i64": ("int64_t", 8),
    "u64": ("uint64_t", 8),
    "fp32": ("float", 4),
    "fp64": ("double", 8),
}
POINTER = ("CUdeviceptr", 8)
HIDDEN_PARAMS = ("global_scratch", "profile_scratch")  # appended by triton 3.6.0, CUdeviceptr each
SM90_MAX_SHARED = 232448  # opt-in shared memory per block on sm_90 (227 KiB)


class AotError(Exception):
    """A problem with the environment or a kernel; main() prints it and exits with status 1."""


def cpp_type(ty: str) -> tuple[str, int]:
    if ty.startswith("*"):
        return POINTER
    if ty not in CPP_TYPES:
        raise AotError(f"parameter type {ty!r} is not supported by the generated launchers "
                       f"(supported: pointers, {', '.join(CPP_TYPES)})")
    return CPP_TYPES[ty]


def camel_constant(name: str) -> str:
    return "k" + "".join(part.capitalize() for part in name.lower().split("_"))


def configure_environment(line_info: bool, cache_dir: Path | None) -> None:
    """Triton reads these when it compiles; set before importing it."""
    os.environ["TRITON_DEFAULT_FP_FUSION"] = "1"
    os.environ["TRITON_DISABLE_LINE_INFO"] = "0" if line_info else "1"
    if cache_dir is not None and "TRITON_CACHE_DIR" not in os.environ:
        os.environ["TRITON_CACHE_DIR"] = str(cache_dir)


def import_triton():
    try:
        import triton
    except Exception as exc:  # ImportError, or a broken install
        raise AotError(
            f"cannot import triton ({type(exc).__name__}: {exc}). The CUDA build compiles its "
            f"Triton kernels ahead of time and needs triton=={REQUIRED_TRITON} in the Python that "
            f"runs this script ({sys.executable}): pip install triton=={REQUIRED_TRITON}") from exc
    if triton.__version__ != REQUIRED_TRITON:
        raise AotError(
            f"triton {triton.__version__} found in {sys.executable}, but the generated launchers "
            f"follow triton {REQUIRED_TRITON}'s calling convention (two hidden trailing "
            f"pointers) and its code generation: pip install triton=={REQUIRED_TRITON}")
    return triton


def load_manifest():
    spec = importlib.util.spec_from_file_location("dflash_triton_manifest", HERE / "manifest.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)
    return module


def load_kernel(source: str, fn_name: str):
    path = HERE / source
    mod_name = "dflash_triton_" + path.stem
    module = sys.modules.get(mod_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
    return getattr(module, fn_name)


def compile_entry(index: int, line_info: bool, cache_dir: str | None) -> dict:
    """Compiles manifest entry `index` (in a worker process: returns errors as {"error": ...})."""
    try:
        configure_environment(line_info, Path(cache_dir) if cache_dir else None)
        return compile_one(load_manifest().KERNELS[index])
    except AotError as exc:
        return {"error": str(exc)}
    except Exception as exc:  # anything else, with its type, rather than an unpicklable object
        return {"error": f"{type(exc).__name__}: {exc}"}


def compile_one(kernel) -> dict:
    triton = import_triton()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = load_kernel(kernel.source, kernel.fn)
    names = [n for n, _ in kernel.params]
    expected = [n for n in fn.arg_names if n not in kernel.constexprs]
    if names != expected:
        raise AotError(f"{kernel.name}: manifest parameters {names} do not match the "
                       f"non-constexpr arguments of {kernel.source}:{kernel.fn} {expected}")
    missing = set(kernel.constexprs) - set(fn.arg_names)
    if missing:
        raise AotError(f"{kernel.name}: constexprs {sorted(missing)} are not arguments of "
                       f"{kernel.fn}")
    signature = {}
    for n in fn.arg_names:
        signature[n] = "constexpr" if n in kernel.constexprs else dict(kernel.params)[n]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in kernel.aligned}
    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options({"num_warps": kernel.num_warps,
                                     "num_stages": kernel.num_stages,
                                     "enable_fp_fusion": kernel.fp_fusion})
    src = ASTSource(fn=fn, signature=signature, constexprs=dict(kernel.constexprs), attrs=attrs)
    try:
        compiled = triton.compile(src, target=target, options=options.__dict__)
    except Exception as exc:
        raise AotError(f"{kernel.name}: triton.compile failed: "
                       f"{type(exc).__name__}: {exc}") from exc
    md = compiled.metadata
    return {
        "name": kernel.name,
        "entry": md.name,
        "cubin": bytes(compiled.asm["cubin"]),
        "ptx": compiled.asm["ptx"],
        "shared": int(md.shared),
        "num_warps": int(md.num_warps),
        "num_stages": int(md.num_stages),
        "num_ctas": int(getattr(md, "num_ctas", 1)),
        "global_scratch_size": int(getattr(md, "global_scratch_size", 0)),
        "profile_scratch_size": int(getattr(md, "profile_scratch_size", 0)),
        "launch_cooperative_grid": bool(getattr(md, "launch_cooperative_grid", False)),
        "launch_pdl": bool(getattr(md, "launch_pdl", False)),
        "tensordesc_meta": list(getattr(md, "tensordesc_meta", None) or []),
        "arch": str(getattr(md, "arch", "")),
    }


_PTX_PARAM_SIZES = {"u8": 1, "s8": 1, "b8": 1, "u16": 2, "s16": 2, "b16": 2, "f16": 2,
                    "u32": 4, "s32": 4, "b32": 4, "f32": 4, "u64": 8, "s64": 8, "b64": 8, "f64": 8}


def ptx_param_sizes(ptx: str, entry: str) -> list[int]:
    m = re.search(r"\.entry\s+" + re.escape(entry) + r"\s*\((.*?)\)", ptx, re.S)
    if not m:
        raise AotError(f"no .entry {entry} in the PTX")
    sizes = []
    for decl in filter(None, (d.strip() for d in m.group(1).split(","))):
        t = re.match(r"\.param\s+\.(\w+)", decl)
        if not t or t.group(1) not in _PTX_PARAM_SIZES:
            raise AotError(f"{entry}: unexpected PTX parameter {decl!r}")
        sizes.append(_PTX_PARAM_SIZES[t.group(1)])
    return sizes


def validate(kernel, result: dict) -> list[int]:
    """Checks what the launchers assume; returns the parameter sizes, hidden ones included."""
    problems = []
    if result["global_scratch_size"] or result["profile_scratch_size"]:
        problems.append("needs global/profile scratch memory")
    if result["launch_cooperative_grid"] or result["launch_pdl"]:
        problems.append("needs a cooperative or PDL launch")
    if result["num_ctas"] != 1:
        problems.append(f"needs clusters of {result['num_ctas']} CTAs")
    if result["tensordesc_meta"]:
        problems.append("takes tensor descriptors")
    if result["num_warps"] != kernel.num_warps:
        problems.append(f"num_warps {result['num_warps']} != {kernel.num_warps}")
    if result["shared"] > SM90_MAX_SHARED:
        problems.append(f"needs {result['shared']} bytes of shared memory (> {SM90_MAX_SHARED})")
    if not re.search(r"^\.target\s+sm_90a\b", result["ptx"], re.M):
        problems.append("PTX does not target sm_90a")
    expected = [cpp_type(ty)[1] for _, ty in kernel.params] + [POINTER[1]] * len(HIDDEN_PARAMS)
    actual = ptx_param_sizes(result["ptx"], result["entry"])
    if actual != expected:
        problems.append(f"PTX parameter sizes {actual} != expected {expected} "
                        f"(arguments, then {', '.join(HIDDEN_PARAMS)})")
    if problems:
        raise AotError(f"{kernel.name}: " + "; ".join(problems))
    return expected


# ------------------------------------------------------------------------------------------------
# C++ emission
# ------------------------------------------------------------------------------------------------

def _signature(kernel) -> str:
    args = ["CUfunction fn", "CUstream stream", "unsigned grid_x", "unsigned grid_y",
            "unsigned grid_z"]
    args += [f"{cpp_type(ty)[0]} {name}" for name, ty in kernel.params]
    return ", ".join(args)


def _wrap(text: str, indent: str, width: int = 100) -> str:
    """Wraps a comma-separated argument list after `indent`."""
    lines, line = [], ""
    for part in text.split(", "):
        candidate = part if not line else line + ", " + part
        if len(indent) + len(candidate) + 2 > width and line:
            lines.append(line + ",")
            line = part
        else:
            line = candidate
    lines.append(line)
    return ("\n" + indent).join(lines)


def _describe(kernel, result) -> str:
    consts = ", ".join(f"{k}={v}" for k, v in kernel.constexprs.items())
    text = (f"{kernel.source}:{kernel.fn} with {consts}; num_warps={kernel.num_warps}, "
            f"num_stages={kernel.num_stages}, fp fusion {'on' if kernel.fp_fusion else 'off'}, "
            f"{result['shared']} bytes of shared memory. "
            f"{kernel.doc}.")
    return "".join(f"// {line}\n" for line in textwrap.wrap(text, width=97))


def emit_header(kernels, results) -> str:
    out = [f"""\
// {GEN_H}: generated by triton_kernels/aot.py from triton_kernels/manifest.py with
// triton {REQUIRED_TRITON} for sm_90a. Do not edit: rebuild instead.
//
// Per kernel: a namespace with its constexprs, launch shape and typed launcher. A launcher
// launches `fn` (loaded by triton_aot::Modules from kKernelImages[kId]) on `stream`; it returns
// CUDA_SUCCESS without launching when the grid is empty, CUDA_ERROR_INVALID_VALUE when a
// 16-divisibility promise of the manifest does not hold, else cuLaunchKernel's result. It never
// loads, allocates, synchronises or throws. Parameters follow triton {REQUIRED_TRITON}'s
// convention: the non-constexpr arguments in order, then two hidden CUdeviceptr (global_scratch,
// profile_scratch), passed as 0 (the generator refuses kernels that would use them).
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>

namespace dflash {{
namespace triton_aot {{
namespace gen {{

constexpr const char* kTritonVersion = "{REQUIRED_TRITON}";
constexpr int kNumKernels = {len(kernels)};

// One compiled kernel, as the loader needs it.
struct KernelImage {{
  const char* name;            // specialisation name (manifest.py)
  const char* entry;           // function symbol in the cubin
  const unsigned char* cubin;  // [cubin_bytes] sm_90a ELF image
  size_t cubin_bytes;
  unsigned shared_bytes;       // dynamic shared memory of every launch
  unsigned num_threads;        // block size: num_warps * 32
  int num_params;              // kernel parameters, the two hidden ones included
  const uint8_t* param_sizes;  // [num_params] size in bytes of each parameter
}};

// [kNumKernels], kKernelImages[ns::kId] describes namespace ns below.
extern const KernelImage kKernelImages[kNumKernels];
"""]
    for idx, (kernel, result) in enumerate(zip(kernels, results)):
        consts = "".join(f"constexpr int {camel_constant(k)} = {v};\n"
                         for k, v in kernel.constexprs.items())
        sig = _wrap(_signature(kernel), " " * 16)
        out.append(f"""
{_describe(kernel, result)}namespace {kernel.name} {{
constexpr int kId = {idx};
{consts}constexpr unsigned kNumThreads = {kernel.num_warps * 32};
constexpr unsigned kSharedBytes = {result['shared']};
CUresult launch({sig});
}}  // namespace {kernel.name}
""")
    out.append("""
}  // namespace gen
}  // namespace triton_aot
}  // namespace dflash
""")
    return "".join(out)


def _byte_array(data: bytes) -> str:
    rows = []
    for i in range(0, len(data), 16):
        rows.append("    " + ",".join(f"0x{b:02x}" for b in data[i:i + 16]) + ",")
    return "\n".join(rows)


def emit_source(kernels, results, param_sizes) -> str:
    out = [f"""\
// {GEN_CPP}: generated by triton_kernels/aot.py from triton_kernels/manifest.py with
// triton {REQUIRED_TRITON} for sm_90a. Do not edit: rebuild instead.
#include "{GEN_H}"

#include "cuda_driver/driver_api.h"

namespace dflash {{
namespace triton_aot {{
namespace gen {{
namespace {{
"""]
    for idx, (kernel, result) in enumerate(zip(kernels, results)):
        digest = hashlib.sha256(result["cubin"]).hexdigest()
        sizes = ", ".join(str(s) for s in param_sizes[idx])
        out.append(f"""
// {kernel.name}: {len(result['cubin'])} bytes,
// sha256 {digest}
alignas(64) static const unsigned char kCubin{idx}[{len(result['cubin'])}] = {{
{_byte_array(result['cubin'])}
}};
static const uint8_t kParamSizes{idx}[{len(param_sizes[idx])}] = {{{sizes}}};
""")
    out.append("\n}  // namespace\n\nconst KernelImage kKernelImages[kNumKernels] = {\n")
    for idx, (kernel, result) in enumerate(zip(kernels, results)):
        out.append(f"    {{\"{kernel.name}\", \"{result['entry']}\",\n"
                   f"     kCubin{idx}, sizeof(kCubin{idx}), {result['shared']}u, "
                   f"{kernel.num_warps * 32}u, {len(param_sizes[idx])}, kParamSizes{idx}}},\n")
    out.append("};\n")
    for kernel in kernels:
        sig = _wrap(_signature(kernel), " " * 16)
        checks = " ||\n      ".join(f"{n} % 16 != 0" for n in kernel.aligned)
        check_line = (f"  if ({checks}) {{\n    return CUDA_ERROR_INVALID_VALUE;\n  }}\n"
                      if checks else "")
        params = _wrap(", ".join([f"&{n}" for n, _ in kernel.params] +
                                 [f"&{n}" for n in HIDDEN_PARAMS]), " " * 20)
        out.append(f"""
namespace {kernel.name} {{
CUresult launch({sig}) {{
  if (grid_x == 0 || grid_y == 0 || grid_z == 0) return CUDA_SUCCESS;
{check_line}  CUdeviceptr global_scratch = 0;
  CUdeviceptr profile_scratch = 0;
  void* params[] = {{{params}}};
  CUlaunchAttribute attr;
  attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attr.value.programmaticStreamSerializationAllowed = 1;
  CUlaunchConfig config = {{}};
  config.gridDimX = grid_x;
  config.gridDimY = grid_y;
  config.gridDimZ = grid_z;
  config.blockDimX = kNumThreads;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = kSharedBytes;
  config.hStream = stream;
  config.attrs = &attr;
  config.numAttrs = cuda_driver::pdl_enabled() ? 1 : 0;
  return cuda_driver::driver_api().cuLaunchKernelEx(&config, fn, params, nullptr);
}}
}}  // namespace {kernel.name}
""")
    out.append("""
}  // namespace gen
}  // namespace triton_aot
}  // namespace dflash
""")
    return "".join(out)


def write_file(path: Path, text: str | bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    if isinstance(text, bytes):
        tmp.write_bytes(text)
    else:
        tmp.write_text(text, encoding="utf-8", newline="\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, help="directory for the generated files")
    parser.add_argument("--jobs", type=int, default=0,
                        help="compiler processes (default: one per CPU, at most one per kernel)")
    parser.add_argument("--line-info", action="store_true",
                        help="keep line info (for profilers; embeds source paths in the cubins)")
    parser.add_argument("--check", action="store_true",
                        help="only check that triton==%s is importable" % REQUIRED_TRITON)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        if args.check:
            configure_environment(args.line_info, None)
            import_triton()
            return 0
        if args.out_dir is None:
            parser.error("--out-dir is required")
        out_dir = args.out_dir.resolve()
        out_dir.mkdir(parents=True, exist_ok=True)
        cache_dir = out_dir / "triton_cache"
        configure_environment(args.line_info, cache_dir)
        import_triton()  # fail early, with the message, before starting workers
        kernels = list(load_manifest().KERNELS)
        names = [k.name for k in kernels]
        if len(set(names)) != len(names) or not all(n.isidentifier() for n in names):
            raise AotError(f"kernel names must be unique C++ identifiers: {names}")
        jobs = args.jobs or min(len(kernels), os.cpu_count() or 1)
        if jobs <= 1:
            results = [compile_entry(i, args.line_info, str(cache_dir))
                       for i in range(len(kernels))]
        else:
            ctx = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
                futures = [pool.submit(compile_entry, i, args.line_info, str(cache_dir))
                           for i in range(len(kernels))]
                results = [f.result() for f in futures]
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            raise AotError("\n  ".join(errors))
        param_sizes = [validate(k, r) for k, r in zip(kernels, results)]
        for kernel, result in zip(kernels, results):
            write_file(out_dir / f"{kernel.name}.ptx", result["ptx"])
        write_file(out_dir / GEN_CPP, emit_source(kernels, results, param_sizes))
        write_file(out_dir / GEN_H, emit_header(kernels, results))
    except AotError as exc:
        print(f"triton_kernels/aot.py: error: {exc}", file=sys.stderr)
        return 1
    print(f"triton_kernels/aot.py: {len(kernels)} kernels for sm_90a in "
          f"{time.perf_counter() - start:.1f} s -> {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

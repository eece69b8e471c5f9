"""The Triton kernel specialisations that aot.py compiles ahead of time, one entry each.

An entry names a @triton.jit function in a file of this directory, its non-constexpr parameters
in declaration order with their Triton types, the constexpr values, the launch meta-parameters
and the parameters promised to be divisible by 16 (pointers: 16-byte aligned). The generated C++
launcher of an entry checks those promises at run time and returns CUDA_ERROR_INVALID_VALUE when
one does not hold. Names become C++ namespaces in triton_kernels_gen.h, constexpr values become
`kCamelCase` constants there (HEAD_DIM -> kHeadDim), so host code reads tile sizes from the
header instead of repeating them.

Pure data: importing this file imports nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Scalar and pointer types aot.py knows how to pass from C++ (see aot.CPP_TYPES).
_BF16 = "*bf16"
_I32P = "*i32"
_F32P = "*fp32"


@dataclass(frozen=True)
class KernelSpec:
    name: str  # C++ identifier of the specialisation
    source: str  # file in triton_kernels/
    fn: str  # @triton.jit function in `source`
    params: tuple[tuple[str, str], ...]  # (name, Triton type) of every non-constexpr parameter
    constexprs: dict[str, int] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3
    aligned: tuple[str, ...] = ()  # parameters with tt.divisibility = 16
    doc: str = ""
    # Contract a multiply and an add into one FMA where the compiler can (Triton's default).
    # Off where a kernel's bits must not depend on which of its code paths handled a value.
    fp_fusion: bool = True


_PREFILL_PARAMS = (
    ("q_ptr", _BF16), ("k_pool_ptr", _BF16), ("v_pool_ptr", _BF16), ("out_ptr", _BF16),
    ("query_start_ptr", _I32P), ("kv_len_ptr", _I32P), ("block_table_ptr", _I32P),
    ("scale", "fp32"),
    ("num_seqs", "i32"), ("num_heads", "i32"), ("num_kv_heads", "i32"), ("block_size", "i32"),
    ("max_blocks_per_seq", "i32"), ("causal", "i32"), ("window", "i32"), ("symmetric", "i32"),
)
_DECODE_PARAMS = (
    ("q_ptr", _BF16), ("k_pool_ptr", _BF16), ("v_pool_ptr", _BF16), ("out_ptr", _BF16),
    ("workspace_ptr", _F32P),
    ("query_start_ptr", _I32P), ("kv_len_ptr", _I32P), ("block_table_ptr", _I32P),
    ("scale", "fp32"),
    ("num_tokens", "i32"), ("num_heads", "i32"), ("num_kv_heads", "i32"), ("block_size", "i32"),
    ("max_blocks_per_seq", "i32"), ("causal", "i32"), ("window", "i32"), ("symmetric", "i32"),
)
_REDUCE_PARAMS = (
    ("workspace_ptr", _F32P), ("out_ptr", _BF16),
    ("num_tokens", "i32"), ("num_heads", "i32"), ("num_splits", "i32"),
)
_CHUNKED_PARAMS = (
    ("q_ptr", _BF16), ("k_pool_ptr", _BF16), ("v_pool_ptr", _BF16), ("out_ptr", _BF16),
    ("workspace_ptr", _F32P),
    ("query_start_ptr", _I32P), ("kv_len_ptr", _I32P), ("block_table_ptr", _I32P),
    ("scale", "fp32"),
    ("num_tokens", "i32"), ("num_seqs", "i32"), ("num_heads", "i32"), ("num_kv_heads", "i32"),
    ("block_size", "i32"), ("max_blocks_per_seq", "i32"), ("causal", "i32"), ("window", "i32"),
    ("symmetric", "i32"), ("split", "i32"),
)
_FOLD_PARAMS = (
    ("workspace_ptr", _F32P), ("out_ptr", _BF16), ("query_start_ptr", _I32P), ("kv_len_ptr", _I32P),
    ("num_tokens", "i32"), ("num_seqs", "i32"), ("num_heads", "i32"), ("num_chunks", "i32"),
)
_ATTN_ALIGNED = ("q_ptr", "k_pool_ptr", "v_pool_ptr", "out_ptr")

# Split-KV: the reduce kernel combines at most this many partials per row.
MAX_SPLITS = 32
# The batch-invariant kernel's key chunk (keys per chunk, at fixed positions; a multiple of its
# BLOCK_N): a row's bits depend on it, so every launch of a deterministic session uses this one.
KEY_CHUNK = 256


def _prefill(head_dim: int, block_m: int, block_n: int, num_warps: int,
             num_stages: int) -> KernelSpec:
    return KernelSpec(
        name=f"paged_attention_prefill_hd{head_dim}",
        source="paged_attention.py",
        fn="paged_attention_prefill_kernel",
        params=_PREFILL_PARAMS,
        constexprs={"HEAD_DIM": head_dim, "BLOCK_M": block_m, "BLOCK_N": block_n},
        num_warps=num_warps,
        num_stages=num_stages,
        aligned=_ATTN_ALIGNED,
        doc="any number of queries per sequence; "
            "grid (T / (BLOCK_M / group) + num_seqs, num_kv_heads)",
        # Batch invariance (deterministic=True runs every row through this kernel): whether a
        # key tile takes the masked or the unmasked loop depends on the tile's FIRST query, so
        # on the other rows of the launch. With fusion the unmasked loop computes
        # exp2(fma(scale, qk, -m)) and the masked one exp2(round(scale * qk) - m) (the mask's
        # select sits between the multiply and the subtraction): a row's scores then change
        # with the rows beside it. Without fusion both loops round the same way.
        fp_fusion=False,
    )


def _decode(head_dim: int, block_m: int, block_n: int, num_warps: int) -> KernelSpec:
    return KernelSpec(
        name=f"paged_attention_decode_hd{head_dim}_m{block_m}",
        source="paged_attention.py",
        fn="paged_attention_decode_kernel",
        params=_DECODE_PARAMS,
        constexprs={"HEAD_DIM": head_dim, "BLOCK_M": block_m, "BLOCK_N": block_n},
        num_warps=num_warps,
        num_stages=3,
        aligned=_ATTN_ALIGNED + ("workspace_ptr",),
        doc="num_q * group <= BLOCK_M per sequence; grid (num_seqs, num_kv_heads, num_splits)",
    )


def _reduce(head_dim: int) -> KernelSpec:
    return KernelSpec(
        name=f"paged_attention_split_reduce_hd{head_dim}",
        source="paged_attention.py",
        fn="paged_attention_split_reduce_kernel",
        params=_REDUCE_PARAMS,
        constexprs={"HEAD_DIM": head_dim, "MAX_SPLITS": MAX_SPLITS},
        num_warps=4,
        num_stages=1,
        aligned=("workspace_ptr", "out_ptr"),
        doc="combines the split-KV partials; grid (T, num_heads)",
    )


def _chunked(head_dim: int, num_warps: int) -> KernelSpec:
    return KernelSpec(
        name=f"paged_attention_chunked_hd{head_dim}",
        source="paged_attention.py",
        fn="paged_attention_chunked_kernel",
        params=_CHUNKED_PARAMS,
        constexprs={"HEAD_DIM": head_dim, "BLOCK_M": 64, "BLOCK_N": 64, "KEY_CHUNK": KEY_CHUNK},
        num_warps=num_warps,
        num_stages=2,
        aligned=_ATTN_ALIGNED + ("workspace_ptr",),
        doc="batch-invariant, any number of queries per sequence; grid (T / (BLOCK_M / group) + "
            "num_seqs, num_kv_heads, key chunks when split else 1)",
        # As the prefill kernel (masked and unmasked loops round alike), and the chunk folds of
        # this kernel and of the fold kernel must round alike too.
        fp_fusion=False,
    )


def _chunk_fold(head_dim: int) -> KernelSpec:
    return KernelSpec(
        name=f"paged_attention_chunk_fold_hd{head_dim}",
        source="paged_attention.py",
        fn="paged_attention_chunk_fold_kernel",
        params=_FOLD_PARAMS,
        constexprs={"HEAD_DIM": head_dim, "KEY_CHUNK": KEY_CHUNK, "UNROLL": 8},
        num_warps=1,
        num_stages=1,
        aligned=("workspace_ptr", "out_ptr"),
        doc="folds the chunked kernel's split partials in chunk order, up to the token's kv_len; "
            "grid (T, num_heads)",
        fp_fusion=False,
    )


# Tiles, warps and stages from a sweep on an H200 (triton 3.6.0, JIT without value
# specialisation, do_bench). Prefill 4k causal: hd128 32/8 BLOCK 128x128 w8 480-486 us vs
# 128x64 w8 541 us; hd64 9/3 64x64 w4 111 us vs 128x64 w4 125 us. Decode hd128 32/8 (m16):
# BLOCK_N 64 w2 142 us at batch 64 x 2k keys vs 192 us with w4, within 6% of the best at batch
# 8 x 4k and 1 x 32k (split-KV). hd64 9/3 decode: BLOCK_N 128 w4 14.4 us vs 16.5 us at batch
# 8 x 2k. Verify (m64): 64x64 w4 best at batch 4 x 4k and 32 x 2k.
KERNELS: tuple[KernelSpec, ...] = (
    _prefill(64, block_m=64, block_n=64, num_warps=4, num_stages=3),
    _prefill(128, block_m=128, block_n=128, num_warps=8, num_stages=2),
    _decode(64, 16, block_n=128, num_warps=4),
    _decode(64, 64, block_n=64, num_warps=4),
    _decode(128, 16, block_n=64, num_warps=2),
    _decode(128, 64, block_n=64, num_warps=4),
    _reduce(64),
    _reduce(128),
    _chunked(64, num_warps=4),
    _chunked(128, num_warps=8),
    _chunk_fold(64),
    _chunk_fold(128),
)

# DFlash2's lattice walk (lattice_walk.py): one program of one warp per request, K <= BLOCK_K
# candidates per slot in registers; lattice_walk.cpp launches the smallest BLOCK_K >= K.
_WALK_PARAMS = (
    ("edges_ptr", _F32P), ("ids_ptr", _I32P), ("params_ptr", _I32P), ("drafts_ptr", _I32P),
    ("realized_ptr", _F32P), ("num_slots", "i32"), ("k", "i32"), ("greedy_walk", "i32"),
)
WALK_BLOCK_KS = (4, 8, 16, 32, 64)


def _walk(block_k: int) -> KernelSpec:
    return KernelSpec(
        name=f"lattice_walk_k{block_k}",
        source="lattice_walk.py",
        fn="lattice_walk_kernel",
        params=_WALK_PARAMS,
        constexprs={"BLOCK_K": block_k},
        num_warps=1,
        num_stages=1,
        doc="K <= BLOCK_K candidates per slot; grid (num_reqs,)",
    )


KERNELS += tuple(_walk(block_k) for block_k in WALK_BLOCK_KS)

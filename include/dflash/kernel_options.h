// dflash::KernelOptions: which kernels a session's backend uses, for A/B timing and debugging.
// Outputs stay within each backend's numerics whatever is chosen. The environment variables
// DFLASH_GEMM, DFLASH_FUSED, DFLASH_ATTENTION, DFLASH_L2_PREFETCH, DFLASH_ROPE_ATTENTION,
// DFLASH_PDL, DFLASH_CPU_GEMM, DFLASH_CUBLASLT_PATH and DFLASH_BATCH_INVARIANT, when set, override
// these fields once, when a session opens.
#pragma once

#include <string>

namespace dflash {

struct KernelOptions {
  // CUDA linear layers: "auto" (the skinny kernel for small weights, N x K <= 4096 x 4096, where
  // it measured faster on the H200; cuBLASLt for the rest), "cublaslt", "skinny" (every layer
  // the skinny kernel supports), "stream" (every layer of up to 16 rows on the streaming
  // skinny kernel, persistent CTAs with a cp.async weight ring, where it supports the shape) or
  // "routed" (as auto, but up to 8 rows of the mid-size weights, K >= 2048 and N x K <= 8192^2 such
  // as Qwen3-8B's QKV, O and down projections, on the streaming kernel, where it led cuBLASLt in
  // isolation; opt-in until an A/B of the whole step confirms it).
  std::string gemm = "auto";
  // CUDA: norms and activations fused into the skinny GEMMs (false: the unfused kernels).
  bool fused_layers = true;
  // CUDA decode attention: "auto" (the CUDA-core split-KV kernel for the AR step's few rows at
  // batch <= 2 of 8 KV heads, else Triton), "triton" (always the AOT Triton kernels),
  // "tensor_cores" (the tensor-core split-KV kernel for every launch of up to 64 rows per KV head:
  // AR, verify and drafter blocks; opt-in, for A/B timing) or "staged" (as "auto", with the
  // CUDA-core kernel's K/V staged in shared memory by cp.async instead of held in registers: fewer
  // registers, the same bits; opt-in until measured in the step; with rope_attention too, the
  // staged kernel runs the fused prologue).
  std::string attention = "auto";
  // CUDA: the weights of a decoder layer's linear layers loaded into L2 ahead of their GEMM, in
  // the time that the latency-bound kernels before it (norms, RoPE, decode attention) leave HBM
  // idle: "off", "all", or a comma-separated list of qkv, o, gate_up, down. The O projection is
  // prefetched whole during its attention, the others only a prefix the size of the gap before
  // them (decoder_layer.cpp); weights under 8 MiB never. Results do not change.
  std::string l2_prefetch = "off";
  // CUDA: the QKV split, per-head norm, RoPE and K/V write folded into the decode attention
  // kernel's prologue (one launch fewer per layer) where the CUDA-core decode kernel runs (the AR
  // step at batch <= 2 under attention "auto"); elsewhere, and with false, the separate RoPE kernel.
  // Results do not change (same bits). Off by default: one A/B job on the H200 (2026-12-05, one
  // repeat) gave the batch-1 AR step 2 % faster; to be confirmed with repeats before it ships.
  bool rope_attention = false;
  // CUDA: programmatic dependent launch. Process-wide: the last CUDA session opened sets it.
  bool programmatic_launch = true;
  // CPU GEMMs: "auto" (every GEMM on the AVX-512 skinny kernel where the CPU has AVX-512; else 2..16
  // rows on the AVX2/FMA one and the rest on OpenBLAS split over the backend's threads), "avx512" /
  // "avx2" (that skinny kernel; an error where the CPU lacks it) or "blas" (OpenBLAS on its own
  // threads for every GEMM).
  std::string cpu_gemm = "auto";
  // CUDA: a libcublasLt.so to try before the default names. Process-wide: the first CUDA session
  // loads the library.
  std::string cublaslt_path;
  // CUDA: batch-invariant kernels (the Python Session's deterministic=True). Every linear layer
  // and every attention call reduces each row in an order that depends on the model's shapes
  // only, never on the number of rows, the batch or the kind of step, so a position's logits
  // have the same bits decoded alone, in a batch, in a speculative verify step or in a prefill:
  // speculative greedy output equals target-only greedy output token for token. Slower (linear
  // layers on one fixed-order shape, no cuBLASLt: up to 16 rows on the streaming kernel, more in
  // 16-row slices of the skinny kernel, with the same bits; attention on one
  // Triton kernel that folds key chunks at fixed positions in order, split over the chunks at
  // small batch). The CPU backend does not implement it (an error).
  bool batch_invariant = false;
};

}  // namespace dflash

// DFlash2's lattice walk through the ahead-of-time compiled Triton kernel (lattice_walk.py): per
// request, the greedy or Gumbel-sampled walk over the K candidates of each of S slots, draw for
// draw the CPU backend's walk_request (cpp/backend/cpu/host_candidates.cpp). lattice_walk()
// picks the smallest compiled BLOCK_K >= k and launches one program per request on the given
// stream. It never allocates, synchronises or throws, so it can be captured into CUDA graphs (the
// launch depends only on the host-side sizes: keep them fixed for a captured graph).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "triton_kernels/triton_attention.h"  // Modules

namespace dflash {
namespace triton_aot {

struct LatticeWalkArgs {
  // Device, contiguous. edges [num_reqs, slots, k, k] fp32: edges[b, s, p, c] scores candidate c
  // of slot s after candidate p of slot s - 1; ids [num_reqs, slots, k] int32 candidate token ids;
  // params [num_reqs] SampleRow (common/sample_row.h, 32 bytes: temperature, seed and the
  // position of the first draft are read).
  const float* edges = nullptr;
  const int32_t* ids = nullptr;
  const void* params = nullptr;
  // Outputs. drafts [num_reqs, slots] int32: ids[b, s, idx_s]; realized [num_reqs, slots, k] fp32:
  // the row edges[b, s, idx_{s-1}, :] the slot drew from (idx_{-1} = 0), copied bit for bit.
  int32_t* drafts = nullptr;
  float* realized = nullptr;
  int32_t num_reqs = 0, slots = 0, k = 0;
  // The greedy walk at every temperature (argmax as at T <= 0), with realized one-hot: 0 at the
  // walked candidate, -inf elsewhere (q = softmax(realized / T) puts all its mass on the draft).
  bool greedy_walk = false;
};

// Largest k lattice_walk() supports (the largest compiled BLOCK_K).
int32_t lattice_walk_max_k();

// Per request b with T = params[b].temperature: prev = 0; for s in [0, slots): row =
// edges[b, s, prev, :]; T <= 0: idx = argmax(row) (NaN as -inf, lowest index on ties, 0 when all
// are -inf); else idx = argmax over the entries that are neither NaN nor -inf of
// double(row[i]) / T - log(-log(u_i)), u_i = philox_uniform(seed, position + s, ids[b, s, i],
// kStreamDraftSample) (the greedy rule when there is none); drafts[b, s] = ids[b, s, idx],
// realized[b, s, :] = row, prev = idx. Returns CUDA_ERROR_INVALID_VALUE for k outside
// [1, lattice_walk_max_k()], negative sizes or null pointers, CUDA_SUCCESS without launching when
// num_reqs or slots is 0, else the launch's result.
CUresult lattice_walk(const Modules& m, cudaStream_t stream, const LatticeWalkArgs& a);

}  // namespace triton_aot
}  // namespace dflash

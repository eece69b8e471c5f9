// The registry of hand-written CUDA kernels: one launcher per op, each in its own .cu file.
// Launchers never allocate, never synchronise and never throw: they return cudaError_t.
// Activations and weights are bf16 ([...] shapes are row-major, contiguous unless a stride is
// given); accumulation is fp32; logits are fp32. All launch on `stream`.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "common/sample_row.h"
#include "cuda/paged_attention_args.h"

namespace dflash {
namespace cuda {

// out[T, H] = table[ids[T], :]; ids outside [0, vocab) write zeros and set *bad_id (device
// int32, may be null) to 1.
cudaError_t embedding(const __nv_bfloat16* table, const int32_t* ids, int64_t num_tokens, int64_t hidden,
                      int64_t vocab, __nv_bfloat16* out, int32_t* bad_id, cudaStream_t stream);

// out[R, H] = rmsnorm(x[R, H]) * w[H]   (fp32 statistics)
cudaError_t rms_norm(const __nv_bfloat16* x, const __nv_bfloat16* w, int64_t rows, int64_t hidden, float eps,
                     __nv_bfloat16* out, cudaStream_t stream);

// residual[R, H] += x[R, H]; out = rmsnorm(residual) * w   (residual kept in bf16, sum in fp32)
cudaError_t add_rms_norm(__nv_bfloat16* residual, const __nv_bfloat16* x, const __nv_bfloat16* w, int64_t rows,
                         int64_t hidden, float eps, __nv_bfloat16* out, cudaStream_t stream);

// out[R, I] = silu(gate_up[R, :I]) * gate_up[R, I:]
cudaError_t silu_mul(const __nv_bfloat16* gate_up, int64_t rows, int64_t inter, __nv_bfloat16* out,
                     cudaStream_t stream);

// out[n] = a[n] + b[n]
cudaError_t add(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n, __nv_bfloat16* out,
                cudaStream_t stream);

// Splits qkv[T, (nh + 2 nkv) hd] into q[T, nh, hd], k[T, nkv, hd], v[T, nkv, hd]; per-head
// RMSNorm of q and k when q_norm / k_norm [hd] are non-null (Qwen3); rotate-half RoPE at
// positions[T] with inv_freq[hd/2] (fp32), angle = position * inv_freq in fp32.
// num_heads may be 0 (the drafter's context path: K/V only), then q may be null.
cudaError_t qkv_norm_rope(const __nv_bfloat16* qkv, const __nv_bfloat16* q_norm, const __nv_bfloat16* k_norm,
                          float eps, const int32_t* positions, const float* inv_freq, int64_t num_tokens,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, __nv_bfloat16* q,
                          __nv_bfloat16* k, __nv_bfloat16* v, cudaStream_t stream);

// The same with K and V written straight into one layer's paged pools: k_pool / v_pool
// [num_slots, nkv * hd] rows slots[T] (a negative slot is skipped); q as above.
cudaError_t qkv_norm_rope_write(const __nv_bfloat16* qkv, const __nv_bfloat16* q_norm,
                                const __nv_bfloat16* k_norm, float eps, const int32_t* positions,
                                const float* inv_freq, const int32_t* slots, int64_t num_tokens,
                                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, __nv_bfloat16* q,
                                __nv_bfloat16* k_pool, __nv_bfloat16* v_pool, cudaStream_t stream);

// k_pool/v_pool [num_slots, nkv * hd] of one layer: rows slots[T] = k[T], v[T].
cudaError_t kv_write(const __nv_bfloat16* k, const __nv_bfloat16* v, const int32_t* slots, int64_t num_tokens,
                     int64_t row_elems, __nv_bfloat16* k_pool, __nv_bfloat16* v_pool, cudaStream_t stream);

// out[R, W] = x[rows[R], :]   (elem_bytes = 2 for bf16, 4 for fp32)
cudaError_t gather_rows(const void* x, const int32_t* rows, int64_t num_rows, int64_t width, int64_t elem_bytes,
                        void* out, cudaStream_t stream);

// dst[R, col:col + C] = src[R, C]  with dst row stride dst_width (bf16)
cudaError_t copy_columns(const __nv_bfloat16* src, int64_t rows, int64_t cols, __nv_bfloat16* dst,
                         int64_t dst_width, int64_t col, cudaStream_t stream);

// Skinny GEMM (decode / speculative verify): out[M, N] = x[M, K] @ w[N, K]^T, bf16 x and w, fp32
// accumulation, out bf16, or fp32 when out_f32. Needs 1 <= M <= kSkinnyGemmMaxRows, K % 8 == 0,
// x and w 16-byte aligned (skinny_gemm_supports); any N. Returns cudaErrorInvalidValue otherwise
// (M == 0 or N == 0: nothing to do, cudaSuccess). Deterministic: the same bits on every run.
constexpr int64_t kSkinnyGemmMaxRows = 32;
bool skinny_gemm_supports(const void* x, const void* w, int64_t m, int64_t k);
// The kernel's shape, for benchmarks (0: the launcher's choice): warps per CTA (1..16, they
// split K), row tiles of 16 w rows per warp (1 or 2), chunks of 32 k per warp per step (4, or 8
// with M <= 16). Combinations that are not built return cudaErrorInvalidValue.
// batch_invariant: one shape for every M (16 columns, 4 chunks per step, one row tile, row_tiles /
// unroll ignored; any M, run in slices of kBatchInvariantRows rows inside one launch), so each
// output's reduction order depends on K and N only: a row gets the same bits whatever the other
// rows of the launch.
struct SkinnyGemmConfig {
  int warps = 0;
  int row_tiles = 0;
  int unroll = 0;
  bool batch_invariant = false;
};
constexpr int64_t kBatchInvariantRows = 16;
// Warps per CTA of the batch-invariant shape for N output columns (the skinny launchers' choice).
// The streaming kernel launched batch-invariant with these warps (StreamGemmConfig) computes every
// output with the same bits as the skinny kernel's batch-invariant launch: the same k chunks per
// warp, accumulator sets, mma order and warp sum (stream_gemm.cu's top).
int batch_invariant_warps(int64_t n);
cudaError_t skinny_gemm(const __nv_bfloat16* x, const __nv_bfloat16* w, int64_t m, int64_t n, int64_t k,
                        bool out_f32, void* out, cudaStream_t stream, const SkinnyGemmConfig* config = nullptr);

// Fused skinny GEMM of a decoder layer, for M <= kSkinnyFusedMaxRows rows, or any M with
// batch_invariant (M, K, shared memory: skinny_gemm_fused_supports). The input transform builds the GEMM's x in shared memory first:
//   kRmsNorm   x = bf16(gamma * (in * rsqrt(mean(in^2) + eps)))  in [M, K]   (the rms_norm kernel's formula)
//   kSiluMul   x = bf16(silu(gate) * up)                        in [M, 2K] = [gate | up] (silu_mul's)
// and with `add` the output is accumulated into out (a bf16 residual stream: out = bf16(out + x @ w^T)).
enum class SkinnyInput { kPlain = 0, kRmsNorm = 1, kSiluMul = 2 };
struct SkinnyFusion {
  SkinnyInput input = SkinnyInput::kPlain;
  const __nv_bfloat16* gamma = nullptr;  // [K], kRmsNorm
  float eps = 0.0f;                      // kRmsNorm
  bool add = false;
  bool batch_invariant = false;  // the shape of SkinnyGemmConfig::batch_invariant, any M (slices of 16)
};
constexpr int64_t kSkinnyFusedMaxRows = 16;
bool skinny_gemm_fused_supports(const void* in, const void* w, int64_t m, int64_t k, const SkinnyFusion& fusion);
cudaError_t skinny_gemm_fused(const __nv_bfloat16* in, const __nv_bfloat16* w, int64_t m, int64_t n, int64_t k,
                              const SkinnyFusion& fusion, __nv_bfloat16* out, cudaStream_t stream);

// Streaming skinny GEMM (cuda/stream_gemm.cu): the product and fusions of skinny_gemm_fused
// (plus the plain product, whose out may be fp32) from persistent CTAs that keep every warp's
// weight copies in flight through a shared-memory ring, across tiles and kernel boundaries.
// M <= kStreamGemmMaxRows, K % 8 == 0, 16-byte aligned inputs; stream_gemm_supports says whether a
// launch shape fits (shared memory). config (benchmarks; 0 = the launcher's choice): warps per CTA
// (1..16), stages (3, 4 or 6; 6 plain only), unroll (4, or 8 with M <= 8 plain), CTAs per SM (at
// most the occupancy); batch_invariant: one shape for every M <= 16 (NT 2, U 4, W from K unless given,
// smem for 16 rows); with warps = batch_invariant_warps(N) its outputs have the bits of the skinny
// kernel's batch-invariant launch (the backend's deterministic mode runs M <= 16 here where it fits).
struct StreamGemmConfig {
  int warps = 0;
  int stages = 0;
  int unroll = 0;
  int ctas_per_sm = 0;
  bool batch_invariant = false;
  int min_warps = 0;  // with warps 0: the launcher's shape only if it keeps at least this many warps
};
constexpr int64_t kStreamGemmMaxRows = 16;
bool stream_gemm_supports(const void* in, const void* w, int64_t m, int64_t k, const SkinnyFusion& fusion,
                          bool out_f32, const StreamGemmConfig* config = nullptr);
cudaError_t stream_gemm(const __nv_bfloat16* in, const __nv_bfloat16* w, int64_t m, int64_t n, int64_t k,
                        const SkinnyFusion& fusion, bool out_f32, void* out, cudaStream_t stream,
                        const StreamGemmConfig* config = nullptr);

// Starts loading w[0, bytes) into L2 for a later kernel (cuda/l2_prefetch.cu): bulk prefetches
// over up to max_blocks CTAs of one warp, issued while the kernel ahead still runs; the kernel
// ends after that one (stream order kept). A hint: nothing is written. w 16-byte aligned,
// bytes > 0 (a tail of bytes % 16 is not prefetched), max_blocks >= 1; cudaErrorInvalidValue
// otherwise.
cudaError_t l2_prefetch(const void* w, int64_t bytes, int max_blocks, cudaStream_t stream);

// Test utility (cuda/late_copy.cu): dst row r = src row r for r in rows[0, num_rows) (dst and src
// [total_rows] rows of row_bytes, a multiple of 16, 16-byte aligned; rows outside [0, total_rows)
// are skipped), written delay_ns after the kernel ahead completed, while the next kernel in the
// stream (launched programmatically) has already started.
cudaError_t late_copy_rows(void* dst, const void* src, int64_t total_rows, const int32_t* rows, int64_t num_rows,
                           int64_t row_bytes, uint32_t delay_ns, cudaStream_t stream);

// fp32 <-> bf16 element conversion
cudaError_t bf16_to_f32(const __nv_bfloat16* x, int64_t n, float* out, cudaStream_t stream);
cudaError_t f32_to_bf16(const float* x, int64_t n, __nv_bfloat16* out, cudaStream_t stream);

// tokens[R] = argmax / sample of logits[R, V] (fp32) with params[R]: Gumbel-max over the
// tokens kept by top-k / top-p at the row's temperature, randomness from Philox keyed by
// (seed, position, token id) on the target-sampling stream (common/philox.h, the same stream
// definition as the CPU backend).
cudaError_t sample(const float* logits, int64_t rows, int64_t vocab, const SampleRow* params, int32_t* tokens,
                   cudaStream_t stream);

// Acceptance of n draft tokens per request without a host round trip per token.
// drafts [R, n]; logits [R, n + 1, V] fp32 (row j: the target's distribution for the token at
// position params[r].position + j, where drafts[r, j] sits); params[r].position = position of
// the first draft. Greedy rows: longest prefix where draft == argmax, then the argmax after it.
// Sampling rows: exact rejection sampling for a one-hot proposal with temperature/top-k/top-p
// applied to the target: accept d with probability p(d) (uniform on the acceptance stream),
// on rejection draw from p without d, after a full accept draw the bonus from p.
// Outputs num_accepted[R] (0..n) and next_token[R].
cudaError_t accept_drafts(const int32_t* drafts, const float* logits, int64_t num_seqs, int64_t n, int64_t vocab,
                          const SampleRow* params, int32_t* num_accepted, int32_t* next_token,
                          cudaStream_t stream);

// The drafter's context path after the stacked K/V GEMM: kv[C, 2 nkv hd] (K then V of one
// layer) → k = RMSNorm(K) per head with k_norm[hd], RoPE at positions[C]; write k, v into that
// layer's pools [num_slots, nkv * hd] at slots[C].
cudaError_t kv_norm_rope_write(const __nv_bfloat16* kv, const __nv_bfloat16* k_norm, float eps,
                               const int32_t* positions, const float* inv_freq, const int32_t* slots,
                               int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, __nv_bfloat16* k_pool,
                               __nv_bfloat16* v_pool, cudaStream_t stream);

// The same for all L drafter layers at once (after the stacked K/V GEMM): kv[C, L, 2 nkv hd],
// k_norm[L, hd] or null; layer l's pools start at k_pool / v_pool + l * pool_layer_elems.
cudaError_t kv_norm_rope_write_layers(const __nv_bfloat16* kv, const __nv_bfloat16* k_norm, float eps,
                                      const int32_t* positions, const float* inv_freq, const int32_t* slots,
                                      int64_t num_tokens, int64_t num_layers, int64_t num_kv_heads,
                                      int64_t head_dim, int64_t pool_layer_elems, __nv_bfloat16* k_pool,
                                      __nv_bfloat16* v_pool, cudaStream_t stream);

// out[R] = argmax of each row of logits[R, V] (lowest id on ties; NaN never wins).
cudaError_t argmax_rows(const __nv_bfloat16* logits, int64_t rows, int64_t vocab, int32_t* out, cudaStream_t stream);
cudaError_t argmax_rows(const float* logits, int64_t rows, int64_t vocab, int32_t* out, cudaStream_t stream);

// flags[R] = 1 where row r of logits[R, V] (fp32) holds a NaN or an infinity, else 0.
cudaError_t nonfinite_rows(const float* logits, int64_t rows, int64_t vocab, int32_t* flags, cudaStream_t stream);

// Per request r of `rows`: drafts[r, :] = use_override[r] ? override_drafts[r, :] : proposed[r, :]
// (each [n]); verify_ids[r, 1 + j] = drafts[r, j] in verify_ids [rows, n + 1].
cudaError_t assemble_drafts(const int32_t* proposed, const int32_t* override_drafts, const int32_t* use_override,
                            int64_t rows, int64_t n, int32_t* drafts, int32_t* verify_ids, cudaStream_t stream);

// ids[R]: ids[i] = feed[i] >= 0 ? prev[feed[i]] : ids[i]  (a pipelined decode step's anchors,
// taken from the previous step's sampled tokens prev[] on the device)
cudaError_t feed_tokens(int32_t* ids, const int32_t* feed, const int32_t* prev, int64_t rows, cudaStream_t stream);
// Backend::feed_spec_inputs over b requests of q rows: block_table [b, width], params [b].
cudaError_t feed_spec_inputs(const int32_t* feed, const int32_t* num_accepted, const int32_t* next_token,
                             const int32_t* block_table, int64_t width, int64_t b, int64_t q, int64_t block_size,
                             int32_t* ids, int32_t* verify_ids, int32_t* positions, int32_t* slots, int32_t* kv_len,
                             int32_t* anchors, SampleRow* params, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// DFlash2 candidate drafting and exact acceptance with proposal rows (backend.h gives the ops'
// semantics; backend/cpu/host_candidates.h is the host reference every kernel is tested against).

// One side (0 = prepare, 1 = finish) of the grouped dynamic depthwise conv over contiguous blocks
// of `block` rows (taps never cross a block), G = hidden / group:
//   y[i, c] = sum_{t < taps, t <= i mod block} (base[side, t, c] + deltas[i, (side * taps + t) * G + c / group])
//             * x[i - t, c]
// x [rows, hidden], base [2, taps, hidden], deltas [rows, 2 * taps * G] (bf16; fp32 math);
// out [rows, hidden] = y, or out += y when accumulate (a residual stream). out must not alias x.
// Needs hidden % group == 0, rows % block == 0, 1 <= taps <= kConvMaxTaps.
constexpr int64_t kConvMaxTaps = 8;
cudaError_t grouped_conv(const __nv_bfloat16* x, const __nv_bfloat16* base, const __nv_bfloat16* deltas,
                         int64_t rows, int64_t hidden, int64_t taps, int64_t group, int64_t side, int64_t block,
                         bool accumulate, __nv_bfloat16* out, cudaStream_t stream);

// x[n] *= factor (bf16 in place; fp32 math)
cudaError_t scale_bf16(__nv_bfloat16* x, int64_t n, float factor, cudaStream_t stream);

// Exact radix top-K per row of logits [rows, vocab] (fp32), one launch for all rows: the K
// largest values, sorted descending, lowest id first on ties; NaN ranks below every number (a row
// with fewer than K numbers fills up with its NaN ids, lowest first, valued -inf); -inf is a
// number. ids [rows, K] int32; unary [rows, K] fp32 = v * multiplier, then
// softcap * tanh(. / softcap) when softcap > 0 (on the K values only). Deterministic.
// workspace: topk_workspace_bytes(rows, vocab, k) bytes (device); counters: int32 [rows] zeroed
// once by the owner (the kernel leaves them zero). 1 <= k <= kTopkMaxK, vocab <= kTopkMaxVocab.
constexpr int64_t kTopkMaxK = 64;
constexpr int64_t kTopkMaxVocab = 262144;
size_t topk_workspace_bytes(int64_t rows, int64_t vocab, int64_t k);
cudaError_t topk_candidates(const float* logits, int64_t rows, int64_t vocab, int64_t k, float multiplier,
                            float softcap, int32_t* ids, float* unary, void* workspace, size_t workspace_bytes,
                            int32_t* counters, cudaStream_t stream);

// Edge scores of the candidate lattice (fp32 out, fp32 accumulation):
//   edges[b, s, p, c] = unary[b, s, c] + sum_j A[pred(b, s, p), j] * gate[b, s, j] * B[ids[b, s, c], j]
//   pred(b, 0, p) = anchors[b], pred(b, s, p) = ids[b, s - 1, p]
// ids [R, S, K] int32, unary [R, S, K] fp32, gate [R, S, rank] fp32, anchors [R] int32, codebooks
// A (predecessor), B (successor) [vocab, rank] bf16. An id outside [0, vocab) contributes a zero
// codebook row. K <= kTopkMaxK, rank <= kEdgeMaxRank.
constexpr int64_t kEdgeMaxRank = 1024;
cudaError_t edge_scores(const int32_t* ids, const float* unary, const float* gate, const int32_t* anchors,
                        const __nv_bfloat16* pred_codebook, const __nv_bfloat16* succ_codebook, int64_t num_reqs,
                        int64_t slots, int64_t k, int64_t rank, int64_t vocab, float* edges, cudaStream_t stream);

// Acceptance with the drafter's proposal rows (exact rejection sampling; host reference:
// accept_candidates_request in backend/cpu/host_candidates.h). drafts [R, n]; logits [R, n + 1, V]
// fp32; params [R] (position = the first draft's). Draft j of request r was drawn from
// q = softmax(realized[r, j, :] / T) over cand_ids[r, j, :] (cand_ids [R, n, K], realized
// [R, n, K]), or, with cand_ids == nullptr, over the whole vocabulary (K == V, column i = token i:
// DFlash's probabilistic drafts). T > 0 rows: accept x iff u * q(x) < p(x) (q(x) > 0), u =
// philox_uniform(seed, position + j, 0, kStreamAccept), p the row's temperature / top-k / top-p
// distribution; on the first rejection the token is a draw from norm(max(p - q, 0)) (from p when
// that is all zero); after n accepts the bonus is drawn from p (target-sampling stream). T = 0
// rows: as accept_drafts (greedy). Outputs num_accepted [R] (0..n), next_token [R].
cudaError_t accept_candidates(const int32_t* drafts, const int32_t* cand_ids, const float* realized, int64_t k,
                              const float* logits, int64_t num_seqs, int64_t n, int64_t vocab,
                              const SampleRow* params, int32_t* num_accepted, int32_t* next_token,
                              cudaStream_t stream);

// Probabilistic DFlash drafts: drafts[i] for row i of logits [rows, V] (fp32), request i / n with
// params[i / n]: at T > 0 a Gumbel-max draw from softmax(logits / T), the noise
// -log(-log(philox_uniform(seed, position + i % n, token, kStreamDraftSample))); at T = 0 the
// argmax (lowest id on ties). Host reference: sample_draft_token (backend/cpu/host_candidates.h).
cudaError_t sample_drafts(const float* logits, int64_t rows, int64_t n, int64_t vocab, const SampleRow* params,
                          int32_t* drafts, cudaStream_t stream);

// Paged decode attention for launches with max_query_len * group <= 64 rows per (sequence, KV
// head), head_dim 64 or 128: up to 16 rows on CUDA cores (decode_attention.cu: the AR step), 17..64
// on tensor cores (decode_attention_mma.cu: the verify step, the drafter's block; every row count
// with PagedAttentionArgs::force_tensor_cores). The PagedAttentionArgs of the Triton paged
// attention (cuda/paged_attention_args.h; counters for split-KV), split-KV with the combine done by
// the last CTA of each (sequence, KV head), so one launch. The split count depends only on the
// host-side fields (CUDA-graph safe).
constexpr int64_t kDecodeAttentionMaxRows = 64;
// nullptr when supported, else why not.
const char* decode_attention_check(const PagedAttentionArgs& args);
int decode_attention_max_splits();
size_t decode_attention_workspace_bytes(int64_t num_tokens, int64_t num_heads, int64_t head_dim, int splits);
// The split count decode_attention() launches for these arguments.
int decode_attention_splits(const PagedAttentionArgs& args);
cudaError_t decode_attention(const PagedAttentionArgs& args, cudaStream_t stream);

// decode_attention with qkv_norm_rope_write fused into it (the CUDA-core kernel only: at most 16
// rows per (sequence, KV head); head_dim 64 or 128): args.q is unused; the queries are built from
// qkv [T, (nh + 2 nkv) hd] (per-head RMSNorm with q_norm when set, RoPE at positions[T]), and the
// K (k_norm, RoPE) and V of every token of a sequence go into args' pools at slots[T] (negative:
// not written) before its key is read. Token t must be the key at position kv_len - num_q + i of
// its sequence (i its index among the sequence's queries), the ragged layout's invariant; unlike
// qkv_norm_rope_write, tokens outside every sequence's query range (and sequences whose kv_len is
// below their query count) are not written. The queries, the
// pools and the output have the bits of qkv_norm_rope_write followed by decode_attention.
struct DecodeRopeArgs {
  const __nv_bfloat16* qkv = nullptr;     // [T, (nh + 2 nkv) hd]
  const __nv_bfloat16* q_norm = nullptr;  // [hd] or null (no per-head norm)
  const __nv_bfloat16* k_norm = nullptr;  // [hd] or null
  float eps = 0.0f;
  const int32_t* positions = nullptr;  // [T]
  const float* inv_freq = nullptr;     // [hd / 2]
  const int32_t* slots = nullptr;      // [T] pool rows (block * block_size + offset)
};
// nullptr when supported, else why not.
const char* decode_attention_rope_check(const PagedAttentionArgs& args, const DecodeRopeArgs& rope);
cudaError_t decode_attention_rope(const PagedAttentionArgs& args, const DecodeRopeArgs& rope, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// DFlash2's FP8 candidate head (backend.h, Fp8Weight; host reference backend/cpu/host_fp8.h): an
// e4m3 copy of the LM head with one fp32 scale per row picks the candidates, the exact head
// re-scores them.

// Per-row e4m3 quantization of w [V, H] (bf16): scale[v] = max_k |w[v, k]| / 448 (1 when that is
// not positive), q[v, k] = e4m3(w[v, k] / scale[v]) (IEEE division, round to nearest even,
// saturating at +-448): bit for bit fp8_quantize_row. q [V, H] e4m3 bytes, scale [V] fp32.
cudaError_t fp8_quantize_rows(const __nv_bfloat16* w, int64_t vocab, int64_t hidden, uint8_t* q, float* scale,
                              cudaStream_t stream);

// out [M, V] fp32 = x [M, H] (bf16) @ W^T, W[v, k] = scale[v] * e4m3(q[v, k]) (q [V, H] e4m3 bytes,
// scale [V] fp32): exact bf16 products (e4m3 -> bf16 is exact), fp32 accumulation, the scale
// applied to the sum. q is read from device memory once per launch whatever M. Needs
// 1 <= M <= kFp8GemvMaxRows, H % 16 == 0, x and q 16-byte aligned (linear_fp8_supports); any V
// (<= 2^30). cudaErrorInvalidValue otherwise (M == 0 or V == 0: nothing to do). Deterministic.
constexpr int64_t kFp8GemvMaxRows = 512;
bool linear_fp8_supports(const void* x, const void* q, int64_t m, int64_t hidden);
cudaError_t linear_fp8(const __nv_bfloat16* x, const uint8_t* q, const float* scale, int64_t m, int64_t vocab,
                       int64_t hidden, float* out, cudaStream_t stream);

// Exact re-score of candidates, per row r of h [R, H] (bf16): v[j] = dot(h[r], head[ids[r, j]])
// (head [V, H] bf16, fp32 accumulation in a fixed order), then ids [R, K] (in/out) re-sorted by v
// (descending, lowest id first on ties, NaN last: topk_candidates' order) and unary [R, K] =
// v * multiplier, then softcap * tanh(. / softcap) when softcap > 0 (NaN, or an id outside
// [0, V): -inf). K <= kTopkMaxK, H % 8 == 0, h and head 16-byte aligned.
cudaError_t rescore_candidates(const __nv_bfloat16* h, const __nv_bfloat16* head, int64_t rows, int64_t k,
                               int64_t hidden, int64_t vocab, float multiplier, float softcap, int32_t* ids,
                               float* unary, cudaStream_t stream);

}  // namespace cuda
}  // namespace dflash

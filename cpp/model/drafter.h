// The drafting seam of the runtime: what a drafter (DFlash, DFlash2) does in a step. It keeps
// a context from the target's tapped hidden states (update_context), and proposes n drafts per
// request for the blocks [anchor, MASK x n] of a batch into the step's device buffers, with the
// proposal rows q it drew them from when they are not one-hot (propose). Every op runs on the
// backend's stream with no host round trip, so a decode program captures it into its graph.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "config/draft_config.h"
#include "model/forward_batch.h"
#include "model/transformer.h"

namespace dflash {

// How a drafter's drafts are verified: one-hot proposals (argmax drafts, accept()), K
// candidates per draft with their scores (DFlash2's walk), or a dense distribution over the
// vocabulary per draft (DFlash's probabilistic drafts).
enum class ProposalKind { kOneHot, kCandidates, kDense };

// Where propose() writes (device tensors owned by the caller, e.g. a decode program's buffers).
struct DraftOutputs {
  Tensor drafts;  // [R, n] int32
  // kCandidates: the proposal q of draft j of request r is softmax(realized[r, j, :] / T) over
  // cand_ids[r, j, :] (T = the request's temperature); kDense: softmax(realized[r, j, :] / T)
  // over the vocabulary (cand_ids unused). K = proposal_width().
  Tensor cand_ids;  // [R, n, K] int32
  Tensor realized;  // [R, n, K] fp32
  // Optional (inspection; empty: not written): DFlash2's unary scores [R, n, K] and edge scores
  // [R, n, K, K] (fp32).
  Tensor unary, edges;
};

class Drafter {
 public:
  virtual ~Drafter() = default;
  virtual const DraftConfig& config() const = 0;
  virtual size_t weight_bytes() const = 0;
  virtual KVPool make_kv_pool(int64_t num_blocks, int64_t block_size) const = 0;

  // Writes the context K/V of committed tokens into every layer of `pool`.
  // taps: [C, num_taps * target_hidden] target layer outputs; positions, slots: [C].
  virtual void update_context(const Tensor& taps, const std::vector<int32_t>& positions,
                              const std::vector<int32_t>& slots, KVPool& pool) = 0;
  // The same with positions, slots [C] int32 already on the backend.
  virtual void update_context(const Tensor& taps, const Tensor& positions, const Tensor& slots, KVPool& pool) = 0;

  virtual ProposalKind proposal_kind() const { return ProposalKind::kOneHot; }
  // K of the proposal rows propose() writes (kCandidates: candidates per draft; kDense: the
  // vocabulary size); 0 for one-hot proposals.
  virtual int64_t proposal_width() const { return 0; }
  // Drafts for the R blocks of `batch`: batch.token_ids holds each request's block [anchor,
  // mask x n] at positions q0 .. q0 + n (kv_len = q0 + n + 1, slots for the block rows),
  // logit_rows the block rows 1..n; anchors[R] int32 the blocks' first tokens; params[R] the
  // requests' packed sampling parameters (position = the first draft's).
  virtual void propose(const DeviceBatch& batch, KVPool& pool, const Tensor& anchors, const Tensor& params,
                       DraftOutputs& out) = 0;
  // The target LM head's logits [R * n, V] (fp32) at the block rows 1..n (inspection).
  virtual Tensor draft_logits(const DeviceBatch& batch, KVPool& pool) = 0;
};

// The drafter of `config.arch`, loaded from draft_dir and checked against the target; a
// DFlash2 drafter whose geometry is beyond the backend's kernel limits (K, rank, taps, vocab)
// is refused here, with the reason (never truncated).
std::unique_ptr<Drafter> drafter_create(const DraftConfig& config, const std::string& draft_dir, Backend& backend,
                                        const Transformer& target, const std::string& target_dir);

}  // namespace dflash

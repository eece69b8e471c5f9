// Decode programs: the fixed-shape part of a step over requests that are all past their
// prefill. AR: one target forward over one token per request + sampling. Speculative: draft
// forward over [anchor, MASK x n] + argmax → verify forward over [anchor, drafts] with taps →
// acceptance → drafter context update of all n + 1 rows (rows past the accepted ones are
// overwritten by the next draft block before anything reads them). Inputs come from static
// buffers (one host→device copy per step), outputs go to host memory by one device→host copy,
// so a step needs one synchronisation. A pipelined AR step (config.feed) may be launched before
// the previous one is read: its anchors then come from the previous step's tokens on the device. On CUDA the rows are padded to a few batch sizes and each
// size is captured into a graph at start-up and replayed; padding rows write a reserved "trash"
// block of the KV pools, outside the allocator's range.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "kv_cache/block_allocator.h"
#include "model/drafter.h"
#include "model/transformer.h"
#include "runtime/step_buffers.h"

namespace dflash {

// One request of a decode step.
struct DecodeRow {
  int32_t anchor = 0;        // the last token (fed to the target; the draft block's anchor)
  int64_t q0 = 0;            // its position (= tokens already in the KV cache)
  const BlockTable* blocks = nullptr;
  SampleRow sample;          // position: the first token sampled / drafted (q0 + 1)
  const int32_t* override_drafts = nullptr;  // [n] test hook: drafts to verify instead of the drafter's
  int32_t feed = -1;  // AR with config.feed: >= 0 takes the anchor from that row of the previous step's tokens
};

struct DecodeProgramConfig {
  int64_t max_batch = 1;       // requests per step (max_num_seqs)
  int64_t max_model_len = 1;   // attention spans up to this
  int64_t block_size = 16;
  int64_t num_spec_tokens = 0;  // 0: AR programs
  int32_t trash_block = 0;     // first reserved block id (num_blocks_for(rows per request) of them)
  bool pad = false;            // pad rows to the graph sizes (CUDA)
  bool graphs = false;         // capture and replay graphs (needs pad)
  bool feed = false;           // AR: anchors may come from the previous step's tokens (DecodeRow::feed)
};

class DecodePrograms {
 public:
  DecodePrograms(Backend& backend, Transformer& target, KVPool& target_pool, Drafter* drafter,
                 KVPool* draft_pool, const DecodeProgramConfig& config);
  ~DecodePrograms();

  // Captures one graph per padded batch size (CUDA graphs on), running each once first.
  void capture();
  bool graphs() const { return config_.graphs; }
  // The padded batch sizes (graph sizes) and the one used for `rows` requests.
  const std::vector<int64_t>& sizes() const { return sizes_; }
  int64_t padded(int64_t rows) const;
  // Reserved trash blocks needed for rows of `rows_per_request` tokens.
  static int64_t trash_blocks(int64_t rows_per_request, int64_t block_size);

  // Runs one step over `rows` (1 <= size <= max_batch); returns when its outputs are on the host.
  // phase (eager only, may be null) is called between the speculative phases with their index
  // 0 draft, 1 verify, 2 accept, 3 context update (for timing).
  void run(const std::vector<DecodeRow>& rows, const std::function<void(int)>& phase = nullptr);
  // run() in two halves: launch queues the step on the backend's stream and returns; other
  // stream-ordered work may be queued before wait(), which returns when the outputs are on the
  // host. (The per-step arena is reused by such work: an AR step's last_logits() must be read
  // before it.)
  // launch returns the step's slot (0 or 1, alternating): a step may be launched while the one
  // before it still runs (pipelined decode) and be waited for by wait_step(slot); the outputs
  // read below are those of the step last waited for. Inputs and outputs are double-buffered on
  // the host, so two steps can be in flight.
  int launch(const std::vector<DecodeRow>& rows, const std::function<void(int)>& phase = nullptr);
  void wait();
  void wait_step(int slot);
  // Outputs of the last run (host memory, valid until the next run). AR: tokens[R].
  // Speculative: drafts[R * n], num_accepted[R], next_token[R].
  const int32_t* tokens() const { return host_outputs(read_slot_).tokens; }
  const int32_t* drafts() const { return host_outputs(read_slot_).drafts; }
  const int32_t* num_accepted() const { return host_outputs(read_slot_).num_accepted; }
  const int32_t* next_token() const { return host_outputs(read_slot_).next_token; }
  // AR: the logits [padded rows, V] (fp32) of the last run, on the backend (valid until the next
  // step); for recordings.
  const Tensor& last_logits() const { return last_logits_; }

 private:
  struct Graph;
  // Issues the program's ops for `b` padded rows (eager, or being captured).
  void issue(int64_t b, const std::function<void(int)>& phase);
  // The speculative op sequence over batch `d` (draft → verify → accept → context), in
  // runtime/speculative_step.cpp with the rest of the speculative step.
  void issue_speculative(DeviceBatch& d, const Tensor& params, const std::function<void(int)>& phase);
  void stage(const std::vector<DecodeRow>& rows, int64_t b, int slot);
  StepInputs<int32_t*> host_inputs(int slot) const { return in_layout_.host(in_host_[slot].get()); }
  StepOutputs<int32_t*> host_outputs(int slot) const { return out_layout_.host(out_host_[slot].get()); }

  Backend& backend_;
  Transformer& target_;
  KVPool& target_pool_;
  Drafter* drafter_;
  KVPool* draft_pool_;
  DecodeProgramConfig config_;
  int64_t q_ = 1;      // rows per request: 1 (AR) or n + 1
  int64_t n_ = 0;      // drafts per request
  int64_t width_ = 0;  // block-table width
  std::vector<int64_t> sizes_;
  std::vector<std::unique_ptr<CapturedGraph>> graphs_;  // per entry of sizes_
  std::vector<Tensor> graph_logits_;                    // AR logits tensor of each graph

  // The step's inputs and outputs as typed fields of one buffer each (step_buffers.h): one
  // host->device copy stages a step's inputs, one device->host copy returns its outputs. Device
  // views of the inputs (in_) and outputs (out_); two pinned host copies of each (in_host_ and
  // out_host_[slot]), so two steps can be in flight.
  StepInputLayout in_layout_;
  StepOutputLayout out_layout_;
  Tensor in_dev_, out_dev_;
  StepInputs<Tensor> in_;
  StepOutputs<Tensor> out_;
  std::shared_ptr<void> in_host_[2], out_host_[2];
  int next_slot_ = 0;  // slot of the next launch
  int last_slot_ = 0;  // slot of the last launch
  int read_slot_ = 0;  // slot whose outputs tokens() & co. read
  // Device scratch of the speculative program (the drafter's proposal: drafts [B, n] and, for
  // K-candidate or dense drafters, cand_ids / realized [B, n, K]).
  Tensor proposed_, cand_ids_, realized_;
  Tensor last_logits_;
};

}  // namespace dflash

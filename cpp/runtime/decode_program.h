// Decode programs: the fixed-shape part of a step over requests that are all past their
// prefill. AR: one target forward over one token per request + sampling. Speculative: draft
// forward over [anchor, MASK x n] + argmax → verify forward over [anchor, drafts] with taps →
// acceptance → drafter context update of all n + 1 rows (rows past the accepted ones are
// overwritten by the next draft block before anything reads them). A drafter's programs exist
// for a set of draft lengths n (adaptive speculation, spec_policy.h; by default only the longest),
// each captured per padded batch size; n = 0 is an AR step that keeps the drafter's context: the
// target forward over the anchor with taps, sampling, and the anchor's row into the drafter's
// context (so any later step may draft again, with any length). Inputs come from static
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
#include "dflash/stats.h"
#include "kv_cache/block_allocator.h"
#include "model/drafter.h"
#include "model/transformer.h"
#include "runtime/spec_policy.h"
#include "runtime/step_buffers.h"

namespace dflash {

// One request of a decode step.
struct DecodeRow {
  int32_t anchor = 0;        // the last token (fed to the target; the draft block's anchor)
  int64_t q0 = 0;            // its position (= tokens already in the KV cache)
  const BlockTable* blocks = nullptr;
  SampleRow sample;          // position: the first token sampled / drafted (q0 + 1)
  const int32_t* override_drafts = nullptr;  // [n] test hook: drafts to verify instead of the drafter's
  // With config.feed, >= 0: the row of the previous step (not read yet) this one continues. AR:
  // the anchor is that row's token. Speculative: the row is staged as if that step had accepted
  // nothing (q0 = its q0, anchor and sample.position to be moved on by the device).
  int32_t feed = -1;
};

struct DecodeProgramConfig {
  int64_t max_batch = 1;       // requests per step (max_num_seqs)
  int64_t max_model_len = 1;   // attention spans up to this
  int64_t block_size = 16;
  int64_t num_spec_tokens = 0;  // 0: AR programs; else the longest draft
  // Speculative: the draft lengths with programs (each in [0, num_spec_tokens]; empty: only
  // num_spec_tokens). 0 is the AR step with the drafter's context update.
  std::vector<int64_t> draft_lengths;
  int32_t trash_block = 0;     // first reserved block id (num_blocks_for(rows per request) of them)
  bool pad = false;            // pad rows to the graph sizes (CUDA)
  bool graphs = false;         // capture and replay graphs (needs pad)
  // Pipelined steps (DecodeRow::feed): AR anchors from the previous step's tokens; speculative
  // requests moved on by the previous step's acceptance (Backend::feed_spec_inputs).
  bool feed = false;
};

class DecodePrograms {
 public:
  DecodePrograms(Backend& backend, Transformer& target, KVPool& target_pool, Drafter* drafter,
                 KVPool* draft_pool, const DecodeProgramConfig& config);
  ~DecodePrograms();

  // Captures one graph per (draft length, padded batch size) (CUDA graphs on), running each once
  // first.
  void capture();
  bool graphs() const { return config_.graphs; }
  // The draft lengths with programs, ascending ({0} for target-only AR programs).
  const std::vector<int64_t>& lengths() const { return lengths_; }
  // Times a step of every draft length at a range of batch sizes, all rows padding (they write
  // the trash blocks only): the graph sizes when padding, else 1, 2, 4, 8 (capped at max_batch;
  // SpecCostTable extrapolates past them). Each cost is the fastest of a few runs (3 replays of
  // a captured graph; 2 eager runs after an untimed one), from staging to the outputs on the
  // host. Graphs must be captured first.
  SpecCostTable measure_costs();
  // The padded batch sizes (graph sizes) and the one used for `rows` requests.
  const std::vector<int64_t>& sizes() const { return sizes_; }
  int64_t padded(int64_t rows) const;
  // Reserved trash blocks needed for rows of `rows_per_request` tokens.
  static int64_t trash_blocks(int64_t rows_per_request, int64_t block_size);

  // Runs one step over `rows` (1 <= size <= max_batch) with `length` drafts per request (one of
  // lengths(); -1: the longest); returns when its outputs are on the host. phase (eager only, may
  // be null) is called between the speculative phases with their index 0 draft, 1 verify, 2
  // accept, 3 context update (for timing).
  void run(const std::vector<DecodeRow>& rows, const std::function<void(int)>& phase = nullptr, int64_t length = -1);
  // run() in two halves: launch queues the step on the backend's stream and returns; other
  // stream-ordered work may be queued before wait(), which returns when the outputs are on the
  // host. (The per-step arena is reused by such work: an AR step's last_logits() must be read
  // before it.)
  // launch returns the step's slot (0 or 1, alternating): a step may be launched while the one
  // before it still runs (pipelined decode) and be waited for by wait_step(slot); the outputs
  // read below are those of the step last waited for. Inputs and outputs are double-buffered on
  // the host, so two steps can be in flight.
  int launch(const std::vector<DecodeRow>& rows, const std::function<void(int)>& phase = nullptr,
             int64_t length = -1);
  void wait();
  void wait_step(int slot);
  // From here on, launch() and the waits add their host time to these counters
  // (time_host_stage_s, time_host_launch_s, time_host_wait_s); null stops it. Start-up runs
  // (capture, measure_costs) are left out by setting it after them.
  void set_host_timers(EngineStats* stats) { host_timers_ = stats; }
  // Outputs of the last run (host memory, valid until the next run). AR: tokens[R].
  // Speculative with n drafts: drafts[R * n], num_accepted[R], next_token[R] (n = 0: next_token
  // only, the sampled token).
  const int32_t* tokens() const { return host_outputs(read_slot_).tokens; }
  const int32_t* drafts() const { return host_outputs(read_slot_).drafts; }
  const int32_t* num_accepted() const { return host_outputs(read_slot_).num_accepted; }
  const int32_t* next_token() const { return host_outputs(read_slot_).next_token; }
  // 1 where a logit row holds a NaN or an infinity: AR and n = 0 [R] (the sampled rows);
  // speculative [R * (n + 1)] (the verify rows of request r from r * (n + 1)).
  const int32_t* nonfinite() const { return host_outputs(read_slot_).nonfinite; }
  // AR: the logits [padded rows, V] (fp32) of the last run, on the backend (valid until the next
  // step); for recordings.
  const Tensor& last_logits() const { return last_logits_; }

 private:
  struct Graph;
  // Issues the program's ops for `b` padded rows with `n` drafts each (eager, or being captured).
  void issue(int64_t b, int64_t n, const std::function<void(int)>& phase);
  // The speculative op sequences over batch `d`, in runtime/speculative_step.cpp with the rest of
  // the speculative step: n drafts (draft → verify → accept → context), and n = 0 (target
  // forward with taps → sample → context).
  void issue_speculative(DeviceBatch& d, int64_t n, const Tensor& params, const std::function<void(int)>& phase);
  void issue_context_step(DeviceBatch& d, const Tensor& params, const std::function<void(int)>& phase);
  void stage(const std::vector<DecodeRow>& rows, int64_t b, int64_t n, int slot);
  // The draft length of `length` (-1: the longest), checked against lengths().
  int64_t length_of(int64_t length) const;
  // The graph of draft length n at padded batch size b.
  size_t graph_index(int64_t n, int64_t b) const;
  StepInputs<int32_t*> host_inputs(int slot) const { return in_layout_.host(in_host_[slot].get()); }
  StepOutputs<int32_t*> host_outputs(int slot) const { return out_layout_.host(out_host_[slot].get()); }

  Backend& backend_;
  Transformer& target_;
  KVPool& target_pool_;
  Drafter* drafter_;
  KVPool* draft_pool_;
  DecodeProgramConfig config_;
  int64_t q_ = 1;      // most rows per request: 1 (AR) or n + 1 of the longest length
  int64_t n_ = 0;      // most drafts per request (buffers are sized for it)
  int64_t width_ = 0;  // block-table width
  std::vector<int64_t> lengths_;  // draft lengths with programs, ascending
  std::vector<int64_t> sizes_;
  // [lengths_.size() * sizes_.size()]: graph_index(n, b)
  std::vector<std::unique_ptr<CapturedGraph>> graphs_;
  std::vector<Tensor> graph_logits_;  // AR logits tensor of each graph

  // The step's inputs and outputs as typed fields of one buffer each (step_buffers.h): one
  // host->device copy stages a step's inputs, one device->host copy returns its outputs. Device
  // views of the inputs (in_) and outputs (out_); two pinned host copies of each (in_host_ and
  // out_host_[slot]), so two steps can be in flight.
  EngineStats* host_timers_ = nullptr;
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

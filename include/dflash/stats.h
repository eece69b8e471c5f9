// SessionStats: what Session::stats() reports: memory, KV cache blocks, prefix caching,
// speculative decoding and CUDA-graph settings, and the engine's counters (EngineStats).
// Counters accumulate from the session's start; fields may be added in later minor versions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dflash {

// Counters and timers of the engine's steps.
struct EngineStats {
  int64_t num_steps = 0;
  int64_t num_forward_tokens = 0;
  int64_t num_generated_tokens = 0;
  int64_t num_requests_finished = 0;
  // Requests ended with finish_reason "error": the logits their next token came from held a NaN
  // or an infinity (counted among the finished too).
  int64_t num_nonfinite_requests = 0;
  // Speculative decoding, summed over requests.
  int64_t num_spec_steps = 0;
  int64_t num_drafted = 0;
  int64_t num_accepted = 0;
  int64_t num_spec_emitted = 0;
  std::vector<int64_t> accepted_per_position;
  // Wall time of the phases of draft-verify decode steps (seconds; measured in eager mode
  // only, where the backend is synchronised between phases), and of whole decode steps.
  double time_draft_s = 0.0, time_verify_s = 0.0, time_accept_s = 0.0, time_context_s = 0.0;
  double time_decode_s = 0.0;
  // How decode steps ran: replays of captured CUDA graphs, eager decode programs (graphs off, or
  // the CPU), eager ragged forwards (prefills, and decode rows that record taps).
  int64_t num_graph_steps = 0;
  int64_t num_eager_decode_steps = 0;
  int64_t num_eager_forwards = 0;
  // Pipelined AR decode: steps launched ahead of their predecessor's outputs, and the rows of
  // such steps dropped because their request had ended.
  int64_t num_pipelined_steps = 0;
  int64_t num_dropped_rows = 0;
  // Scheduling: requests preempted (their KV freed, recomputed on re-admission), and prefill
  // chunks run (a prompt prefilled in one go counts one; each recompute counts too).
  int64_t num_preemptions = 0;
  int64_t num_prefill_chunks = 0;
  // Speculative decode steps by the draft length they ran with ([num_spec_tokens + 1]; with
  // fixed speculation all at num_spec_tokens, with adaptive speculation 0 = an AR step), and the
  // start-up time spent measuring the adaptive policy's step costs.
  std::vector<int64_t> spec_length_steps;
  double time_measure_costs_s = 0.0;
};

struct SessionStats {
  std::string device;  // "cpu" or "cuda"
  int64_t weight_bytes = 0;
  int64_t kv_cache_bytes = 0;
  int64_t kv_cache_tokens = 0;
  int64_t block_size = 0;
  int64_t num_blocks = 0;
  int64_t num_free_blocks = 0;  // free or evictable (cached, no request holds them)
  // Requests added and not finished: admitted (running) and queued (waiting).
  int64_t num_running_requests = 0;
  int64_t num_waiting_requests = 0;
  // Prefix caching: cached blocks (referenced or not), the evictable ones among them, blocks
  // evicted so far; prefill tokens looked up in the cache and found there.
  bool prefix_caching = false;
  int64_t num_cached_blocks = 0;
  int64_t num_evictable_blocks = 0;
  int64_t num_evicted_blocks = 0;
  int64_t prefix_cache_query_tokens = 0;
  int64_t prefix_cache_hit_tokens = 0;
  int64_t max_model_len = 0;
  int num_threads = 0;
  int64_t workspace_bytes = 0;
  int64_t draft_weight_bytes = 0;
  int64_t draft_kv_cache_bytes = 0;
  int64_t num_speculative_tokens = 0;  // 0 without a drafter
  // "greedy", "probabilistic" (DFlash), "walk" / "greedy_walk" (DFlash2); "" without a drafter.
  std::string draft_sampling;
  bool cuda_graphs = false;                // decode steps replay captured CUDA graphs
  std::vector<int64_t> graph_batch_sizes;  // padded batch sizes of the decode programs
  double graph_capture_s = 0.0;            // time spent capturing them at start-up
  std::string speculation;                 // "fixed" / "adaptive"; "" without a drafter
  std::vector<int64_t> draft_lengths;      // draft lengths with decode programs
  // Adaptive speculation: the policy's step costs, seconds [batch size][draft length] of
  // spec_cost_seconds for the batch sizes and draft lengths listed (empty otherwise).
  std::vector<int64_t> spec_cost_batch_sizes;
  std::vector<int64_t> spec_cost_lengths;
  std::vector<std::vector<double>> spec_cost_seconds;
  EngineStats engine;
};

}  // namespace dflash

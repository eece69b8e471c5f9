// SessionStats: what Session::stats() reports: memory, KV cache blocks, prefix caching,
// speculative decoding and CUDA-graph settings, and the engine's counters (EngineStats).
// Counters accumulate from the session's start; fields may be added in later minor versions.
// for_each_engine_stat / for_each_session_stat are the one list of the fields and the names they
// are reported under (the Python module's attributes and dict, and so dflash.Session.stats()).
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
  // Host time of the decode steps' programs (seconds, summed): staging a step's inputs (filling
  // the pinned buffer, queueing its copy to the device); queueing the step (the graph launch or,
  // eager, issuing every op; the output copy); blocked waiting for the device to finish it.
  // Between two graph steps the device idles while the host does the rest of a step: all but
  // the wait (the results' handling is decode_time_s minus these three).
  double time_host_stage_s = 0.0, time_host_launch_s = 0.0, time_host_wait_s = 0.0;
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
  bool deterministic = false;              // batch-invariant kernels (KernelOptions::batch_invariant)
  bool async_decode = false;               // pipelined decode steps (SessionConfig::async_decode)
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

// The one list of the statistics: fn(key, member) for each field (a pointer to member), in the
// order they are reported. key is the name Python sees: the _core attribute, the key of
// SessionStats.as_dict() and of dflash.Session.stats(). A field added to a struct above is added
// to its list too, and is then reported everywhere; tests/cpp/stats_test.cpp checks that no field
// is left out. Most keys are the field's name. Fields that Session.stats() reports only in a
// derived form keep their field's name: num_spec_emitted (acceptance_length), the phase times
// time_*_s (nested as spec_time_s), spec_length_steps (a dict by draft length), spec_cost_*
// (spec_cost_table).
template <class Fn>
void for_each_engine_stat(Fn&& fn) {
  fn("num_steps", &EngineStats::num_steps);
  fn("num_forward_tokens", &EngineStats::num_forward_tokens);
  fn("num_generated_tokens", &EngineStats::num_generated_tokens);
  fn("num_requests_finished", &EngineStats::num_requests_finished);
  fn("num_nonfinite_requests", &EngineStats::num_nonfinite_requests);
  fn("num_spec_steps", &EngineStats::num_spec_steps);
  fn("num_drafted", &EngineStats::num_drafted);
  fn("num_accepted", &EngineStats::num_accepted);
  fn("num_spec_emitted", &EngineStats::num_spec_emitted);
  fn("accepted_per_position", &EngineStats::accepted_per_position);
  fn("time_draft_s", &EngineStats::time_draft_s);
  fn("time_verify_s", &EngineStats::time_verify_s);
  fn("time_accept_s", &EngineStats::time_accept_s);
  fn("time_context_s", &EngineStats::time_context_s);
  fn("decode_time_s", &EngineStats::time_decode_s);
  fn("host_stage_s", &EngineStats::time_host_stage_s);
  fn("host_launch_s", &EngineStats::time_host_launch_s);
  fn("host_wait_s", &EngineStats::time_host_wait_s);
  fn("graph_steps", &EngineStats::num_graph_steps);
  fn("eager_steps", &EngineStats::num_eager_decode_steps);
  fn("eager_forwards", &EngineStats::num_eager_forwards);
  fn("pipelined_steps", &EngineStats::num_pipelined_steps);
  fn("dropped_rows", &EngineStats::num_dropped_rows);
  fn("num_preemptions", &EngineStats::num_preemptions);
  fn("num_prefill_chunks", &EngineStats::num_prefill_chunks);
  fn("spec_length_steps", &EngineStats::spec_length_steps);
  fn("spec_cost_measure_s", &EngineStats::time_measure_costs_s);
}

// SessionStats' own fields (its engine's are for_each_engine_stat's); every key is the field's name.
template <class Fn>
void for_each_session_stat(Fn&& fn) {
  fn("device", &SessionStats::device);
  fn("weight_bytes", &SessionStats::weight_bytes);
  fn("kv_cache_bytes", &SessionStats::kv_cache_bytes);
  fn("kv_cache_tokens", &SessionStats::kv_cache_tokens);
  fn("block_size", &SessionStats::block_size);
  fn("num_blocks", &SessionStats::num_blocks);
  fn("num_free_blocks", &SessionStats::num_free_blocks);
  fn("num_running_requests", &SessionStats::num_running_requests);
  fn("num_waiting_requests", &SessionStats::num_waiting_requests);
  fn("prefix_caching", &SessionStats::prefix_caching);
  fn("num_cached_blocks", &SessionStats::num_cached_blocks);
  fn("num_evictable_blocks", &SessionStats::num_evictable_blocks);
  fn("num_evicted_blocks", &SessionStats::num_evicted_blocks);
  fn("prefix_cache_query_tokens", &SessionStats::prefix_cache_query_tokens);
  fn("prefix_cache_hit_tokens", &SessionStats::prefix_cache_hit_tokens);
  fn("max_model_len", &SessionStats::max_model_len);
  fn("num_threads", &SessionStats::num_threads);
  fn("workspace_bytes", &SessionStats::workspace_bytes);
  fn("draft_weight_bytes", &SessionStats::draft_weight_bytes);
  fn("draft_kv_cache_bytes", &SessionStats::draft_kv_cache_bytes);
  fn("num_speculative_tokens", &SessionStats::num_speculative_tokens);
  fn("draft_sampling", &SessionStats::draft_sampling);
  fn("cuda_graphs", &SessionStats::cuda_graphs);
  fn("deterministic", &SessionStats::deterministic);
  fn("async_decode", &SessionStats::async_decode);
  fn("graph_batch_sizes", &SessionStats::graph_batch_sizes);
  fn("graph_capture_s", &SessionStats::graph_capture_s);
  fn("speculation", &SessionStats::speculation);
  fn("draft_lengths", &SessionStats::draft_lengths);
  fn("spec_cost_batch_sizes", &SessionStats::spec_cost_batch_sizes);
  fn("spec_cost_lengths", &SessionStats::spec_cost_lengths);
  fn("spec_cost_seconds", &SessionStats::spec_cost_seconds);  // [batch sizes][lengths]
}

}  // namespace dflash

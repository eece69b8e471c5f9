// Adaptive speculation: the draft length L of each speculative decode step, for the whole batch,
// from a small set of lengths with decode programs (0 = an AR step that keeps the drafter's
// context up to date; the longest = num_speculative_tokens). The choice maximises the expected
// tokens per second of the step,
//     sum over requests i of E_i[tokens emitted with L drafts] / cost(batch, L),
// from the step costs of this device (SpecCostTable: measured at start-up by timing the decode
// programs, or injected) and each request's running acceptance by draft position. Ties go to the
// shorter length, so L = 0 (plain AR decoding) wins whenever speculation does not pay. Pure host
// logic, no backend types: the functions below are what the engine calls and what tests drive.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace dflash {

// Seconds per decode step by (batch size, draft length).
struct SpecCostTable {
  std::vector<int64_t> batch_sizes;  // [S] ascending, >= 1
  std::vector<int64_t> lengths;      // [N] ascending draft lengths
  std::vector<double> seconds;       // [S, N] cost of a step of batch_sizes[s] requests with lengths[l] drafts

  bool empty() const { return batch_sizes.empty(); }
  // Throws InvalidArgument unless the shapes agree, sizes and lengths ascend and costs are
  // finite and positive.
  void validate() const;
  // The cost of a step of `batch` requests with lengths[l] drafts: the entry of that batch size,
  // linear interpolation between measured sizes, the smallest size's entry below it, and linear
  // extrapolation from the last two sizes above the largest (never below the largest's entry).
  double cost(int64_t batch, size_t l) const;
  // From rows [batch size, cost of lengths[0], cost of lengths[1], ...] (the session option's
  // form); validated.
  static SpecCostTable from_rows(const std::vector<int64_t>& lengths, const std::vector<std::vector<double>>& rows);
};

// The default draft lengths with programs for a drafter of `max_length` drafts: 0, 1, 3, 7, ...
// (2^k - 1 below max_length) and max_length.
std::vector<int64_t> spec_default_lengths(int64_t max_length);
// `lengths` sorted, without repeats, with 0 and max_length added (empty: the default lengths);
// InvalidArgument for a length outside [0, max_length].
std::vector<int64_t> spec_lengths_normalize(std::vector<int64_t> lengths, int64_t max_length);

// E[min(a + 1, remaining)]: the tokens a step with `length` drafts is expected to emit (a accepted
// drafts plus the bonus / correction token), at most `remaining` (max_tokens left), when draft j
// is accepted with probability rate[j] given that drafts 0..j-1 were (rate: [>= length]).
double spec_expected_tokens(const std::vector<double>& rate, int64_t length, int64_t remaining);

// The index into table.lengths that maximises sum_i spec_expected_tokens(*rates[i], L,
// remaining[i]) / table.cost(batch, L); the shortest length among equal rates (relative
// tolerance 1e-9). rates, remaining: [R] per request of the step; batch: the step's batch size as
// the decode programs run it (padded on CUDA).
size_t spec_choose_length(const SpecCostTable& table, int64_t batch, const std::vector<const std::vector<double>*>& rates,
                          const std::vector<int64_t>& remaining);

struct SpecPolicyConfig {
  double prior = 0.6;          // acceptance rate of every position before anything was observed
  double request_rate = 0.125;  // EWMA weight of a request's new observation of a position
  double global_rate = 0.02;    // EWMA weight in the session-wide estimate new requests start from
  double recovery_rate = 0.01;  // per AR step, the share of (prior - estimate) a request's estimate gains back
};

// The running acceptance estimates and the choice. Per request (by id) and per draft position j,
// an exponentially weighted estimate of P(draft j accepted | drafts 0..j-1 accepted): a step that
// drafted L and accepted a observes "accepted" at positions j < a and "rejected" at position a
// (when a < L); later positions are not observed. A request starts from the session-wide
// estimate (the same EWMA over every request's observations, starting at the prior). A
// speculative step (L > 0) updates the request's and the session-wide estimates; an AR step
// (L = 0) observes nothing, so each position of the request's estimate that is below the prior
// moves towards it by recovery_rate: after a run of AR steps speculation is tried again (a
// request whose acceptance fell in one passage of its text is not held at L = 0 for the rest of
// it), and a request whose drafts keep failing goes back to AR steps after the probe. Not
// thread-safe (the engine's thread owns it).
class SpecPolicy {
 public:
  SpecPolicy(int64_t max_length, SpecPolicyConfig config, SpecCostTable table);

  const SpecCostTable& table() const { return table_; }
  // The draft length for a step over requests `ids` (remaining: max_tokens left each) at the
  // (padded) batch size `batch`.
  int64_t choose(const std::vector<int64_t>& ids, const std::vector<int64_t>& remaining, int64_t batch);
  // Records a step of request `id` that drafted `length` tokens and accepted `accepted`.
  void observe(int64_t id, int64_t length, int64_t accepted);
  // Drops a finished or aborted request's estimate.
  void forget(int64_t id) { requests_.erase(id); }
  // The estimate of request `id` [max_length] (the session-wide one for an unseen id).
  const std::vector<double>& rates(int64_t id) const;
  const std::vector<double>& global_rates() const { return global_; }
  int64_t num_tracked() const { return static_cast<int64_t>(requests_.size()); }

 private:
  std::vector<double>& request_rates(int64_t id);

  int64_t max_length_;
  SpecPolicyConfig config_;
  SpecCostTable table_;
  std::vector<double> global_;  // [max_length]
  std::unordered_map<int64_t, std::vector<double>> requests_;
};

}  // namespace dflash

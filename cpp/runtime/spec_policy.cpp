// Adaptive speculation: cost table lookups, expected tokens, the choice of a step's draft length
// and the running acceptance estimates (see spec_policy.h).
#include "runtime/spec_policy.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"

namespace dflash {

void SpecCostTable::validate() const {
  const size_t s = batch_sizes.size(), n = lengths.size();
  DFLASH_ARG_CHECK(s >= 1 && n >= 1, "a speculation cost table needs at least one batch size and one draft length");
  DFLASH_ARG_CHECK(seconds.size() == s * n, "the speculation cost table has ", seconds.size(), " costs for ", s,
                   " batch sizes x ", n, " draft lengths");
  for (size_t i = 0; i < s; ++i) {
    DFLASH_ARG_CHECK(batch_sizes[i] >= 1 && (i == 0 || batch_sizes[i] > batch_sizes[i - 1]),
                     "the speculation cost table's batch sizes must be >= 1 and ascending");
  }
  for (size_t l = 0; l < n; ++l) {
    DFLASH_ARG_CHECK(lengths[l] >= 0 && (l == 0 || lengths[l] > lengths[l - 1]),
                     "the speculation cost table's draft lengths must be >= 0 and ascending");
  }
  for (double c : seconds) {
    DFLASH_ARG_CHECK(std::isfinite(c) && c > 0.0, "speculation step costs must be finite and > 0, got ", c);
  }
}

double SpecCostTable::cost(int64_t batch, size_t l) const {
  const size_t n = lengths.size(), s = batch_sizes.size();
  auto at = [&](size_t i) { return seconds[i * n + l]; };
  if (batch <= batch_sizes.front() || s == 1) {
    if (s == 1 && batch > batch_sizes.front()) {  // one size: proportional to the batch
      return at(0) * static_cast<double>(batch) / static_cast<double>(batch_sizes.front());
    }
    return at(0);
  }
  const auto hi = std::lower_bound(batch_sizes.begin(), batch_sizes.end(), batch);
  if (hi != batch_sizes.end() && *hi == batch) return at(static_cast<size_t>(hi - batch_sizes.begin()));
  // Between two sizes, or past the last one (the last two sizes' slope).
  const size_t i1 = hi == batch_sizes.end() ? s - 1 : static_cast<size_t>(hi - batch_sizes.begin());
  const size_t i0 = i1 - 1;
  const double x0 = static_cast<double>(batch_sizes[i0]), x1 = static_cast<double>(batch_sizes[i1]);
  const double y = at(i0) + (at(i1) - at(i0)) * (static_cast<double>(batch) - x0) / (x1 - x0);
  return hi == batch_sizes.end() ? std::max(y, at(s - 1)) : y;
}

SpecCostTable SpecCostTable::from_rows(const std::vector<int64_t>& lengths, const std::vector<std::vector<double>>& rows) {
  SpecCostTable t;
  t.lengths = lengths;
  for (const std::vector<double>& row : rows) {
    DFLASH_ARG_CHECK(row.size() == lengths.size() + 1, "a speculation cost table row is [batch_size, one cost per draft "
                     "length]: ", lengths.size() + 1, " numbers, got ", row.size());
    DFLASH_ARG_CHECK(row[0] >= 1 && row[0] == std::floor(row[0]) && row[0] < 1e9,
                     "a speculation cost table row starts with its batch size (an integer >= 1), got ", row[0]);
    t.batch_sizes.push_back(static_cast<int64_t>(row[0]));
    t.seconds.insert(t.seconds.end(), row.begin() + 1, row.end());
  }
  t.validate();
  return t;
}

std::vector<int64_t> spec_default_lengths(int64_t max_length) {
  std::vector<int64_t> out = {0};
  for (int64_t l = 1; l < max_length; l = 2 * l + 1) out.push_back(l);
  if (max_length > 0) out.push_back(max_length);
  return out;
}

std::vector<int64_t> spec_lengths_normalize(std::vector<int64_t> lengths, int64_t max_length) {
  if (lengths.empty()) return spec_default_lengths(max_length);
  for (int64_t l : lengths) {
    DFLASH_ARG_CHECK(l >= 0 && l <= max_length, "draft lengths must be in [0, num_speculative_tokens=", max_length,
                     "], got ", l);
  }
  lengths.push_back(0);
  lengths.push_back(max_length);
  std::sort(lengths.begin(), lengths.end());
  lengths.erase(std::unique(lengths.begin(), lengths.end()), lengths.end());
  return lengths;
}

double spec_expected_tokens(const std::vector<double>& rate, int64_t length, int64_t remaining) {
  if (remaining <= 0) return 0.0;
  const int64_t last = std::min(length, remaining - 1);
  DFLASH_CHECK(last <= static_cast<int64_t>(rate.size()), "acceptance estimates for ", rate.size(),
               " positions, asked about ", length);
  double expected = 1.0, reach = 1.0;  // P(a >= 0) = 1
  for (int64_t k = 1; k <= last; ++k) {
    reach *= std::clamp(rate[k - 1], 0.0, 1.0);
    expected += reach;
  }
  return expected;
}

size_t spec_choose_length(const SpecCostTable& table, int64_t batch, const std::vector<const std::vector<double>*>& rates,
                          const std::vector<int64_t>& remaining) {
  DFLASH_CHECK(rates.size() == remaining.size(), rates.size(), " acceptance estimates for ", remaining.size(),
               " requests");
  size_t best = 0;
  double best_rate = -1.0;
  for (size_t l = 0; l < table.lengths.size(); ++l) {
    double tokens = 0.0;
    for (size_t i = 0; i < rates.size(); ++i) tokens += spec_expected_tokens(*rates[i], table.lengths[l], remaining[i]);
    const double rate = tokens / table.cost(batch, l);
    if (rate > best_rate * (1.0 + 1e-9)) {
      best = l;
      best_rate = rate;
    }
  }
  return best;
}

SpecPolicy::SpecPolicy(int64_t max_length, SpecPolicyConfig config, SpecCostTable table)
    : max_length_(max_length), config_(config), table_(std::move(table)) {
  DFLASH_ARG_CHECK(max_length_ >= 1, "adaptive speculation needs a drafter of at least one draft token");
  DFLASH_ARG_CHECK(config_.prior >= 0.0 && config_.prior <= 1.0, "the acceptance prior must be in [0, 1], got ",
                   config_.prior);
  DFLASH_ARG_CHECK(config_.request_rate > 0.0 && config_.request_rate <= 1.0 && config_.global_rate > 0.0 &&
                       config_.global_rate <= 1.0,
                   "acceptance EWMA weights must be in (0, 1]");
  DFLASH_ARG_CHECK(config_.recovery_rate >= 0.0 && config_.recovery_rate <= 1.0,
                   "the acceptance recovery rate must be in [0, 1], got ", config_.recovery_rate);
  table_.validate();
  DFLASH_ARG_CHECK(table_.lengths.back() <= max_length_, "a draft length of the cost table (", table_.lengths.back(),
                   ") exceeds the drafter's ", max_length_);
  global_.assign(max_length_, config_.prior);
}

const std::vector<double>& SpecPolicy::rates(int64_t id) const {
  const auto it = requests_.find(id);
  return it == requests_.end() ? global_ : it->second;
}

std::vector<double>& SpecPolicy::request_rates(int64_t id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) it = requests_.emplace(id, global_).first;
  return it->second;
}

int64_t SpecPolicy::choose(const std::vector<int64_t>& ids, const std::vector<int64_t>& remaining, int64_t batch) {
  std::vector<const std::vector<double>*> rates;
  rates.reserve(ids.size());
  for (int64_t id : ids) rates.push_back(&this->rates(id));
  return table_.lengths[spec_choose_length(table_, batch, rates, remaining)];
}

void SpecPolicy::observe(int64_t id, int64_t length, int64_t accepted) {
  DFLASH_CHECK(length >= 0 && length <= max_length_ && accepted >= 0 && accepted <= length, "observed ", accepted,
               " accepted of ", length, " drafts (at most ", max_length_, ")");
  std::vector<double>& mine = request_rates(id);
  if (length == 0) {  // an AR step: no observation; estimates below the prior recover towards it
    for (double& x : mine) {
      if (x < config_.prior) x += config_.recovery_rate * (config_.prior - x);
    }
    return;
  }
  auto update = [&](int64_t j, double x) {
    mine[j] += config_.request_rate * (x - mine[j]);
    global_[j] += config_.global_rate * (x - global_[j]);
  };
  for (int64_t j = 0; j < accepted; ++j) update(j, 1.0);
  if (accepted < length) update(accepted, 0.0);
}

}  // namespace dflash

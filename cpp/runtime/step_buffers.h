// The typed buffers of a decode step: every input and output field of a decode program, named,
// with its capacity, laid out back to back in one buffer so that a step stages its inputs with
// one host->device copy and returns its outputs with one device->host copy. The same layout
// gives device views (Tensor) and host pointers (into pinned staging memory); all fields are
// int32 (the sampling parameters as SampleRow words).
#pragma once

#include <cstdint>
#include <type_traits>

#include "backend/backend.h"
#include "common/tensor.h"

namespace dflash {

// B = max_batch requests, q = rows per request (1 AR, n + 1 speculative), n = drafts per request,
// width = block-table width.
template <class F>
struct StepInputs {
  F ids;              // [B * q] the rows fed to the first forward (AR tokens; [anchor, MASK x n] blocks)
  F verify_ids;       // [B * q] [anchor, drafts] per request (the verify forward's tokens)
  F positions;        // [B * q]
  F slots;            // [B * q] KV slots of the rows
  F query_start;      // [B + 1]
  F kv_len;           // [B]
  F logit_rows;       // [B * n] the draft rows 1..n of each block
  F override_drafts;  // [B * n] drafts to verify instead of the drafter's (test hook)
  F use_override;     // [B]
  F params;           // [B * kSampleParamWords] SampleRow per request
  F feed;             // [B] pipelined AR: the row of the previous step's tokens giving the anchor
  F anchors;          // [B] the blocks' first tokens
  F block_table;      // [B, width] (last: a step of b requests copies only its b rows)
};

template <class F>
struct StepOutputs {
  F tokens;        // [B] AR: the sampled tokens
  F drafts;        // [B * n] the verified drafts
  F num_accepted;  // [B]
  F next_token;    // [B] the bonus / correction token
  F nonfinite;     // [B * q] 1 where a logit row (AR: the sampled row; speculative: verify row j of
                   // request r at r * (n + 1) + j) holds a NaN or an infinity
};

constexpr int64_t kSampleParamWords = static_cast<int64_t>(sizeof(SampleRow) / sizeof(int32_t));

// fn(a.field, b.field, ...) for every field of the structs, in layout order (the one list of them).
template <class Fn, class... S>
void step_inputs_visit(Fn fn, S&... s) {
  fn(s.ids...), fn(s.verify_ids...), fn(s.positions...), fn(s.slots...), fn(s.query_start...), fn(s.kv_len...);
  fn(s.logit_rows...), fn(s.override_drafts...), fn(s.use_override...), fn(s.params...), fn(s.feed...);
  fn(s.anchors...), fn(s.block_table...);
}

template <class Fn, class... S>
void step_outputs_visit(Fn fn, S&... s) {
  fn(s.tokens...), fn(s.drafts...), fn(s.num_accepted...), fn(s.next_token...), fn(s.nonfinite...);
}

// Word offsets and capacities of the fields of T (StepInputs or StepOutputs) in one buffer; each
// field starts on an even word (8-byte aligned, so the packed params keep their int64).
template <template <class> class T>
class StepLayout {
 public:
  StepLayout() = default;
  explicit StepLayout(const T<int64_t>& capacity) : count_(capacity) {
    int64_t at = 0;
    visit([&](int64_t& offset, const int64_t& count) {
      offset = at;
      at += (count + 1) / 2 * 2;
    }, offset_, count_);
    words_ = at;
  }
  int64_t words() const { return words_; }
  // Device views of every field (int32, [capacity]) in `buffer` (words() int32 words).
  T<Tensor> device(const Tensor& buffer) const {
    T<Tensor> out;
    visit([&](Tensor& t, const int64_t& offset, const int64_t& count) {
      t = buffer;
      t.shape = {count};
      t.data = static_cast<int32_t*>(buffer.data) + offset;
    }, out, offset_, count_);
    return out;
  }
  // Host pointers to every field in `buffer` (words() int32 words).
  T<int32_t*> host(void* buffer) const {
    T<int32_t*> out;
    visit([&](int32_t*& p, const int64_t& offset) { p = static_cast<int32_t*>(buffer) + offset; }, out, offset_);
    return out;
  }
  // The word offset of every field.
  const T<int64_t>& offsets() const { return offset_; }

 private:
  template <class Fn, class... S>
  static void visit(Fn fn, S&... s) {
    if constexpr (std::is_same_v<T<int>, StepInputs<int>>) {
      step_inputs_visit(fn, s...);
    } else {
      step_outputs_visit(fn, s...);
    }
  }

  T<int64_t> offset_{}, count_{};
  int64_t words_ = 0;
};

using StepInputLayout = StepLayout<StepInputs>;
using StepOutputLayout = StepLayout<StepOutputs>;

}  // namespace dflash

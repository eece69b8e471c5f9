// Block allocator and per-request block tables of the paged KV cache.
#include "kv_cache/block_allocator.h"

#include "common/error.h"

namespace dflash {

BlockAllocator::BlockAllocator(int64_t num_blocks)
    : num_blocks_(num_blocks), allocated_(num_blocks, 0) {
  DFLASH_ARG_CHECK(num_blocks > 0, "the KV cache needs at least one block");
  free_.reserve(num_blocks);
  for (int64_t i = num_blocks - 1; i >= 0; --i) free_.push_back(static_cast<int32_t>(i));
}

void BlockAllocator::allocate(int64_t n, std::vector<int32_t>* out) {
  DFLASH_CHECK(n <= num_free(), "KV cache out of blocks: asked for ", n, ", ", num_free(),
               " free");
  for (int64_t i = 0; i < n; ++i) {
    int32_t id = free_.back();
    free_.pop_back();
    allocated_[id] = 1;
    out->push_back(id);
  }
}

void BlockAllocator::free(const std::vector<int32_t>& blocks) {
  for (int32_t id : blocks) {
    DFLASH_CHECK(id >= 0 && id < num_blocks_ && allocated_[id], "freeing block ", id,
                 " that is not allocated");
    allocated_[id] = 0;
    free_.push_back(id);
  }
}

void BlockTable::reserve(int64_t tokens, BlockAllocator& alloc) {
  const int64_t need = blocks_for(tokens, block_size_) - static_cast<int64_t>(blocks_.size());
  if (need > 0) alloc.allocate(need, &blocks_);
}

void BlockTable::append(int64_t n) {
  DFLASH_CHECK(num_tokens_ + n <= capacity(), "BlockTable::append past capacity (",
               num_tokens_ + n, " > ", capacity(), ")");
  num_tokens_ += n;
}

void BlockTable::truncate(int64_t tokens) {
  DFLASH_CHECK(tokens >= 0 && tokens <= num_tokens_, "BlockTable::truncate to ", tokens,
               " of ", num_tokens_);
  num_tokens_ = tokens;
}

int32_t BlockTable::slot(int64_t pos) const {
  DFLASH_CHECK(pos >= 0 && pos < capacity(), "BlockTable::slot ", pos, " outside capacity ",
               capacity());
  return blocks_[pos / block_size_] * static_cast<int32_t>(block_size_) +
         static_cast<int32_t>(pos % block_size_);
}

void BlockTable::release(BlockAllocator& alloc) {
  alloc.free(blocks_);
  blocks_.clear();
  num_tokens_ = 0;
}

}  // namespace dflash

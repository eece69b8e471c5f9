// Block allocator (reference counts, cached blocks kept until evicted) and per-request block
// tables of the paged KV cache.
#include "kv_cache/block_allocator.h"

#include "common/error.h"

namespace dflash {

BlockAllocator::BlockAllocator(int64_t num_blocks, bool prefix_caching)
    : num_blocks_(num_blocks),
      prefix_caching_(prefix_caching),
      ref_(num_blocks > 0 ? num_blocks : 0, 0),
      cache_(num_blocks > 0 ? num_blocks : 0) {
  DFLASH_ARG_CHECK(num_blocks > 0, "the KV cache needs at least one block");
  free_.reserve(num_blocks);
  for (int64_t i = num_blocks - 1; i >= 0; --i) free_.push_back(static_cast<int32_t>(i));
}

void BlockAllocator::allocate(int64_t n, std::vector<int32_t>* out) {
  DFLASH_CHECK(n <= num_free(), "KV cache out of blocks: asked for ", n, ", ", num_free(),
               " free");
  for (int64_t i = 0; i < n; ++i) {
    int32_t id;
    if (!free_.empty()) {
      id = free_.back();
      free_.pop_back();
    } else {
      id = cache_.lru_pop();  // the least recently used cached block: its hash is forgotten
      cache_.erase(id);
      ++num_evictions_;
    }
    ref_[id] = 1;
    out->push_back(id);
  }
}

void BlockAllocator::free(const std::vector<int32_t>& blocks) {
  for (int32_t id : blocks) {
    DFLASH_CHECK(id >= 0 && id < num_blocks_ && ref_[id] > 0, "freeing block ", id,
                 " that is not allocated");
    if (--ref_[id] > 0) continue;
    if (cache_.cached(id)) {
      cache_.lru_push(id);
    } else {
      free_.push_back(id);
    }
  }
}

int32_t BlockAllocator::ref_count(int32_t block) const {
  DFLASH_CHECK(block >= 0 && block < num_blocks_, "block id ", block, " outside [0, ", num_blocks_, ")");
  return ref_[block];
}

int32_t BlockAllocator::lookup(uint64_t hash, uint64_t parent, const int32_t* tokens, int64_t n) const {
  return prefix_caching_ ? cache_.find(hash, parent, tokens, n) : -1;
}

void BlockAllocator::share(int32_t block) {
  DFLASH_CHECK(block >= 0 && block < num_blocks_ && (ref_[block] > 0 || cache_.in_lru(block)),
               "sharing block ", block, ", which is neither referenced nor cached");
  if (ref_[block]++ == 0) cache_.lru_remove(block);
}

void BlockAllocator::cache(int32_t block, uint64_t hash, uint64_t parent, const int32_t* tokens, int64_t n) {
  if (!prefix_caching_) return;
  DFLASH_CHECK(block >= 0 && block < num_blocks_ && ref_[block] > 0, "caching block ", block,
               ", which no request holds");
  cache_.insert(block, hash, parent, tokens, n);
}

void BlockTable::reserve(int64_t tokens, BlockAllocator& alloc) {
  const int64_t need = blocks_for(tokens, block_size_) - static_cast<int64_t>(blocks_.size());
  if (need > 0) alloc.allocate(need, &blocks_);
}

void BlockTable::adopt(const std::vector<int32_t>& blocks, const std::vector<uint64_t>& hashes) {
  DFLASH_CHECK(blocks_.empty() && hashes_.empty() && num_tokens_ == 0 && blocks.size() == hashes.size(),
               "BlockTable::adopt into a table that is not empty");
  blocks_ = blocks;
  hashes_ = hashes;
  num_tokens_ = static_cast<int64_t>(blocks.size()) * block_size_;
}

void BlockTable::push_hash(uint64_t hash) {
  DFLASH_CHECK(hashes_.size() < blocks_.size(), "BlockTable::push_hash past the table's blocks");
  hashes_.push_back(hash);
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
  alloc.free(std::vector<int32_t>(blocks_.rbegin(), blocks_.rend()));
  blocks_.clear();
  hashes_.clear();
  num_tokens_ = 0;
}

}  // namespace dflash

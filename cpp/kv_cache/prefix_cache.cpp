// Chain hashes of full KV blocks and the hash -> cached block index with its LRU list of
// unreferenced blocks (see prefix_cache.h).
#include "kv_cache/prefix_cache.h"

#include <algorithm>

#include "common/error.h"

namespace dflash {

namespace {
// splitmix64's finaliser: every input bit reaches every output bit.
uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}
}  // namespace

uint64_t prefix_block_hash(uint64_t parent, const int32_t* tokens, int64_t n) {
  uint64_t h = mix64(parent ^ (0x9e3779b97f4a7c15ull * static_cast<uint64_t>(n + 1)));
  for (int64_t i = 0; i < n; ++i) {
    h = mix64(h + 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])));
  }
  return h;
}

PrefixCacheIndex::PrefixCacheIndex(int64_t num_blocks)
    : entries_(num_blocks), prev_(num_blocks, -1), next_(num_blocks, -1), in_lru_(num_blocks, 0) {}

int32_t PrefixCacheIndex::find(uint64_t hash, uint64_t parent, const int32_t* tokens, int64_t n) const {
  auto it = by_hash_.find(hash);
  if (it == by_hash_.end()) return -1;
  const Entry& e = entries_[it->second];
  if (e.parent != parent || static_cast<int64_t>(e.tokens.size()) != n ||
      !std::equal(e.tokens.begin(), e.tokens.end(), tokens)) {
    return -1;
  }
  return it->second;
}

bool PrefixCacheIndex::insert(int32_t block, uint64_t hash, uint64_t parent, const int32_t* tokens, int64_t n) {
  Entry& e = entries_[block];
  if (e.valid || by_hash_.count(hash)) return false;
  e.valid = true;
  e.hash = hash;
  e.parent = parent;
  e.tokens.assign(tokens, tokens + n);
  by_hash_.emplace(hash, block);
  return true;
}

void PrefixCacheIndex::erase(int32_t block) {
  Entry& e = entries_[block];
  if (!e.valid) return;
  DFLASH_CHECK(!in_lru_[block], "erasing the hash of block ", block, " while it is in the LRU list");
  by_hash_.erase(e.hash);
  e.valid = false;
  e.tokens.clear();
}

void PrefixCacheIndex::lru_push(int32_t block) {
  DFLASH_CHECK(entries_[block].valid && !in_lru_[block], "LRU push of block ", block,
               " (not cached, or already listed)");
  prev_[block] = tail_;
  next_[block] = -1;
  if (tail_ >= 0) next_[tail_] = block;
  tail_ = block;
  if (head_ < 0) head_ = block;
  in_lru_[block] = 1;
  ++lru_size_;
}

void PrefixCacheIndex::lru_remove(int32_t block) {
  DFLASH_CHECK(in_lru_[block], "LRU removal of block ", block, ", which is not listed");
  const int32_t p = prev_[block], n = next_[block];
  (p >= 0 ? next_[p] : head_) = n;
  (n >= 0 ? prev_[n] : tail_) = p;
  prev_[block] = next_[block] = -1;
  in_lru_[block] = 0;
  --lru_size_;
}

int32_t PrefixCacheIndex::lru_pop() {
  const int32_t block = head_;
  if (block >= 0) lru_remove(block);
  return block;
}

}  // namespace dflash

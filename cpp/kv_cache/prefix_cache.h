// Prefix caching bookkeeping: the chain hash of a full KV block (its token ids and its parent
// block's hash, so that equal hashes stand for equal whole prefixes), and the index from those
// hashes to the cached blocks holding their K/V, with the least-recently-used order of the cached
// blocks no request references (the ones the allocator may evict). The index only tracks ids;
// the BlockAllocator owns it and keeps the reference counts. Not thread-safe.
//
// What a cached block holds is the target's K/V of its tokens and the drafter's context K/V of
// the same tokens (same block ids): both depend only on the prefix up to the block's end (the
// drafter's context of a token is computed from the target's taps of that token), so the one
// hash covers both.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace dflash {

// Parent hash of a request's first block.
constexpr uint64_t kPrefixHashRoot = 0x6a09e667f3bcc908ull;

// Chain hash of a full block: its `n` token ids [n] after the block whose hash is `parent`.
uint64_t prefix_block_hash(uint64_t parent, const int32_t* tokens, int64_t n);

class PrefixCacheIndex {
 public:
  explicit PrefixCacheIndex(int64_t num_blocks);

  int64_t num_cached() const { return static_cast<int64_t>(by_hash_.size()); }
  int64_t num_unreferenced() const { return lru_size_; }
  bool cached(int32_t block) const { return entries_[block].valid; }

  // The cached block of chain hash `hash` whose parent hash and tokens [n] are these (the stored
  // key is compared in full, so a false hit needs a collision of the parent's 64-bit chain hash
  // and the same tokens); -1 if none.
  int32_t find(uint64_t hash, uint64_t parent, const int32_t* tokens, int64_t n) const;
  // Registers `block` as the holder of `hash`; false (nothing changes) if the hash is already
  // cached in another block or `block` already holds one.
  bool insert(int32_t block, uint64_t hash, uint64_t parent, const int32_t* tokens, int64_t n);
  // Forgets the hash `block` holds (it is being reused for other tokens).
  void erase(int32_t block);

  // The LRU list of cached blocks with no reference: push at the tail (most recently used),
  // remove from anywhere, pop the head (least recently used; -1 if empty).
  void lru_push(int32_t block);
  void lru_remove(int32_t block);
  int32_t lru_pop();
  bool in_lru(int32_t block) const { return in_lru_[block] != 0; }

 private:
  struct Entry {
    bool valid = false;
    uint64_t hash = 0, parent = 0;
    std::vector<int32_t> tokens;
  };
  std::unordered_map<uint64_t, int32_t> by_hash_;
  std::vector<Entry> entries_;  // [num_blocks]
  std::vector<int32_t> prev_, next_;  // [num_blocks] LRU links (-1: none)
  std::vector<uint8_t> in_lru_;       // [num_blocks]
  int32_t head_ = -1, tail_ = -1;
  int64_t lru_size_ = 0;
};

}  // namespace dflash

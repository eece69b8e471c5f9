// BlockAllocator hands out ids of fixed-size KV blocks from one pool, with reference counts so
// that requests can share the blocks of a common prefix (prefix caching), and BlockTable holds
// the blocks of one request. Only ids are tracked; the memory lives in a KVPool owned by the
// backend (the target's and the drafter's pools use the same ids). Not thread-safe (the engine's
// thread owns it).
//
// With prefix caching, a full block can be registered under the chain hash of its prefix
// (prefix_cache.h). When its last reference goes it stays cached, unreferenced, in an LRU list:
// a later request with the same prefix shares it again (share()); allocate() evicts the least
// recently used of them only when no never-cached free block is left. num_free() counts free and
// evictable blocks alike: both are available to allocate().
#pragma once

#include <cstdint>
#include <vector>

#include "kv_cache/prefix_cache.h"

namespace dflash {

class BlockAllocator {
 public:
  explicit BlockAllocator(int64_t num_blocks, bool prefix_caching = false);

  int64_t num_blocks() const { return num_blocks_; }
  // Blocks allocate() can hand out: free ones and cached ones no request references.
  int64_t num_free() const { return static_cast<int64_t>(free_.size()) + cache_.num_unreferenced(); }
  bool can_allocate(int64_t n) const { return n <= num_free(); }
  // Appends n block ids (reference count 1) to `out`, evicting unreferenced cached blocks (least
  // recently used first) once the never-cached free blocks are gone; throws dflash::Error if
  // fewer than n are available.
  void allocate(int64_t n, std::vector<int32_t>* out);
  // Drops one reference of each block (in order); a block left without one returns to the free
  // blocks, or to the end of the LRU list when it is cached. Throws on an unreferenced id.
  void free(const std::vector<int32_t>& blocks);
  int32_t ref_count(int32_t block) const;

  // Prefix caching (all no-ops / misses when it is off).
  bool prefix_caching() const { return prefix_caching_; }
  // The cached block holding the full block of chain hash `hash` (parent hash `parent`, tokens
  // [n]), or -1. Takes no reference.
  int32_t lookup(uint64_t hash, uint64_t parent, const int32_t* tokens, int64_t n) const;
  // Adds a reference to a block that is referenced or cached (taking it out of the LRU list).
  void share(int32_t block);
  // Registers a referenced full block as the holder of `hash`; nothing happens if another block
  // already holds that hash (two requests computed the same prefix) or caching is off.
  void cache(int32_t block, uint64_t hash, uint64_t parent, const int32_t* tokens, int64_t n);
  bool is_cached(int32_t block) const { return cache_.cached(block); }
  // Cached blocks (referenced or not), the unreferenced ones among them, evictions so far.
  int64_t num_cached() const { return cache_.num_cached(); }
  int64_t num_evictable() const { return cache_.num_unreferenced(); }
  int64_t num_evictions() const { return num_evictions_; }

 private:
  int64_t num_blocks_;
  bool prefix_caching_;
  std::vector<int32_t> free_;  // stack of free, never-cached (or evicted) ids
  std::vector<int32_t> ref_;   // [num_blocks] references held by block tables
  PrefixCacheIndex cache_;
  int64_t num_evictions_ = 0;
};

// The blocks of one request and how many token slots of them are in use. Truncation (rollback
// after rejected speculative tokens) only moves num_tokens: O(1); blocks stay with the request
// until release(). With prefix caching its leading blocks may be shared with other requests
// (adopted from the cache, never written: only slots past num_tokens are written), and it keeps
// the chain hashes of its leading full blocks (hashes()[i] of block i).
class BlockTable {
 public:
  explicit BlockTable(int64_t block_size) : block_size_(block_size) {}

  int64_t block_size() const { return block_size_; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t capacity() const { return static_cast<int64_t>(blocks_.size()) * block_size_; }
  const std::vector<int32_t>& blocks() const { return blocks_; }
  const std::vector<uint64_t>& hashes() const { return hashes_; }

  // Blocks needed to hold `tokens` slots in total.
  static int64_t blocks_for(int64_t tokens, int64_t block_size) {
    return (tokens + block_size - 1) / block_size;
  }
  // Grows the table so that `tokens` slots fit (allocating from `alloc`).
  void reserve(int64_t tokens, BlockAllocator& alloc);
  // An empty table takes over full blocks whose references the caller holds, with their chain
  // hashes [blocks.size()]: num_tokens becomes blocks.size() * block_size.
  void adopt(const std::vector<int32_t>& blocks, const std::vector<uint64_t>& hashes);
  // Records the chain hash of the next full block (block hashes().size()).
  void push_hash(uint64_t hash);
  // Marks `n` more slots as used; they must fit in the capacity.
  void append(int64_t n);
  // Drops the tail: num_tokens = tokens (<= num_tokens). O(1).
  void truncate(int64_t tokens);
  // Slot index (block id * block_size + offset) of token position `pos` (< capacity).
  int32_t slot(int64_t pos) const;
  // Returns every block to `alloc`, the last block first (so that, cached, a prefix's tail is
  // evicted before its head).
  void release(BlockAllocator& alloc);

 private:
  int64_t block_size_;
  int64_t num_tokens_ = 0;
  std::vector<int32_t> blocks_;
  std::vector<uint64_t> hashes_;
};

}  // namespace dflash

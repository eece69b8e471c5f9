// BlockAllocator hands out ids of fixed-size KV blocks from one pool. It only tracks ids; the
// memory lives in a KVPool owned by the backend. Not thread-safe (the engine's thread owns it).
#pragma once

#include <cstdint>
#include <vector>

namespace dflash {

class BlockAllocator {
 public:
  explicit BlockAllocator(int64_t num_blocks);

  int64_t num_blocks() const { return num_blocks_; }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  bool can_allocate(int64_t n) const { return n <= num_free(); }
  // Appends n block ids to `out`; throws dflash::Error if fewer than n are free.
  void allocate(int64_t n, std::vector<int32_t>* out);
  // Returns blocks to the pool; throws on an id that is not currently allocated.
  void free(const std::vector<int32_t>& blocks);

 private:
  int64_t num_blocks_;
  std::vector<int32_t> free_;       // stack of free ids
  std::vector<uint8_t> allocated_;  // [num_blocks] 1 while handed out
};

// The blocks of one request and how many token slots of them are in use. Truncation (rollback
// after rejected speculative tokens) only moves num_tokens: O(1); blocks stay with the request
// until release().
class BlockTable {
 public:
  explicit BlockTable(int64_t block_size) : block_size_(block_size) {}

  int64_t block_size() const { return block_size_; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t capacity() const { return static_cast<int64_t>(blocks_.size()) * block_size_; }
  const std::vector<int32_t>& blocks() const { return blocks_; }

  // Blocks needed to hold `tokens` slots in total.
  static int64_t blocks_for(int64_t tokens, int64_t block_size) {
    return (tokens + block_size - 1) / block_size;
  }
  // Grows the table so that `tokens` slots fit (allocating from `alloc`).
  void reserve(int64_t tokens, BlockAllocator& alloc);
  // Marks `n` more slots as used; they must fit in the capacity.
  void append(int64_t n);
  // Drops the tail: num_tokens = tokens (<= num_tokens). O(1).
  void truncate(int64_t tokens);
  // Slot index (block id * block_size + offset) of token position `pos` (< capacity).
  int32_t slot(int64_t pos) const;
  // Returns every block to `alloc`.
  void release(BlockAllocator& alloc);

 private:
  int64_t block_size_;
  int64_t num_tokens_ = 0;
  std::vector<int32_t> blocks_;
};

}  // namespace dflash

// BlockAllocator (ids, reference counts, cached blocks and their LRU eviction) and BlockTable
// (growth, slots, O(1) truncation, release order): cpp/kv_cache/block_allocator.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "common/error.h"
#include "kv_cache/block_allocator.h"
#include "test_files.h"

namespace dflash {
namespace {

using dflash_test::token_range;

TEST(BlockAllocator, HandsOutEveryBlockOnceAndTakesThemBack) {
  BlockAllocator a(8);
  EXPECT_EQ(a.num_blocks(), 8);
  EXPECT_EQ(a.num_free(), 8);
  std::vector<int32_t> got;
  a.allocate(3, &got);
  a.allocate(5, &got);
  ASSERT_EQ(got.size(), 8u);
  EXPECT_EQ(std::set<int32_t>(got.begin(), got.end()).size(), 8u);
  for (int32_t b : got) {
    EXPECT_GE(b, 0);
    EXPECT_LT(b, 8);
    EXPECT_EQ(a.ref_count(b), 1);
  }
  EXPECT_EQ(a.num_free(), 0);
  EXPECT_FALSE(a.can_allocate(1));
  std::vector<int32_t> more;
  EXPECT_THROW(a.allocate(1, &more), Error);
  a.free({got[0], got[1]});
  EXPECT_EQ(a.num_free(), 2);
  EXPECT_EQ(a.ref_count(got[0]), 0);
  a.free(std::vector<int32_t>(got.begin() + 2, got.end()));
  EXPECT_EQ(a.num_free(), 8);
}

TEST(BlockAllocator, FreeingAnUnreferencedBlockThrows) {
  BlockAllocator a(4);
  std::vector<int32_t> got;
  a.allocate(1, &got);
  a.free(got);
  EXPECT_THROW(a.free(got), Error);
  EXPECT_EQ(a.num_free(), 4);
}

TEST(BlockAllocator, SharedBlocksReturnWithTheirLastReference) {
  BlockAllocator a(4);
  std::vector<int32_t> got;
  a.allocate(1, &got);
  a.share(got[0]);
  EXPECT_EQ(a.ref_count(got[0]), 2);
  a.free(got);
  EXPECT_EQ(a.ref_count(got[0]), 1);
  EXPECT_EQ(a.num_free(), 3);
  a.free(got);
  EXPECT_EQ(a.num_free(), 4);
}

TEST(BlockAllocator, WithoutPrefixCachingNothingIsCached) {
  BlockAllocator a(4, /*prefix_caching=*/false);
  std::vector<int32_t> got;
  a.allocate(1, &got);
  const std::vector<int32_t> t = token_range(10, 4);
  const uint64_t h = prefix_block_hash(kPrefixHashRoot, t.data(), 4);
  a.cache(got[0], h, kPrefixHashRoot, t.data(), 4);
  EXPECT_FALSE(a.is_cached(got[0]));
  EXPECT_EQ(a.lookup(h, kPrefixHashRoot, t.data(), 4), -1);
  a.free(got);
  EXPECT_EQ(a.num_cached(), 0);
}

TEST(BlockAllocator, CachedBlocksStayFindableAndAreEvictedLeastRecentlyUsedFirst) {
  BlockAllocator a(3, /*prefix_caching=*/true);
  std::vector<int32_t> b;
  a.allocate(3, &b);
  std::vector<uint64_t> hashes;
  std::vector<std::vector<int32_t>> toks;
  for (int i = 0; i < 2; ++i) {  // blocks b[0] and b[1] hold two different prefixes
    toks.push_back(token_range(100 * (i + 1), 4));
    hashes.push_back(prefix_block_hash(kPrefixHashRoot, toks[i].data(), 4));
    a.cache(b[i], hashes[i], kPrefixHashRoot, toks[i].data(), 4);
  }
  EXPECT_EQ(a.num_cached(), 2);
  EXPECT_EQ(a.num_evictable(), 0);
  // Released in the order b[1], b[0]: b[1] becomes the least recently used.
  a.free({b[1]});
  a.free({b[0]});
  a.free({b[2]});
  EXPECT_EQ(a.num_free(), 3);  // evictable cached blocks count as free
  EXPECT_EQ(a.num_evictable(), 2);
  EXPECT_EQ(a.lookup(hashes[0], kPrefixHashRoot, toks[0].data(), 4), b[0]);
  EXPECT_EQ(a.lookup(hashes[1], kPrefixHashRoot, toks[1].data(), 4), b[1]);
  // Sharing a cached block takes it out of the LRU list.
  a.share(b[0]);
  EXPECT_EQ(a.ref_count(b[0]), 1);
  EXPECT_EQ(a.num_evictable(), 1);
  EXPECT_EQ(a.num_free(), 2);
  // The never-cached block goes first, then the LRU cached block (b[1]) is evicted.
  std::vector<int32_t> fresh;
  a.allocate(1, &fresh);
  EXPECT_EQ(fresh[0], b[2]);
  EXPECT_EQ(a.num_evictions(), 0);
  a.allocate(1, &fresh);
  EXPECT_EQ(fresh[1], b[1]);
  EXPECT_EQ(a.num_evictions(), 1);
  EXPECT_FALSE(a.is_cached(b[1]));
  EXPECT_EQ(a.lookup(hashes[1], kPrefixHashRoot, toks[1].data(), 4), -1);
  EXPECT_EQ(a.lookup(hashes[0], kPrefixHashRoot, toks[0].data(), 4), b[0]);
  a.free({b[0], fresh[0], fresh[1]});
  EXPECT_EQ(a.num_free(), 3);
}

TEST(BlockAllocator, SecondBlockWithTheSameHashIsNotCached) {
  BlockAllocator a(2, true);
  std::vector<int32_t> b;
  a.allocate(2, &b);
  const std::vector<int32_t> t = token_range(5, 4);
  const uint64_t h = prefix_block_hash(kPrefixHashRoot, t.data(), 4);
  a.cache(b[0], h, kPrefixHashRoot, t.data(), 4);
  a.cache(b[1], h, kPrefixHashRoot, t.data(), 4);  // two requests computed the same prefix
  EXPECT_TRUE(a.is_cached(b[0]));
  EXPECT_FALSE(a.is_cached(b[1]));
  EXPECT_EQ(a.num_cached(), 1);
}

TEST(BlockTable, GrowsByWholeBlocksAndMapsPositionsToSlots) {
  EXPECT_EQ(BlockTable::blocks_for(0, 4), 0);
  EXPECT_EQ(BlockTable::blocks_for(1, 4), 1);
  EXPECT_EQ(BlockTable::blocks_for(4, 4), 1);
  EXPECT_EQ(BlockTable::blocks_for(5, 4), 2);
  BlockAllocator a(6);
  BlockTable t(4);
  t.reserve(5, a);
  ASSERT_EQ(t.blocks().size(), 2u);
  EXPECT_EQ(t.capacity(), 8);
  EXPECT_EQ(t.num_tokens(), 0);
  EXPECT_EQ(a.num_free(), 4);
  t.reserve(8, a);  // fits already
  EXPECT_EQ(t.blocks().size(), 2u);
  t.append(6);
  EXPECT_EQ(t.num_tokens(), 6);
  for (int64_t pos = 0; pos < 8; ++pos) {
    EXPECT_EQ(t.slot(pos), t.blocks()[pos / 4] * 4 + pos % 4) << pos;
  }
  t.truncate(2);  // rollback keeps the blocks
  EXPECT_EQ(t.num_tokens(), 2);
  EXPECT_EQ(t.blocks().size(), 2u);
  EXPECT_EQ(a.num_free(), 4);
  t.release(a);
  EXPECT_TRUE(t.blocks().empty());
  EXPECT_EQ(t.num_tokens(), 0);
  EXPECT_EQ(a.num_free(), 6);
}

TEST(BlockTable, ReleaseReturnsTheTailFirst) {
  // Cached blocks enter the LRU list in release order: the tail of a prefix is evicted first.
  BlockAllocator a(3, true);
  BlockTable t(2);
  t.reserve(6, a);
  t.append(6);
  uint64_t parent = kPrefixHashRoot;
  std::vector<std::vector<int32_t>> toks;
  for (int k = 0; k < 3; ++k) {
    toks.push_back(token_range(10 * k, 2));
    const uint64_t h = prefix_block_hash(parent, toks[k].data(), 2);
    a.cache(t.blocks()[k], h, parent, toks[k].data(), 2);
    t.push_hash(h);
    parent = h;
  }
  EXPECT_EQ(t.hashes().size(), 3u);
  const std::vector<int32_t> blocks = t.blocks();
  t.release(a);
  std::vector<int32_t> got;
  a.allocate(1, &got);
  EXPECT_EQ(got[0], blocks[2]);
  a.allocate(1, &got);
  EXPECT_EQ(got[1], blocks[1]);
}

TEST(BlockTable, AdoptTakesFullBlocksWithTheirHashes) {
  BlockAllocator a(4, true);
  std::vector<int32_t> shared;
  a.allocate(2, &shared);
  BlockTable t(4);
  t.adopt(shared, {11u, 22u});
  EXPECT_EQ(t.num_tokens(), 8);
  EXPECT_EQ(t.blocks(), shared);
  EXPECT_EQ(t.hashes(), (std::vector<uint64_t>{11u, 22u}));
  t.reserve(9, a);
  EXPECT_EQ(t.blocks().size(), 3u);
  t.release(a);
  EXPECT_EQ(a.num_free(), 4);
}

}  // namespace
}  // namespace dflash

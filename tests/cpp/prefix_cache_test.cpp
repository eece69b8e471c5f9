// Prefix caching's chain hash and index (cpp/kv_cache/prefix_cache.h): hashes that stand for
// whole prefixes, lookups that compare the full key, and the LRU list of unreferenced blocks.
#include <gtest/gtest.h>

#include <vector>

#include "kv_cache/prefix_cache.h"

namespace dflash {
namespace {

TEST(PrefixBlockHash, DependsOnTheTokensTheirOrderAndTheParent) {
  const std::vector<int32_t> a{1, 2, 3, 4}, b{1, 2, 4, 3};
  const uint64_t ha = prefix_block_hash(kPrefixHashRoot, a.data(), 4);
  EXPECT_EQ(ha, prefix_block_hash(kPrefixHashRoot, a.data(), 4));  // deterministic
  EXPECT_NE(ha, prefix_block_hash(kPrefixHashRoot, b.data(), 4));
  EXPECT_NE(ha, prefix_block_hash(ha, a.data(), 4));  // the same block after another prefix
  EXPECT_NE(ha, prefix_block_hash(kPrefixHashRoot, a.data(), 3));
  // A chain: equal second-block hashes need equal first blocks.
  const uint64_t second_after_a = prefix_block_hash(ha, b.data(), 4);
  const uint64_t second_after_b = prefix_block_hash(prefix_block_hash(kPrefixHashRoot, b.data(), 4), b.data(), 4);
  EXPECT_NE(second_after_a, second_after_b);
}

TEST(PrefixCacheIndex, FindsOnlyTheExactKey) {
  PrefixCacheIndex index(4);
  const std::vector<int32_t> t{7, 8, 9};
  const uint64_t h = prefix_block_hash(kPrefixHashRoot, t.data(), 3);
  EXPECT_EQ(index.find(h, kPrefixHashRoot, t.data(), 3), -1);
  ASSERT_TRUE(index.insert(2, h, kPrefixHashRoot, t.data(), 3));
  EXPECT_TRUE(index.cached(2));
  EXPECT_EQ(index.num_cached(), 1);
  EXPECT_EQ(index.find(h, kPrefixHashRoot, t.data(), 3), 2);
  // Same hash value but another parent or other tokens (a collision) is not a hit.
  const std::vector<int32_t> other{7, 8, 10};
  EXPECT_EQ(index.find(h, h, t.data(), 3), -1);
  EXPECT_EQ(index.find(h, kPrefixHashRoot, other.data(), 3), -1);
  EXPECT_EQ(index.find(h, kPrefixHashRoot, t.data(), 2), -1);
  // One block per hash and one hash per block.
  EXPECT_FALSE(index.insert(3, h, kPrefixHashRoot, t.data(), 3));
  const uint64_t h2 = prefix_block_hash(kPrefixHashRoot, other.data(), 3);
  EXPECT_FALSE(index.insert(2, h2, kPrefixHashRoot, other.data(), 3));
  EXPECT_FALSE(index.cached(3));
  index.erase(2);
  EXPECT_FALSE(index.cached(2));
  EXPECT_EQ(index.num_cached(), 0);
  EXPECT_EQ(index.find(h, kPrefixHashRoot, t.data(), 3), -1);
  EXPECT_TRUE(index.insert(3, h, kPrefixHashRoot, t.data(), 3));
}

TEST(PrefixCacheIndex, LruListPopsTheOldestAndRemovesFromAnywhere) {
  PrefixCacheIndex index(5);
  EXPECT_EQ(index.lru_pop(), -1);
  for (int32_t b : {3, 1, 4, 0}) {  // only cached blocks enter the list
    const std::vector<int32_t> t{b, b + 1};
    ASSERT_TRUE(index.insert(b, prefix_block_hash(kPrefixHashRoot, t.data(), 2), kPrefixHashRoot, t.data(), 2));
    index.lru_push(b);
  }
  EXPECT_EQ(index.num_unreferenced(), 4);
  EXPECT_TRUE(index.in_lru(4));
  EXPECT_FALSE(index.in_lru(2));
  index.lru_remove(1);  // middle
  EXPECT_FALSE(index.in_lru(1));
  index.lru_remove(0);  // tail
  index.lru_push(1);    // back at the tail: most recently used
  EXPECT_EQ(index.num_unreferenced(), 3);
  EXPECT_EQ(index.lru_pop(), 3);
  EXPECT_EQ(index.lru_pop(), 4);
  EXPECT_EQ(index.lru_pop(), 1);
  EXPECT_EQ(index.lru_pop(), -1);
  EXPECT_EQ(index.num_unreferenced(), 0);
}

}  // namespace
}  // namespace dflash

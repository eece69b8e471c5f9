// The one list of the stats' fields (include/dflash/stats.h: for_each_engine_stat and
// for_each_session_stat): every field of EngineStats and SessionStats is in it exactly once, and
// no two fields share a key (the Python module reports both structs in one dict).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <set>
#include <string>
#include <vector>

#include "dflash/stats.h"

namespace {

// The bytes a field takes in its struct, [begin, end), and the field type's alignment.
struct Span {
  size_t begin = 0, end = 0, align = 1;
};

template <class S, class M>
Span span_of(const S& s, M S::*member) {
  const size_t offset = static_cast<size_t>(reinterpret_cast<const char*>(&(s.*member)) -
                                            reinterpret_cast<const char*>(&s));
  return {offset, offset + sizeof(M), alignof(M)};
}

// Success when the listed fields tile the struct: no two overlap (a field listed twice), and every
// gap between them is only padding, narrower than the next field's alignment (a field left out
// leaves a wider gap; one small enough to hide in another's padding would slip through).
template <class S>
::testing::AssertionResult tiles(std::vector<Span> spans) {
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  size_t at = 0;
  for (const Span& f : spans) {
    if (f.begin < at) return ::testing::AssertionFailure() << "a field is listed twice (byte " << f.begin << ")";
    if (f.begin - at >= f.align)
      return ::testing::AssertionFailure() << "bytes " << at << ".." << f.begin << " are in no listed field";
    at = f.end;
  }
  if (sizeof(S) - at >= alignof(S))
    return ::testing::AssertionFailure() << "bytes " << at << ".." << sizeof(S) << " are in no listed field";
  return ::testing::AssertionSuccess();
}

TEST(StatsList, EveryEngineFieldIsListedOnce) {
  const dflash::EngineStats s;
  std::vector<Span> spans;
  dflash::for_each_engine_stat([&](const char*, auto member) { spans.push_back(span_of(s, member)); });
  EXPECT_TRUE(tiles<dflash::EngineStats>(spans));
}

TEST(StatsList, EverySessionFieldIsListedOnce) {
  const dflash::SessionStats s;
  std::vector<Span> spans{span_of(s, &dflash::SessionStats::engine)};  // listed by the engine's list
  dflash::for_each_session_stat([&](const char*, auto member) { spans.push_back(span_of(s, member)); });
  EXPECT_TRUE(tiles<dflash::SessionStats>(spans));
}

TEST(StatsList, KeysAreUnique) {
  std::vector<std::string> keys;
  dflash::for_each_session_stat([&](const char* key, auto) { keys.emplace_back(key); });
  dflash::for_each_engine_stat([&](const char* key, auto) { keys.emplace_back(key); });
  EXPECT_EQ(std::set<std::string>(keys.begin(), keys.end()).size(), keys.size());
  EXPECT_EQ(std::count(keys.begin(), keys.end(), "engine"), 0);  // the nested struct's attribute
}

}  // namespace

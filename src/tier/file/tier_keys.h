// Test helpers over a whole tier: write numbered test chunks, and read them back checking every
// byte (tier/file/test_chunks.h says what the bytes are). For the suites against real servers.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "kvtier/file_tier.h"
#include "tier/file/test_chunks.h"

namespace kvtier::testing {

// Writes keys [first, first + count) through `tier`, chunks of `chunk` bytes.
inline void WriteKeys(FileTier& tier, uint64_t first, uint64_t count, uint64_t chunk) {
  AlignedBuffer buf(chunk);
  for (uint64_t i = first; i < first + count; ++i) {
    FillChunk(TestKey(i), buf.first(chunk));
    Status s = tier.Write(TestKey(i), buf.first(chunk));
    ASSERT_TRUE(s.ok()) << i << ": " << s.ToString();
  }
}

// Reads keys [first, first + count) through `tier`: each must be there, with its own bytes.
inline void ExpectKeys(FileTier& tier, uint64_t first, uint64_t count, uint64_t chunk) {
  AlignedBuffer buf(chunk);
  for (uint64_t i = first; i < first + count; ++i) {
    std::memset(buf.data(), 0, buf.size());
    Status s = tier.Read(TestKey(i), buf.first(chunk));
    ASSERT_TRUE(s.ok()) << i << ": " << s.ToString();
    EXPECT_TRUE(VerifyChunk(TestKey(i), buf.first(chunk))) << "wrong bytes for key " << i;
  }
}

// LookupPrefix of `keys` until all are found or `timeout` passes: the prefix found last. A
// lookup answers from the index; a chunk another tier wrote is indexed by the probe that the
// first lookup to miss it queues (docs/file-format.md, "The index").
inline size_t LookupEventually(FileTier& tier, const std::vector<ChunkKey>& keys,
                               std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const size_t n = tier.LookupPrefix(keys);
    if (n == keys.size() || std::chrono::steady_clock::now() >= deadline) return n;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace kvtier::testing

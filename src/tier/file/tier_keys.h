// Test helpers over a whole tier: write numbered test chunks, and read them back checking every
// byte (tier/file/test_chunks.h says what the bytes are). For the suites against real servers.
#pragma once

#include <gtest/gtest.h>

#include <cstring>

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

}  // namespace kvtier::testing

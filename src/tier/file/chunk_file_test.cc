#include "tier/file/chunk_file.h"

#include <algorithm>
#include <vector>

#include <gtest/gtest.h>
#include <xxhash.h>

#include "kvtier/io.h"
#include "tier/file/test_chunks.h"

namespace kvtier::file_tier_internal {
namespace {

ChunkHeader SampleHeader() {
  ChunkHeader h;
  h.namespace_root = testing::TestNamespace().Root();
  h.key = testing::TestKey(1);
  h.layout_fingerprint = 42;
  h.payload_bytes = 123456;
  h.payload_checksum = 0xfeedfacecafebeefull;
  h.created_unix_ms = 1700000000000ull;
  h.chunk_tokens = 256;
  h.rank = 1;
  h.world_size = 2;
  h.model_id = "Qwen/Qwen3-8B";
  return h;
}

TEST(ChunkFileTest, HeaderRoundTrips) {
  AlignedBuffer buf(kHeaderBytes);
  EncodeHeader(SampleHeader(), std::span<uint8_t, kHeaderBytes>(buf.data(), kHeaderBytes));
  EXPECT_EQ(std::string(reinterpret_cast<char*>(buf.data()), 8), "KVTCHUNK");
  DecodedHeader d = DecodeHeader(std::span<const uint8_t, kHeaderBytes>(buf.data(), kHeaderBytes));
  ASSERT_EQ(d.verdict, HeaderVerdict::kOk) << d.reason;
  const ChunkHeader& h = d.header;
  ChunkHeader want = SampleHeader();
  EXPECT_EQ(h.namespace_root, want.namespace_root);
  EXPECT_EQ(h.key, want.key);
  EXPECT_EQ(h.layout_fingerprint, 42u);
  EXPECT_EQ(h.payload_bytes, 123456u);
  EXPECT_EQ(h.payload_checksum, want.payload_checksum);
  EXPECT_EQ(h.created_unix_ms, want.created_unix_ms);
  EXPECT_EQ(h.chunk_tokens, 256u);
  EXPECT_EQ(h.rank, 1u);
  EXPECT_EQ(h.world_size, 2u);
  EXPECT_EQ(h.model_id, "Qwen/Qwen3-8B");
}

TEST(ChunkFileTest, EveryHeaderBitFlipIsDetected) {
  AlignedBuffer good(kHeaderBytes), bad(kHeaderBytes);
  EncodeHeader(SampleHeader(), std::span<uint8_t, kHeaderBytes>(good.data(), kHeaderBytes));
  for (size_t byte = 0; byte < kHeaderBytes; byte += 7) {
    std::memcpy(bad.data(), good.data(), kHeaderBytes);
    bad.data()[byte] ^= 0x10;
    DecodedHeader d =
        DecodeHeader(std::span<const uint8_t, kHeaderBytes>(bad.data(), kHeaderBytes));
    EXPECT_EQ(d.verdict, HeaderVerdict::kCorrupt) << "flip at byte " << byte;
  }
}

// The descriptor (docs/file-format.md, "The descriptor"): opaque bytes in the header's reserved
// area, announced by flags bit 0, covered by the header checksum.
TEST(ChunkFileTest, DescriptorRoundTripsAndHeadersWithoutOneHaveNone) {
  AlignedBuffer buf(kHeaderBytes);
  auto span = std::span<uint8_t, kHeaderBytes>(buf.data(), kHeaderBytes);
  auto cspan = std::span<const uint8_t, kHeaderBytes>(buf.data(), kHeaderBytes);
  ChunkHeader h = SampleHeader();
  for (size_t len : {size_t{1}, size_t{1300}, kMaxDescriptorBytes}) {
    h.descriptor.assign(len, '\0');
    for (size_t i = 0; i < len; ++i) h.descriptor[i] = static_cast<char>(i * 31 + 7);
    EncodeHeader(h, span);
    uint32_t flags;
    std::memcpy(&flags, buf.data() + 100, 4);
    EXPECT_EQ(flags, kFlagDescriptor);
    DecodedHeader d = DecodeHeader(cspan);
    ASSERT_EQ(d.verdict, HeaderVerdict::kOk) << d.reason;
    EXPECT_EQ(d.header.descriptor, h.descriptor) << len;
    EXPECT_EQ(d.descriptor_problem, "");
    EXPECT_EQ(d.header.model_id, "Qwen/Qwen3-8B");
  }
  // Too long for the area: left out, the rest of the header as ever.
  h.descriptor.assign(kMaxDescriptorBytes + 1, 'x');
  EncodeHeader(h, span);
  DecodedHeader d = DecodeHeader(cspan);
  ASSERT_EQ(d.verdict, HeaderVerdict::kOk) << d.reason;
  EXPECT_EQ(d.header.descriptor, "");
  // A header as written before descriptors existed (flags 0, the area zero) has none.
  EncodeHeader(SampleHeader(), span);
  EXPECT_TRUE(std::all_of(buf.data() + kDescriptorOffset, buf.data() + kHeaderBytes - 8,
                          [](uint8_t b) { return b == 0; }));
  d = DecodeHeader(cspan);
  ASSERT_EQ(d.verdict, HeaderVerdict::kOk);
  EXPECT_EQ(d.header.descriptor, "");
  EXPECT_EQ(d.descriptor_problem, "");
}

// A descriptor this build cannot take, in a header whose checksum holds (another writer's bug,
// a later descriptor format), costs the descriptor only: the chunk stays readable.
TEST(ChunkFileTest, ADescriptorThisBuildCannotTakeLeavesTheChunk) {
  AlignedBuffer buf(kHeaderBytes);
  ChunkHeader h = SampleHeader();
  h.descriptor = "descriptor";
  struct Case {
    uint32_t length, format;
  };
  for (Case c : {Case{0, 1}, Case{kMaxDescriptorBytes + 1, 1}, Case{0xffffffffu, 1}, Case{10, 2}}) {
    EncodeHeader(h, std::span<uint8_t, kHeaderBytes>(buf.data(), kHeaderBytes));
    std::memcpy(buf.data() + kDescriptorOffset, &c.length, 4);
    std::memcpy(buf.data() + kDescriptorOffset + 4, &c.format, 4);
    uint64_t sum = XXH3_64bits(buf.data(), kHeaderBytes - 8);
    std::memcpy(buf.data() + kHeaderBytes - 8, &sum, 8);
    DecodedHeader d =
        DecodeHeader(std::span<const uint8_t, kHeaderBytes>(buf.data(), kHeaderBytes));
    ASSERT_EQ(d.verdict, HeaderVerdict::kOk) << d.reason;
    EXPECT_EQ(d.header.descriptor, "");
    EXPECT_NE(d.descriptor_problem, "") << c.length << " " << c.format;
    EXPECT_EQ(d.header.payload_checksum, h.payload_checksum);
  }
}

// A flipped bit in the descriptor is a flipped bit in the header: the checksum catches it, and
// the file is corrupt like any other header damage (the format has one checksum for the header).
TEST(ChunkFileTest, AFlipInTheDescriptorIsCaughtByTheHeaderChecksum) {
  AlignedBuffer good(kHeaderBytes), bad(kHeaderBytes);
  ChunkHeader h = SampleHeader();
  h.descriptor.assign(kMaxDescriptorBytes, 'd');
  EncodeHeader(h, std::span<uint8_t, kHeaderBytes>(good.data(), kHeaderBytes));
  for (size_t byte = kDescriptorOffset; byte < kHeaderBytes - 8; byte += 13) {
    std::memcpy(bad.data(), good.data(), kHeaderBytes);
    bad.data()[byte] ^= 0x04;
    EXPECT_EQ(
        DecodeHeader(std::span<const uint8_t, kHeaderBytes>(bad.data(), kHeaderBytes)).verdict,
        HeaderVerdict::kCorrupt)
        << byte;
  }
}

TEST(ChunkFileTest, OtherVersionIsForeign) {
  AlignedBuffer buf(kHeaderBytes);
  ChunkHeader h = SampleHeader();
  EncodeHeader(h, std::span<uint8_t, kHeaderBytes>(buf.data(), kHeaderBytes));
  buf.data()[8] = 2;  // version 2, with a valid header checksum
  uint64_t sum = XXH3_64bits(buf.data(), kHeaderBytes - 8);
  std::memcpy(buf.data() + kHeaderBytes - 8, &sum, 8);
  DecodedHeader d = DecodeHeader(std::span<const uint8_t, kHeaderBytes>(buf.data(), kHeaderBytes));
  EXPECT_EQ(d.verdict, HeaderVerdict::kForeign) << d.reason;
}

// The payload checksum goes through xxHash's runtime dispatcher where the library has one: it
// must be the format's XXH3-64 (seed 0) whatever loop the CPU runs, one-shot and streamed.
TEST(ChunkFileTest, PayloadChecksumIsXxh3OneShotAndStreamed) {
  std::vector<uint8_t> bytes((9u << 18) + 4096 + 7);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 131 + (i >> 9));
  for (size_t n : {size_t{0}, size_t{1}, size_t{240}, size_t{241}, size_t{4096}, size_t{65536},
                   size_t{(9u << 18)}, bytes.size()}) {
    SCOPED_TRACE(n);
    const uint64_t want = XXH3_64bits(bytes.data(), n);
    EXPECT_EQ(PayloadChecksum({bytes.data(), n}), want);
    PayloadHasher hasher;
    for (size_t at = 0; at < n;) {  // uneven pieces, as reads complete
      size_t piece = std::min(n - at, size_t{1} << (10 + at % 11));
      hasher.Update({bytes.data() + at, piece});
      at += piece;
    }
    EXPECT_EQ(hasher.Digest(), want);
  }
}

TEST(ChunkFileTest, Names) {
  std::string hex = testing::TestKey(3).ToHex();
  EXPECT_TRUE(IsChunkName(hex));
  EXPECT_FALSE(IsChunkName(hex.substr(1)));
  std::string upper = hex;
  upper[0] = 'A';
  EXPECT_FALSE(IsChunkName(upper));
  std::string tmp = TempName(hex);
  EXPECT_TRUE(IsTempName(tmp)) << tmp;
  EXPECT_FALSE(IsChunkName(tmp));
  EXPECT_NE(TempName(hex), TempName(hex));
  EXPECT_TRUE(IsNamespaceName(testing::TestNamespace().Id()));
  EXPECT_EQ(LeafDir("/r/ns", hex), "/r/ns/" + hex.substr(0, 2) + "/" + hex.substr(2, 2));
  EXPECT_EQ(ChunkFileBytes(1), 8192u);
  EXPECT_EQ(ChunkFileBytes(4096), 8192u);
  EXPECT_EQ(ChunkFileBytes(32u << 20), (32u << 20) + 4096);
}

}  // namespace
}  // namespace kvtier::file_tier_internal

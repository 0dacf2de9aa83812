#include "server/codec.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace kvtier::server {
namespace {

ChunkKey Key(uint8_t b) {
  std::array<uint8_t, 32> a;
  a.fill(b);
  return ChunkKey(a);
}

std::span<const uint8_t> Body(const std::vector<uint8_t>& frame) {
  return std::span<const uint8_t>(frame).subspan(kHeaderBytes);
}

TEST(CodecTest, HeaderRoundTrip) {
  FrameHeader h{1234, 6, 0, 0x0102030405060708ull};
  uint8_t buf[kHeaderBytes];
  EncodeHeader(h, buf);
  FrameHeader g = DecodeHeader(buf);
  EXPECT_EQ(g.body_length, 1234u);
  EXPECT_EQ(g.opcode, 6);
  EXPECT_EQ(g.request_id, 0x0102030405060708ull);
  // Little-endian on the wire.
  EXPECT_EQ(buf[0], 1234 & 0xFF);
  EXPECT_EQ(buf[8], 0x08);
}

TEST(CodecTest, HeaderChecks) {
  EXPECT_TRUE(CheckRequestHeader({10, 2, 0, 1}, 100).ok());
  EXPECT_EQ(CheckRequestHeader({10, 2, 1, 1}, 100).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckRequestHeader({10, 0, 0, 1}, 100).code(), StatusCode::kUnimplemented);
  EXPECT_EQ(CheckRequestHeader({10, 77, 0, 1}, 100).code(), StatusCode::kUnimplemented);
  Status big = CheckRequestHeader({101, 2, 0, 1}, 100);
  EXPECT_EQ(big.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(big.message().find("exceeds"), std::string::npos);
}

TEST(CodecTest, DescribeRoundTripAndBounds) {
  const std::vector<uint8_t> d1 = {0x81, 0xa5, 'i', 'n', 'd', 'e', 'x', 0x00};
  const std::vector<uint8_t> d2(300, 0xc0);
  const DescribeEntry in[] = {{Key(1), d1}, {Key(2), d2}};
  auto frame = EncodeDescribeRequest(9, in);
  FrameHeader h = DecodeHeader(frame.data());
  EXPECT_EQ(h.opcode, 10);
  EXPECT_EQ(h.body_length, 4 + DescribeEntryBytes(d1.size()) + DescribeEntryBytes(d2.size()));
  auto out = DecodeDescribeRequest(Body(frame), 16);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ASSERT_EQ(out->size(), 2u);
  EXPECT_EQ((*out)[0].key, Key(1));
  EXPECT_EQ((*out)[1].key, Key(2));
  EXPECT_TRUE(
      std::equal(d1.begin(), d1.end(), (*out)[0].descriptor.begin(), (*out)[0].descriptor.end()));
  EXPECT_EQ((*out)[1].descriptor.size(), 300u);
  EXPECT_EQ(OpcodeName(10), "describe");

  // Too many entries, a count the body cannot hold, an empty or oversized descriptor, a
  // truncated entry, trailing bytes: all refused.
  EXPECT_FALSE(DecodeDescribeRequest(Body(frame), 1).ok());
  std::vector<uint8_t> lie = frame;
  lie[kHeaderBytes] = 0xff;
  EXPECT_FALSE(DecodeDescribeRequest(Body(lie), 4096).ok());
  const DescribeEntry empty[] = {{Key(3), {}}};
  EXPECT_FALSE(DecodeDescribeRequest(Body(EncodeDescribeRequest(1, empty)), 16).ok());
  const std::vector<uint8_t> huge(kMaxDescriptorBytes + 1, 0);
  const DescribeEntry big[] = {{Key(3), huge}};
  auto oversized = DecodeDescribeRequest(Body(EncodeDescribeRequest(1, big)), 16);
  ASSERT_FALSE(oversized.ok());
  EXPECT_NE(oversized.status().message().find("descriptor has"), std::string::npos);
  auto cut = std::span<const uint8_t>(frame).subspan(kHeaderBytes, h.body_length - 1);
  EXPECT_FALSE(DecodeDescribeRequest(cut, 16).ok());
  std::vector<uint8_t> longer = frame;
  longer.push_back(0);
  EXPECT_FALSE(DecodeDescribeRequest(Body(longer), 16).ok());
  const std::vector<uint8_t> none = {0, 0, 0, 0};
  auto zero = DecodeDescribeRequest(none, 16);
  ASSERT_TRUE(zero.ok());
  EXPECT_TRUE(zero->empty());
}

TEST(CodecTest, HelloRoundTrip) {
  HelloRequest r;
  r.token = "secret";
  r.ns.model_id = "Qwen/Qwen3-8B";
  r.ns.layout_fingerprint = 42;
  r.ns.chunk_tokens = 256;
  r.ns.rank = 1;
  r.ns.world_size = 2;
  r.ns.tenant_salt = "t";
  r.chunk_bytes = 1 << 20;
  r.client_name = "rank1";
  auto frame = EncodeHelloRequest(7, r);
  FrameHeader h = DecodeHeader(frame.data());
  EXPECT_EQ(h.opcode, static_cast<uint16_t>(Opcode::kHello));
  EXPECT_EQ(h.body_length, frame.size() - kHeaderBytes);
  auto d = DecodeHelloRequest(Body(frame));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->token, "secret");
  EXPECT_EQ(d->ns.model_id, "Qwen/Qwen3-8B");
  EXPECT_EQ(d->ns.layout_fingerprint, 42u);
  EXPECT_EQ(d->ns.rank, 1u);
  EXPECT_EQ(d->ns.world_size, 2u);
  EXPECT_EQ(d->ns.tenant_salt, "t");
  EXPECT_EQ(d->chunk_bytes, 1u << 20);
  EXPECT_EQ(d->client_name, "rank1");
}

TEST(CodecTest, HelloRejectsBadMagicTruncationAndTrailingBytes) {
  HelloRequest r;
  r.ns.model_id = "m";
  auto frame = EncodeHelloRequest(1, r);
  std::vector<uint8_t> body(frame.begin() + kHeaderBytes, frame.end());
  auto bad_magic = body;
  bad_magic[0] = 'X';
  EXPECT_EQ(DecodeHelloRequest(bad_magic).status().code(), StatusCode::kUnimplemented);
  for (size_t n = 0; n < body.size(); ++n) {
    EXPECT_FALSE(DecodeHelloRequest(std::span(body).first(n)).ok()) << n;
  }
  auto longer = body;
  longer.push_back(0);
  Status s = DecodeHelloRequest(longer).status();
  EXPECT_NE(s.message().find("trailing"), std::string::npos) << s.ToString();
}

TEST(CodecTest, KeysAndSlotsRoundTripWithLimits) {
  std::vector<ChunkKey> keys = {Key(1), Key(2), Key(3)};
  auto frame = EncodeKeysRequest(Opcode::kLookup, 9, keys);
  auto d = DecodeKeysRequest(Body(frame), 3);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(*d, keys);
  EXPECT_FALSE(DecodeKeysRequest(Body(frame), 2).ok());  // over the limit

  std::vector<SlotId> slots = {5, kNoSlot, 7};
  auto sframe = EncodeSlotsRequest(Opcode::kCommit, 9, slots);
  auto s = DecodeSlotsRequest(Body(sframe), 16);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, slots);

  // A count that promises more than the body holds is refused without allocating it.
  std::vector<uint8_t> lying = {0xFF, 0xFF, 0xFF, 0x7F};
  EXPECT_FALSE(DecodeKeysRequest(lying, 1u << 31).ok());
  EXPECT_FALSE(DecodeSlotsRequest(lying, 1u << 31).ok());
  EXPECT_TRUE(DecodeEmptyRequest({}).ok());
  uint8_t one = 0;
  EXPECT_FALSE(DecodeEmptyRequest(std::span(&one, 1)).ok());
}

TEST(CodecTest, RepliesRoundTrip) {
  HelloReply hr;
  hr.session_id = 3;
  hr.arena_bytes = 1 << 30;
  hr.slot_bytes = 4096;
  hr.chunk_bytes = 4000;
  hr.num_slots = 262144;
  hr.server_version = "0.1.0";
  auto frame = EncodeReply(1, 5, Status::Ok(), HelloReplyFields(hr));
  FrameHeader h = DecodeHeader(frame.data());
  EXPECT_EQ(h.opcode, 1 | kReplyBit);
  EXPECT_EQ(h.request_id, 5u);
  Reader r(Body(frame));
  Status remote;
  ASSERT_TRUE(DecodeReplyStatus(r, &remote).ok());
  ASSERT_TRUE(remote.ok());
  auto d = DecodeHelloReply(r);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->num_slots, 262144u);
  EXPECT_EQ(d->server_version, "0.1.0");

  PrepareLoadReply p{2, {4, 9}};
  auto pf = EncodeReply(6, 1, Status::Ok(), PrepareLoadReplyFields(p));
  Reader pr(Body(pf));
  ASSERT_TRUE(DecodeReplyStatus(pr, &remote).ok());
  auto pd = DecodePrepareLoadReply(pr, 16);
  ASSERT_TRUE(pd.ok());
  EXPECT_EQ(pd->slots, (std::vector<SlotId>{4, 9}));
}

TEST(CodecTest, ErrorReplyCarriesCodeMessageAndRetryable) {
  auto frame = EncodeReply(3, 8, Status::Rejected("pool full"), LookupReplyFields({1, 1}));
  Reader r(Body(frame));
  Status remote;
  ASSERT_TRUE(DecodeReplyStatus(r, &remote).ok());
  EXPECT_EQ(remote.code(), StatusCode::kRejected);
  EXPECT_TRUE(remote.retryable());
  EXPECT_EQ(remote.message(), "pool full");
  EXPECT_EQ(r.remaining(), 0u);  // no fields after an error
}

TEST(CodecTest, UnknownStatusCodeIsRejected) {
  std::vector<uint8_t> body = {200, 0, 0, 0};
  Reader r(body);
  Status remote;
  EXPECT_FALSE(DecodeReplyStatus(r, &remote).ok());
}

}  // namespace
}  // namespace kvtier::server

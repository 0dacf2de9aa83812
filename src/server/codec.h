// Wire codec of the kvtier server protocol (docs/protocol.md): frame headers and the bodies of
// every request and reply, for both the server and the client.
//
// Decoders take untrusted bytes: they check every length against the remaining input and the
// configured limits, require a body to be consumed exactly, and report failures as Status
// values (never by crashing, throwing or reading out of bounds). A libFuzzer target
// (fuzz/codec_fuzz.cc) exercises them.
//
// Thread-safety: all functions are pure; Reader and Writer are single-threaded values.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/chunk_key.h"
#include "kvtier/eviction.h"
#include "kvtier/status.h"

namespace kvtier::server {

inline constexpr uint16_t kProtocolVersion = 1;
inline constexpr size_t kHeaderBytes = 16;
inline constexpr uint16_t kReplyBit = 0x8000;
inline constexpr char kHelloMagic[4] = {'K', 'V', 'T', 'R'};
inline constexpr uint32_t kDefaultMaxMessageBytes = 1u << 20;
inline constexpr uint32_t kDefaultMaxKeysPerRequest = 4096;
inline constexpr uint32_t kNoSlotWire = 0xFFFFFFFFu;
// Largest hello body a server reads from a peer it does not know yet.
inline constexpr uint32_t kMaxHelloBytes = 16 * 1024;

enum class Opcode : uint16_t {
  kHello = 1,
  kLookup = 2,
  kReserve = 3,
  kCommit = 4,
  kAbort = 5,
  kPrepareLoad = 6,
  kRelease = 7,
  kStats = 8,
  kPing = 9,
  kDescribe = 10,
};
inline constexpr uint16_t kMaxOpcode = 10;
// Largest descriptor one `describe` entry may carry. A 256-token chunk of 16-token blocks with
// 32-byte hashes and token ids takes about 1.8 KB; the bound leaves room for 2,048-token chunks
// while keeping what one entry can make the server hold small.
inline constexpr uint32_t kMaxDescriptorBytes = 16 * 1024;
std::string_view OpcodeName(uint16_t opcode);  // "lookup", ...; "unknown" otherwise

struct FrameHeader {
  uint32_t body_length = 0;
  uint16_t opcode = 0;
  uint16_t flags = 0;
  uint64_t request_id = 0;
};

void EncodeHeader(const FrameHeader& h, uint8_t out[kHeaderBytes]);
FrameHeader DecodeHeader(const uint8_t in[kHeaderBytes]);
// Checks a header received by the server: flags 0, a known request opcode (kUnimplemented
// otherwise), body_length <= max_body (kInvalidArgument otherwise).
Status CheckRequestHeader(const FrameHeader& h, uint32_t max_body);

// Appends little-endian fields to a byte vector.
class Writer {
 public:
  explicit Writer(std::vector<uint8_t>* out) : out_(out) {}
  void U8(uint8_t v) { out_->push_back(v); }
  void U16(uint16_t v) { Raw(&v, 2); }
  void U32(uint32_t v) { Raw(&v, 4); }
  void U64(uint64_t v) { Raw(&v, 8); }
  // REQUIRES: s.size() <= 65535 (longer strings are cut; callers validate first).
  void Str(std::string_view s);
  void Keys(std::span<const ChunkKey> keys);
  void Slots(std::span<const SlotId> slots);
  void Raw(const void* p, size_t n) {
    if (n == 0) return;
    const size_t at = out_->size();
    out_->resize(at + n);
    std::memcpy(out_->data() + at, p, n);
  }

 private:
  std::vector<uint8_t>* out_;
};
static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");

// Reads fields from untrusted bytes. The first failure sticks: later reads return zeros and
// status() reports the first problem.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> in) : in_(in) {}
  uint8_t U8();
  uint16_t U16();
  uint32_t U32();
  uint64_t U64();
  std::string Str();
  // A count, then count x 32 bytes; fails if count > max.
  std::vector<ChunkKey> Keys(uint32_t max);
  std::vector<SlotId> Slots(uint32_t max);
  void Raw(void* dst, size_t n);
  void Skip(size_t n);
  // OK if every read succeeded and the input was consumed exactly.
  Status Finish(std::string_view what) const;
  bool ok() const { return error_.empty(); }
  size_t remaining() const { return in_.size() - pos_; }

 private:
  bool Need(size_t n, const char* field);
  std::span<const uint8_t> in_;
  size_t pos_ = 0;
  std::string error_;
};

struct HelloRequest {
  uint16_t version = kProtocolVersion;
  std::string token;
  KeyNamespace ns;
  uint64_t chunk_bytes = 0;
  std::string client_name;
};

struct HelloReply {
  uint16_t version = kProtocolVersion;
  uint64_t session_id = 0;
  uint64_t arena_bytes = 0;
  uint64_t slot_bytes = 0;
  uint64_t chunk_bytes = 0;
  uint32_t num_slots = 0;
  uint32_t max_keys_per_request = kDefaultMaxKeysPerRequest;
  uint32_t max_message_bytes = kDefaultMaxMessageBytes;
  std::string server_version;
};

struct LookupReply {
  uint32_t total = 0;
  uint32_t memory = 0;
};

// One entry of a `describe` request: a client chunk key and the msgpack descriptor of its vLLM
// block hashes (docs/kv-events.md). Decoded entries point into the request body.
struct DescribeEntry {
  ChunkKey key;
  std::span<const uint8_t> descriptor;
};

struct PrepareLoadReply {
  uint32_t chunks = 0;
  std::vector<SlotId> slots;
};

// --- Building frames. Each returns a whole frame (header + body). ---
std::vector<uint8_t> EncodeHelloRequest(uint64_t request_id, const HelloRequest& r);
std::vector<uint8_t> EncodeKeysRequest(Opcode op, uint64_t request_id,
                                       std::span<const ChunkKey> keys);
std::vector<uint8_t> EncodeSlotsRequest(Opcode op, uint64_t request_id,
                                        std::span<const SlotId> slots);
std::vector<uint8_t> EncodeEmptyRequest(Opcode op, uint64_t request_id);
// REQUIRES: every descriptor is at most kMaxDescriptorBytes (callers check first).
std::vector<uint8_t> EncodeDescribeRequest(uint64_t request_id,
                                           std::span<const DescribeEntry> entries);
// The bytes one entry adds to a describe body (the client splits batches by it).
inline size_t DescribeEntryBytes(size_t descriptor_bytes) {
  return ChunkKey::kSize + 4 + descriptor_bytes;
}

// A reply frame: header with opcode|kReplyBit, the status, then `fields` (only when OK).
std::vector<uint8_t> EncodeReply(uint16_t request_opcode, uint64_t request_id, const Status& status,
                                 std::span<const uint8_t> fields = {});
std::vector<uint8_t> HelloReplyFields(const HelloReply& r);
std::vector<uint8_t> LookupReplyFields(const LookupReply& r);
std::vector<uint8_t> SlotsReplyFields(std::span<const SlotId> slots);
std::vector<uint8_t> U32ReplyFields(uint32_t v);
std::vector<uint8_t> PrepareLoadReplyFields(const PrepareLoadReply& r);
std::vector<uint8_t> TextReplyFields(std::string_view text);

// --- Decoding bodies (the bytes after the header). ---
Result<HelloRequest> DecodeHelloRequest(std::span<const uint8_t> body);
Result<std::vector<ChunkKey>> DecodeKeysRequest(std::span<const uint8_t> body, uint32_t max_keys);
Result<std::vector<SlotId>> DecodeSlotsRequest(std::span<const uint8_t> body, uint32_t max_slots);
Status DecodeEmptyRequest(std::span<const uint8_t> body);
// At most max_entries entries, each descriptor non-empty and at most kMaxDescriptorBytes. The
// descriptors are not parsed here (only a server publishing events reads them).
Result<std::vector<DescribeEntry>> DecodeDescribeRequest(std::span<const uint8_t> body,
                                                         uint32_t max_entries);

// A reply body: the status, and a Reader positioned at the fields (when the status is OK). The
// returned Status is the decoding outcome; `*remote` receives the server's status.
Status DecodeReplyStatus(Reader& reader, Status* remote);
Result<HelloReply> DecodeHelloReply(Reader& reader);
Result<LookupReply> DecodeLookupReply(Reader& reader);
Result<std::vector<SlotId>> DecodeSlotsReply(Reader& reader, uint32_t max_slots);
Result<uint32_t> DecodeU32Reply(Reader& reader);
Result<PrepareLoadReply> DecodePrepareLoadReply(Reader& reader, uint32_t max_slots);
Result<std::string> DecodeTextReply(Reader& reader);
Status DecodeEmptyReply(Reader& reader);

}  // namespace kvtier::server

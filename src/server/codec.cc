#include "server/codec.h"

#include <fmt/format.h>

namespace kvtier::server {

std::string_view OpcodeName(uint16_t opcode) {
  switch (static_cast<Opcode>(opcode & ~kReplyBit)) {
    case Opcode::kHello: return "hello";
    case Opcode::kLookup: return "lookup";
    case Opcode::kReserve: return "reserve";
    case Opcode::kCommit: return "commit";
    case Opcode::kAbort: return "abort";
    case Opcode::kPrepareLoad: return "prepare_load";
    case Opcode::kRelease: return "release";
    case Opcode::kStats: return "stats";
    case Opcode::kPing: return "ping";
    case Opcode::kDescribe: return "describe";
  }
  return "unknown";
}

void EncodeHeader(const FrameHeader& h, uint8_t out[kHeaderBytes]) {
  std::memcpy(out, &h.body_length, 4);
  std::memcpy(out + 4, &h.opcode, 2);
  std::memcpy(out + 6, &h.flags, 2);
  std::memcpy(out + 8, &h.request_id, 8);
}

FrameHeader DecodeHeader(const uint8_t in[kHeaderBytes]) {
  FrameHeader h;
  std::memcpy(&h.body_length, in, 4);
  std::memcpy(&h.opcode, in + 4, 2);
  std::memcpy(&h.flags, in + 6, 2);
  std::memcpy(&h.request_id, in + 8, 8);
  return h;
}

Status CheckRequestHeader(const FrameHeader& h, uint32_t max_body) {
  if (h.flags != 0) {
    return Status::InvalidArgument(fmt::format("frame flags must be 0, got {:#x}", h.flags));
  }
  if (h.opcode < 1 || h.opcode > kMaxOpcode) {
    return Status::Unimplemented(fmt::format("unknown opcode {}", h.opcode));
  }
  if (h.body_length > max_body) {
    return Status::InvalidArgument(fmt::format("message of {} bytes exceeds the limit of {} bytes",
                                               h.body_length, max_body));
  }
  return Status::Ok();
}

void Writer::Str(std::string_view s) {
  if (s.size() > 0xFFFF) s = s.substr(0, 0xFFFF);
  U16(static_cast<uint16_t>(s.size()));
  Raw(s.data(), s.size());
}

void Writer::Keys(std::span<const ChunkKey> keys) {
  U32(static_cast<uint32_t>(keys.size()));
  for (const ChunkKey& k : keys) Raw(k.data(), ChunkKey::kSize);
}

void Writer::Slots(std::span<const SlotId> slots) {
  U32(static_cast<uint32_t>(slots.size()));
  Raw(slots.data(), slots.size() * sizeof(SlotId));
}

bool Reader::Need(size_t n, const char* field) {
  if (!error_.empty()) return false;
  if (n > remaining()) {
    error_ = fmt::format("truncated {}: needs {} bytes, {} left", field, n, remaining());
    return false;
  }
  return true;
}

uint8_t Reader::U8() {
  uint8_t v = 0;
  if (Need(1, "u8")) v = in_[pos_++];
  return v;
}
uint16_t Reader::U16() {
  uint16_t v = 0;
  Raw(&v, 2);
  return v;
}
uint32_t Reader::U32() {
  uint32_t v = 0;
  Raw(&v, 4);
  return v;
}
uint64_t Reader::U64() {
  uint64_t v = 0;
  Raw(&v, 8);
  return v;
}

void Reader::Raw(void* dst, size_t n) {
  if (!Need(n, "field") || n == 0) return;
  std::memcpy(dst, in_.data() + pos_, n);
  pos_ += n;
}

void Reader::Skip(size_t n) {
  if (Need(n, "field")) pos_ += n;
}

std::string Reader::Str() {
  uint16_t n = U16();
  if (!Need(n, "string")) return {};
  std::string s(reinterpret_cast<const char*>(in_.data() + pos_), n);
  pos_ += n;
  return s;
}

std::vector<ChunkKey> Reader::Keys(uint32_t max) {
  uint32_t n = U32();
  std::vector<ChunkKey> keys;
  if (!ok()) return keys;
  if (n > max) {
    error_ = fmt::format("{} keys exceed the limit of {} per request", n, max);
    return keys;
  }
  if (!Need(static_cast<size_t>(n) * ChunkKey::kSize, "keys")) return keys;
  keys.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    std::array<uint8_t, ChunkKey::kSize> b;
    std::memcpy(b.data(), in_.data() + pos_, ChunkKey::kSize);
    pos_ += ChunkKey::kSize;
    keys[i] = ChunkKey(b);
  }
  return keys;
}

std::vector<SlotId> Reader::Slots(uint32_t max) {
  uint32_t n = U32();
  std::vector<SlotId> slots;
  if (!ok()) return slots;
  if (n > max) {
    error_ = fmt::format("{} slots exceed the limit of {} per request", n, max);
    return slots;
  }
  if (!Need(static_cast<size_t>(n) * sizeof(SlotId), "slots")) return slots;
  slots.resize(n);
  if (n > 0) std::memcpy(slots.data(), in_.data() + pos_, n * sizeof(SlotId));
  pos_ += n * sizeof(SlotId);
  return slots;
}

Status Reader::Finish(std::string_view what) const {
  if (!error_.empty()) return Status::InvalidArgument(fmt::format("bad {}: {}", what, error_));
  if (pos_ != in_.size()) {
    return Status::InvalidArgument(
        fmt::format("bad {}: {} unexpected trailing bytes", what, in_.size() - pos_));
  }
  return Status::Ok();
}

namespace {

std::vector<uint8_t> Frame(uint16_t opcode, uint64_t request_id, std::vector<uint8_t> body) {
  std::vector<uint8_t> out(kHeaderBytes);
  FrameHeader h;
  h.body_length = static_cast<uint32_t>(body.size());
  h.opcode = opcode;
  h.request_id = request_id;
  EncodeHeader(h, out.data());
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

// Starts a frame whose body is appended in place (avoids a copy on hot paths).
std::vector<uint8_t> StartFrame(size_t body_hint) {
  std::vector<uint8_t> out(kHeaderBytes);
  out.reserve(kHeaderBytes + body_hint);
  return out;
}
std::vector<uint8_t> EndFrame(std::vector<uint8_t> out, uint16_t opcode, uint64_t request_id) {
  FrameHeader h;
  h.body_length = static_cast<uint32_t>(out.size() - kHeaderBytes);
  h.opcode = opcode;
  h.request_id = request_id;
  EncodeHeader(h, out.data());
  return out;
}

}  // namespace

std::vector<uint8_t> EncodeHelloRequest(uint64_t request_id, const HelloRequest& r) {
  std::vector<uint8_t> body;
  Writer w(&body);
  w.Raw(kHelloMagic, 4);
  w.U16(r.version);
  w.U16(0);
  w.Str(r.token);
  w.Str(r.ns.model_id);
  w.U64(r.ns.layout_fingerprint);
  w.U32(r.ns.chunk_tokens);
  w.U32(r.ns.rank);
  w.U32(r.ns.world_size);
  w.Str(r.ns.tenant_salt);
  w.U64(r.chunk_bytes);
  w.Str(r.client_name);
  return Frame(static_cast<uint16_t>(Opcode::kHello), request_id, std::move(body));
}

std::vector<uint8_t> EncodeKeysRequest(Opcode op, uint64_t request_id,
                                       std::span<const ChunkKey> keys) {
  auto out = StartFrame(4 + keys.size() * ChunkKey::kSize);
  Writer(&out).Keys(keys);
  return EndFrame(std::move(out), static_cast<uint16_t>(op), request_id);
}

std::vector<uint8_t> EncodeSlotsRequest(Opcode op, uint64_t request_id,
                                        std::span<const SlotId> slots) {
  auto out = StartFrame(4 + slots.size() * 4);
  Writer(&out).Slots(slots);
  return EndFrame(std::move(out), static_cast<uint16_t>(op), request_id);
}

std::vector<uint8_t> EncodeEmptyRequest(Opcode op, uint64_t request_id) {
  return Frame(static_cast<uint16_t>(op), request_id, {});
}

std::vector<uint8_t> EncodeDescribeRequest(uint64_t request_id,
                                           std::span<const DescribeEntry> entries) {
  size_t hint = 4;
  for (const DescribeEntry& e : entries) hint += DescribeEntryBytes(e.descriptor.size());
  auto out = StartFrame(hint);
  Writer w(&out);
  w.U32(static_cast<uint32_t>(entries.size()));
  for (const DescribeEntry& e : entries) {
    w.Raw(e.key.data(), ChunkKey::kSize);
    w.U32(static_cast<uint32_t>(e.descriptor.size()));
    w.Raw(e.descriptor.data(), e.descriptor.size());
  }
  return EndFrame(std::move(out), static_cast<uint16_t>(Opcode::kDescribe), request_id);
}

std::vector<uint8_t> EncodeReply(uint16_t request_opcode, uint64_t request_id,
                                 const Status& status, std::span<const uint8_t> fields) {
  auto out = StartFrame(4 + fields.size() + status.message().size());
  Writer w(&out);
  w.U8(static_cast<uint8_t>(status.code()));
  w.U8(status.retryable() ? 1 : 0);
  w.Str(status.ok() ? std::string_view() : std::string_view(status.message()));
  if (status.ok()) w.Raw(fields.data(), fields.size());
  return EndFrame(std::move(out), static_cast<uint16_t>(request_opcode | kReplyBit), request_id);
}

std::vector<uint8_t> HelloReplyFields(const HelloReply& r) {
  std::vector<uint8_t> f;
  Writer w(&f);
  w.U16(r.version);
  w.U16(0);
  w.U64(r.session_id);
  w.U64(r.arena_bytes);
  w.U64(r.slot_bytes);
  w.U64(r.chunk_bytes);
  w.U32(r.num_slots);
  w.U32(r.max_keys_per_request);
  w.U32(r.max_message_bytes);
  w.Str(r.server_version);
  return f;
}

std::vector<uint8_t> LookupReplyFields(const LookupReply& r) {
  std::vector<uint8_t> f;
  Writer w(&f);
  w.U32(r.total);
  w.U32(r.memory);
  return f;
}

std::vector<uint8_t> SlotsReplyFields(std::span<const SlotId> slots) {
  std::vector<uint8_t> f;
  Writer(&f).Slots(slots);
  return f;
}

std::vector<uint8_t> U32ReplyFields(uint32_t v) {
  std::vector<uint8_t> f;
  Writer(&f).U32(v);
  return f;
}

std::vector<uint8_t> PrepareLoadReplyFields(const PrepareLoadReply& r) {
  std::vector<uint8_t> f;
  Writer w(&f);
  w.U32(r.chunks);
  w.Slots(r.slots);
  return f;
}

std::vector<uint8_t> TextReplyFields(std::string_view text) {
  std::vector<uint8_t> f;
  Writer w(&f);
  w.U32(static_cast<uint32_t>(text.size()));
  w.Raw(text.data(), text.size());
  return f;
}

Result<HelloRequest> DecodeHelloRequest(std::span<const uint8_t> body) {
  Reader r(body);
  char magic[4] = {};
  r.Raw(magic, 4);
  if (r.ok() && std::memcmp(magic, kHelloMagic, 4) != 0) {
    return Status::Unimplemented("bad hello: wrong magic (not a kvtier client?)");
  }
  HelloRequest h;
  h.version = r.U16();
  uint16_t reserved = r.U16();
  h.token = r.Str();
  h.ns.model_id = r.Str();
  h.ns.layout_fingerprint = r.U64();
  h.ns.chunk_tokens = r.U32();
  h.ns.rank = r.U32();
  h.ns.world_size = r.U32();
  h.ns.tenant_salt = r.Str();
  h.chunk_bytes = r.U64();
  h.client_name = r.Str();
  KVTIER_RETURN_IF_ERROR(r.Finish("hello"));
  if (reserved != 0) return Status::InvalidArgument("bad hello: reserved field is not 0");
  return h;
}

Result<std::vector<ChunkKey>> DecodeKeysRequest(std::span<const uint8_t> body,
                                                uint32_t max_keys) {
  Reader r(body);
  auto keys = r.Keys(max_keys);
  KVTIER_RETURN_IF_ERROR(r.Finish("keys"));
  return keys;
}

Result<std::vector<SlotId>> DecodeSlotsRequest(std::span<const uint8_t> body,
                                               uint32_t max_slots) {
  Reader r(body);
  auto slots = r.Slots(max_slots);
  KVTIER_RETURN_IF_ERROR(r.Finish("slots"));
  return slots;
}

Status DecodeEmptyRequest(std::span<const uint8_t> body) {
  return Reader(body).Finish("empty request");
}

Result<std::vector<DescribeEntry>> DecodeDescribeRequest(std::span<const uint8_t> body,
                                                         uint32_t max_entries) {
  Reader r(body);
  const uint32_t n = r.U32();
  if (!r.ok()) return r.Finish("describe");
  if (n > max_entries) {
    return Status::InvalidArgument(
        fmt::format("bad describe: {} entries exceed the limit of {} per request", n, max_entries));
  }
  // Each entry takes at least 37 bytes: a count the body cannot hold is refused before any
  // allocation.
  if (static_cast<uint64_t>(n) * DescribeEntryBytes(1) > r.remaining()) {
    return Status::InvalidArgument(
        fmt::format("bad describe: {} entries cannot fit in {} bytes", n, r.remaining()));
  }
  std::vector<DescribeEntry> entries(n);
  for (uint32_t i = 0; i < n; ++i) {
    std::array<uint8_t, ChunkKey::kSize> key;
    r.Raw(key.data(), key.size());
    const uint32_t len = r.U32();
    if (!r.ok()) break;
    if (len == 0 || len > kMaxDescriptorBytes) {
      return Status::InvalidArgument(
          fmt::format("bad describe: entry {}'s descriptor has {} bytes (1 to {} allowed)", i, len,
                      kMaxDescriptorBytes));
    }
    const size_t at = body.size() - r.remaining();
    r.Skip(len);  // a truncated body fails here, reported by Finish
    if (!r.ok()) break;
    entries[i].key = ChunkKey(key);
    entries[i].descriptor = body.subspan(at, len);
  }
  KVTIER_RETURN_IF_ERROR(r.Finish("describe"));
  return entries;
}

Status DecodeReplyStatus(Reader& reader, Status* remote) {
  uint8_t code = reader.U8();
  uint8_t retryable = reader.U8();
  std::string message = reader.Str();
  if (!reader.ok()) return reader.Finish("reply status");
  if (code > static_cast<uint8_t>(StatusCode::kAborted)) {
    return Status::InvalidArgument(fmt::format("bad reply: unknown status code {}", code));
  }
  *remote = code == 0 ? Status::Ok()
                      : Status(static_cast<StatusCode>(code), std::move(message), retryable != 0);
  return Status::Ok();
}

Result<HelloReply> DecodeHelloReply(Reader& r) {
  HelloReply h;
  h.version = r.U16();
  r.U16();
  h.session_id = r.U64();
  h.arena_bytes = r.U64();
  h.slot_bytes = r.U64();
  h.chunk_bytes = r.U64();
  h.num_slots = r.U32();
  h.max_keys_per_request = r.U32();
  h.max_message_bytes = r.U32();
  h.server_version = r.Str();
  KVTIER_RETURN_IF_ERROR(r.Finish("hello reply"));
  return h;
}

Result<LookupReply> DecodeLookupReply(Reader& r) {
  LookupReply l;
  l.total = r.U32();
  l.memory = r.U32();
  KVTIER_RETURN_IF_ERROR(r.Finish("lookup reply"));
  return l;
}

Result<std::vector<SlotId>> DecodeSlotsReply(Reader& r, uint32_t max_slots) {
  auto slots = r.Slots(max_slots);
  KVTIER_RETURN_IF_ERROR(r.Finish("slots reply"));
  return slots;
}

Result<uint32_t> DecodeU32Reply(Reader& r) {
  uint32_t v = r.U32();
  KVTIER_RETURN_IF_ERROR(r.Finish("reply"));
  return v;
}

Result<PrepareLoadReply> DecodePrepareLoadReply(Reader& r, uint32_t max_slots) {
  PrepareLoadReply p;
  p.chunks = r.U32();
  p.slots = r.Slots(max_slots);
  KVTIER_RETURN_IF_ERROR(r.Finish("prepare_load reply"));
  if (p.chunks != p.slots.size()) {
    return Status::InvalidArgument("bad prepare_load reply: chunk count differs from slot count");
  }
  return p;
}

Result<std::string> DecodeTextReply(Reader& r) {
  uint32_t n = r.U32();
  if (!r.ok() || n > r.remaining()) return Status::InvalidArgument("bad text reply: truncated");
  std::string s(n, '\0');
  r.Raw(s.data(), n);
  KVTIER_RETURN_IF_ERROR(r.Finish("text reply"));
  return s;
}

Status DecodeEmptyReply(Reader& r) { return r.Finish("reply"); }

}  // namespace kvtier::server

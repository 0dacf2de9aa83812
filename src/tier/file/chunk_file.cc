#include "tier/file/chunk_file.h"

#include <unistd.h>

#include <array>
#include <bit>
#include <cctype>
#include <cstring>
#include <random>

#include <fmt/format.h>
// The header's checksum (4 KiB), inlined. Payloads are hashed in payload_checksum.cc.
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace kvtier::file_tier_internal {
namespace {

constexpr char kMagic[8] = {'K', 'V', 'T', 'C', 'H', 'U', 'N', 'K'};
constexpr size_t kChecksumOffset = kHeaderBytes - 8;

template <typename T>
void Put(uint8_t* p, T v) {  // little-endian: the only byte order this project builds for
  static_assert(std::endian::native == std::endian::little);
  std::memcpy(p, &v, sizeof(T));
}
template <typename T>
T Get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

bool IsLowerHex(std::string_view s) {
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace

void EncodeHeader(const ChunkHeader& h, std::span<uint8_t, kHeaderBytes> out) {
  uint8_t* p = out.data();
  std::memset(p, 0, kHeaderBytes);
  std::memcpy(p, kMagic, 8);
  Put<uint32_t>(p + 8, kFormatVersion);
  Put<uint32_t>(p + 12, static_cast<uint32_t>(kHeaderBytes));
  std::memcpy(p + 16, h.namespace_root.data(), 32);
  std::memcpy(p + 48, h.key.data(), 32);
  Put<uint64_t>(p + 80, h.layout_fingerprint);
  Put<uint64_t>(p + 88, h.payload_bytes);
  Put<uint32_t>(p + 96, kChecksumXxh3);
  const bool described = !h.descriptor.empty() && h.descriptor.size() <= kMaxDescriptorBytes;
  Put<uint32_t>(p + 100, described ? kFlagDescriptor : 0);
  Put<uint64_t>(p + 104, h.payload_checksum);
  Put<uint64_t>(p + 112, h.created_unix_ms);
  Put<uint32_t>(p + 120, h.chunk_tokens);
  Put<uint32_t>(p + 124, h.rank);
  Put<uint32_t>(p + 128, h.world_size);
  size_t n = std::min(h.model_id.size(), kMaxModelIdBytes);
  Put<uint32_t>(p + 132, static_cast<uint32_t>(n));
  std::memcpy(p + 136, h.model_id.data(), n);
  if (described) {
    Put<uint32_t>(p + kDescriptorOffset, static_cast<uint32_t>(h.descriptor.size()));
    Put<uint32_t>(p + kDescriptorOffset + 4, kDescriptorFormat);
    std::memcpy(p + kDescriptorOffset + 8, h.descriptor.data(), h.descriptor.size());
  }
  Put<uint64_t>(p + kChecksumOffset, XXH3_64bits(p, kChecksumOffset));
}

DecodedHeader DecodeHeader(std::span<const uint8_t, kHeaderBytes> in) {
  const uint8_t* p = in.data();
  DecodedHeader d;
  if (std::memcmp(p, kMagic, 8) != 0) {
    d.reason = "bad magic (not a kvtier chunk file)";
    return d;
  }
  if (Get<uint64_t>(p + kChecksumOffset) != XXH3_64bits(p, kChecksumOffset)) {
    d.reason = "header checksum mismatch";
    return d;
  }
  uint32_t version = Get<uint32_t>(p + 8);
  if (version != kFormatVersion) {
    d.verdict = HeaderVerdict::kForeign;
    d.reason = fmt::format("format version {} (this build reads {})", version, kFormatVersion);
    return d;
  }
  if (Get<uint32_t>(p + 12) != kHeaderBytes) {
    d.reason = fmt::format("header_bytes {} is not {}", Get<uint32_t>(p + 12), kHeaderBytes);
    return d;
  }
  if (Get<uint32_t>(p + 96) != kChecksumXxh3) {
    d.verdict = HeaderVerdict::kForeign;
    d.reason = fmt::format("unknown checksum type {}", Get<uint32_t>(p + 96));
    return d;
  }
  ChunkHeader& h = d.header;
  std::array<uint8_t, 32> bytes;
  std::memcpy(bytes.data(), p + 16, 32);
  h.namespace_root = ChunkKey(bytes);
  std::memcpy(bytes.data(), p + 48, 32);
  h.key = ChunkKey(bytes);
  h.layout_fingerprint = Get<uint64_t>(p + 80);
  h.payload_bytes = Get<uint64_t>(p + 88);
  h.payload_checksum = Get<uint64_t>(p + 104);
  h.created_unix_ms = Get<uint64_t>(p + 112);
  h.chunk_tokens = Get<uint32_t>(p + 120);
  h.rank = Get<uint32_t>(p + 124);
  h.world_size = Get<uint32_t>(p + 128);
  uint32_t n = Get<uint32_t>(p + 132);
  if (n > kMaxModelIdBytes) {
    d.reason = fmt::format("model_id length {} is over {}", n, kMaxModelIdBytes);
    return d;
  }
  if (h.payload_bytes > (uint64_t{1} << 40)) {
    d.reason = fmt::format("payload length {} is absurd", h.payload_bytes);
    return d;
  }
  h.model_id.assign(reinterpret_cast<const char*>(p + 136), n);
  d.verdict = HeaderVerdict::kOk;
  // The descriptor is an addition within format 1: files without one (older writers, flags 0)
  // and descriptors this build cannot take are a missing descriptor, never a missing chunk.
  // Other flag bits are reserved for later additions and ignored.
  if (Get<uint32_t>(p + 100) & kFlagDescriptor) {
    const uint32_t len = Get<uint32_t>(p + kDescriptorOffset);
    const uint32_t format = Get<uint32_t>(p + kDescriptorOffset + 4);
    if (format != kDescriptorFormat) {
      d.descriptor_problem =
          fmt::format("descriptor format {} (this build reads {})", format, kDescriptorFormat);
    } else if (len == 0 || len > kMaxDescriptorBytes) {
      d.descriptor_problem =
          fmt::format("descriptor length {} is not 1 to {}", len, kMaxDescriptorBytes);
    } else {
      h.descriptor.assign(reinterpret_cast<const char*>(p + kDescriptorOffset + 8), len);
    }
  }
  return d;
}

bool IsChunkName(std::string_view name) { return name.size() == 64 && IsLowerHex(name); }

bool IsTempName(std::string_view name) {
  return name.size() > 64 + kTempInfix.size() && IsLowerHex(name.substr(0, 64)) &&
         name.substr(64, kTempInfix.size()) == kTempInfix;
}

bool IsNamespaceName(std::string_view name) { return name.size() == 16 && IsLowerHex(name); }
bool IsHexByteName(std::string_view name) { return name.size() == 2 && IsLowerHex(name); }

std::string LeafDir(const std::string& ns_dir, const std::string& key_hex) {
  return fmt::format("{}/{}/{}", ns_dir, key_hex.substr(0, 2), key_hex.substr(2, 2));
}

std::string UniqueSuffix() {
  static const std::string host = [] {
    char buf[256] = {};
    if (gethostname(buf, sizeof(buf) - 1) != 0) return std::string("host");
    std::string h(buf);
    for (char& c : h) {  // keep names portable: no '/' or odd bytes
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '.') c = '_';
    }
    return h.substr(0, 64);
  }();
  thread_local std::mt19937_64 rng(std::random_device{}() ^
                                   (static_cast<uint64_t>(getpid()) << 32));
  return fmt::format("{}.{}.{:016x}", host, getpid(), rng());
}

std::string TempName(const std::string& key_hex) {
  return fmt::format("{}{}{}", key_hex, kTempInfix, UniqueSuffix());
}

}  // namespace kvtier::file_tier_internal

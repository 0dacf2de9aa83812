// Internal: the chunk file format of docs/file-format.md (header codec, names, checksums), shared
// by FileTier and the cache-directory tools.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "kvtier/chunk_key.h"
#include "kvtier/status.h"
#include "kvtier/tier_listener.h"

namespace kvtier::file_tier_internal {

inline constexpr size_t kHeaderBytes = 4096;
inline constexpr uint32_t kFormatVersion = 1;
inline constexpr uint32_t kChecksumXxh3 = 1;
inline constexpr size_t kMaxModelIdBytes = 1024;
// The descriptor area (docs/file-format.md): flags bit 0, then at kDescriptorOffset a u32 length,
// a u32 descriptor format and the bytes, up to the header checksum.
inline constexpr uint32_t kFlagDescriptor = 1;
inline constexpr size_t kDescriptorOffset = 1160;
inline constexpr uint32_t kDescriptorFormat = 1;
inline constexpr size_t kMaxDescriptorBytes = kMaxChunkDescriptorBytes;
static_assert(kDescriptorOffset + 8 + kMaxDescriptorBytes == kHeaderBytes - 8);
inline constexpr std::string_view kMarkerName = "kvtier-cache.json";
inline constexpr std::string_view kNamespaceFileName = "namespace.json";
inline constexpr std::string_view kTempInfix = ".tmp.";
// FileTierOptions::shared_capacity: markers of recent publishes, <ns>/recent/<key>.<unix_ms>.
inline constexpr std::string_view kRecentDirName = "recent";

struct ChunkHeader {
  ChunkKey namespace_root;
  ChunkKey key;
  uint64_t layout_fingerprint = 0;
  uint64_t payload_bytes = 0;
  uint64_t payload_checksum = 0;
  uint64_t created_unix_ms = 0;
  uint32_t chunk_tokens = 0, rank = 0, world_size = 0;
  std::string model_id;
  // Opaque to the tier (the KV-cache events' descriptor of the chunk, TierListener); empty: none.
  std::string descriptor;
};

// Writes the 4096-byte header, header checksum included. A descriptor longer than
// kMaxDescriptorBytes is left out (the file then has none).
void EncodeHeader(const ChunkHeader& header, std::span<uint8_t, kHeaderBytes> out);

enum class HeaderVerdict {
  kOk,
  kCorrupt,  // bad magic, bad header checksum, nonsense fields
  kForeign,  // well-formed but another format version or checksum type
};
struct DecodedHeader {
  HeaderVerdict verdict = HeaderVerdict::kCorrupt;
  std::string reason;  // why, when not kOk
  ChunkHeader header;
  // Why a descriptor announced by the flags was not taken (an unknown descriptor format, a
  // length out of bounds); the chunk itself is unaffected. Empty otherwise.
  std::string descriptor_problem;
};
DecodedHeader DecodeHeader(std::span<const uint8_t, kHeaderBytes> in);

uint64_t PayloadChecksum(std::span<const uint8_t> payload);

// The same checksum, fed piece by piece (as a read completes).
class PayloadHasher {
 public:
  PayloadHasher();
  ~PayloadHasher();
  PayloadHasher(const PayloadHasher&) = delete;
  PayloadHasher& operator=(const PayloadHasher&) = delete;
  void Update(std::span<const uint8_t> bytes);
  uint64_t Digest() const;

 private:
  void* state_;  // XXH3_state_t, kept out of this header
};
inline uint64_t ChunkFileBytes(uint64_t payload_bytes) {
  return kHeaderBytes + (payload_bytes + 4095) / 4096 * 4096;
}

// A published chunk's name: exactly 64 lowercase hex digits.
bool IsChunkName(std::string_view name);
// A temporary name: <64 hex>.tmp.<anything>.
bool IsTempName(std::string_view name);
// A namespace folder name: exactly 16 lowercase hex digits.
bool IsNamespaceName(std::string_view name);
bool IsHexByteName(std::string_view name);  // "00".."ff": an <aa> or <bb> folder
// root/<ns>/<aa>/<bb>
std::string LeafDir(const std::string& ns_dir, const std::string& key_hex);

// "<host>.<pid>.<16 hex random digits>": unique across processes and hosts.
std::string UniqueSuffix();
// <key_hex>.tmp.<UniqueSuffix()>
std::string TempName(const std::string& key_hex);

}  // namespace kvtier::file_tier_internal

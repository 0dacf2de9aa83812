// Internal: the chunk file format of docs/file-format.md (header codec, names, checksums), shared
// by FileTier and the cache-directory tools.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "kvtier/chunk_key.h"
#include "kvtier/status.h"

namespace kvtier::file_tier_internal {

inline constexpr size_t kHeaderBytes = 4096;
inline constexpr uint32_t kFormatVersion = 1;
inline constexpr uint32_t kChecksumXxh3 = 1;
inline constexpr size_t kMaxModelIdBytes = 1024;
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
};

// Writes the 4096-byte header, header checksum included.
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

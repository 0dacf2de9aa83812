// Incremental SHA-256 over OpenSSL's EVP interface, with the little-endian and length-prefixed
// encodings that chunk keys and fingerprints are defined with (docs/chunk-key.md).
#pragma once

#include <openssl/evp.h>

#include <array>
#include <cstdint>
#include <string_view>

namespace kvtier {

class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new()) { EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr); }
  ~Sha256() { EVP_MD_CTX_free(ctx_); }
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void Update(const void* data, size_t n) { EVP_DigestUpdate(ctx_, data, n); }
  void UpdateU32(uint32_t v) {
    uint8_t b[4] = {static_cast<uint8_t>(v), static_cast<uint8_t>(v >> 8),
                    static_cast<uint8_t>(v >> 16), static_cast<uint8_t>(v >> 24)};
    Update(b, 4);
  }
  void UpdateU64(uint64_t v) {
    UpdateU32(static_cast<uint32_t>(v));
    UpdateU32(static_cast<uint32_t>(v >> 32));
  }
  // Length-prefixed, so field boundaries are unambiguous.
  void UpdateString(std::string_view s) {
    UpdateU64(s.size());
    Update(s.data(), s.size());
  }
  std::array<uint8_t, 32> Final() {
    std::array<uint8_t, 32> out;
    unsigned int len = 0;
    EVP_DigestFinal_ex(ctx_, out.data(), &len);
    return out;
  }

 private:
  EVP_MD_CTX* ctx_;
};

}  // namespace kvtier

// Tenant tokens (ServerOptions::tenant_tokens): which tenant the token a client presents at
// hello names, under isolate_clients (docs/security.md).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/status.h"
#include "server/server.h"

namespace kvtier::server {

class TenantTokens {
 public:
  TenantTokens() = default;
  // Checks the list: a printable name and a non-empty token each, no token given twice.
  static Result<TenantTokens> Make(const std::vector<ServerOptions::TenantToken>& tokens);

  bool empty() const { return digests_.empty(); }
  // The tenant whose token `token` is, or nullptr. Every entry is compared, in constant time,
  // so the time taken tells nothing about which entry (if any) came close.
  const std::string* Find(std::string_view token) const;

 private:
  // (tenant, SHA-256 of the token): equal-length values to compare.
  struct Digest {
    std::string tenant;
    std::array<uint8_t, 32> digest;
  };
  std::vector<Digest> digests_;
};

}  // namespace kvtier::server

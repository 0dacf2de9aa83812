#include "server/tenants.h"

#include <fmt/format.h>
#include <openssl/crypto.h>

#include <unordered_set>

#include "common/sha256.h"
#include "server/printable.h"

namespace kvtier::server {

namespace {
std::array<uint8_t, 32> Sha256Of(std::string_view s) {
  Sha256 h;
  h.Update(s.data(), s.size());
  return h.Final();
}
}  // namespace

Result<TenantTokens> TenantTokens::Make(const std::vector<ServerOptions::TenantToken>& tokens) {
  TenantTokens out;
  std::unordered_set<std::string> seen;
  for (const auto& t : tokens) {
    if (t.tenant.empty() || t.token.empty() || !IsPrintableUtf8(t.tenant)) {
      return Status::InvalidArgument(
          "server: a tenant token needs a printable tenant name and a non-empty token");
    }
    if (!seen.insert(t.token).second) {
      return Status::InvalidArgument(fmt::format(
          "server: tenants \"{}\" and another share a token; each token names one tenant",
          t.tenant));
    }
    out.digests_.push_back({t.tenant, Sha256Of(t.token)});
  }
  return out;
}

const std::string* TenantTokens::Find(std::string_view token) const {
  const std::array<uint8_t, 32> digest = Sha256Of(token);
  const std::string* found = nullptr;
  for (const Digest& t : digests_) {
    if (CRYPTO_memcmp(t.digest.data(), digest.data(), digest.size()) == 0) found = &t.tenant;
  }
  return found;
}

}  // namespace kvtier::server

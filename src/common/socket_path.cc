#include "kvtier/socket_path.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdlib>

namespace kvtier {

std::string DefaultSocketPath() {
  const char* xdg = std::getenv("XDG_RUNTIME_DIR");
  if (xdg && *xdg) return std::string(xdg) + "/kvtier.sock";
  return PrivateSocketDir() + "/kvtier.sock";
}

std::string PrivateSocketDir() {
  const char* tmp = std::getenv("TMPDIR");
  return fmt::format("{}/kvtier-{}", tmp && *tmp ? tmp : "/tmp", ::getuid());
}

}  // namespace kvtier

#include "stress/roles.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>

namespace kvtier::stress {

std::string ServerSocket(const std::string& dir) { return dir + "/kvtier.sock"; }
std::string TenantFile(const std::string& dir) { return dir + "/tenants"; }
std::string VerifierToken(uint64_t seed) { return fmt::format("verifiers-{:x}", seed); }
std::string IntruderToken(uint64_t seed) { return fmt::format("intruder-{:x}", seed * 31 + 7); }
std::string HttpPortFile(const std::string& dir) { return dir + "/http-port"; }
std::string RoleCountsFile(const std::string& dir) { return dir + "/role-counts"; }

void AppendRoleCounts(const std::string& dir, const std::string& line) {
  // One write of O_APPEND: lines of processes ending at once do not interleave.
  const int fd =
      ::open(RoleCountsFile(dir).c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return;
  const std::string text = line + "\n";
  (void)!::write(fd, text.data(), text.size());
  ::close(fd);
}

double NowUnix() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace kvtier::stress

// Attacks on the HTTP listener (docs/security.md, "A local user who is not a client"): each
// crosses one of the limits the listener is built with (cpp-httplib's compile-time bounds, the
// worker count and the queue).
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "stress/attacks.h"
#include "stress/raw_socket.h"
#include "stress/roles.h"

namespace kvtier::stress {
namespace {

using namespace std::chrono_literals;

// Idle connections, more than the workers and the queue together.
void IdleConnections(int port, std::mt19937_64& rng) {
  std::vector<int> fds;
  for (int i = 0; i < 48; ++i) {
    if (int fd = ConnectTcp(port); fd >= 0) fds.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200 + rng() % 600));
  for (int fd : fds) ::close(fd);
}

// A request line, a header line, or a header count far over the limits.
void OversizedRequest(int port, std::mt19937_64& rng) {
  int fd = ConnectTcp(port);
  if (fd < 0) return;
  const int which = static_cast<int>(rng() % 3);
  std::string req = which == 0 ? "GET /" + std::string(64 << 10, 'a') + " HTTP/1.1\r\n"
                               : "GET /stats HTTP/1.1\r\n";
  if (which == 1) req += "X-Big: " + std::string(64 << 10, 'b') + "\r\n";
  for (int i = 0; which == 2 && i < 500; ++i) req += fmt::format("X-H{}: v\r\n", i);
  SendText(fd, req + "\r\n");
  Drain(fd, 100ms);
  ::close(fd);
}

// A body announced at 1 GiB, a MiB of it sent.
void HugeBody(int port) {
  int fd = ConnectTcp(port);
  if (fd < 0) return;
  SendText(fd, "POST /stats HTTP/1.1\r\nContent-Length: 1073741824\r\n\r\n");
  SendText(fd, std::string(1 << 20, 'x'));
  Drain(fd, 50ms);
  ::close(fd);
}

// Hundreds of ranges of one document.
void ManyRanges(int port) {
  int fd = ConnectTcp(port);
  if (fd < 0) return;
  std::string ranges = "bytes=0-0";
  for (int i = 1; i < 400; ++i) ranges += fmt::format(",0-{}", i);
  SendText(fd, "GET /metrics HTTP/1.1\r\nRange: " + ranges + "\r\n\r\n");
  Drain(fd, 100ms);
  ::close(fd);
}

// A request trickled a byte at a time.
void Trickle(int port) {
  int fd = ConnectTcp(port);
  if (fd < 0) return;
  const std::string req = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
  for (size_t i = 0; i < req.size() && i < 12; ++i) {
    SendText(fd, req.substr(i, 1));
    std::this_thread::sleep_for(50ms);
  }
  ::close(fd);
}

}  // namespace

void AttackHttp(const StressOptions& run, std::mt19937_64& rng) {
  int port = -1;
  std::ifstream(HttpPortFile(run.dir)) >> port;
  switch (rng() % 5) {
    case 0:
      return IdleConnections(port, rng);
    case 1:
      return OversizedRequest(port, rng);
    case 2:
      return HugeBody(port);
    case 3:
      return ManyRanges(port);
    default:
      return Trickle(port);
  }
}

}  // namespace kvtier::stress

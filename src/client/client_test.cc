// The client library on its own (linked without the engine or the daemon): how it fails when
// there is no server, or a peer that accepts and then says nothing.
#include "kvtier/client.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>

namespace kvtier {
namespace {

using namespace std::chrono_literals;

ClientOptions Options(const std::string& socket) {
  ClientOptions o;
  o.socket_path = socket;
  o.ns.model_id = "client-test";
  o.ns.chunk_tokens = 16;
  o.chunk_bytes = 4096;
  return o;
}

std::string TempSocket(const char* name) {
  const char* tmp = std::getenv("TMPDIR");
  return fmt::format("{}/kvtier-client-test-{}-{}.sock", tmp && *tmp ? tmp : "/tmp", getpid(),
                     name);
}

TEST(ClientTest, NoServerIsUnavailableWithTheWayToStartOne) {
  const std::string path = TempSocket("none");
  auto c = Client::Connect(Options(path));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kUnavailable) << c.status().ToString();
  EXPECT_NE(c.status().message().find("kvtier serve --socket " + path), std::string::npos)
      << c.status().ToString();
}

TEST(ClientTest, BadOptionsAreRefusedBeforeConnecting) {
  ClientOptions o = Options(TempSocket("bad"));
  o.ns.model_id.clear();
  EXPECT_EQ(Client::Connect(o).status().code(), StatusCode::kInvalidArgument);
  o = Options(std::string(200, 'x'));
  EXPECT_EQ(Client::Connect(o).status().code(), StatusCode::kInvalidArgument);
}

// A peer that accepts and never answers the hello: the client gives up at its timeout instead
// of hanging its caller.
TEST(ClientTest, ASilentPeerTimesOut) {
  const std::string path = TempSocket("silent");
  ::unlink(path.c_str());
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  ClientOptions o = Options(path);
  o.connect_timeout = 300ms;
  o.rpc_timeout = 300ms;
  const auto t0 = std::chrono::steady_clock::now();
  auto c = Client::Connect(o);
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_FALSE(c.ok());
  EXPECT_LT(took, 5s);
  ::close(fd);
  ::unlink(path.c_str());
}

}  // namespace
}  // namespace kvtier

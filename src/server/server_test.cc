// Integration tests: the real `kvtier serve` binary in its own process, clients in this process
// and in forked child processes.
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include "kvtier/client.h"
#include "server/codec.h"
#include "testing/temp_dir.h"

namespace kvtier {
namespace {

using namespace std::chrono_literals;
constexpr uint64_t kChunkBytes = 64 * 1024;

#ifdef KVTIER_BINARY
constexpr const char* kBinary = KVTIER_BINARY;
#else
constexpr const char* kBinary = nullptr;
#endif

// A `kvtier serve` process.
class ServerProcess {
 public:
  ServerProcess(const testing::TempDir& dir, std::vector<std::string> extra)
      : socket_(dir.Sub("kv.sock")), log_(dir.Sub("server.log")) {
    args_ = {kBinary, "serve", "--socket", socket_, "--chunk-bytes", std::to_string(kChunkBytes),
             "--l1-size-gb", "0.015625", "--http-port", "0", "--log-level", "info"};
    args_.insert(args_.end(), extra.begin(), extra.end());
  }
  ~ServerProcess() { Kill(SIGKILL); }

  // Starts the process and waits until it accepts clients.
  void Start() {
    pid_ = fork();
    if (pid_ == 0) {
      int fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
      std::vector<char*> argv;
      for (auto& a : args_) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    ASSERT_GT(pid_, 0);
    for (int i = 0; i < 300; ++i) {
      if (Listening()) return;
      int status;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        FAIL() << "kvtier serve exited at start:\n" << Log();
      }
      std::this_thread::sleep_for(50ms);
    }
    FAIL() << "kvtier serve did not come up:\n" << Log();
  }
  bool Listening() const {
    int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strcpy(addr.sun_path, socket_.c_str());
    bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    ::close(fd);
    return ok;
  }
  // Sends `sig` and waits for the exit; returns the wait status.
  int Kill(int sig) {
    if (pid_ <= 0) return -1;
    ::kill(pid_, sig);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return status;
  }

  void Signal(int sig) {
    ::kill(pid_, sig);
    int status;
    if (sig == SIGSTOP) waitpid(pid_, &status, WUNTRACED);  // returns once it is stopped
  }
  ClientOptions Options(const std::string& model = "test-model") const {
    ClientOptions o;
    o.socket_path = socket_;
    o.ns.model_id = model;
    o.ns.chunk_tokens = 16;
    o.chunk_bytes = kChunkBytes;
    o.copy_threads = 0;  // no threads in this process, so forking clients is safe
    o.rpc_timeout = 5000ms;
    return o;
  }
  Result<std::unique_ptr<Client>> Connect(const std::string& model = "test-model") const {
    return Client::Connect(Options(model));
  }
  std::string Log() const {
    std::ifstream in(log_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  int HttpPort() const {
    std::string log = Log();
    auto at = log.find("http://127.0.0.1:");
    if (at == std::string::npos) return -1;
    return std::atoi(log.c_str() + at + std::strlen("http://127.0.0.1:"));
  }
  const std::string& socket() const { return socket_; }

 private:
  std::string socket_, log_;
  std::vector<std::string> args_;
  pid_t pid_ = -1;
};

std::vector<ChunkKey> Keys(uint32_t n, uint32_t seed) {
  KeyNamespace ns;
  ns.model_id = "keys";
  ns.chunk_tokens = 4;
  std::vector<uint32_t> tokens(n * 4);
  std::iota(tokens.begin(), tokens.end(), seed * 100000);
  return *ComputeChunkKeys(ns, tokens);
}

std::vector<uint8_t> Chunk(uint32_t i) {
  std::vector<uint8_t> c(kChunkBytes);
  for (size_t j = 0; j < c.size(); ++j) c[j] = static_cast<uint8_t>(i * 31 + j * 7);
  return c;
}

void StoreChunks(ChunkStore& store, const std::vector<ChunkKey>& keys) {
  std::vector<std::vector<uint8_t>> data;
  std::vector<std::span<const uint8_t>> src;
  for (uint32_t i = 0; i < keys.size(); ++i) data.push_back(Chunk(i));
  for (auto& d : data) src.emplace_back(d);
  auto op = store.Store(keys, src);
  ASSERT_TRUE(op.ok()) << op.status().ToString();
  OpResult r = op->Wait();
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  ASSERT_EQ(r.chunks, keys.size());
}

// Loads `keys` and checks the leading `expect` chunks have the content StoreChunks wrote.
void ExpectLoad(ChunkStore& store, const std::vector<ChunkKey>& keys, size_t expect) {
  std::vector<std::vector<uint8_t>> out(keys.size(), std::vector<uint8_t>(kChunkBytes));
  std::vector<std::span<uint8_t>> dst;
  for (auto& o : out) dst.emplace_back(o);
  auto op = store.Load(keys, dst);
  ASSERT_TRUE(op.ok()) << op.status().ToString();
  OpResult r = op->Wait();
  ASSERT_EQ(r.chunks, expect) << r.status.ToString();
  for (uint32_t i = 0; i < expect; ++i) ASSERT_EQ(out[i], Chunk(i)) << "chunk " << i;
}

nlohmann::json Stats(Client& c) {
  auto s = c.StatsJson();
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return nlohmann::json::parse(s.ok() ? *s : "{}");
}

// Runs `body` in a child process; returns its pid.
pid_t Spawn(const std::function<int()>& body) {
  pid_t pid = fork();
  if (pid == 0) _exit(body());
  return pid;
}

int WaitExit(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

class ServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!kBinary) GTEST_SKIP() << "the kvtier binary is not part of this build";
  }
  testing::TempDir dir_{"kvtier-server-test"};
};

TEST_F(ServerTest, StoreLookupLoadAndPartialPrefix) {
  ServerProcess server(dir_, {"--no-l2"});
  ASSERT_NO_FATAL_FAILURE(server.Start());
  auto client = server.Connect();
  ASSERT_TRUE(client.ok()) << client.status().ToString();
  Client& c = **client;
  EXPECT_EQ(c.chunk_bytes(), kChunkBytes);
  EXPECT_EQ(c.num_slots(), 256u);
  auto keys = Keys(10, 1);
  std::vector<ChunkKey> first8(keys.begin(), keys.begin() + 8);
  ASSERT_NO_FATAL_FAILURE(StoreChunks(c, first8));
  ASSERT_NO_FATAL_FAILURE(StoreChunks(c, first8));  // idempotent
  LookupResult l = c.Lookup(keys);
  EXPECT_EQ(l.total, 8u);
  EXPECT_EQ(l.memory, 8u);
  ASSERT_NO_FATAL_FAILURE(ExpectLoad(c, keys, 8));  // a partial load delivers the prefix
  EXPECT_TRUE(c.Ping().ok());
  auto st = Stats(c);
  EXPECT_EQ(st["pool"]["resident"], 8);
  EXPECT_EQ(st["pool"]["pinned"], 0);
}

TEST_F(ServerTest, SameCodeRunsInProcessAndAgainstTheServer) {
  ServerProcess server(dir_, {"--no-l2"});
  ASSERT_NO_FATAL_FAILURE(server.Start());
  for (auto mode : {ChunkStoreMode::kInProcess, ChunkStoreMode::kServer}) {
    ChunkStoreOptions o;
    o.mode = mode;
    o.client = server.Options();
    o.engine.ns = o.client.ns;
    o.engine.chunk_bytes = kChunkBytes;
    o.engine.memory.capacity_bytes = 64 * kChunkBytes;
    auto store = OpenChunkStore(o);
    ASSERT_TRUE(store.ok()) << store.status().ToString();
    auto keys = Keys(5, 2);
    ASSERT_NO_FATAL_FAILURE(StoreChunks(**store, keys));
    EXPECT_EQ((*store)->Lookup(keys).total, 5u);
    ASSERT_NO_FATAL_FAILURE(ExpectLoad(**store, keys, 5));
    // Zero-copy: pin, read in place, unpin.
    auto op = (*store)->PrepareLoad(keys);
    ASSERT_TRUE(op.ok());
    OpResult r = op->Wait();
    ASSERT_EQ(r.slots.size(), 5u);
    auto data = (*store)->SlotData(r.slots[3]);
    EXPECT_TRUE(std::equal(data.begin(), data.end(), Chunk(3).begin()));
    EXPECT_TRUE((*store)->Unpin(r.slots).ok());
  }
}

TEST_F(ServerTest, TwoInstancesShareEachOthersPrefixesButNotOtherNamespaces) {
  ServerProcess server(dir_, {"--no-l2"});
  ASSERT_NO_FATAL_FAILURE(server.Start());
  auto keys = Keys(6, 3);
  // Instance A, a separate process, stores a prefix and exits.
  pid_t a = Spawn([&] {
    auto c = server.Connect();
    if (!c.ok()) return 2;
    std::vector<std::vector<uint8_t>> data;
    std::vector<std::span<const uint8_t>> src;
    for (uint32_t i = 0; i < keys.size(); ++i) data.push_back(Chunk(i));
    for (auto& d : data) src.emplace_back(d);
    auto op = (*c)->Store(keys, src);
    return op.ok() && op->Wait().chunks == keys.size() ? 0 : 3;
  });
  ASSERT_EQ(WaitExit(a), 0);
  // Instance B (this process, same namespace) hits the whole prefix.
  auto b = server.Connect();
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->Lookup(keys).total, 6u);
  ASSERT_NO_FATAL_FAILURE(ExpectLoad(**b, keys, 6));
  // A client of another model sends the very same key bytes and reaches nothing.
  auto other = server.Connect("another-model");
  ASSERT_TRUE(other.ok());
  EXPECT_EQ((*other)->Lookup(keys).total, 0u);
  ASSERT_NO_FATAL_FAILURE(ExpectLoad(**other, keys, 0));
  // Another tenant of the same model is separate too.
  ClientOptions t = server.Options();
  t.ns.tenant_salt = "tenant-2";
  auto tenant = Client::Connect(t);
  ASSERT_TRUE(tenant.ok());
  EXPECT_EQ((*tenant)->Lookup(keys).total, 0u);
}

TEST_F(ServerTest, WrongTokenAndRefusedNamespacesOrLayouts) {
  ServerProcess server(dir_, {"--no-l2", "--token", "s3cret"});
  ASSERT_NO_FATAL_FAILURE(server.Start());
  ClientOptions o = server.Options();
  auto none = Client::Connect(o);
  EXPECT_EQ(none.status().code(), StatusCode::kPermissionDenied) << none.status().ToString();
  o.token = "wrong";
  EXPECT_EQ(Client::Connect(o).status().code(), StatusCode::kPermissionDenied);
  o.token = "s3cret";
  EXPECT_TRUE(Client::Connect(o).ok());

  ClientOptions layout = o;
  layout.chunk_bytes = kChunkBytes * 2;
  auto mismatch = Client::Connect(layout);
  EXPECT_EQ(mismatch.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(mismatch.status().message().find("layout mismatch"), std::string::npos)
      << mismatch.status().ToString();

  // A namespace the server must refuse (rank outside the world), sent on a raw socket because
  // the client library refuses it before sending.
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, server.socket().c_str());
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  server::HelloRequest h;
  h.token = "s3cret";
  h.ns.model_id = "m";
  h.ns.rank = 4;
  h.ns.world_size = 2;
  h.chunk_bytes = kChunkBytes;
  auto frame = server::EncodeHelloRequest(1, h);
  ASSERT_EQ(::send(fd, frame.data(), frame.size(), 0), static_cast<ssize_t>(frame.size()));
  uint8_t buf[4096];
  ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_WAITALL);
  ASSERT_GT(n, static_cast<ssize_t>(server::kHeaderBytes));
  server::Reader r(std::span<const uint8_t>(buf + server::kHeaderBytes, n - server::kHeaderBytes));
  Status remote;
  ASSERT_TRUE(server::DecodeReplyStatus(r, &remote).ok());
  EXPECT_EQ(remote.code(), StatusCode::kInvalidArgument) << remote.ToString();
  ::close(fd);
}

// Sends raw bytes on a fresh connection and returns (reply status, connection closed after).
std::pair<Status, bool> SendRaw(const std::string& socket, const std::vector<uint8_t>& bytes,
                                bool hello_first) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, socket.c_str());
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return {Status::Unavailable("connect"), false};
  }
  struct timeval tv {5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  auto read_frame = [&](std::vector<uint8_t>* body) -> bool {
    uint8_t hdr[server::kHeaderBytes];
    if (::recv(fd, hdr, sizeof(hdr), MSG_WAITALL) != sizeof(hdr)) return false;
    auto h = server::DecodeHeader(hdr);
    body->resize(h.body_length);
    return h.body_length == 0 ||
           ::recv(fd, body->data(), body->size(), MSG_WAITALL) == ssize_t(h.body_length);
  };
  std::vector<uint8_t> body;
  if (hello_first) {
    server::HelloRequest h;
    h.ns.model_id = "m";
    h.chunk_bytes = kChunkBytes;
    auto f = server::EncodeHelloRequest(1, h);
    ::send(fd, f.data(), f.size(), MSG_NOSIGNAL);
    if (!read_frame(&body)) return {Status::Internal("no hello reply"), false};
  }
  ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  Status remote = Status::Internal("no reply");
  if (read_frame(&body)) {
    server::Reader r(body);
    if (!server::DecodeReplyStatus(r, &remote).ok()) remote = Status::Internal("bad reply");
  }
  char c;
  bool closed = ::recv(fd, &c, 1, 0) == 0;
  ::close(fd);
  return {remote, closed};
}

TEST_F(ServerTest, MalformedAndOversizedMessagesGetAnErrorAndADisconnect) {
  ServerProcess server(dir_, {"--no-l2"});
  ASSERT_NO_FATAL_FAILURE(server.Start());
  auto header = [](uint32_t len, uint16_t op, uint16_t flags) {
    std::vector<uint8_t> f(server::kHeaderBytes);
    server::EncodeHeader({len, op, flags, 77}, f.data());
    return f;
  };
  // Oversized: the 1 GiB body is never read.
  auto [big, big_closed] = SendRaw(server.socket(), header(1u << 30, 2, 0), true);
  EXPECT_EQ(big.code(), StatusCode::kInvalidArgument) << big.ToString();
  EXPECT_TRUE(big_closed);
  // Unknown opcode, non-zero flags.
  auto [op, op_closed] = SendRaw(server.socket(), header(0, 999, 0), true);
  EXPECT_EQ(op.code(), StatusCode::kUnimplemented);
  EXPECT_TRUE(op_closed);
  auto [fl, fl_closed] = SendRaw(server.socket(), header(0, 9, 1), true);
  EXPECT_EQ(fl.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(fl_closed);
  // A request before the handshake.
  auto [pre, pre_closed] = SendRaw(server.socket(), header(0, 9, 0), false);
  EXPECT_EQ(pre.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(pre_closed);
  // A lookup whose key count promises more than the body holds.
  auto lying = header(8, 2, 0);
  for (uint8_t b : {0xFF, 0xFF, 0, 0, 1, 2, 3, 4}) lying.push_back(b);
  auto [lie, lie_closed] = SendRaw(server.socket(), lying, true);
  EXPECT_EQ(lie.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(lie_closed);
  // Garbage instead of a hello.
  std::vector<uint8_t> junk(64, 0xAB);
  auto [g, g_closed] = SendRaw(server.socket(), junk, false);
  EXPECT_FALSE(g.ok());
  EXPECT_TRUE(g_closed);
  // A release of a slot this connection does not hold is an error, but not a disconnect.
  auto c = server.Connect();
  ASSERT_TRUE(c.ok());
  SlotId s = 3;
  EXPECT_EQ((*c)->Unpin(std::span(&s, 1)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*c)->CommitSlots(Keys(1, 9), std::span(&s, 1)).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE((*c)->Ping().ok());
  // And the server still serves.
  auto keys = Keys(2, 4);
  ASSERT_NO_FATAL_FAILURE(StoreChunks(**c, keys));
  EXPECT_EQ((*c)->Lookup(keys).total, 2u);
}

TEST_F(ServerTest, SigkilledClientsMidLoadLeaveNoPinnedSlot) {
  ServerProcess server(dir_, {"--no-l2"});
  ASSERT_NO_FATAL_FAILURE(server.Start());
  auto keys = Keys(32, 5);
  {
    auto c = server.Connect();
    ASSERT_TRUE(c.ok());
    ASSERT_NO_FATAL_FAILURE(StoreChunks(**c, keys));
  }
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  std::vector<pid_t> kids;
  for (int k = 0; k < 4; ++k) {
    kids.push_back(Spawn([&, k] {
      auto c = server.Connect();
      if (!c.ok()) return 2;
      // Hold pins and a reservation, then keep loading (pin, copy, release) until killed.
      auto held = (*c)->PrepareLoad(keys);
      if (!held.ok() || held->Wait().slots.size() != keys.size()) return 3;
      auto fresh = Keys(2, 100 + k);
      auto reserved = (*c)->ReserveSlots(fresh);
      if (!reserved.ok() || reserved->size() != 2) return 4;
      char one = 1;
      if (write(ready[1], &one, 1) != 1) return 5;
      std::vector<uint8_t> buf(kChunkBytes);
      while (true) {
        auto op = (*c)->PrepareLoad(keys);
        if (!op.ok()) return 6;
        OpResult r = op->Wait();
        for (SlotId s : r.slots) std::memcpy(buf.data(), (*c)->SlotData(s).data(), buf.size());
        if (!(*c)->Unpin(r.slots).ok()) return 7;
      }
    }));
  }
  for (size_t i = 0; i < kids.size(); ++i) {
    char b;
    ASSERT_EQ(read(ready[0], &b, 1), 1);
  }
  close(ready[0]);
  close(ready[1]);
  auto observer = server.Connect();
  ASSERT_TRUE(observer.ok());
  auto during = Stats(**observer);
  EXPECT_EQ(during["pool"]["pinned"], 32);
  EXPECT_EQ(during["clients"].size(), 5u);
  std::this_thread::sleep_for(50ms);
  for (pid_t p : kids) ::kill(p, SIGKILL);
  for (pid_t p : kids) EXPECT_EQ(WaitExit(p), 128 + SIGKILL);
  nlohmann::json after;
  for (int i = 0; i < 100; ++i) {
    after = Stats(**observer);
    if (after["pool"]["pinned"] == 0 && after["clients"].size() == 1) break;
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(after["pool"]["pinned"], 0) << after.dump();
  EXPECT_EQ(after["clients"].size(), 1u);
  // Every slot can be taken again: none is stuck reserved or pinned.
  auto all = Keys((*observer)->num_slots(), 200);
  auto slots = (*observer)->ReserveSlots(all);
  ASSERT_TRUE(slots.ok());
  EXPECT_EQ(slots->size(), all.size());
  EXPECT_TRUE((*observer)->AbortSlots(*slots).ok());
}

TEST_F(ServerTest, DeadServerMeansMissesAndUnavailableNotAHang) {
  ServerProcess server(dir_, {"--no-l2"});
  ASSERT_NO_FATAL_FAILURE(server.Start());
  auto c = server.Connect();
  ASSERT_TRUE(c.ok());
  auto keys = Keys(2, 6);
  ASSERT_NO_FATAL_FAILURE(StoreChunks(**c, keys));
  server.Kill(SIGKILL);
  auto start = std::chrono::steady_clock::now();
  EXPECT_EQ((*c)->Lookup(keys).total, 0u);
  EXPECT_FALSE((*c)->connected());
  EXPECT_EQ((*c)->Ping().code(), StatusCode::kUnavailable);
  EXPECT_EQ((*c)->TryLookup(keys).status().code(), StatusCode::kUnavailable);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  auto again = server.Connect();
  EXPECT_EQ(again.status().code(), StatusCode::kUnavailable) << again.status().ToString();
}

TEST_F(ServerTest, StalledServerTimesOutInsteadOfHangingTheClient) {
  ServerProcess server(dir_, {"--no-l2"});
  ASSERT_NO_FATAL_FAILURE(server.Start());
  ClientOptions o = server.Options();
  o.rpc_timeout = 300ms;
  auto c = Client::Connect(o);
  ASSERT_TRUE(c.ok());
  auto keys = Keys(2, 10);
  ASSERT_NO_FATAL_FAILURE(StoreChunks(**c, keys));
  server.Signal(SIGSTOP);
  auto start = std::chrono::steady_clock::now();
  auto r = (*c)->TryLookup(keys);
  auto took = std::chrono::steady_clock::now() - start;
  server.Signal(SIGCONT);
  EXPECT_EQ(r.status().code(), StatusCode::kTimeout) << r.status().ToString();
  EXPECT_GE(took, 250ms);
  EXPECT_LT(took, 3s);
  EXPECT_FALSE((*c)->connected());
  EXPECT_EQ((*c)->Lookup(keys).total, 0u);  // fails fast from now on
  // The server, resumed, released the broken connection and serves new clients.
  auto fresh = server.Connect();
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ((*fresh)->Lookup(keys).total, 2u);
}

TEST_F(ServerTest, SigtermDrainsAndExitsCleanly) {
  ServerProcess server(dir_, {"--no-l2"});
  ASSERT_NO_FATAL_FAILURE(server.Start());
  auto c = server.Connect();
  ASSERT_TRUE(c.ok());
  int status = server.Kill(SIGTERM);
  ASSERT_TRUE(WIFEXITED(status)) << server.Log();
  EXPECT_EQ(WEXITSTATUS(status), 0) << server.Log();
  EXPECT_NE(access(server.socket().c_str(), F_OK), 0) << "socket file left behind";
  EXPECT_FALSE((*c)->Ping().ok());
  EXPECT_NE(server.Log().find("drained"), std::string::npos);
}

// Restarts after SIGKILL (write-through) and after SIGTERM (write-back flushed at drain).
TEST_F(ServerTest, RestartedServerServesFileTierChunks) {
  for (const char* policy : {"write_through", "write_back"}) {
    SCOPED_TRACE(policy);
    std::string l2 = R"({"type":"fs","path":")" + dir_.Sub(std::string("l2-") + policy) +
                     R"(","max_size_gb":1})";
    std::vector<std::string> args = {"--l2", l2, "--write-policy", policy};
    auto keys = Keys(4, 7);
    {
      ServerProcess server(dir_, args);
      ASSERT_NO_FATAL_FAILURE(server.Start());
      auto c = server.Connect();
      ASSERT_TRUE(c.ok());
      ASSERT_NO_FATAL_FAILURE(StoreChunks(**c, keys));
      if (std::string(policy) == "write_through") {
        for (int i = 0; i < 200; ++i) {
          auto st = Stats(**c);
          if (st["tiers"]["file"]["chunks"] == 4 && st["tiers"]["file"]["queued_writes"] == 0) {
            break;
          }
          std::this_thread::sleep_for(20ms);
        }
        server.Kill(SIGKILL);
      } else {
        int status = server.Kill(SIGTERM);
        ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << server.Log();
      }
    }
    ServerProcess restarted(dir_, args);
    ASSERT_NO_FATAL_FAILURE(restarted.Start());
    auto c = restarted.Connect();
    ASSERT_TRUE(c.ok());
    LookupResult l = (*c)->Lookup(keys);
    EXPECT_EQ(l.total, 4u) << restarted.Log();
    EXPECT_EQ(l.memory, 0u);
    ASSERT_NO_FATAL_FAILURE(ExpectLoad(**c, keys, 4));
    EXPECT_EQ((*c)->Lookup(keys).memory, 4u);  // promoted into L1 by the load
  }
}

TEST_F(ServerTest, MetricsHealthAndStatsOverHttp) {
  ServerProcess server(dir_, {"--no-l2"});
  ASSERT_NO_FATAL_FAILURE(server.Start());
  int port = server.HttpPort();
  ASSERT_GT(port, 0) << server.Log();
  httplib::Client http("127.0.0.1", port);
  auto health = http.Get("/healthz");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  auto value = [&](const std::string& series) {
    auto res = http.Get("/metrics");
    if (!res) return -1.0;
    std::istringstream in(res->body);
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
    }
    return -1.0;
  };
  EXPECT_EQ(value("kvtier_hits_total{tier=\"memory\"}"), 0);
  auto c = server.Connect();
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(value("kvtier_connected_clients"), 1);
  auto keys = Keys(3, 8);
  ASSERT_NO_FATAL_FAILURE(StoreChunks(**c, keys));
  ASSERT_NO_FATAL_FAILURE(ExpectLoad(**c, keys, 3));
  EXPECT_EQ(value("kvtier_hits_total{tier=\"memory\"}"), 3);
  EXPECT_EQ(value("kvtier_bytes_written_total{tier=\"memory\"}"), 3.0 * kChunkBytes);
  EXPECT_EQ(value("kvtier_bytes_read_total{tier=\"memory\"}"), 3.0 * kChunkBytes);
  EXPECT_EQ(value("kvtier_rpc_requests_total{op=\"prepare_load\"}"), 1);
  EXPECT_EQ(value("kvtier_pool_slots{state=\"resident\"}"), 3);
  EXPECT_EQ(value("kvtier_store_latency_seconds_count"), 1);
  auto stats = http.Get("/stats");
  ASSERT_TRUE(stats);
  auto j = nlohmann::json::parse(stats->body);
  EXPECT_EQ(j["pool"]["resident"], 3);
}

// Runs `kvtier serve ARGS` expecting a quick failure; returns (exit code, output).
std::pair<int, std::string> RunServeFailing(const testing::TempDir& dir,
                                            std::vector<std::string> args) {
  std::string out = dir.Sub("fail.log");
  std::string cmd = std::string(kBinary) + " serve";
  for (auto& a : args) cmd += " '" + a + "'";
  cmd += " > " + out + " 2>&1";
  int status = std::system(("timeout 20 " + cmd).c_str());
  std::ifstream in(out);
  std::stringstream ss;
  ss << in.rdbuf();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, ss.str()};
}

TEST_F(ServerTest, BadCommandLinesFailClearly) {
  std::string sock = dir_.Sub("bad.sock");
  auto [rc1, out1] = RunServeFailing(dir_, {"--socket", sock, "--no-such-flag"});
  EXPECT_NE(rc1, 0);
  auto [rc2, out2] = RunServeFailing(dir_, {"--socket", sock, "--l2", "{not json"});
  EXPECT_NE(rc2, 0);
  EXPECT_NE(out2.find("not valid JSON"), std::string::npos) << out2;
  std::ofstream(dir_.Sub("bad.json")) << R"({"l1_size_gb": "big"})";
  auto [rc3, out3] = RunServeFailing(dir_, {"--socket", sock, "--config", dir_.Sub("bad.json")});
  EXPECT_NE(rc3, 0);
  EXPECT_NE(out3.find("l1_size_gb"), std::string::npos) << out3;
  auto [rc4, out4] = RunServeFailing(dir_, {"--socket", sock, "--eviction-policy", "random"});
  EXPECT_NE(rc4, 0);
  auto [rc5, out5] = RunServeFailing(dir_, {"--socket", sock, "--model", "no-such-model"});
  EXPECT_NE(rc5, 0);
  EXPECT_NE(out5.find("preset"), std::string::npos) << out5;
  std::ofstream(dir_.Sub("not-a-socket")) << "x";
  auto [rc6, out6] = RunServeFailing(dir_, {"--socket", dir_.Sub("not-a-socket"), "--no-l2"});
  EXPECT_NE(rc6, 0);
  EXPECT_NE(out6.find("not a socket"), std::string::npos) << out6;

  ServerProcess server(dir_, {"--no-l2"});
  ASSERT_NO_FATAL_FAILURE(server.Start());
  auto [rc7, out7] = RunServeFailing(dir_, {"--socket", server.socket(), "--no-l2",
                                            "--http-port", "-1"});
  EXPECT_NE(rc7, 0);
  EXPECT_NE(out7.find("in use"), std::string::npos) << out7;
  EXPECT_TRUE(server.Connect().ok());  // the running server is untouched
}

}  // namespace
}  // namespace kvtier

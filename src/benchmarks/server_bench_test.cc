// RunServerBench on small runs: against the server it starts in this process, against a real
// server started in a child process (--socket), and its failures.
#include "benchmarks/server_bench.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "server/server.h"
#include "testing/temp_dir.h"
#include "testing/wait.h"

namespace kvtier::benchmarks {
namespace {

namespace fs = std::filesystem;

ServerBenchOptions Small() {
  ServerBenchOptions o;
  o.clients = 2;
  o.chunk_mib = 1;
  o.chunks = 2;
  o.repeats = 1;
  o.rpc_rounds = 20;
  o.rpc_interval_us = 100;
  return o;
}

// Sane figures for a run of `o` whose clients all moved every chunk.
void ExpectSane(const ServerBenchOptions& o, const ServerBenchResult& r) {
  const size_t rounds = static_cast<size_t>(o.clients) * o.rpc_rounds;
  for (int m = 0; m < kRpcModes; ++m) {
    EXPECT_EQ(r.rpc[m][kFloor].count, rounds) << m;
    EXPECT_EQ(r.rpc[m][kLookup].count, rounds) << m;
    // Every other round pins and unpins one chunk; its floor makes two more trips.
    EXPECT_EQ(r.rpc[m][kPrepareLoad].count, rounds / 2) << m;
    EXPECT_EQ(r.rpc[m][kRelease].count, rounds / 2) << m;
    EXPECT_EQ(r.rpc[m][kFloorFollow].count, rounds) << m;
    for (int op = kFloor; op <= kRelease; ++op) {
      const LatencySummary& l = r.rpc[m][op];
      EXPECT_GT(l.p50, 0) << kRpcOpNames[op];
      EXPECT_GE(l.p99, l.p50) << kRpcOpNames[op];
      EXPECT_GE(l.p999, l.p99) << kRpcOpNames[op];
    }
    for (int op = kLookup; op <= kRelease; ++op) {
      EXPECT_NEAR(r.vs_floor[m][op], r.rpc[m][op].p50 / r.rpc[m][FloorOf(op)].p50, 1e-9);
    }
  }
  bool met = true;
  for (int op = kLookup; op <= kRelease; ++op) met = met && r.vs_floor[kPaced][op] <= 1.5;
  EXPECT_EQ(r.goal_met, met);
  EXPECT_GT(r.memcpy_GBps, 0);
  EXPECT_GT(r.store_GBps, 0);
  EXPECT_GT(r.load_GBps, 0);
  EXPECT_EQ(r.store_refused_chunks, 0u);
  EXPECT_EQ(r.load_missed_chunks, 0u);
}

TEST(ServerBench, InProcessServer) {
  const ServerBenchOptions o = Small();
  auto r = RunServerBench(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectSane(o, *r);
  EXPECT_EQ(r->server, "in-process server (L1 only)");
  EXPECT_EQ(r->chunk_bytes, 1u << 20);
  EXPECT_FALSE(r->steady_state);

  nlohmann::json j = ServerBenchResultToJson(o, *r);
  EXPECT_EQ(j["rpc_paced_timed_from"], "scheduled send time");
  EXPECT_EQ(j["rpc_lookup_count"], 40);
  EXPECT_EQ(j["rpc_goal_met"], r->goal_met);
  EXPECT_DOUBLE_EQ(j["store_GBps"].get<double>(), r->store_GBps);
  EXPECT_EQ(j["rpc_floor_message_bytes"], FloorMessageBytes());
  EXPECT_EQ(j["chunk_bytes"], 1u << 20);
  EXPECT_FALSE(j.contains("steady_state"));
}

TEST(ServerBench, BackToBackRoundsAndIsolatedClients) {
  ServerBenchOptions o = Small();
  o.rpc_interval_us = 0;
  o.isolate_clients = true;
  auto r = RunServerBench(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectSane(o, *r);
  EXPECT_NE(r->server.find("isolated clients"), std::string::npos) << r->server;
  nlohmann::json j = ServerBenchResultToJson(o, *r);
  EXPECT_EQ(j["rpc_paced_timed_from"], "send");
  EXPECT_EQ(j["isolate_clients"], true);
}

TEST(ServerBench, SteadyStateWithAFileTier) {
  testing::TempDir l2("kvtier-server-bench-l2");
  ServerBenchOptions o = Small();
  o.chunks = 4;
  o.repeats = 2;
  o.warmup = 2;
  o.l2_dir = l2.path();
  o.write_policy = WritePolicy::kWriteBack;
  auto r = RunServerBench(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectSane(o, *r);
  ASSERT_TRUE(r->steady_state);
  const SteadyStateResult& s = *r->steady_state;
  EXPECT_EQ(s.write_policy, WritePolicy::kWriteBack);
  EXPECT_GT(s.measured_seconds, 0);
  EXPECT_GT(s.l1_evictions, 0u) << "the pool is full in the measured passes";
  EXPECT_GT(s.raw_o_direct_write_GBps, 0);
  EXPECT_GE(s.raw_o_direct_bytes, 16u << 20);
  EXPECT_GE(s.raw_o_direct_write_threads, 1);
  EXPECT_EQ(s.l2_errors, 0u);
  EXPECT_GT(s.write_backs + s.dirty_evictions, 0u);
  EXPECT_NE(r->server.find(l2.path()), std::string::npos) << r->server;
  EXPECT_EQ(ServerBenchResultToJson(o, *r)["steady_state"]["write_policy"], "write_back");
  EXPECT_TRUE(fs::is_empty(l2.path())) << "the tier's and the reference's files are removed";
}

// A real server in a child process: this process must not run threads when the benchmark forks
// its clients.
class ServerProcess {
 public:
  explicit ServerProcess(const std::string& socket) {
    pid_ = fork();
    if (pid_ != 0) return;
    server::ServerOptions o;
    o.socket_path = socket;
    o.http_port = -1;
    o.engine.chunk_bytes = 1 << 20;
    o.engine.memory.capacity_bytes = 32 << 20;
    auto started = server::Server::Start(o);
    if (!started.ok()) _exit(1);
    for (;;) pause();
  }
  ~ServerProcess() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }

 private:
  pid_t pid_ = -1;
};

TEST(ServerBench, RunningServer) {
  testing::TempDir dir("kvtier-server-bench");
  const std::string socket = dir.Sub("kv.sock");
  ServerProcess server(socket);
  ASSERT_TRUE(testing::WaitUntil([&] { return fs::exists(socket); })) << "server did not start";
  ServerBenchOptions o = Small();
  o.socket = socket;
  o.chunk_mib = 4;  // a running server has its own chunk size
  auto r = RunServerBench(o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectSane(o, *r);
  EXPECT_EQ(r->server, socket);
  EXPECT_EQ(r->chunk_bytes, 0u);
  EXPECT_FALSE(ServerBenchResultToJson(o, *r).contains("chunk_bytes"));
}

TEST(ServerBench, UnreachableServerFailsTheClients) {
  testing::TempDir dir("kvtier-server-bench");
  ServerBenchOptions o = Small();
  o.socket = dir.Sub("nobody.sock");
  auto r = RunServerBench(o);
  ASSERT_FALSE(r.ok());
  // Each client says why on stderr; the run names the client that failed first.
  EXPECT_NE(r.status().message().find("client process"), std::string::npos)
      << r.status().ToString();
  EXPECT_NE(r.status().message().find("exit status 11"), std::string::npos)
      << r.status().ToString();
}

TEST(ServerBench, RefusesOptionsThatDoNotGoTogether) {
  testing::TempDir l2("kvtier-server-bench-l2");
  struct Case {
    void (*bend)(ServerBenchOptions&, const std::string& dir);
    const char* says;
  };
  const Case cases[] = {
      {[](ServerBenchOptions& o, const std::string&) {
         o.isolate_clients = true;
         o.socket = "/nowhere.sock";
       },
       "--isolate-clients configures the server started here"},
      {[](ServerBenchOptions& o, const std::string& d) {
         o.isolate_clients = true;
         o.l2_dir = d;
       },
       "--isolate-clients runs without --l2"},
      {[](ServerBenchOptions& o, const std::string& d) {
         o.l2_dir = d;
         o.socket = "/nowhere.sock";
       },
       "--l2 configures the server started here"},
      {[](ServerBenchOptions& o, const std::string& d) { o.l2_dir = d + "/missing"; },
       "/missing: not a directory"},
      {[](ServerBenchOptions& o, const std::string&) { o.clients = 0; }, "--clients 0"},
      {[](ServerBenchOptions& o, const std::string&) { o.chunk_mib = 2048; }, "--chunk-mib"},
      {[](ServerBenchOptions& o, const std::string&) { o.repeats = 0; }, "--repeats"},
      {[](ServerBenchOptions& o, const std::string&) { o.warmup = -1; }, "--warmup"},
      {[](ServerBenchOptions& o, const std::string&) { o.rpc_rounds = 0; }, "--rpc-rounds"},
      {[](ServerBenchOptions& o, const std::string&) { o.rpc_interval_us = -1; },
       "--rpc-interval-us"},
  };
  for (const Case& c : cases) {
    ServerBenchOptions o = Small();
    c.bend(o, l2.path());
    EXPECT_EQ(ValidateServerBenchOptions(o).code(), StatusCode::kInvalidArgument) << c.says;
    auto r = RunServerBench(o);
    ASSERT_FALSE(r.ok()) << c.says;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.says;
    EXPECT_NE(r.status().message().find(c.says), std::string::npos) << r.status().ToString();
  }
  EXPECT_TRUE(ValidateServerBenchOptions(Small()).ok());
}

}  // namespace
}  // namespace kvtier::benchmarks

// kvtier bench server: N client processes doing lookups, stores and loads through a server's
// shared pool. Reports control round-trip latency per operation (p50/p99) next to the bare
// Unix-socket round trip of the same processes (the floor), and data throughput through the pool
// next to a plain memcpy by the same N processes, each limit measured in the same run.
//
// Steady state (--l2 DIR): the server has a file tier on DIR and an L1 pool of two passes' worth
// of chunks, so after the warm-up passes every store evicts, as in a cache that has been running
// for an hour; run once per write policy. The file tier's write rate over the measured passes is
// reported beside plain O_DIRECT writes of chunk files to the same directory by as many threads
// as the tier writes with.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "benchmarks/server_bench.h"
#include "kvtier/engine.h"
#include "tools/command.h"

namespace kvtier::tools {
namespace {

using benchmarks::ServerBenchOptions;
using benchmarks::ServerBenchResult;

struct BenchServerArgs {
  ServerBenchOptions options;
  std::vector<std::string> write_policies;  // with --l2; empty: all three
  int warmup = -1;                          // unmeasured passes; -1: 2 with --l2, else 0
  bool json = false;
};

void PrintSteadyState(const benchmarks::SteadyStateResult& s) {
  fmt::print("{:<38} {:>8.2f} GB/s  {:.2f} x plain O_DIRECT writes ({:.2f} GB/s, {} threads)\n",
             "file tier writes (measured passes)", s.l2_write_GBps, s.l2_write_vs_raw,
             s.raw_o_direct_write_GBps, s.raw_o_direct_write_threads);
  fmt::print(
      "  L1 evictions {}, written back by the flusher {}, lost before reaching L2 {}, stores "
      "refused while L2 caught up {}, write-through deferred {} / dropped {}, L2 errors {}\n",
      s.l1_evictions, s.write_backs, s.dirty_evictions, s.dirty_refusals, s.write_through_deferred,
      s.write_through_dropped, s.l2_errors);
}

void PrintRoundTrips(const ServerBenchOptions& a, const ServerBenchResult& r) {
  using namespace benchmarks;
  const char* labels[kRpcOps] = {"floor: bare socket, first of round",
                                 "floor: bare socket, follow-up",
                                 "lookup (16 keys)",
                                 "prepare_load (1 key)",
                                 "release (1 slot)",
                                 "(lookups sent late by)"};
  for (int m = 0; m < kRpcModes; ++m) {
    if (m == kPaced && a.rpc_interval_us <= 0) {
      fmt::print("control round trips, not paced (--rpc-interval-us 0: back to back):\n");
    } else if (m == kPaced) {
      fmt::print(
          "control round trips, paced ({} per client, one round every {} us on average, "
          "timed from the scheduled send):\n",
          a.rpc_rounds, a.rpc_interval_us);
    } else {
      fmt::print("control round trips, saturated (clients back to back):\n");
    }
    for (int op = 0; op < kRpcOps; ++op) {
      const LatencySummary& l = r.rpc[m][op];
      if (op == kSendLate && m != kPaced) continue;
      std::string ratio;
      if (op >= kLookup && op <= kRelease)
        ratio = fmt::format("  {:.2f} x floor", r.vs_floor[m][op]);
      fmt::print("  {:<36} p50 {:>7.1f} us  p99 {:>8.1f} us  p99.9 {:>8.1f} us{}\n", labels[op],
                 l.p50, l.p99, l.p999, ratio);
    }
  }
  fmt::print("goal (paced p50 of every operation <= {:.1f} x floor): {}\n", kRpcGoalVsFloor,
             r.goal_met ? "met" : "NOT met");
}

void PrintServerBench(const ServerBenchOptions& a, const ServerBenchResult& r) {
  fmt::print("server: {}; {} client processes, {} chunks each per pass\n", r.server, a.clients,
             a.chunks);
  PrintRoundTrips(a, r);
  const bool isolate = a.isolate_clients;
  const double mem = r.memcpy_GBps;
  fmt::print("{:<38} {:>8.2f} GB/s (limit)\n", "memcpy, same processes", mem);
  fmt::print("{:<38} {:>8.2f} GB/s  {:.2f} x memcpy\n",
             isolate ? "store through a private window" : "store into the shared pool",
             r.store_GBps, r.store_GBps / mem);
  fmt::print("{:<38} {:>8.2f} GB/s  {:.2f} x memcpy\n",
             isolate ? "load through a private window" : "load from the shared pool", r.load_GBps,
             r.load_GBps / mem);
  if (r.store_refused_chunks + r.load_missed_chunks > 0) {
    fmt::print(
        "WARNING: {} chunks found no slot to store into and {} were missing at load; "
        "the rates above count only the bytes moved\n",
        r.store_refused_chunks, r.load_missed_chunks);
  }
  if (r.steady_state) PrintSteadyState(*r.steady_state);
}

// One run: prints it (text), or stores its JSON object in *out. Returns the exit status.
int RunOnce(const ServerBenchOptions& a, bool json, nlohmann::json* out) {
  auto result = benchmarks::RunServerBench(a);
  if (!result.ok()) {
    fmt::print(stderr, "kvtier bench server: error: {}\n", result.status().message());
    return 1;
  }
  if (json) {
    *out = benchmarks::ServerBenchResultToJson(a, *result);
  } else {
    PrintServerBench(a, *result);
  }
  return 0;
}

// The shared pool and isolated clients, same chunks, processes and passes, one after the other.
int RunIsolationPair(ServerBenchOptions a, bool json) {
  nlohmann::json runs = nlohmann::json::array();
  double rate[2][2] = {};  // [isolated][store, load]
  for (bool isolate : {false, true}) {
    if (!json) fmt::print("== {} ==\n", isolate ? "isolated clients" : "shared pool");
    a.isolate_clients = isolate;
    nlohmann::json j;
    if (int rc = RunOnce(a, json, &j); rc != 0) return rc;
    if (json) {
      rate[isolate][0] = j["store_GBps"].get<double>();
      rate[isolate][1] = j["load_GBps"].get<double>();
      runs.push_back(std::move(j));
    } else {
      fmt::print("\n");
    }
  }
  if (json) {
    nlohmann::json cost = {
        {"store_isolated_vs_shared", rate[0][0] > 0 ? rate[1][0] / rate[0][0] : 0},
        {"load_isolated_vs_shared", rate[0][1] > 0 ? rate[1][1] / rate[0][1] : 0}};
    fmt::print("{}\n", nlohmann::json{{"runs", runs}, {"isolation_cost", cost}}.dump(2));
  }
  return 0;
}

// Steady state: one run per write policy.
int RunPerWritePolicy(ServerBenchOptions a, const std::vector<WritePolicy>& policies, bool json) {
  nlohmann::json runs = nlohmann::json::array();
  for (WritePolicy p : policies) {
    if (!json) fmt::print("== write policy {} ==\n", WritePolicyName(p));
    a.write_policy = p;
    nlohmann::json j;
    if (int rc = RunOnce(a, json, &j); rc != 0) return rc;
    runs.push_back(std::move(j));
    if (!json) fmt::print("\n");
  }
  if (json) fmt::print("{}\n", nlohmann::json{{"runs", runs}}.dump(2));
  return 0;
}

int RunBenchServer(BenchServerArgs args) {
  ServerBenchOptions& a = args.options;
  a.warmup = args.warmup >= 0 ? args.warmup : a.l2_dir.empty() ? 0 : 2;
  auto usage_error = [](const std::string& msg) {
    fmt::print(stderr, "kvtier bench server: error: {}\n", msg);
    return 2;
  };
  if (Status s = benchmarks::ValidateServerBenchOptions(a); !s.ok()) {
    return usage_error(s.message());
  }
  if (a.l2_dir.empty() && !args.write_policies.empty()) {
    return usage_error("--write-policy needs --l2 DIR");
  }
  // No per-client connect lines from the server started here in the report.
  if (a.socket.empty()) spdlog::set_level(spdlog::level::warn);
  if (a.l2_dir.empty()) {
    if (a.isolate_clients) return RunIsolationPair(a, args.json);
    nlohmann::json j;
    int rc = RunOnce(a, args.json, &j);
    if (rc == 0 && args.json) fmt::print("{}\n", j.dump(2));
    return rc;
  }
  std::vector<WritePolicy> policies;
  if (args.write_policies.empty()) args.write_policies = {"write_back", "write_through", "none"};
  for (const auto& name : args.write_policies) {
    auto p = ParseWritePolicy(name);
    if (!p.ok()) return usage_error(fmt::format("--write-policy: {}", p.status().message()));
    policies.push_back(*p);
  }
  return RunPerWritePolicy(a, policies, args.json);
}

void AddBenchServer(CLI::App& parent, CommandContext& ctx) {
  auto args = std::make_shared<BenchServerArgs>();
  CLI::App* cmd = parent.add_subcommand(
      "server",
      "N client processes doing lookups, stores and loads through a server's shared pool: "
      "control round-trip latency per operation next to the bare Unix-socket round trip, and "
      "pool throughput next to memcpy, both limits measured by the same processes");
  cmd->add_option("--socket", args->options.socket,
                  "Socket of a running `kvtier serve` (default: start an L1-only server in this "
                  "process)");
  cmd->add_option("--clients", args->options.clients, "Client processes")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  cmd->add_option("--chunk-mib", args->options.chunk_mib,
                  "Chunk size in MiB of the server started here (a running server's own chunk "
                  "size is used with --socket)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  cmd->add_option("--chunks", args->options.chunks, "Chunks per client and pass")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cmd->add_option("--repeats", args->options.repeats, "Passes; the median is reported")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  cmd->add_option("--rpc-rounds", args->options.rpc_rounds,
                  "Lookup rounds per client in the rpc phase")
      ->check(CLI::Range(1, 10000000))
      ->capture_default_str();
  cmd->add_option("--rpc-interval-us", args->options.rpc_interval_us,
                  "Each client starts one round (lookup, and every other round a pin/unpin) this "
                  "often in the paced rpc phase (0: back to back)")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  cmd->add_option("--token", args->options.token, "The server's token, if it has one");
  cmd->add_option("--l2", args->options.l2_dir,
                  "Steady state: give the server started here a file tier in this directory (a "
                  "real filesystem with O_DIRECT; a subdirectory is created and removed) and an "
                  "L1 pool of two passes' worth of chunks, so that after the warm-up every store "
                  "evicts; the tier's write rate is reported beside plain O_DIRECT writes");
  cmd->add_option("--write-policy", args->write_policies,
                  "With --l2: write_back, write_through or none; repeat for several (default: "
                  "all three, one run each)");
  cmd->add_option("--warmup", args->warmup,
                  "Unmeasured passes before the measured ones (default: 2 with --l2, else 0)")
      ->check(CLI::Range(0, 1000));
  cmd->add_flag("--isolate-clients", args->options.isolate_clients,
                "Run twice, with the shared pool and with isolated clients (kvtier serve "
                "--isolate-clients: private windows, server-side copies), to measure what "
                "isolation costs");
  cmd->add_flag("--json", args->json, "Print one JSON object");
  cmd->callback([args, &ctx] { ctx.exit_code = RunBenchServer(*args); });
}

const bool kRegistered = RegisterCommand("bench", &AddBenchServer);

}  // namespace
}  // namespace kvtier::tools

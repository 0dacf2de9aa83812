// kvtier bench server: N client processes doing lookups, stores and loads through a server's
// shared pool. Reports control round-trip latency (p50/p99) and data throughput through the pool,
// next to a plain memcpy by the same N processes measured in the same run.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "kvtier/client.h"
#include "server/server.h"
#include "testing/temp_dir.h"
#include "tools/command.h"

namespace kvtier::tools {
namespace {

using Clock = std::chrono::steady_clock;

struct BenchServerArgs {
  std::string socket;
  int clients = 4;
  uint64_t chunk_mib = 4;
  uint32_t chunks = 16;      // per client and pass
  int repeats = 5;
  int rpc_rounds = 2000;     // per client
  int rpc_interval_us = 200; // pacing of each client's round trips in the paced rpc phase
  std::string token;
  bool json = false;
};

double Now() { return std::chrono::duration<double>(Clock::now().time_since_epoch()).count(); }

bool WriteAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = write(fd, c, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    ssize_t r = read(fd, c, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// One measured phase of one client: when it ran and how many bytes it moved.
struct PhaseTime {
  double start = 0, end = 0;
  uint64_t bytes = 0;
};

enum Phase { kMemcpy = 0, kStore = 1, kLoad = 2 };

std::vector<ChunkKey> ClientKeys(int client, int generation, uint32_t n) {
  KeyNamespace ns;
  ns.model_id = "kvtier-bench-server";
  ns.chunk_tokens = 1;
  std::vector<uint32_t> tokens(n);
  std::iota(tokens.begin(), tokens.end(), static_cast<uint32_t>((client * 1000 + generation) << 12));
  return *ComputeChunkKeys(ns, tokens);
}

// The work of one client process. Talks to the parent through `to_parent` (ready marks and, at
// the end, the results) and `from_parent` (go marks).
int RunClient(const BenchServerArgs& a, const std::string& socket, uint64_t chunk_bytes, int me,
              int to_parent, int from_parent) {
  auto barrier = [&] {
    char c = 'r';
    return WriteAll(to_parent, &c, 1) && ReadAll(from_parent, &c, 1);
  };
  char c;
  if (!ReadAll(from_parent, &c, 1)) return 10;  // the server is up
  ClientOptions o;
  o.socket_path = socket;
  o.ns.model_id = "kvtier-bench-server";
  o.ns.chunk_tokens = 1;
  o.chunk_bytes = chunk_bytes;
  o.token = a.token;
  o.client_name = fmt::format("bench-{}", me);
  o.copy_threads = 0;
  auto client = Client::Connect(o);
  if (!client.ok()) {
    fmt::print(stderr, "client {}: {}\n", me, client.status().ToString());
    return 11;
  }
  Client& cl = **client;
  chunk_bytes = cl.chunk_bytes();
  // Two generations of every client's chunks must fit in the pool (a running server's pool may
  // be small for its chunk size).
  const uint32_t n = std::max<uint32_t>(
      1, std::min<uint32_t>(a.chunks, cl.num_slots() / (2 * static_cast<uint32_t>(a.clients))));
  std::vector<uint8_t> src(n * chunk_bytes), dst(n * chunk_bytes);
  for (size_t i = 0; i < src.size(); i += 4096) src[i] = static_cast<uint8_t>(i >> 12);
  std::memset(dst.data(), 0, dst.size());  // pre-fault

  auto store = [&](const std::vector<ChunkKey>& keys) -> uint64_t {
    auto slots = cl.ReserveSlots(keys);
    if (!slots.ok()) return 0;
    uint64_t bytes = 0;
    for (size_t i = 0; i < slots->size(); ++i) {
      if ((*slots)[i] == kNoSlot) continue;
      std::memcpy(cl.SlotData((*slots)[i]).data(), src.data() + i * chunk_bytes, chunk_bytes);
      bytes += chunk_bytes;
    }
    return cl.CommitSlots(keys, *slots).ok() ? bytes : 0;
  };
  auto load = [&](const std::vector<ChunkKey>& keys) -> uint64_t {
    auto op = cl.PrepareLoad(keys);
    if (!op.ok()) return 0;
    OpResult r = op->Wait();
    for (size_t i = 0; i < r.slots.size(); ++i) {
      std::memcpy(dst.data() + i * chunk_bytes, cl.SlotData(r.slots[i]).data(), chunk_bytes);
    }
    return cl.Unpin(r.slots).ok() ? r.slots.size() * chunk_bytes : 0;
  };

  // Warm-up: this client's chunks are resident for the rpc phase.
  auto warm = ClientKeys(me, 0, n);
  if (store(warm) == 0 && cl.Lookup(warm).total != n) return 12;

  // Control round trips, all clients at once: lookups of the whole prefix, and pin/unpin of one
  // chunk (prepare_load + release), each timed alone. Two phases: paced (each client starts rounds at
  // random times, rpc_interval_us apart on average, as inference processes do between scheduler steps) and
  // saturated (back to back: the machine's CPUs are the bottleneck).
  std::vector<float> rpc_us[2];
  std::span<const ChunkKey> one(warm.data(), 1);
  for (int phase = 0; phase < 2; ++phase) {
    const bool paced = phase == 0 && a.rpc_interval_us > 0;
    std::vector<float>& out = rpc_us[phase];
    out.reserve(a.rpc_rounds * 2);
    if (!barrier()) return 13;
    // Poisson arrivals with a per-client seed, so clients do not fire in lockstep.
    std::mt19937_64 rng(1234 + me);
    std::exponential_distribution<double> gap(1.0 / std::max(1, a.rpc_interval_us));
    auto next = Clock::now();
    for (int i = 0; i < a.rpc_rounds; ++i) {
      if (paced) {
        next += std::chrono::microseconds(static_cast<int64_t>(gap(rng)));
        std::this_thread::sleep_until(next);
      }
      auto t0 = Clock::now();
      auto l = cl.TryLookup(warm);
      auto t1 = Clock::now();
      if (!l.ok()) return 14;
      out.push_back(std::chrono::duration<float, std::micro>(t1 - t0).count());
      if (i % 2 == 0) {
        auto op = cl.PrepareLoad(one);
        if (!op.ok()) return 15;
        OpResult r = op->Wait();
        auto t2 = Clock::now();
        Status u = cl.Unpin(r.slots);
        auto t3 = Clock::now();
        if (!u.ok()) return 16;
        out.push_back(std::chrono::duration<float, std::micro>(t2 - t1).count());
        out.push_back(std::chrono::duration<float, std::micro>(t3 - t2).count());
      }
    }
  }

  // Data passes: memcpy (the limit), store into the pool, load another client's chunks.
  std::vector<PhaseTime> times;
  for (int rep = 0; rep < a.repeats; ++rep) {
    PhaseTime t;
    if (!barrier()) return 17;
    t.start = Now();
    for (uint32_t i = 0; i < n; ++i) {
      std::memcpy(dst.data() + i * chunk_bytes, src.data() + i * chunk_bytes, chunk_bytes);
    }
    t.end = Now();
    t.bytes = n * chunk_bytes;
    times.push_back(t);

    auto mine = ClientKeys(me, rep + 1, n);
    if (!barrier()) return 18;
    t.start = Now();
    t.bytes = store(mine);
    t.end = Now();
    times.push_back(t);

    auto theirs = ClientKeys((me + 1) % a.clients, rep + 1, n);
    if (!barrier()) return 19;
    t.start = Now();
    t.bytes = load(theirs);
    t.end = Now();
    times.push_back(t);
  }
  uint32_t phases = static_cast<uint32_t>(times.size());
  if (!WriteAll(to_parent, &phases, 4) ||
      !WriteAll(to_parent, times.data(), phases * sizeof(PhaseTime))) {
    return 20;
  }
  for (auto& v : rpc_us) {
    uint32_t count = static_cast<uint32_t>(v.size());
    if (!WriteAll(to_parent, &count, 4) || !WriteAll(to_parent, v.data(), count * sizeof(float))) {
      return 20;
    }
  }
  return 0;
}

double Percentile(std::vector<float>& v, double p) {
  if (v.empty()) return 0;
  size_t k = std::min(v.size() - 1, static_cast<size_t>(p * v.size()));
  std::nth_element(v.begin(), v.begin() + k, v.end());
  return v[k];
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int RunBenchServer(const BenchServerArgs& a) {
  const uint64_t chunk_bytes_wanted = a.chunk_mib << 20;
  struct Child {
    pid_t pid;
    int to_child, from_child;
  };
  std::vector<Child> kids;
  // Children are forked before this process starts any thread (the in-process server's).
  for (int i = 0; i < a.clients; ++i) {
    int down[2], up[2];
    if (pipe(down) != 0 || pipe(up) != 0) {
      fmt::print(stderr, "kvtier bench server: error: pipe: {}\n", std::strerror(errno));
      return 1;
    }
    pid_t pid = fork();
    if (pid == 0) {
      close(down[1]);
      close(up[0]);
      for (auto& k : kids) {
        close(k.to_child);
        close(k.from_child);
      }
      std::string socket = a.socket;
      if (socket.empty()) {
        // Read the path of the in-process server from the parent.
        uint32_t len = 0;
        if (!ReadAll(down[0], &len, 4) || len > 4096) _exit(21);
        socket.resize(len);
        if (!ReadAll(down[0], socket.data(), len)) _exit(21);
      }
      _exit(RunClient(a, socket, a.socket.empty() ? chunk_bytes_wanted : 0, i, up[1], down[0]));
    }
    close(down[0]);
    close(up[1]);
    kids.push_back({pid, down[1], up[0]});
  }
  auto fail = [&](const std::string& msg) {
    for (auto& k : kids) kill(k.pid, SIGKILL);
    for (auto& k : kids) waitpid(k.pid, nullptr, 0);
    fmt::print(stderr, "kvtier bench server: error: {}\n", msg);
    return 1;
  };

  std::optional<testing::TempDir> dir;
  std::unique_ptr<server::Server> srv;
  std::string where = a.socket;
  if (a.socket.empty()) {
    dir.emplace("kvtier-bench-server");
    spdlog::set_level(spdlog::level::warn);  // no per-client connect lines in the report
    server::ServerOptions o;
    o.socket_path = dir->Sub("kvtier.sock");
    o.http_port = -1;
    o.engine.chunk_bytes = chunk_bytes_wanted;
    // Two generations of every client's chunks, so loads find the chunks just stored.
    o.engine.memory.capacity_bytes = 2ull * a.clients * a.chunks * chunk_bytes_wanted;
    auto started = server::Server::Start(o);
    if (!started.ok()) return fail(started.status().ToString());
    srv = std::move(started).value();
    where = "in-process server (L1 only)";
    for (auto& k : kids) {
      uint32_t len = static_cast<uint32_t>(o.socket_path.size());
      WriteAll(k.to_child, &len, 4);
      WriteAll(k.to_child, o.socket_path.data(), len);
    }
  }
  char go = 'g';
  for (auto& k : kids) WriteAll(k.to_child, &go, 1);
  // Barriers: two rpc phases, then memcpy/store/load per repeat.
  const int barriers = 2 + 3 * a.repeats;
  for (int b = 0; b < barriers; ++b) {
    for (auto& k : kids) {
      char c;
      if (!ReadAll(k.from_child, &c, 1)) {
        int status = 0;
        waitpid(k.pid, &status, 0);
        return fail(fmt::format("client process {} failed (exit status {})", k.pid,
                                WIFEXITED(status) ? WEXITSTATUS(status) : -1));
      }
    }
    for (auto& k : kids) WriteAll(k.to_child, &go, 1);
  }
  std::vector<std::vector<PhaseTime>> times(a.clients);
  std::vector<float> rpc[2];
  for (int i = 0; i < a.clients; ++i) {
    uint32_t phases = 0;
    if (!ReadAll(kids[i].from_child, &phases, 4) || phases != 3u * a.repeats) {
      return fail("a client process did not report its results");
    }
    times[i].resize(phases);
    if (!ReadAll(kids[i].from_child, times[i].data(), phases * sizeof(PhaseTime))) {
      return fail("a client process did not report its results");
    }
    for (auto& all : rpc) {
      uint32_t count = 0;
      std::vector<float> lat;
      if (!ReadAll(kids[i].from_child, &count, 4) || count > (1u << 28)) {
        return fail("a client process did not report its results");
      }
      lat.resize(count);
      if (!ReadAll(kids[i].from_child, lat.data(), count * sizeof(float))) {
        return fail("a client process did not report its results");
      }
      all.insert(all.end(), lat.begin(), lat.end());
    }
  }
  for (auto& k : kids) {
    int status = 0;
    waitpid(k.pid, &status, 0);
    close(k.to_child);
    close(k.from_child);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      fmt::print(stderr, "kvtier bench server: error: client process exited with {}\n", status);
      return 1;
    }
  }
  // Throughput of a phase = bytes moved by all clients / (last end - first start); median of
  // the repeats.
  auto gbps = [&](Phase p) {
    std::vector<double> v;
    for (int rep = 0; rep < a.repeats; ++rep) {
      double s = 1e300, e = 0;
      uint64_t bytes = 0;
      for (int i = 0; i < a.clients; ++i) {
        const PhaseTime& t = times[i][rep * 3 + p];
        s = std::min(s, t.start);
        e = std::max(e, t.end);
        bytes += t.bytes;
      }
      v.push_back(bytes / (e - s) / 1e9);
    }
    return Median(v);
  };
  const double mem = gbps(kMemcpy), st = gbps(kStore), ld = gbps(kLoad);
  const size_t rpc_count = rpc[0].size();
  const double p50 = Percentile(rpc[0], 0.50), p99 = Percentile(rpc[0], 0.99),
               p999 = Percentile(rpc[0], 0.999);
  const double sat_p50 = Percentile(rpc[1], 0.50), sat_p99 = Percentile(rpc[1], 0.99);
  uint64_t chunk_bytes = srv ? srv->engine().options().chunk_bytes : 0;
  if (srv) srv->Stop();
  if (a.json) {
    nlohmann::json j = {{"server", where},
                        {"clients", a.clients},
                        {"chunks_per_client", a.chunks},
                        {"repeats", a.repeats},
                        {"rpc_count", rpc_count},
                        {"rpc_p50_us", p50},
                        {"rpc_p99_us", p99},
                        {"rpc_p999_us", p999},
                        {"rpc_interval_us", a.rpc_interval_us},
                        {"rpc_saturated_p50_us", sat_p50},
                        {"rpc_saturated_p99_us", sat_p99},
                        {"store_GBps", st},
                        {"load_GBps", ld},
                        {"memcpy_GBps", mem},
                        {"store_vs_memcpy", st / mem},
                        {"load_vs_memcpy", ld / mem}};
    if (chunk_bytes) j["chunk_bytes"] = chunk_bytes;
    fmt::print("{}\n", j.dump(2));
  } else {
    fmt::print("server: {}; {} client processes, {} chunks each per pass\n", where, a.clients,
               a.chunks);
    fmt::print("{:<34} {:>8.1f} us  p99 {:.1f} us  p99.9 {:.1f} us  ({} round trips, one per "
               "client every {} us)\n",
               "rpc (lookup, prepare_load, release)", p50, p99, p999, rpc_count,
               a.rpc_interval_us);
    fmt::print("{:<34} {:>8.1f} us  p99 {:.1f} us  (clients back to back)\n", "rpc, saturated",
               sat_p50, sat_p99);
    fmt::print("{:<34} {:>8.2f} GB/s (limit)\n", "memcpy, same processes", mem);
    fmt::print("{:<34} {:>8.2f} GB/s  {:.2f} x memcpy\n", "store into the shared pool", st,
               st / mem);
    fmt::print("{:<34} {:>8.2f} GB/s  {:.2f} x memcpy\n", "load from the shared pool", ld,
               ld / mem);
  }
  return 0;
}

void AddBenchServer(CLI::App& parent, CommandContext& ctx) {
  auto args = std::make_shared<BenchServerArgs>();
  CLI::App* cmd = parent.add_subcommand(
      "server",
      "N client processes doing lookups, stores and loads through a server's shared pool: "
      "control round-trip latency and pool throughput next to memcpy by the same processes");
  cmd->add_option("--socket", args->socket,
                  "Socket of a running `kvtier serve` (default: start an L1-only server in this "
                  "process)");
  cmd->add_option("--clients", args->clients, "Client processes")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  cmd->add_option("--chunk-mib", args->chunk_mib,
                  "Chunk size in MiB of the server started here (a running server's own chunk "
                  "size is used with --socket)")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  cmd->add_option("--chunks", args->chunks, "Chunks per client and pass")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cmd->add_option("--repeats", args->repeats, "Passes; the median is reported")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  cmd->add_option("--rpc-rounds", args->rpc_rounds, "Lookup rounds per client in the rpc phase")
      ->check(CLI::Range(1, 10000000))
      ->capture_default_str();
  cmd->add_option("--rpc-interval-us", args->rpc_interval_us,
                  "Each client starts one round (lookup, and every other round a pin/unpin) this "
                  "often in the paced rpc phase (0: back to back)")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  cmd->add_option("--token", args->token, "The server's token, if it has one");
  cmd->add_flag("--json", args->json, "Print one JSON object");
  cmd->callback([args, &ctx] { ctx.exit_code = RunBenchServer(*args); });
}

const bool kRegistered = RegisterCommand("bench", &AddBenchServer);

}  // namespace
}  // namespace kvtier::tools

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
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <thread>

#include "kvtier/client.h"
#include "kvtier/io.h"
#include "server/codec.h"
#include "server/server.h"
#include "testing/temp_dir.h"
#include "tools/bench_timing.h"
#include "tools/command.h"
#include "tools/raw_io.h"

namespace kvtier::tools {
namespace {

using Clock = std::chrono::steady_clock;

struct BenchServerArgs {
  std::string socket;
  int clients = 4;
  uint64_t chunk_mib = 4;
  uint32_t chunks = 16;  // per client and pass
  int repeats = 5;
  int rpc_rounds = 2000;      // per client
  int rpc_interval_us = 200;  // pacing of each client's round trips in the paced rpc phase
  std::string token;
  bool json = false;
  std::string l2_dir;                       // steady state: the in-process server's file tier
  std::vector<std::string> write_policies;  // with l2_dir; empty: all three
  int warmup = -1;                          // unmeasured passes; -1: 2 with l2_dir, else 0
  bool isolate_clients = false;  // also run the in-process server with private client windows
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
  uint64_t refused = 0;  // chunks the pool had no slot for (stores) or did not have (loads)
};

enum Phase { kMemcpy = 0, kStore = 1, kLoad = 2 };

// The timed control round trips. The floor is the bare Unix-socket round trip: a message of a
// lookup request's size to an echo thread and back, in rounds shaped like kvtier's (one trip,
// and every other round two more right after it), so that both offer the machine the same load.
// kFloor is a round's first trip, timed like a lookup; kFloorFollow the trips that follow it,
// timed like prepare_load and release. kSendLate is not a round trip: how late each paced lookup
// went out after its scheduled time (the client's wake-up, or a backlog).
enum RpcOp {
  kFloor = 0,
  kFloorFollow = 1,
  kLookup = 2,
  kPrepareLoad = 3,
  kRelease = 4,
  kSendLate = 5,
  kRpcOps = 6
};
constexpr const char* kRpcOpNames[kRpcOps] = {"floor",        "floor_followup", "lookup",
                                              "prepare_load", "release",        "send_late"};
// The floor each kvtier operation is compared with.
constexpr RpcOp FloorOf(int op) { return op == kLookup ? kFloor : kFloorFollow; }
// Two modes: paced (Poisson arrivals) and saturated (back to back).
constexpr int kRpcModes = 2;

// Connects to a Unix socket; -1 on failure.
int ConnectUnix(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) return -1;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// The floor's server: a listening Unix socket and one thread per connection echoing fixed-size
// messages back, blocking in read() between them as the real server's threads wait for requests.
class EchoServer {
 public:
  ~EchoServer() { Stop(); }

  Status Start(const std::string& path, size_t message_bytes) {
    path_ = path;
    message_bytes_ = message_bytes;
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (path.size() >= sizeof(addr.sun_path)) {
      return Status::InvalidArgument("socket path too long");
    }
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    listen_fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listen_fd_ < 0) return Status::FromErrno(errno, "socket");
    if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        listen(listen_fd_, 256) != 0) {
      return Status::FromErrno(errno, fmt::format("listen on {}", path));
    }
    acceptor_ = std::thread([this] {
      for (;;) {
        int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0) {
          if (errno == EINTR) continue;
          return;  // shut down
        }
        std::lock_guard<std::mutex> lock(mu_);
        conns_.push_back(fd);
        echoers_.emplace_back([this, fd] {
          std::vector<char> buf(message_bytes_);
          while (ReadAll(fd, buf.data(), buf.size()) && WriteAll(fd, buf.data(), buf.size())) {
          }
        });
      }
    });
    return Status::Ok();
  }

  void Stop() {
    if (listen_fd_ < 0) return;
    shutdown(listen_fd_, SHUT_RDWR);
    if (acceptor_.joinable()) acceptor_.join();
    close(listen_fd_);
    listen_fd_ = -1;
    std::lock_guard<std::mutex> lock(mu_);
    for (int fd : conns_) shutdown(fd, SHUT_RDWR);
    for (auto& t : echoers_) t.join();
    for (int fd : conns_) close(fd);
    unlink(path_.c_str());
  }

 private:
  std::string path_;
  size_t message_bytes_ = 0;
  int listen_fd_ = -1;
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<int> conns_;
  std::vector<std::thread> echoers_;
};

// Bytes of a 16-key lookup request, the floor's message size.
size_t FloorMessageBytes() {
  std::vector<ChunkKey> keys(16);
  return server::EncodeKeysRequest(server::Opcode::kLookup, 1, keys).size();
}

std::vector<ChunkKey> ClientKeys(int client, int generation, uint32_t n) {
  KeyNamespace ns;
  ns.model_id = "kvtier-bench-server";
  ns.chunk_tokens = 1;
  std::vector<uint32_t> tokens(n);
  std::iota(tokens.begin(), tokens.end(),
            static_cast<uint32_t>((client * 1000 + generation) << 12));
  return *ComputeChunkKeys(ns, tokens);
}

// The work of one client process. Talks to the parent through `to_parent` (ready marks and, at
// the end, the results) and `from_parent` (go marks).
int RunClient(const BenchServerArgs& a, const std::string& socket, const std::string& floor_socket,
              uint64_t chunk_bytes, int me, int to_parent, int from_parent) {
  auto barrier = [&] {
    char c = 'r';
    return WriteAll(to_parent, &c, 1) && ReadAll(from_parent, &c, 1);
  };
  char c;
  if (!ReadAll(from_parent, &c, 1)) return 10;  // the server is up
  // Paced rounds are timed from their scheduled send time, so this process's own oversleeping
  // counts against every round trip (the floor's and kvtier's alike). The default timer slack
  // (50 us) would add up to that much to each; 1 ns keeps the wake-ups as punctual as the
  // kernel can make them.
  prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
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

  // Each returns the bytes moved; `refused` counts the chunks that were not.
  uint64_t refused = 0;
  auto store = [&](const std::vector<ChunkKey>& keys) -> uint64_t {
    auto slots = cl.ReserveSlots(keys);
    if (!slots.ok()) return 0;
    refused += keys.size() - slots->size();
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
    refused += keys.size() - r.slots.size();
    for (size_t i = 0; i < r.slots.size(); ++i) {
      std::memcpy(dst.data() + i * chunk_bytes, cl.SlotData(r.slots[i]).data(), chunk_bytes);
    }
    return cl.Unpin(r.slots).ok() ? r.slots.size() * chunk_bytes : 0;
  };

  // Warm-up: this client's chunks are resident for the rpc phase.
  auto warm = ClientKeys(me, 0, n);
  if (store(warm) == 0 && cl.Lookup(warm).total != n) return 12;

  // Control round trips, all clients at once: lookups of the whole prefix, and pin/unpin of one
  // chunk (prepare_load + release), each timed alone; and, as the floor, bare round trips of a
  // message of a lookup request's size to an echo thread. Two modes: paced (each client starts
  // rounds at Poisson-random times, rpc_interval_us apart on average, as inference processes do
  // between scheduler steps) and saturated (back to back: the machine's CPUs are the
  // bottleneck). In each mode the floor runs first, then kvtier, on the same schedule.
  // Paced latencies are timed from the round's scheduled send time (bench_timing.h): a late
  // wake-up, or a round still waiting for the one before, counts. prepare_load and release follow
  // the lookup in the same round and are timed from when the operation before them returned.
  std::vector<float> rpc_us[kRpcModes][kRpcOps];
  std::span<const ChunkKey> one(warm.data(), 1);
  const int floor_fd = ConnectUnix(floor_socket);
  if (floor_fd < 0) return 22;
  std::vector<char> floor_msg(FloorMessageBytes(), 'f');
  auto sleep_until = [](Clock::time_point t) { std::this_thread::sleep_until(t); };
  auto now = [] { return Clock::now(); };
  for (int mode = 0; mode < kRpcModes; ++mode) {
    const bool paced = mode == 0 && a.rpc_interval_us > 0;
    for (int part = 0; part < 2; ++part) {
      const bool floor = part == 0;
      if (!barrier()) return 13;
      // Poisson arrivals with a per-client seed, so clients do not fire in lockstep; the same
      // seed for the floor and for kvtier, so both see the same schedule.
      PacedSchedule<Clock> schedule(Clock::now(), std::max(1, a.rpc_interval_us), 1234 + me);
      for (int i = 0; i < a.rpc_rounds; ++i) {
        const Clock::time_point scheduled = paced ? schedule.Next() : Clock::now();
        if (floor) {
          auto trip = [&] {
            return WriteAll(floor_fd, floor_msg.data(), floor_msg.size()) &&
                   ReadAll(floor_fd, floor_msg.data(), floor_msg.size());
          };
          bool ok = false;
          rpc_us[mode][kFloor].push_back(
              TimeFromSchedule(scheduled, sleep_until, now, [&] { ok = trip(); }));
          if (!ok) return 23;
          for (int k = 0; k < (i % 2 == 0 ? 2 : 0); ++k) {
            auto t = Clock::now();
            if (!trip()) return 23;
            rpc_us[mode][kFloorFollow].push_back(MicrosBetween(t, Clock::now()));
          }
          continue;
        }
        bool ok = false;
        Clock::time_point sent;
        rpc_us[mode][kLookup].push_back(TimeFromSchedule(scheduled, sleep_until, now, [&] {
          sent = Clock::now();
          ok = cl.TryLookup(warm).ok();
        }));
        if (!ok) return 14;
        rpc_us[mode][kSendLate].push_back(MicrosBetween(scheduled, sent));
        if (i % 2 == 0) {
          auto t1 = Clock::now();
          auto op = cl.PrepareLoad(one);
          if (!op.ok()) return 15;
          OpResult r = op->Wait();
          auto t2 = Clock::now();
          Status u = cl.Unpin(r.slots);
          auto t3 = Clock::now();
          if (!u.ok()) return 16;
          rpc_us[mode][kPrepareLoad].push_back(MicrosBetween(t1, t2));
          rpc_us[mode][kRelease].push_back(MicrosBetween(t2, t3));
        }
      }
    }
  }
  close(floor_fd);

  // Data passes: memcpy (the limit), store into the pool, load another client's chunks. Each
  // pass stores new chunks, so once the pool is full every store evicts.
  std::vector<PhaseTime> times;
  for (int rep = 0; rep < a.warmup + a.repeats; ++rep) {
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
    refused = 0;
    t.start = Now();
    t.bytes = store(mine);
    t.end = Now();
    t.refused = refused;
    times.push_back(t);

    auto theirs = ClientKeys((me + 1) % a.clients, rep + 1, n);
    if (!barrier()) return 19;
    refused = 0;
    t.start = Now();
    t.bytes = load(theirs);
    t.end = Now();
    t.refused = refused;
    times.push_back(t);
  }
  uint32_t phases = static_cast<uint32_t>(times.size());
  if (!WriteAll(to_parent, &phases, 4) ||
      !WriteAll(to_parent, times.data(), phases * sizeof(PhaseTime))) {
    return 20;
  }
  for (auto& mode : rpc_us) {
    for (auto& v : mode) {
      uint32_t count = static_cast<uint32_t>(v.size());
      if (!WriteAll(to_parent, &count, 4) ||
          !WriteAll(to_parent, v.data(), count * sizeof(float))) {
        return 20;
      }
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

// What a steady-state run adds: the file tier's side of the measured passes.
struct SteadyState {
  WritePolicy policy = WritePolicy::kWriteBack;
  EngineStats before, after;
  double seconds = 0;  // wall time of the measured passes
};

// The file tier's side of a steady-state run, and plain O_DIRECT writes of as many bytes (at
// least 16 chunks, at most 4 GiB) in chunk files to the same directory by as many threads as
// the tier writes with: what the disk takes from a writer with no cache in front of it.
Result<nlohmann::json> MeasureSteadyState(const BenchServerArgs& a, const SteadyState& st,
                                          uint64_t chunk_bytes, int threads) {
  const FileTierStats &f0 = st.before.file_detail, &f1 = st.after.file_detail;
  const uint64_t l2_bytes = f1.bytes_written - f0.bytes_written;
  const uint64_t buf_bytes = (chunk_bytes + 4095) / 4096 * 4096;
  const uint64_t files = std::clamp<uint64_t>(l2_bytes / chunk_bytes, 16, (4ull << 30) / buf_bytes);
  threads = std::max(1, threads);
  const std::string raw_dir = fmt::format("{}/kvtier-bench-raw-{}", a.l2_dir, getpid());
  Env& env = *Env::Default();
  if (Status s = env.CreateDirs(raw_dir); !s.ok()) {
    return s.WithContext(fmt::format("cannot create {}", raw_dir));
  }
  struct Cleanup {
    Env& env;
    std::string dir;
    ~Cleanup() { (void)RemoveTree(env, dir); }
  } cleanup{env, raw_dir};
  std::vector<AlignedBuffer> bufs;  // one per thread, filled before the clock starts
  for (int t = 0; t < threads; ++t) {
    bufs.emplace_back(buf_bytes);
    std::memset(bufs.back().data(), 0x5a, buf_bytes);
  }
  std::vector<Status> failed(threads);  // a thread stops writing at its first failure
  const double raw_s = Parallel(threads, static_cast<uint32_t>(files), [&](int t, uint32_t i) {
    if (failed[t].ok()) failed[t] = RawWrite(fmt::format("{}/{}", raw_dir, i), bufs[t].span());
  });
  for (const Status& s : failed) {
    if (!s.ok()) return s.WithContext("plain O_DIRECT writes (the reference)");
  }
  const double l2_gbps = st.seconds > 0 ? l2_bytes / st.seconds / 1e9 : 0;
  const double raw_gbps = files * buf_bytes / raw_s / 1e9;
  const EngineStats &e0 = st.before, &e1 = st.after;
  return nlohmann::json{
      {"write_policy", WritePolicyName(st.policy)},
      {"measured_seconds", st.seconds},
      {"l1_evictions", e1.memory_detail.evictions - e0.memory_detail.evictions},
      {"l2_bytes_written", l2_bytes},
      {"l2_write_GBps", l2_gbps},
      {"raw_o_direct_write_GBps", raw_gbps},
      {"raw_o_direct_write_threads", threads},
      {"raw_o_direct_bytes", files * buf_bytes},
      {"l2_write_vs_raw", raw_gbps > 0 ? l2_gbps / raw_gbps : 0},
      {"write_backs", e1.write_backs - e0.write_backs},
      {"dirty_evictions", e1.dirty_evictions - e0.dirty_evictions},
      {"dirty_refusals", e1.memory_detail.dirty_refusals - e0.memory_detail.dirty_refusals},
      {"write_through_deferred", e1.write_through_deferred - e0.write_through_deferred},
      {"write_through_dropped", e1.write_through_dropped - e0.write_through_dropped},
      {"l2_errors", f1.errors - f0.errors}};
}

void PrintSteadyState(const nlohmann::json& j) {
  fmt::print("{:<38} {:>8.2f} GB/s  {:.2f} x plain O_DIRECT writes ({:.2f} GB/s, {} threads)\n",
             "file tier writes (measured passes)", j["l2_write_GBps"].get<double>(),
             j["l2_write_vs_raw"].get<double>(), j["raw_o_direct_write_GBps"].get<double>(),
             j["raw_o_direct_write_threads"].get<int>());
  fmt::print(
      "  L1 evictions {}, written back by the flusher {}, lost before reaching L2 {}, stores "
      "refused while L2 caught up {}, write-through deferred {} / dropped {}, L2 errors {}\n",
      j["l1_evictions"].get<uint64_t>(), j["write_backs"].get<uint64_t>(),
      j["dirty_evictions"].get<uint64_t>(), j["dirty_refusals"].get<uint64_t>(),
      j["write_through_deferred"].get<uint64_t>(),
      j["write_through_dropped"].get<uint64_t>(), j["l2_errors"].get<uint64_t>());
}

int RunOnce(const BenchServerArgs& a, std::optional<WritePolicy> policy, bool isolate,
            nlohmann::json* out) {
  const uint64_t chunk_bytes_wanted = a.chunk_mib << 20;
  const int passes = a.warmup + a.repeats;
  // The file tier of a steady-state run, removed after it.
  const std::string l2_root = fmt::format("{}/kvtier-bench-server-{}", a.l2_dir, getpid());
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
      auto read_path = [&](std::string& path) {
        uint32_t len = 0;
        if (!ReadAll(down[0], &len, 4) || len > 4096) return false;
        path.resize(len);
        return ReadAll(down[0], path.data(), len);
      };
      // The parent sends the floor's socket, then the in-process server's if it starts one.
      std::string floor_socket, socket = a.socket;
      if (!read_path(floor_socket)) _exit(21);
      if (socket.empty() && !read_path(socket)) _exit(21);
      _exit(RunClient(a, socket, floor_socket, a.socket.empty() ? chunk_bytes_wanted : 0, i, up[1],
                      down[0]));
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

  auto send_path = [](int fd, const std::string& path) {
    uint32_t len = static_cast<uint32_t>(path.size());
    return WriteAll(fd, &len, 4) && WriteAll(fd, path.data(), len);
  };
  testing::TempDir dir("kvtier-bench-server");
  EchoServer echo;
  {
    const std::string floor_socket = dir.Sub("floor.sock");
    Status started = echo.Start(floor_socket, FloorMessageBytes());
    if (!started.ok()) return fail(started.ToString());
    for (auto& k : kids) send_path(k.to_child, floor_socket);
  }
  std::unique_ptr<server::Server> srv;
  std::string where = a.socket;
  if (a.socket.empty()) {
    spdlog::set_level(spdlog::level::warn);  // no per-client connect lines in the report
    server::ServerOptions o;
    o.socket_path = dir.Sub("kvtier.sock");
    o.http_port = -1;
    o.engine.chunk_bytes = chunk_bytes_wanted;
    // Two generations of every client's chunks, so loads find the chunks just stored.
    o.engine.memory.capacity_bytes = 2ull * a.clients * a.chunks * chunk_bytes_wanted;
    if (isolate) {
      // Windows as large as the pool, so each client moves as many chunks as with the shared
      // pool (a client sizes its passes from the slots it maps).
      o.isolate_clients = true;
      o.max_slots_per_client = 2 * a.clients * a.chunks;
    }
    if (policy) {
      FileTierOptions f;
      f.root = l2_root;
      o.engine.file = f;
      o.engine.write_policy = *policy;
    }
    auto started = server::Server::Start(o);
    if (!started.ok()) return fail(started.status().ToString());
    srv = std::move(started).value();
    where = policy ? fmt::format("in-process server, L1 + file tier on {}, {}", a.l2_dir,
                                 WritePolicyName(*policy))
                   : "in-process server (L1 only)";
    if (isolate) where += ", isolated clients (private windows, server-side copies)";
    for (auto& k : kids) send_path(k.to_child, o.socket_path);
  }
  char go = 'g';
  for (auto& k : kids) WriteAll(k.to_child, &go, 1);
  // Barriers: floor and kvtier in each rpc mode, then memcpy/store/load per pass.
  const int barriers = 2 * kRpcModes + 3 * passes;
  const int first_measured = 2 * kRpcModes + 3 * a.warmup;
  std::optional<SteadyState> steady;
  if (policy && srv) {
    steady.emplace();
    steady->policy = *policy;
  }
  Clock::time_point measured_from;
  for (int b = 0; b < barriers; ++b) {
    if (steady && b == first_measured) {
      steady->before = srv->engine().Stats();
      measured_from = Clock::now();
    }
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
  std::vector<float> rpc[kRpcModes][kRpcOps];
  for (int i = 0; i < a.clients; ++i) {
    uint32_t phases = 0;
    if (!ReadAll(kids[i].from_child, &phases, 4) || phases != 3u * passes) {
      return fail("a client process did not report its results");
    }
    times[i].resize(phases);
    if (!ReadAll(kids[i].from_child, times[i].data(), phases * sizeof(PhaseTime))) {
      return fail("a client process did not report its results");
    }
    for (auto& all : std::span(&rpc[0][0], kRpcModes * kRpcOps)) {
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
  if (steady) {
    steady->seconds = std::chrono::duration<double>(Clock::now() - measured_from).count();
    steady->after = srv->engine().Stats();
  }
  // Throughput of a phase = bytes moved by all clients / (last end - first start); median of
  // the repeats.
  auto gbps = [&](Phase p) {
    std::vector<double> v;
    for (int rep = a.warmup; rep < passes; ++rep) {
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
  // Chunks the measured passes could not store or load: a throughput over fewer bytes.
  auto refused = [&](Phase p) {
    uint64_t n = 0;
    for (int rep = a.warmup; rep < passes; ++rep) {
      for (int i = 0; i < a.clients; ++i) n += times[i][rep * 3 + p].refused;
    }
    return n;
  };
  const uint64_t store_refused = refused(kStore), load_missed = refused(kLoad);
  struct Latency {
    size_t count = 0;
    double p50 = 0, p99 = 0, p999 = 0;
  };
  Latency lat[kRpcModes][kRpcOps];
  for (int m = 0; m < kRpcModes; ++m) {
    for (int op = 0; op < kRpcOps; ++op) {
      std::vector<float>& v = rpc[m][op];
      lat[m][op] = {v.size(), Percentile(v, 0.50), Percentile(v, 0.99), Percentile(v, 0.999)};
    }
  }
  // kvtier's round trips against the bare socket round trip of the same clients in the same
  // mode: an absolute target cannot hold on every machine, the ratio can.
  constexpr double kGoalVsFloor = 1.5;
  const bool paced = a.rpc_interval_us > 0;
  double vs_floor[kRpcOps] = {}, sat_vs_floor[kRpcOps] = {};
  bool goal_met = true;
  for (int op = kLookup; op <= kRelease; ++op) {
    const double f = lat[0][FloorOf(op)].p50, sat_f = lat[1][FloorOf(op)].p50;
    vs_floor[op] = f > 0 ? lat[0][op].p50 / f : 0;
    sat_vs_floor[op] = sat_f > 0 ? lat[1][op].p50 / sat_f : 0;
    goal_met = goal_met && vs_floor[op] > 0 && vs_floor[op] <= kGoalVsFloor;
  }
  uint64_t chunk_bytes = srv ? srv->engine().options().chunk_bytes : 0;
  const int tier_write_threads =
      srv && srv->engine().options().file ? srv->engine().options().file->write_threads : 0;
  if (srv) srv->Stop();
  echo.Stop();
  nlohmann::json l2;
  if (steady) {
    (void)RemoveTree(*Env::Default(), l2_root);
    auto r = MeasureSteadyState(a, *steady, chunk_bytes, tier_write_threads);
    if (!r.ok()) {
      fmt::print(stderr, "kvtier bench server: error: {}\n", r.status().ToString());
      return 1;
    }
    l2 = *r;
  }
  if (a.json) {
    nlohmann::json j = {{"server", where},
                        {"clients", a.clients},
                        {"chunks_per_client", a.chunks},
                        {"repeats", a.repeats},
                        {"rpc_rounds_per_client", a.rpc_rounds},
                        {"rpc_interval_us", a.rpc_interval_us},
                        {"rpc_paced_timed_from", paced ? "scheduled send time" : "send"},
                        {"rpc_floor_message_bytes", FloorMessageBytes()},
                        {"rpc_floor_p50_us", lat[0][kFloor].p50},
                        {"rpc_floor_p99_us", lat[0][kFloor].p99},
                        {"rpc_saturated_floor_p50_us", lat[1][kFloor].p50},
                        {"rpc_saturated_floor_p99_us", lat[1][kFloor].p99},
                        {"rpc_floor_followup_p50_us", lat[0][kFloorFollow].p50},
                        {"rpc_floor_followup_p99_us", lat[0][kFloorFollow].p99},
                        {"rpc_saturated_floor_followup_p50_us", lat[1][kFloorFollow].p50},
                        {"rpc_goal_p50_vs_floor", kGoalVsFloor},
                        {"rpc_goal_met", goal_met},
                        {"store_GBps", st},
                        {"load_GBps", ld},
                        {"memcpy_GBps", mem},
                        {"store_vs_memcpy", st / mem},
                        {"load_vs_memcpy", ld / mem},
                        {"store_refused_chunks", store_refused},
                        {"load_missed_chunks", load_missed}};
    j["rpc_send_late_p50_us"] = lat[0][kSendLate].p50;
    j["rpc_send_late_p99_us"] = lat[0][kSendLate].p99;
    for (int op = kLookup; op <= kRelease; ++op) {
      const std::string name = kRpcOpNames[op];
      j["rpc_" + name + "_count"] = lat[0][op].count;
      j["rpc_" + name + "_p50_us"] = lat[0][op].p50;
      j["rpc_" + name + "_p99_us"] = lat[0][op].p99;
      j["rpc_" + name + "_p999_us"] = lat[0][op].p999;
      j["rpc_" + name + "_p50_vs_floor"] = vs_floor[op];
      j["rpc_saturated_" + name + "_p50_us"] = lat[1][op].p50;
      j["rpc_saturated_" + name + "_p99_us"] = lat[1][op].p99;
      j["rpc_saturated_" + name + "_p50_vs_floor"] = sat_vs_floor[op];
    }
    if (chunk_bytes) j["chunk_bytes"] = chunk_bytes;
    j["warmup_passes"] = a.warmup;
    j["isolate_clients"] = isolate;
    if (steady) j["steady_state"] = l2;
    *out = std::move(j);
  } else {
    fmt::print("server: {}; {} client processes, {} chunks each per pass\n", where, a.clients,
               a.chunks);
    const char* labels[kRpcOps] = {"floor: bare socket, first of round",
                                   "floor: bare socket, follow-up",
                                   "lookup (16 keys)",
                                   "prepare_load (1 key)",
                                   "release (1 slot)",
                                   "(lookups sent late by)"};
    for (int m = 0; m < kRpcModes; ++m) {
      if (m == 0 && !paced) {
        fmt::print("control round trips, not paced (--rpc-interval-us 0: back to back):\n");
      } else if (m == 0) {
        fmt::print(
            "control round trips, paced ({} per client, one round every {} us on average, "
            "timed from the scheduled send):\n",
            a.rpc_rounds, a.rpc_interval_us);
      } else {
        fmt::print("control round trips, saturated (clients back to back):\n");
      }
      for (int op = 0; op < kRpcOps; ++op) {
        const Latency& l = lat[m][op];
        if (op == kSendLate && m != 0) continue;
        std::string ratio;
        if (op >= kLookup && op <= kRelease) {
          ratio = fmt::format("  {:.2f} x floor", m == 0 ? vs_floor[op] : sat_vs_floor[op]);
        }
        fmt::print("  {:<36} p50 {:>7.1f} us  p99 {:>8.1f} us  p99.9 {:>8.1f} us{}\n", labels[op],
                   l.p50, l.p99, l.p999, ratio);
      }
    }
    fmt::print("goal (paced p50 of every operation <= {:.1f} x floor): {}\n", kGoalVsFloor,
               goal_met ? "met" : "NOT met");
    fmt::print("{:<38} {:>8.2f} GB/s (limit)\n", "memcpy, same processes", mem);
    fmt::print("{:<38} {:>8.2f} GB/s  {:.2f} x memcpy\n",
               isolate ? "store through a private window" : "store into the shared pool", st,
               st / mem);
    fmt::print("{:<38} {:>8.2f} GB/s  {:.2f} x memcpy\n",
               isolate ? "load through a private window" : "load from the shared pool", ld,
               ld / mem);
    if (store_refused + load_missed > 0) {
      fmt::print(
          "WARNING: {} chunks found no slot to store into and {} were missing at load; "
          "the rates above count only the bytes moved\n",
          store_refused, load_missed);
    }
    if (steady) PrintSteadyState(l2);
  }
  return 0;
}

int RunBenchServer(BenchServerArgs a) {
  if (a.warmup < 0) a.warmup = a.l2_dir.empty() ? 0 : 2;
  if (a.isolate_clients && !a.socket.empty()) {
    fmt::print(stderr,
               "kvtier bench server: error: --isolate-clients configures the server started "
               "here; a running server (--socket) has its own mode\n");
    return 2;
  }
  if (a.l2_dir.empty()) {
    if (!a.write_policies.empty()) {
      fmt::print(stderr, "kvtier bench server: error: --write-policy needs --l2 DIR\n");
      return 2;
    }
    if (!a.isolate_clients) {
      nlohmann::json j;
      int rc = RunOnce(a, std::nullopt, false, &j);
      if (rc == 0 && a.json) fmt::print("{}\n", j.dump(2));
      return rc;
    }
    // The shared pool and isolated clients, same chunks, processes and passes, one after the
    // other.
    nlohmann::json runs = nlohmann::json::array();
    double rate[2][2] = {};  // [isolated][store, load]
    for (bool isolate : {false, true}) {
      if (!a.json) fmt::print("== {} ==\n", isolate ? "isolated clients" : "shared pool");
      nlohmann::json j;
      if (int rc = RunOnce(a, std::nullopt, isolate, &j); rc != 0) return rc;
      if (a.json) {
        rate[isolate][0] = j["store_GBps"].get<double>();
        rate[isolate][1] = j["load_GBps"].get<double>();
        runs.push_back(std::move(j));
      } else {
        fmt::print("\n");
      }
    }
    if (a.json) {
      nlohmann::json cost = {
          {"store_isolated_vs_shared", rate[0][0] > 0 ? rate[1][0] / rate[0][0] : 0},
          {"load_isolated_vs_shared", rate[0][1] > 0 ? rate[1][1] / rate[0][1] : 0}};
      fmt::print("{}\n", nlohmann::json{{"runs", runs}, {"isolation_cost", cost}}.dump(2));
    }
    return 0;
  }
  if (a.isolate_clients) {
    fmt::print(stderr, "kvtier bench server: error: --isolate-clients runs without --l2\n");
    return 2;
  }
  if (!a.socket.empty()) {
    fmt::print(stderr,
               "kvtier bench server: error: --l2 configures the server started here; a running "
               "server (--socket) has its own tiers\n");
    return 2;
  }
  if (!std::filesystem::is_directory(a.l2_dir)) {
    fmt::print(stderr, "kvtier bench server: error: --l2 {}: not a directory\n", a.l2_dir);
    return 2;
  }
  std::vector<WritePolicy> policies;
  if (a.write_policies.empty()) a.write_policies = {"write_back", "write_through", "none"};
  for (const auto& name : a.write_policies) {
    auto p = ParseWritePolicy(name);
    if (!p.ok()) {
      fmt::print(stderr, "kvtier bench server: error: --write-policy: {}\n", p.status().message());
      return 2;
    }
    policies.push_back(*p);
  }
  nlohmann::json runs = nlohmann::json::array();
  for (WritePolicy p : policies) {
    if (!a.json) fmt::print("== write policy {} ==\n", WritePolicyName(p));
    nlohmann::json j;
    if (int rc = RunOnce(a, p, false, &j); rc != 0) return rc;
    runs.push_back(std::move(j));
    if (!a.json) fmt::print("\n");
  }
  if (a.json) fmt::print("{}\n", nlohmann::json{{"runs", runs}}.dump(2));
  return 0;
}

void AddBenchServer(CLI::App& parent, CommandContext& ctx) {
  auto args = std::make_shared<BenchServerArgs>();
  CLI::App* cmd = parent.add_subcommand(
      "server",
      "N client processes doing lookups, stores and loads through a server's shared pool: "
      "control round-trip latency per operation next to the bare Unix-socket round trip, and "
      "pool throughput next to memcpy, both limits measured by the same processes");
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
  cmd->add_option("--l2", args->l2_dir,
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
  cmd->add_flag("--isolate-clients", args->isolate_clients,
                "Run twice, with the shared pool and with isolated clients (kvtier serve "
                "--isolate-clients: private windows, server-side copies), to measure what "
                "isolation costs");
  cmd->add_flag("--json", args->json, "Print one JSON object");
  cmd->callback([args, &ctx] { ctx.exit_code = RunBenchServer(*args); });
}

const bool kRegistered = RegisterCommand("bench", &AddBenchServer);

}  // namespace
}  // namespace kvtier::tools

#include "benchmarks/server_bench.h"

#include <fmt/format.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <span>
#include <thread>
#include <utility>
#include <vector>

#include "benchmarks/bench_timing.h"
#include "benchmarks/raw_io.h"
#include "kvtier/client.h"
#include "kvtier/io.h"
#include "server/codec.h"
#include "server/server.h"
#include "testing/temp_dir.h"

namespace kvtier::benchmarks {
namespace {

using Clock = std::chrono::steady_clock;

// A failure whose message carries the code of the error underneath, as the command prints it.
Status Failure(const Status& s) { return Status(s.code(), s.ToString(), s.retryable()); }

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

enum Phase { kMemcpy = 0, kStore = 1, kLoad = 2, kPhases = 3 };

// A client's round-trip samples, per mode and operation (microseconds).
using RpcSamples = std::vector<float>[kRpcModes][kRpcOps];

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
    acceptor_ = std::thread([this] { Accept(); });
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
  void Accept() {
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
  }

  std::string path_;
  size_t message_bytes_ = 0;
  int listen_fd_ = -1;
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<int> conns_;
  std::vector<std::thread> echoers_;
};

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
// the end, the results) and `from_parent` (go marks). Each step returns 0 or the process's exit
// status.
class BenchClient {
 public:
  BenchClient(const ServerBenchOptions& a, int me, int to_parent, int from_parent)
      : a_(a), me_(me), to_parent_(to_parent), from_parent_(from_parent) {}

  int Run(const std::string& socket, const std::string& floor_socket, uint64_t chunk_bytes);

 private:
  bool Barrier() {
    char c = 'r';
    return WriteAll(to_parent_, &c, 1) && ReadAll(from_parent_, &c, 1);
  }
  int Connect(const std::string& socket, uint64_t chunk_bytes);
  uint64_t Store(const std::vector<ChunkKey>& keys);
  uint64_t Load(const std::vector<ChunkKey>& keys);
  int FloorRound(int fd, int mode, int round, Clock::time_point scheduled);
  int KvtierRound(int mode, int round, Clock::time_point scheduled);
  int RpcPhases(const std::string& floor_socket);
  int DataPasses();
  int SendResults();

  const ServerBenchOptions& a_;
  const int me_, to_parent_, from_parent_;
  std::unique_ptr<Client> client_;
  uint64_t chunk_bytes_ = 0;
  uint32_t n_ = 0;  // chunks per pass
  std::vector<uint8_t> src_, dst_;
  std::vector<ChunkKey> warm_;
  std::vector<char> floor_msg_;
  uint64_t refused_ = 0;  // chunks the last Store or Load did not move
  RpcSamples rpc_us_;
  std::vector<PhaseTime> times_;
};

int BenchClient::Connect(const std::string& socket, uint64_t chunk_bytes) {
  ClientOptions o;
  o.socket_path = socket;
  o.ns.model_id = "kvtier-bench-server";
  o.ns.chunk_tokens = 1;
  o.chunk_bytes = chunk_bytes;
  o.token = a_.token;
  o.client_name = fmt::format("bench-{}", me_);
  o.copy_threads = 0;
  auto client = Client::Connect(o);
  if (!client.ok()) {
    fmt::print(stderr, "client {}: {}\n", me_, client.status().ToString());
    return 11;
  }
  client_ = std::move(*client);
  chunk_bytes_ = client_->chunk_bytes();
  // Two generations of every client's chunks must fit in the pool (a running server's pool may
  // be small for its chunk size).
  n_ = std::max<uint32_t>(
      1, std::min<uint32_t>(a_.chunks,
                            client_->num_slots() / (2 * static_cast<uint32_t>(a_.clients))));
  src_.resize(n_ * chunk_bytes_);
  dst_.resize(n_ * chunk_bytes_);
  for (size_t i = 0; i < src_.size(); i += 4096) src_[i] = static_cast<uint8_t>(i >> 12);
  std::memset(dst_.data(), 0, dst_.size());  // pre-fault
  return 0;
}

// Returns the bytes moved; refused_ counts the chunks that were not.
uint64_t BenchClient::Store(const std::vector<ChunkKey>& keys) {
  Client& cl = *client_;
  auto slots = cl.ReserveSlots(keys);
  if (!slots.ok()) return 0;
  refused_ += keys.size() - slots->size();
  uint64_t bytes = 0;
  for (size_t i = 0; i < slots->size(); ++i) {
    if ((*slots)[i] == kNoSlot) continue;
    std::memcpy(cl.SlotData((*slots)[i]).data(), src_.data() + i * chunk_bytes_, chunk_bytes_);
    bytes += chunk_bytes_;
  }
  return cl.CommitSlots(keys, *slots).ok() ? bytes : 0;
}

uint64_t BenchClient::Load(const std::vector<ChunkKey>& keys) {
  Client& cl = *client_;
  auto op = cl.PrepareLoad(keys);
  if (!op.ok()) return 0;
  OpResult r = op->Wait();
  refused_ += keys.size() - r.slots.size();
  for (size_t i = 0; i < r.slots.size(); ++i) {
    std::memcpy(dst_.data() + i * chunk_bytes_, cl.SlotData(r.slots[i]).data(), chunk_bytes_);
  }
  return cl.Unpin(r.slots).ok() ? r.slots.size() * chunk_bytes_ : 0;
}

// A floor round: one bare round trip timed like a lookup, and every other round two more
// timed like prepare_load and release.
int BenchClient::FloorRound(int fd, int mode, int round, Clock::time_point scheduled) {
  auto trip = [&] {
    return WriteAll(fd, floor_msg_.data(), floor_msg_.size()) &&
           ReadAll(fd, floor_msg_.data(), floor_msg_.size());
  };
  bool ok = false;
  rpc_us_[mode][kFloor].push_back(TimeFromSchedule(
      scheduled, [](Clock::time_point t) { std::this_thread::sleep_until(t); },
      [] { return Clock::now(); }, [&] { ok = trip(); }));
  if (!ok) return 23;
  for (int k = 0; k < (round % 2 == 0 ? 2 : 0); ++k) {
    auto t = Clock::now();
    if (!trip()) return 23;
    rpc_us_[mode][kFloorFollow].push_back(MicrosBetween(t, Clock::now()));
  }
  return 0;
}

// A kvtier round: a lookup of the whole prefix, and every other round pin/unpin of one chunk
// (prepare_load + release), each timed from when the operation before it returned.
int BenchClient::KvtierRound(int mode, int round, Clock::time_point scheduled) {
  Client& cl = *client_;
  bool ok = false;
  Clock::time_point sent;
  rpc_us_[mode][kLookup].push_back(TimeFromSchedule(
      scheduled, [](Clock::time_point t) { std::this_thread::sleep_until(t); },
      [] { return Clock::now(); },
      [&] {
        sent = Clock::now();
        ok = cl.TryLookup(warm_).ok();
      }));
  if (!ok) return 14;
  rpc_us_[mode][kSendLate].push_back(MicrosBetween(scheduled, sent));
  if (round % 2 != 0) return 0;
  std::span<const ChunkKey> one(warm_.data(), 1);
  auto t1 = Clock::now();
  auto op = cl.PrepareLoad(one);
  if (!op.ok()) return 15;
  OpResult r = op->Wait();
  auto t2 = Clock::now();
  Status u = cl.Unpin(r.slots);
  auto t3 = Clock::now();
  if (!u.ok()) return 16;
  rpc_us_[mode][kPrepareLoad].push_back(MicrosBetween(t1, t2));
  rpc_us_[mode][kRelease].push_back(MicrosBetween(t2, t3));
  return 0;
}

// Control round trips, all clients at once, paced then saturated; in each mode the floor first,
// then kvtier, on the same schedule. Paced rounds start at Poisson-random times, as inference
// processes do between scheduler steps, and are timed from their scheduled send time
// (bench_timing.h): a late wake-up, or a round still waiting for the one before, counts.
int BenchClient::RpcPhases(const std::string& floor_socket) {
  const int floor_fd = ConnectUnix(floor_socket);
  if (floor_fd < 0) return 22;
  floor_msg_.assign(FloorMessageBytes(), 'f');
  int rc = 0;
  for (int mode = 0; mode < kRpcModes && rc == 0; ++mode) {
    const bool paced = mode == kPaced && a_.rpc_interval_us > 0;
    for (int part = 0; part < 2 && rc == 0; ++part) {
      const bool floor = part == 0;
      if (!Barrier()) return 13;
      // A per-client seed, so clients do not fire in lockstep; the same seed for the floor and
      // for kvtier, so both see the same schedule.
      PacedSchedule<Clock> schedule(Clock::now(), std::max(1, a_.rpc_interval_us), 1234 + me_);
      for (int i = 0; i < a_.rpc_rounds && rc == 0; ++i) {
        const Clock::time_point scheduled = paced ? schedule.Next() : Clock::now();
        rc = floor ? FloorRound(floor_fd, mode, i, scheduled) : KvtierRound(mode, i, scheduled);
      }
    }
  }
  close(floor_fd);
  return rc;
}

// Data passes: memcpy (the limit), store into the pool, load another client's chunks. Each pass
// stores new chunks, so once the pool is full every store evicts.
int BenchClient::DataPasses() {
  for (int rep = 0; rep < a_.warmup + a_.repeats; ++rep) {
    PhaseTime t;
    if (!Barrier()) return 17;
    t.start = Now();
    for (uint32_t i = 0; i < n_; ++i) {
      std::memcpy(dst_.data() + i * chunk_bytes_, src_.data() + i * chunk_bytes_, chunk_bytes_);
    }
    t.end = Now();
    t.bytes = n_ * chunk_bytes_;
    times_.push_back(t);

    auto mine = ClientKeys(me_, rep + 1, n_);
    if (!Barrier()) return 18;
    refused_ = 0;
    t.start = Now();
    t.bytes = Store(mine);
    t.end = Now();
    t.refused = refused_;
    times_.push_back(t);

    auto theirs = ClientKeys((me_ + 1) % a_.clients, rep + 1, n_);
    if (!Barrier()) return 19;
    refused_ = 0;
    t.start = Now();
    t.bytes = Load(theirs);
    t.end = Now();
    t.refused = refused_;
    times_.push_back(t);
  }
  return 0;
}

int BenchClient::SendResults() {
  uint32_t phases = static_cast<uint32_t>(times_.size());
  if (!WriteAll(to_parent_, &phases, 4) ||
      !WriteAll(to_parent_, times_.data(), phases * sizeof(PhaseTime))) {
    return 20;
  }
  for (auto& mode : rpc_us_) {
    for (auto& v : mode) {
      uint32_t count = static_cast<uint32_t>(v.size());
      if (!WriteAll(to_parent_, &count, 4) ||
          !WriteAll(to_parent_, v.data(), count * sizeof(float))) {
        return 20;
      }
    }
  }
  return 0;
}

int BenchClient::Run(const std::string& socket, const std::string& floor_socket,
                     uint64_t chunk_bytes) {
  char c;
  if (!ReadAll(from_parent_, &c, 1)) return 10;  // the server is up
  // Paced rounds are timed from their scheduled send time, so this process's own oversleeping
  // counts against every round trip (the floor's and kvtier's alike). The default timer slack
  // (50 us) would add up to that much to each; 1 ns keeps the wake-ups as punctual as the
  // kernel can make them.
  prctl(PR_SET_TIMERSLACK, 1UL, 0, 0, 0);
  if (int rc = Connect(socket, chunk_bytes); rc != 0) return rc;
  // Warm-up: this client's chunks are resident for the rpc phase.
  warm_ = ClientKeys(me_, 0, n_);
  if (Store(warm_) == 0 && client_->Lookup(warm_).total != n_) return 12;
  if (int rc = RpcPhases(floor_socket); rc != 0) return rc;
  if (int rc = DataPasses(); rc != 0) return rc;
  return SendResults();
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

// The client processes, seen from the parent: a pipe each way.
class ClientProcesses {
 public:
  ~ClientProcesses() { KillAll(); }

  // Forks the clients; each waits for the floor's socket path, then the in-process server's (if
  // `socket` is empty), then a go mark. REQUIRES: no other thread runs in this process.
  Status Fork(const ServerBenchOptions& a, uint64_t chunk_bytes_wanted);
  // Sends a socket path to every client.
  void SendPath(const std::string& path);
  // Sends a go mark to every client.
  void Go();
  // Waits for a ready mark from every client; fails when one is gone.
  Status WaitReady();
  // Reads every client's results.
  Status ReadResults(int passes, std::vector<std::vector<PhaseTime>>* times, RpcSamples* rpc);
  // Waits for every client to exit; fails when one did not exit with 0.
  Status Reap();
  void KillAll();

 private:
  struct Child {
    pid_t pid;
    int to_child, from_child;
  };
  std::vector<Child> kids_;
};

Status ClientProcesses::Fork(const ServerBenchOptions& a, uint64_t chunk_bytes_wanted) {
  for (int i = 0; i < a.clients; ++i) {
    int down[2], up[2];
    if (pipe(down) != 0 || pipe(up) != 0) {
      return Status::IOError(fmt::format("pipe: {}", std::strerror(errno)));
    }
    pid_t pid = fork();
    if (pid == 0) {
      close(down[1]);
      close(up[0]);
      for (auto& k : kids_) {
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
      BenchClient client(a, i, up[1], down[0]);
      _exit(client.Run(socket, floor_socket, a.socket.empty() ? chunk_bytes_wanted : 0));
    }
    close(down[0]);
    close(up[1]);
    kids_.push_back({pid, down[1], up[0]});
  }
  return Status::Ok();
}

void ClientProcesses::SendPath(const std::string& path) {
  uint32_t len = static_cast<uint32_t>(path.size());
  for (auto& k : kids_)
    (void)(WriteAll(k.to_child, &len, 4) && WriteAll(k.to_child, path.data(), len));
}

void ClientProcesses::Go() {
  char go = 'g';
  for (auto& k : kids_) WriteAll(k.to_child, &go, 1);
}

Status ClientProcesses::WaitReady() {
  for (auto& k : kids_) {
    char c;
    if (!ReadAll(k.from_child, &c, 1)) {
      int status = 0;
      waitpid(k.pid, &status, 0);
      const pid_t pid = std::exchange(k.pid, -1);
      return Status::Aborted(fmt::format("client process {} failed (exit status {})", pid,
                                         WIFEXITED(status) ? WEXITSTATUS(status) : -1));
    }
  }
  return Status::Ok();
}

Status ClientProcesses::ReadResults(int passes, std::vector<std::vector<PhaseTime>>* times,
                                    RpcSamples* rpc) {
  const Status lost = Status::Aborted("a client process did not report its results");
  times->resize(kids_.size());
  for (size_t i = 0; i < kids_.size(); ++i) {
    const int fd = kids_[i].from_child;
    uint32_t phases = 0;
    if (!ReadAll(fd, &phases, 4) || phases != kPhases * static_cast<uint32_t>(passes)) return lost;
    (*times)[i].resize(phases);
    if (!ReadAll(fd, (*times)[i].data(), phases * sizeof(PhaseTime))) return lost;
    for (auto& all : std::span(&(*rpc)[0][0], size_t{kRpcModes} * kRpcOps)) {
      uint32_t count = 0;
      if (!ReadAll(fd, &count, 4) || count > (1u << 28)) return lost;
      std::vector<float> lat(count);
      if (!ReadAll(fd, lat.data(), count * sizeof(float))) return lost;
      all.insert(all.end(), lat.begin(), lat.end());
    }
  }
  return Status::Ok();
}

Status ClientProcesses::Reap() {
  Status failed;
  for (auto& k : kids_) {
    int status = 0;
    waitpid(k.pid, &status, 0);
    k.pid = -1;
    close(k.to_child);
    close(k.from_child);
    k.to_child = k.from_child = -1;
    if (failed.ok() && (!WIFEXITED(status) || WEXITSTATUS(status) != 0)) {
      failed = Status::Aborted(fmt::format("client process exited with {}", status));
    }
  }
  kids_.clear();
  return failed;
}

void ClientProcesses::KillAll() {
  for (auto& k : kids_) {
    if (k.pid > 0) kill(k.pid, SIGKILL);
  }
  for (auto& k : kids_) {
    if (k.pid > 0) waitpid(k.pid, nullptr, 0);
    if (k.to_child >= 0) close(k.to_child);
    if (k.from_child >= 0) close(k.from_child);
  }
  kids_.clear();
}

// The server started in this process, and what it is, in words.
Result<std::unique_ptr<server::Server>> StartServer(const ServerBenchOptions& a,
                                                    const std::string& socket_path,
                                                    const std::string& l2_root) {
  const uint64_t chunk_bytes = a.chunk_mib << 20;
  server::ServerOptions o;
  o.socket_path = socket_path;
  o.http_port = -1;
  o.engine.chunk_bytes = chunk_bytes;
  // Two generations of every client's chunks, so loads find the chunks just stored.
  o.engine.memory.capacity_bytes = 2ull * a.clients * a.chunks * chunk_bytes;
  if (a.isolate_clients) {
    // Windows as large as the pool, so each client moves as many chunks as with the shared
    // pool (a client sizes its passes from the slots it maps).
    o.isolate_clients = true;
    o.max_slots_per_client = 2 * a.clients * a.chunks;
  }
  if (!a.l2_dir.empty()) {
    FileTierOptions f;
    f.root = l2_root;
    o.engine.file = f;
    o.engine.write_policy = a.write_policy;
  }
  auto started = server::Server::Start(o);
  if (!started.ok()) return Failure(started.status());
  return std::move(started).value();
}

std::string Where(const ServerBenchOptions& a) {
  if (!a.socket.empty()) return a.socket;
  std::string where = !a.l2_dir.empty() ? fmt::format("in-process server, L1 + file tier on {}, {}",
                                                      a.l2_dir, WritePolicyName(a.write_policy))
                                        : "in-process server (L1 only)";
  if (a.isolate_clients) where += ", isolated clients (private windows, server-side copies)";
  return where;
}

// The engine's counters around the measured passes of a steady-state run.
struct EngineWindow {
  EngineStats before, after;
  Clock::time_point from;  // when the measured passes began
  double seconds = 0;      // wall time of the measured passes
};

// The file tier's side of a steady-state run, and plain O_DIRECT writes of as many bytes (at
// least 16 chunks, at most 4 GiB) in chunk files to the same directory by as many threads as
// the tier writes with: what the disk takes from a writer with no cache in front of it.
Result<SteadyStateResult> MeasureSteadyState(const ServerBenchOptions& a, const EngineWindow& w,
                                             uint64_t chunk_bytes, int threads) {
  const FileTierStats &f0 = w.before.file_detail, &f1 = w.after.file_detail;
  const uint64_t l2_bytes = f1.bytes_written - f0.bytes_written;
  const uint64_t buf_bytes = (chunk_bytes + 4095) / 4096 * 4096;
  const uint64_t files = std::clamp<uint64_t>(l2_bytes / chunk_bytes, 16, (4ull << 30) / buf_bytes);
  threads = std::max(1, threads);
  const std::string raw_dir = fmt::format("{}/kvtier-bench-raw-{}", a.l2_dir, getpid());
  Env& env = *Env::Default();
  if (Status s = env.CreateDirs(raw_dir); !s.ok()) {
    return Failure(s.WithContext(fmt::format("cannot create {}", raw_dir)));
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
    if (!s.ok()) return Failure(s.WithContext("plain O_DIRECT writes (the reference)"));
  }
  const EngineStats &e0 = w.before, &e1 = w.after;
  SteadyStateResult r;
  r.write_policy = a.write_policy;
  r.measured_seconds = w.seconds;
  r.l1_evictions = e1.memory_detail.evictions - e0.memory_detail.evictions;
  r.l2_bytes_written = l2_bytes;
  r.l2_write_GBps = w.seconds > 0 ? l2_bytes / w.seconds / 1e9 : 0;
  r.raw_o_direct_write_GBps = files * buf_bytes / raw_s / 1e9;
  r.raw_o_direct_write_threads = threads;
  r.raw_o_direct_bytes = files * buf_bytes;
  r.l2_write_vs_raw =
      r.raw_o_direct_write_GBps > 0 ? r.l2_write_GBps / r.raw_o_direct_write_GBps : 0;
  r.write_backs = e1.write_backs - e0.write_backs;
  r.dirty_evictions = e1.dirty_evictions - e0.dirty_evictions;
  r.dirty_refusals = e1.memory_detail.dirty_refusals - e0.memory_detail.dirty_refusals;
  r.write_through_deferred = e1.write_through_deferred - e0.write_through_deferred;
  r.write_through_dropped = e1.write_through_dropped - e0.write_through_dropped;
  r.l2_errors = f1.errors - f0.errors;
  return r;
}

// The figures of a run from what the clients reported.
void Summarize(const ServerBenchOptions& a, std::vector<std::vector<PhaseTime>>& times,
               RpcSamples& rpc, ServerBenchResult* r) {
  const int passes = a.warmup + a.repeats;
  // Throughput of a phase = bytes moved by all clients / (last end - first start); median of
  // the measured passes.
  auto gbps = [&](Phase p) {
    std::vector<double> v;
    for (int rep = a.warmup; rep < passes; ++rep) {
      double s = 1e300, e = 0;
      uint64_t bytes = 0;
      for (const auto& client : times) {
        const PhaseTime& t = client[rep * kPhases + p];
        s = std::min(s, t.start);
        e = std::max(e, t.end);
        bytes += t.bytes;
      }
      v.push_back(bytes / (e - s) / 1e9);
    }
    return Median(v);
  };
  auto refused = [&](Phase p) {
    uint64_t n = 0;
    for (int rep = a.warmup; rep < passes; ++rep) {
      for (const auto& client : times) n += client[rep * kPhases + p].refused;
    }
    return n;
  };
  r->memcpy_GBps = gbps(kMemcpy);
  r->store_GBps = gbps(kStore);
  r->load_GBps = gbps(kLoad);
  r->store_refused_chunks = refused(kStore);
  r->load_missed_chunks = refused(kLoad);
  for (int m = 0; m < kRpcModes; ++m) {
    for (int op = 0; op < kRpcOps; ++op) {
      std::vector<float>& v = rpc[m][op];
      r->rpc[m][op] = {v.size(), Percentile(v, 0.50), Percentile(v, 0.99), Percentile(v, 0.999)};
    }
  }
  r->goal_met = true;
  for (int op = kLookup; op <= kRelease; ++op) {
    for (int m = 0; m < kRpcModes; ++m) {
      const double f = r->rpc[m][FloorOf(op)].p50;
      r->vs_floor[m][op] = f > 0 ? r->rpc[m][op].p50 / f : 0;
    }
    const double paced = r->vs_floor[kPaced][op];
    r->goal_met = r->goal_met && paced > 0 && paced <= kRpcGoalVsFloor;
  }
}

// Drives the clients through their barriers (floor and kvtier in each rpc mode, then memcpy,
// store and load per pass), taking the engine's counters when the measured passes begin if
// `window` is given.
Status DriveClients(const ServerBenchOptions& a, ClientProcesses& kids, server::Server* srv,
                    EngineWindow* window) {
  const int barriers = 2 * kRpcModes + kPhases * (a.warmup + a.repeats);
  const int first_measured = 2 * kRpcModes + kPhases * a.warmup;
  for (int b = 0; b < barriers; ++b) {
    if (window && b == first_measured) {
      window->before = srv->engine().Stats();
      window->from = Clock::now();
    }
    if (Status s = kids.WaitReady(); !s.ok()) return s;
    kids.Go();
  }
  return Status::Ok();
}

}  // namespace

size_t FloorMessageBytes() {
  std::vector<ChunkKey> keys(16);
  return server::EncodeKeysRequest(server::Opcode::kLookup, 1, keys).size();
}

Status ValidateServerBenchOptions(const ServerBenchOptions& a) {
  if (a.isolate_clients && !a.socket.empty()) {
    return Status::InvalidArgument(
        "--isolate-clients configures the server started here; a running server (--socket) has "
        "its own mode");
  }
  if (a.isolate_clients && !a.l2_dir.empty()) {
    return Status::InvalidArgument("--isolate-clients runs without --l2");
  }
  if (!a.l2_dir.empty() && !a.socket.empty()) {
    return Status::InvalidArgument(
        "--l2 configures the server started here; a running server (--socket) has its own tiers");
  }
  if (!a.l2_dir.empty() && !std::filesystem::is_directory(a.l2_dir)) {
    return Status::InvalidArgument(fmt::format("--l2 {}: not a directory", a.l2_dir));
  }
  auto out_of = [](const char* flag, int64_t v, int64_t lo, int64_t hi) {
    return v < lo || v > hi
               ? Status::InvalidArgument(fmt::format("{} {} is not in [{}, {}]", flag, v, lo, hi))
               : Status::Ok();
  };
  for (Status s :
       {out_of("--clients", a.clients, 1, 256),
        out_of("--chunk-mib", static_cast<int64_t>(a.chunk_mib), 1, 1024),
        out_of("--chunks", a.chunks, 1, 4096), out_of("--repeats", a.repeats, 1, 1000),
        out_of("--warmup", a.warmup, 0, 1000), out_of("--rpc-rounds", a.rpc_rounds, 1, 10000000),
        out_of("--rpc-interval-us", a.rpc_interval_us, 0, 1000000)}) {
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

Result<ServerBenchResult> RunServerBench(const ServerBenchOptions& a) {
  if (Status s = ValidateServerBenchOptions(a); !s.ok()) return s;
  // The file tier of a steady-state run, removed after it.
  const std::string l2_root = fmt::format("{}/kvtier-bench-server-{}", a.l2_dir, getpid());
  struct RemoveOnExit {  // after the server has stopped, whatever happens
    std::string dir;
    ~RemoveOnExit() {
      if (!dir.empty()) (void)RemoveTree(*Env::Default(), dir);
    }
  } l2_cleanup{a.l2_dir.empty() ? std::string() : l2_root};
  // Children are forked before this process starts any thread (the echo server's, the
  // in-process server's).
  ClientProcesses kids;
  // On failure the clients go first: none is left waiting on a server being stopped.
  auto fail = [&kids](Status s) {
    kids.KillAll();
    return s;
  };
  if (Status s = kids.Fork(a, a.chunk_mib << 20); !s.ok()) return fail(s);
  testing::TempDir dir("kvtier-bench-server");
  EchoServer echo;
  const std::string floor_socket = dir.Sub("floor.sock");
  if (Status s = echo.Start(floor_socket, FloorMessageBytes()); !s.ok()) return fail(Failure(s));
  kids.SendPath(floor_socket);
  ServerBenchResult r;
  r.server = Where(a);
  std::unique_ptr<server::Server> srv;
  if (a.socket.empty()) {
    auto started = StartServer(a, dir.Sub("kvtier.sock"), l2_root);
    if (!started.ok()) return fail(started.status());
    srv = std::move(*started);
    kids.SendPath(dir.Sub("kvtier.sock"));
  }
  kids.Go();
  std::optional<EngineWindow> window;
  if (srv && !a.l2_dir.empty()) window.emplace();
  if (Status s = DriveClients(a, kids, srv.get(), window ? &*window : nullptr); !s.ok()) {
    return fail(s);
  }
  std::vector<std::vector<PhaseTime>> times;
  RpcSamples rpc;
  if (Status s = kids.ReadResults(a.warmup + a.repeats, &times, &rpc); !s.ok()) return fail(s);
  if (Status s = kids.Reap(); !s.ok()) return s;
  if (window) {
    window->seconds = std::chrono::duration<double>(Clock::now() - window->from).count();
    window->after = srv->engine().Stats();
  }
  Summarize(a, times, rpc, &r);
  r.chunk_bytes = srv ? srv->engine().options().chunk_bytes : 0;
  const int tier_write_threads =
      srv && srv->engine().options().file ? srv->engine().options().file->write_threads : 0;
  if (srv) srv->Stop();
  echo.Stop();
  if (window) {
    (void)RemoveTree(*Env::Default(), l2_root);
    auto steady = MeasureSteadyState(a, *window, r.chunk_bytes, tier_write_threads);
    if (!steady.ok()) return steady.status();
    r.steady_state = *steady;
  }
  return r;
}

nlohmann::json ServerBenchResultToJson(const ServerBenchOptions& a, const ServerBenchResult& r) {
  const LatencySummary(&paced)[kRpcOps] = r.rpc[kPaced];
  const LatencySummary(&saturated)[kRpcOps] = r.rpc[kSaturated];
  nlohmann::json j = {
      {"server", r.server},
      {"clients", a.clients},
      {"chunks_per_client", a.chunks},
      {"repeats", a.repeats},
      {"rpc_rounds_per_client", a.rpc_rounds},
      {"rpc_interval_us", a.rpc_interval_us},
      {"rpc_paced_timed_from", a.rpc_interval_us > 0 ? "scheduled send time" : "send"},
      {"rpc_floor_message_bytes", FloorMessageBytes()},
      {"rpc_floor_p50_us", paced[kFloor].p50},
      {"rpc_floor_p99_us", paced[kFloor].p99},
      {"rpc_saturated_floor_p50_us", saturated[kFloor].p50},
      {"rpc_saturated_floor_p99_us", saturated[kFloor].p99},
      {"rpc_floor_followup_p50_us", paced[kFloorFollow].p50},
      {"rpc_floor_followup_p99_us", paced[kFloorFollow].p99},
      {"rpc_saturated_floor_followup_p50_us", saturated[kFloorFollow].p50},
      {"rpc_goal_p50_vs_floor", kRpcGoalVsFloor},
      {"rpc_goal_met", r.goal_met},
      {"store_GBps", r.store_GBps},
      {"load_GBps", r.load_GBps},
      {"memcpy_GBps", r.memcpy_GBps},
      {"store_vs_memcpy", r.store_GBps / r.memcpy_GBps},
      {"load_vs_memcpy", r.load_GBps / r.memcpy_GBps},
      {"store_refused_chunks", r.store_refused_chunks},
      {"load_missed_chunks", r.load_missed_chunks}};
  j["rpc_send_late_p50_us"] = paced[kSendLate].p50;
  j["rpc_send_late_p99_us"] = paced[kSendLate].p99;
  for (int op = kLookup; op <= kRelease; ++op) {
    const std::string name = kRpcOpNames[op];
    j["rpc_" + name + "_count"] = paced[op].count;
    j["rpc_" + name + "_p50_us"] = paced[op].p50;
    j["rpc_" + name + "_p99_us"] = paced[op].p99;
    j["rpc_" + name + "_p999_us"] = paced[op].p999;
    j["rpc_" + name + "_p50_vs_floor"] = r.vs_floor[kPaced][op];
    j["rpc_saturated_" + name + "_p50_us"] = saturated[op].p50;
    j["rpc_saturated_" + name + "_p99_us"] = saturated[op].p99;
    j["rpc_saturated_" + name + "_p50_vs_floor"] = r.vs_floor[kSaturated][op];
  }
  if (r.chunk_bytes) j["chunk_bytes"] = r.chunk_bytes;
  j["warmup_passes"] = a.warmup;
  j["isolate_clients"] = a.isolate_clients;
  if (r.steady_state) {
    const SteadyStateResult& s = *r.steady_state;
    j["steady_state"] = {{"write_policy", WritePolicyName(s.write_policy)},
                         {"measured_seconds", s.measured_seconds},
                         {"l1_evictions", s.l1_evictions},
                         {"l2_bytes_written", s.l2_bytes_written},
                         {"l2_write_GBps", s.l2_write_GBps},
                         {"raw_o_direct_write_GBps", s.raw_o_direct_write_GBps},
                         {"raw_o_direct_write_threads", s.raw_o_direct_write_threads},
                         {"raw_o_direct_bytes", s.raw_o_direct_bytes},
                         {"l2_write_vs_raw", s.l2_write_vs_raw},
                         {"write_backs", s.write_backs},
                         {"dirty_evictions", s.dirty_evictions},
                         {"dirty_refusals", s.dirty_refusals},
                         {"write_through_deferred", s.write_through_deferred},
                         {"write_through_dropped", s.write_through_dropped},
                         {"l2_errors", s.l2_errors}};
  }
  return j;
}

}  // namespace kvtier::benchmarks

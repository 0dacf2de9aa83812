#include "benchmarks/tier_bench.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>

#include "benchmarks/raw_io.h"
#include "io/nfs_raw.h"
#include "io/s3_raw.h"
#include "kvtier/cache_dir.h"
#include "kvtier/file_tier.h"
#include "kvtier/io.h"
#include "probe/storage_probe.h"

namespace kvtier::benchmarks {
namespace {

using Clock = std::chrono::steady_clock;

// A failure whose message carries the code of the error underneath, as the command prints it.
Status Failure(const Status& s) { return Status(s.code(), s.ToString(), s.retryable()); }

void DropFromPageCache(const std::vector<std::string>& paths) {
  for (const auto& p : paths) {
    int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

// A fixed set of buffers handed out to requests in flight.
class BufferPool {
 public:
  BufferPool(int n, size_t bytes) {
    for (int i = 0; i < n; ++i) {
      bufs_.emplace_back(bytes);
      free_.push_back(i);
    }
  }
  int Take() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !free_.empty(); });
    int i = free_.back();
    free_.pop_back();
    return i;
  }
  void Give(int i) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      free_.push_back(i);
    }
    cv_.notify_all();
  }
  void WaitAll() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return free_.size() == bufs_.size(); });
  }
  int size() const { return static_cast<int>(bufs_.size()); }
  AlignedBuffer& at(int i) { return bufs_[i]; }

 private:
  std::vector<AlignedBuffer> bufs_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int> free_;
};

// Keeps `in_flight` asynchronous tier calls going over chunks [0, n); returns the wall time, and
// the first error in *error.
template <typename Submit>
double TierPhase(BufferPool& pool, uint32_t n, Submit submit, Status* error) {
  std::mutex mu;
  auto t0 = Clock::now();
  for (uint32_t i = 0; i < n; ++i) {
    int b = pool.Take();
    auto done = [&pool, &mu, error, b](Status s) {
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (error->ok()) *error = s;
      }
      pool.Give(b);
    };
    Status s = submit(i, pool.at(b), done);
    if (!s.ok()) {  // rejected: cannot happen with the queue sized to the buffers
      pool.Give(b);
      std::lock_guard<std::mutex> lock(mu);
      if (error->ok()) *error = s;
    }
  }
  pool.WaitAll();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Where the benchmark writes: the Env the tier uses, and the reference's plain writes and reads
// (O_DIRECT system calls, libnfs's or libcurl's calls), one client per thread when remote.
class Storage {
 public:
  static Result<std::unique_ptr<Storage>> Open(const TierBenchOptions& a, int connections) {
    auto st = std::make_unique<Storage>();
    st->nfs_ = IsNfsUrl(a.dir);
    st->s3_ = IsS3Url(a.dir);
    st->env_ = Env::Default();
    if (st->nfs_) {
      NfsEnvOptions no;
      no.url = a.dir;
      no.connections = connections;
      no.requests_in_flight = a.io_depth;
      no.max_request_bytes = std::max<uint64_t>(a.request_kib << 10, 4096);
      auto made = NewNfsEnv(no);
      if (!made.ok()) return Failure(made.status());
      st->remote_env_ = std::move(*made);
    } else if (st->s3_) {
      S3EnvOptions so;
      so.url = a.dir;
      so.connections = connections;
      if (a.s3_part_mib > 0) so.part_bytes = static_cast<size_t>(a.s3_part_mib) << 20;
      auto made = NewS3Env(so);
      if (!made.ok()) return Failure(made.status());
      st->remote_env_ = std::move(*made);
    }
    if (st->remote_env_) st->env_ = st->remote_env_.get();
    if (Status s = st->env_->CreateDirs(a.dir); !s.ok()) {
      return Status(s.code(), fmt::format("cannot use {} as a directory: {}", a.dir, s.ToString()));
    }
    return st;
  }

  // The reference's clients; connected after the free-space check, as they hold connections.
  Status ConnectReference(const std::string& dir, int threads) {
    for (int t = 0; remote() && t < threads; ++t) {
      if (nfs_) {
        auto c = io::NfsRawClient::Connect(dir);
        if (!c.ok()) return Failure(c.status());
        nfs_clients_.push_back(std::move(*c));
      } else {
        auto c = io::S3RawClient::Connect(dir);
        if (!c.ok()) return Failure(c.status());
        s3_clients_.push_back(std::move(*c));
      }
    }
    return Status::Ok();
  }

  Status RawWriteFile(int t, const std::string& path, std::span<const uint8_t> buf) {
    return nfs_  ? nfs_clients_[t]->WriteFile(path, buf)
           : s3_ ? s3_clients_[t]->WriteFile(path, buf)
                 : RawWrite(path, buf);
  }
  Status RawReadFile(int t, const std::string& path, std::span<uint8_t> buf) {
    return nfs_  ? nfs_clients_[t]->ReadFile(path, buf)
           : s3_ ? s3_clients_[t]->ReadFile(path, buf)
                 : RawRead(path, buf);
  }
  const char* reference() const {
    return nfs_ ? "raw libnfs" : s3_ ? "raw libcurl" : "raw O_DIRECT";
  }

  Env& env() { return *env_; }
  bool nfs() const { return nfs_; }
  bool s3() const { return s3_; }
  bool remote() const { return nfs_ || s3_; }

 private:
  bool nfs_ = false, s3_ = false;
  std::unique_ptr<Env> remote_env_;
  Env* env_ = nullptr;
  std::vector<std::unique_ptr<io::NfsRawClient>> nfs_clients_;
  std::vector<std::unique_ptr<io::S3RawClient>> s3_clients_;
};

// Refuses a local directory without room for a repeat's files (raw and tier) and some slack.
Status CheckFreeSpace(const TierBenchOptions& a) {
  const uint64_t chunk = a.chunk_mib << 20;
  const uint64_t needed = 2 * a.chunks * (chunk + 4096) + (256u << 20);
  struct statvfs vfs;
  if (::statvfs(a.dir.c_str(), &vfs) != 0) return Status::Ok();
  const uint64_t avail = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  if (avail >= needed) return Status::Ok();
  return Status::InvalidArgument(
      fmt::format("{} has {:.2f} GB free; this run needs {:.2f} GB (lower --chunks or --chunk-mib)",
                  a.dir, avail / 1e9, needed / 1e9));
}

// One benchmark run: the storage, the buffers and what the repeats add up.
class TierBench {
 public:
  TierBench(const TierBenchOptions& a, Storage& storage, IoEngineKind engine, std::string raw_dir)
      : a_(a),
        storage_(storage),
        engine_(engine),
        raw_dir_(std::move(raw_dir)),
        chunk_(a.chunk_mib << 20),
        pool_(std::max(a.readers, a.writers), chunk_),
        rng_(std::random_device{}()),
        salt_(fmt::format("{:016x}", rng_())) {
    for (int b = 0; b < pool_.size(); ++b) {
      auto span = pool_.at(b).span();
      for (size_t i = 0; i + 8 <= span.size(); i += 8) {
        uint64_t v = rng_();
        std::memcpy(span.data() + i, &v, 8);
      }
    }
    result_.reference = storage.reference();
    result_.nfs = storage.nfs();
    result_.s3 = storage.s3();
    result_.tier_opened_o_direct = true;
  }

  Status RunRepeat(int rep);
  TierBenchResult Finish();

 private:
  struct Repeat {
    FileTier* tier = nullptr;
    std::vector<ChunkKey> keys;
    std::vector<std::string> raw_paths, tier_paths;
    Status raw_error, tier_error;
  };
  FileTierOptions TierOptions(int rep) const;
  void RawPhase(Repeat& r, bool write);
  void TierPhaseOf(Repeat& r, bool write);
  void Log(const std::string& line) const {
    if (a_.log) a_.log(line);
  }
  void Progress(const char* what, double s) const {
    Log(fmt::format("  {:<11} {:>6.2f} GB/s  ({} x {} MiB in {:.2f} s)", what,
                    a_.chunks * chunk_ / s / 1e9, a_.chunks, a_.chunk_mib, s));
  }

  const TierBenchOptions& a_;
  Storage& storage_;
  const IoEngineKind engine_;
  const std::string raw_dir_;
  const uint64_t chunk_;
  BufferPool pool_;
  std::mt19937_64 rng_;
  const std::string salt_;
  TierBenchResult result_;
};

FileTierOptions TierBench::TierOptions(int rep) const {
  FileTierOptions o;
  o.root = a_.dir;
  o.ns.model_id = "kvtier-bench-tier";
  o.ns.chunk_tokens = 256;
  o.ns.tenant_salt = fmt::format("{}-{}", salt_, rep);  // a fresh namespace: no stale chunks
  o.chunk_bytes = chunk_;
  o.read_threads = a_.readers;
  o.write_threads = a_.writers;
  o.max_queued_reads = o.max_queued_writes = static_cast<size_t>(pool_.size());
  o.io_engine = engine_;
  o.io_queue_depth = a_.io_depth;
  o.io_request_bytes = a_.request_kib << 10;
  o.io_write_request_bytes = a_.write_request_kib << 10;
  if (storage_.remote()) o.env = &storage_.env();
  return o;
}

void TierBench::RawPhase(Repeat& r, bool write) {
  std::atomic<bool> failed{false};
  std::mutex mu;
  const int threads = write ? a_.writers : a_.readers;
  double s = Parallel(threads, a_.chunks, [&](int t, uint32_t i) {
    auto buf = pool_.at(t % pool_.size()).first(chunk_);
    Status st = write ? storage_.RawWriteFile(t, r.raw_paths[i], buf)
                      : storage_.RawReadFile(t, r.raw_paths[i], buf);
    if (!st.ok() && !failed.exchange(true)) {
      std::lock_guard<std::mutex> lock(mu);
      r.raw_error = st;
    }
  });
  Throughput& total = write ? result_.raw_write : result_.raw_read;
  total.bytes += a_.chunks * chunk_;
  total.seconds += s;
  Progress(write ? "raw write" : "raw read", s);
}

void TierBench::TierPhaseOf(Repeat& r, bool write) {
  double s = TierPhase(
      pool_, a_.chunks,
      [&](uint32_t i, AlignedBuffer& b, auto done) {
        return write ? r.tier->WriteAsync(r.keys[i], b.first(chunk_), done)
                     : r.tier->ReadAsync(r.keys[i], b.first(chunk_), done);
      },
      &r.tier_error);
  Throughput& total = write ? result_.tier_write : result_.tier_read;
  total.bytes += a_.chunks * chunk_;
  total.seconds += s;
  Progress(write ? "tier write" : "tier read", s);
}

Status TierBench::RunRepeat(int rep) {
  const FileTierOptions o = TierOptions(rep);
  auto opened = FileTier::Open(o);
  if (!opened.ok()) return Failure(opened.status());
  Repeat r;
  r.tier = opened->get();
  for (uint32_t i = 0; i < a_.chunks; ++i) {
    std::string s = fmt::format("bench-{}-{}-{}", salt_, rep, i);
    r.keys.push_back(*ChunkKey::FromOpaque({reinterpret_cast<const uint8_t*>(s.data()), s.size()}));
    r.raw_paths.push_back(fmt::format("{}/raw-{}-{}", raw_dir_, rep, i));
    r.tier_paths.push_back(r.tier->ChunkPath(r.keys[i]));
  }
  auto first_error = [&r]() -> Status {
    if (!r.raw_error.ok()) return Failure(r.raw_error);
    if (!r.tier_error.ok()) return Failure(r.tier_error);
    return Status::Ok();
  };
  // Alternate which goes first, so that drift on a shared machine hits both alike.
  const bool raw_first = rep % 2 == 0;
  for (bool write : {true, false}) {
    if (!write && !storage_.remote()) {
      // Over NFS or S3 this client caches nothing; the server's cache is its own.
      DropFromPageCache(r.raw_paths);
      DropFromPageCache(r.tier_paths);
    }
    if (raw_first) RawPhase(r, write);
    TierPhaseOf(r, write);
    if (!raw_first) RawPhase(r, write);
    if (Status s = first_error(); !s.ok()) return s;
  }
  FileTierStats st = r.tier->Stats();
  result_.io_engine = st.io_engine;
  if (st.hits != a_.chunks) {
    return Status::IOError(fmt::format("the tier served {} of {} chunks", st.hits, a_.chunks));
  }
  // The tier opening its files with O_DIRECT proves nothing by itself: tmpfs accepts the flag
  // and serves every read from the page cache. What counts is that the files read are not in
  // the page cache afterwards (they were dropped from it before the read phase).
  result_.tier_opened_o_direct = result_.tier_opened_o_direct && st.o_direct;
  if (!storage_.remote()) {
    result_.raw_page_cache_resident_bytes +=
        probe::MeasurePageCacheResidency(r.raw_paths).resident_bytes;
    result_.tier_page_cache_resident_bytes +=
        probe::MeasurePageCacheResidency(r.tier_paths).resident_bytes;
  }
  const std::string ns_id = o.ns.Id();
  opened->reset();
  for (const auto& p : r.raw_paths) (void)storage_.env().Unlink(p);
  if (a_.keep) {
    result_.kept_namespaces.push_back(ns_id);
  } else if (auto purged = PurgeCacheDir(a_.dir, ns_id, &storage_.env()); !purged.ok()) {
    Log(fmt::format("warning: {}", purged.status().ToString()));
  }
  return Status::Ok();
}

TierBenchResult TierBench::Finish() {
  TierBenchResult& r = result_;
  const uint64_t resident = r.page_cache_resident_bytes();
  if (!r.tier_opened_o_direct) {
    r.warning = fmt::format(
        "the file tier could not open its files with O_DIRECT in {}: its reads "
        "went through the page cache",
        a_.dir);
  } else if (resident > 0) {
    r.warning = fmt::format(
        "O_DIRECT was accepted but not honoured in {}: after the read phases the page cache held "
        "{} bytes of the files read ({} of the tier's, {} of the raw files'; tmpfs, or a "
        "filesystem that ignores the flag); these figures are page-cache figures, not storage",
        a_.dir, resident, r.tier_page_cache_resident_bytes, r.raw_page_cache_resident_bytes);
  }
  return std::move(result_);
}

}  // namespace

Status ValidateTierBenchOptions(const TierBenchOptions& a) {
  if (a.chunk_mib == 0 || a.chunk_mib > 4096) {
    return Status::InvalidArgument("--chunk-mib must be in [1, 4096]");
  }
  if (a.chunks == 0) return Status::InvalidArgument("--chunks must be positive");
  if (a.readers < 1 || a.readers > 256 || a.writers < 1 || a.writers > 256) {
    return Status::InvalidArgument("--readers and --writers must be in [1, 256]");
  }
  if (a.repeats < 1) return Status::InvalidArgument("--repeats must be positive");
  if (a.dir.empty()) return Status::InvalidArgument("--dir is required");
  if (auto engine = ParseIoEngineKind(a.io_engine); !engine.ok()) return engine.status();
  return Status::Ok();
}

Result<TierBenchResult> RunTierBench(const TierBenchOptions& a) {
  if (Status s = ValidateTierBenchOptions(a); !s.ok()) return s;
  const IoEngineKind engine = *ParseIoEngineKind(a.io_engine);
  // On NFS the tier gets as many connections as the reference has threads; on S3, whose reads
  // are ranged GETs of several parts at once, four per thread.
  const int threads = std::max(a.readers, a.writers);
  const int connections = a.connections > 0 ? a.connections : (IsS3Url(a.dir) ? 4 : 1) * threads;
  if (connections > 256) return Status::InvalidArgument("--connections must be in [1, 256]");
  auto storage = Storage::Open(a, connections);
  if (!storage.ok()) return storage.status();
  Storage& st = **storage;
  if (!st.remote()) {
    if (Status s = CheckFreeSpace(a); !s.ok()) return s;
  }
  const std::string raw_dir = fmt::format("{}/.kvtier-bench-raw-{}", a.dir, getpid());
  if (Status s = st.env().CreateDirs(raw_dir); !s.ok()) {
    return Status(s.code(), fmt::format("cannot create {}: {}", raw_dir, s.ToString()));
  }
  struct Cleanup {
    Env& env;
    std::string dir;
    ~Cleanup() { (void)RemoveTree(env, dir); }
  } cleanup{st.env(), raw_dir};
  if (Status s = st.ConnectReference(a.dir, threads); !s.ok()) return s;

  TierBench bench(a, st, engine, raw_dir);
  if (a.log) {
    a.log(
        fmt::format("kvtier bench tier: {} chunks of {} MiB in {}, {} writers, {} readers, {} "
                    "repeats",
                    a.chunks, a.chunk_mib, a.dir, a.writers, a.readers, a.repeats));
  }
  for (int rep = 0; rep < a.repeats; ++rep) {
    if (Status s = bench.RunRepeat(rep); !s.ok()) return s;
  }
  TierBenchResult result = bench.Finish();
  result.connections = st.remote() ? connections : 0;
  return result;
}

nlohmann::json TierBenchResultToJson(const TierBenchOptions& a, const TierBenchResult& r) {
  return nlohmann::json{{"dir", a.dir},
                        {"chunk_mib", a.chunk_mib},
                        {"chunks", a.chunks},
                        {"readers", a.readers},
                        {"writers", a.writers},
                        {"repeats", a.repeats},
                        {"io_engine", r.io_engine},
                        {"o_direct", r.o_direct()},
                        {"write_GBps", r.tier_write.GBps()},
                        {"read_GBps", r.tier_read.GBps()},
                        {"raw_write_GBps", r.raw_write.GBps()},
                        {"raw_read_GBps", r.raw_read.GBps()},
                        {"write_ratio", r.write_ratio()},
                        {"read_ratio", r.read_ratio()},
                        {"page_cache_resident_bytes", r.page_cache_resident_bytes()},
                        {"tier_page_cache_resident_bytes", r.tier_page_cache_resident_bytes},
                        {"raw_page_cache_resident_bytes", r.raw_page_cache_resident_bytes},
                        {"tier_opened_o_direct", r.tier_opened_o_direct},
                        {"warnings", r.warning.empty() ? std::vector<std::string>{}
                                                       : std::vector<std::string>{r.warning}},
                        {"raw_write_includes_fdatasync", true},
                        {"reference", r.reference},
                        {"connections", r.connections},
                        {"nfs_connections", r.nfs ? r.connections : 0},
                        {"kept_namespaces", r.kept_namespaces}};
}

}  // namespace kvtier::benchmarks

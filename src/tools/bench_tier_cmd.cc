// kvtier bench tier: writes then reads chunks through the file tier, and in the same run does
// plain O_DIRECT writes and reads of files of the same size with the same concurrency (the
// physical limit this tier is held to).
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "io/nfs_raw.h"
#include "io/s3_raw.h"
#include "kvtier/cache_dir.h"
#include "kvtier/file_tier.h"
#include "kvtier/io.h"
#include "probe/storage_probe.h"
#include "tools/command.h"
#include "tools/raw_io.h"

namespace kvtier::tools {
namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

struct BenchTierArgs {
  std::string dir;
  uint64_t chunk_mib = 32;
  uint32_t chunks = 32;
  int readers = 4;
  int writers = 4;
  int repeats = 4;
  std::string io_engine = "auto";
  int io_depth = 8;
  uint64_t request_kib = 4096;
  uint64_t write_request_kib = 65536;
  int connections = 0;  // nfs:// and s3://; 0: max(readers, writers) for NFS, 4x that for S3
  int s3_part_mib = 0;  // s3:// only; 0: the env's default
  bool keep = false;
  bool json = false;
};

struct Totals {
  uint64_t bytes = 0;
  double seconds = 0;
  double GBps() const { return seconds > 0 ? bytes / seconds / 1e9 : 0; }
};

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

int RunBenchTier(const BenchTierArgs& a) {
  auto fail = [](const std::string& msg) {
    fmt::print(stderr, "kvtier bench tier: {}\n", msg);
    return 1;
  };
  if (a.chunk_mib == 0 || a.chunk_mib > 4096) return fail("--chunk-mib must be in [1, 4096]");
  if (a.chunks == 0) return fail("--chunks must be positive");
  if (a.readers < 1 || a.readers > 256 || a.writers < 1 || a.writers > 256) {
    return fail("--readers and --writers must be in [1, 256]");
  }
  if (a.repeats < 1) return fail("--repeats must be positive");
  auto engine = ParseIoEngineKind(a.io_engine);
  if (!engine.ok()) return fail(engine.status().message());
  // On NFS (nfs://, no kernel mount) the reference is plain libnfs with every request of a file
  // in flight (io::NfsRawClient), one connection per thread, and the tier gets as many
  // connections as there are threads. On S3 (s3://) it is plain libcurl, one whole-object PUT or
  // GET at a time per thread (io::S3RawClient), and the tier, whose reads are ranged GETs of
  // several parts at once, gets four connections per thread.
  const bool nfs = IsNfsUrl(a.dir), s3 = IsS3Url(a.dir), remote = nfs || s3;
  const int threads = std::max(a.readers, a.writers);
  const int connections = a.connections > 0 ? a.connections : (s3 ? 4 : 1) * threads;
  if (connections > 256) return fail("--connections must be in [1, 256]");
  std::unique_ptr<Env> remote_env;
  Env* env = Env::Default();
  if (nfs) {
    NfsEnvOptions no;
    no.url = a.dir;
    no.connections = connections;
    no.requests_in_flight = a.io_depth;
    no.max_request_bytes = std::max<uint64_t>(a.request_kib << 10, 4096);
    auto made = NewNfsEnv(no);
    if (!made.ok()) return fail(made.status().ToString());
    remote_env = std::move(*made);
  } else if (s3) {
    S3EnvOptions so;
    so.url = a.dir;
    so.connections = connections;
    if (a.s3_part_mib > 0) so.part_bytes = static_cast<size_t>(a.s3_part_mib) << 20;
    auto made = NewS3Env(so);
    if (!made.ok()) return fail(made.status().ToString());
    remote_env = std::move(*made);
  }
  if (remote_env) env = remote_env.get();
  if (Status s = env->CreateDirs(a.dir); !s.ok()) {
    return fail(fmt::format("cannot use {} as a directory: {}", a.dir, s.ToString()));
  }
  const uint64_t chunk = a.chunk_mib << 20;
  const uint64_t per_repeat = 2 * a.chunks * (chunk + 4096);
  struct statvfs vfs;
  if (!remote && ::statvfs(a.dir.c_str(), &vfs) == 0) {
    uint64_t avail = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    if (avail < per_repeat + (256u << 20)) {
      return fail(
          fmt::format("{} has {:.2f} GB free; this run needs {:.2f} GB (lower --chunks or "
                      "--chunk-mib)",
                      a.dir, avail / 1e9, (per_repeat + (256u << 20)) / 1e9));
    }
  }

  const std::string raw_dir = fmt::format("{}/.kvtier-bench-raw-{}", a.dir, getpid());
  if (Status s = env->CreateDirs(raw_dir); !s.ok()) {
    return fail(fmt::format("cannot create {}: {}", raw_dir, s.ToString()));
  }
  struct Cleanup {
    Env* env;
    std::string dir;
    ~Cleanup() { (void)RemoveTree(*env, dir); }
  } cleanup{env, raw_dir};

  // The reference's plain writes and reads: O_DIRECT system calls, libnfs's or libcurl's calls.
  std::vector<std::unique_ptr<io::NfsRawClient>> nfs_clients;
  std::vector<std::unique_ptr<io::S3RawClient>> s3_clients;
  for (int t = 0; remote && t < threads; ++t) {
    if (nfs) {
      auto c = io::NfsRawClient::Connect(a.dir);
      if (!c.ok()) return fail(c.status().ToString());
      nfs_clients.push_back(std::move(*c));
    } else {
      auto c = io::S3RawClient::Connect(a.dir);
      if (!c.ok()) return fail(c.status().ToString());
      s3_clients.push_back(std::move(*c));
    }
  }
  auto raw_write_file = [&](int t, const std::string& path, std::span<const uint8_t> buf) {
    return nfs  ? nfs_clients[t]->WriteFile(path, buf)
           : s3 ? s3_clients[t]->WriteFile(path, buf)
                : RawWrite(path, buf);
  };
  auto raw_read_file = [&](int t, const std::string& path, std::span<uint8_t> buf) {
    return nfs  ? nfs_clients[t]->ReadFile(path, buf)
           : s3 ? s3_clients[t]->ReadFile(path, buf)
                : RawRead(path, buf);
  };
  const char* raw_name = nfs ? "raw libnfs" : s3 ? "raw libcurl" : "raw O_DIRECT";

  const int bufs = std::max(a.readers, a.writers);
  BufferPool pool(bufs, chunk);
  std::mt19937_64 rng(std::random_device{}());
  for (int b = 0; b < bufs; ++b) {
    auto span = pool.at(b).span();
    for (size_t i = 0; i + 8 <= span.size(); i += 8) {
      uint64_t v = rng();
      std::memcpy(span.data() + i, &v, 8);
    }
  }

  Totals raw_w, raw_r, tier_w, tier_r;
  bool o_direct = true;
  std::string io_engine_name;
  uint64_t raw_resident = 0, tier_resident = 0;
  std::vector<std::string> kept_namespaces;
  const std::string salt = fmt::format("{:016x}", rng());
  auto progress = [&](const char* what, uint64_t bytes, double s) {
    fmt::print(stderr, "  {:<11} {:>6.2f} GB/s  ({} x {} MiB in {:.2f} s)\n", what, bytes / s / 1e9,
               a.chunks, a.chunk_mib, s);
  };
  fmt::print(stderr,
             "kvtier bench tier: {} chunks of {} MiB in {}, {} writers, {} readers, {} repeats\n",
             a.chunks, a.chunk_mib, a.dir, a.writers, a.readers, a.repeats);

  for (int rep = 0; rep < a.repeats; ++rep) {
    FileTierOptions o;
    o.root = a.dir;
    o.ns.model_id = "kvtier-bench-tier";
    o.ns.chunk_tokens = 256;
    o.ns.tenant_salt = fmt::format("{}-{}", salt, rep);  // a fresh namespace: no stale chunks
    o.chunk_bytes = chunk;
    o.read_threads = a.readers;
    o.write_threads = a.writers;
    o.max_queued_reads = o.max_queued_writes = static_cast<size_t>(bufs);
    o.io_engine = *engine;
    o.io_queue_depth = a.io_depth;
    o.io_request_bytes = a.request_kib << 10;
    o.io_write_request_bytes = a.write_request_kib << 10;
    if (remote) o.env = env;
    auto opened = FileTier::Open(o);
    if (!opened.ok()) return fail(opened.status().ToString());
    FileTier& tier = **opened;
    io_engine_name = tier.Stats().io_engine;
    std::vector<ChunkKey> keys;
    for (uint32_t i = 0; i < a.chunks; ++i) {
      std::string s = fmt::format("bench-{}-{}-{}", salt, rep, i);
      keys.push_back(*ChunkKey::FromOpaque({reinterpret_cast<const uint8_t*>(s.data()), s.size()}));
    }
    std::vector<std::string> raw_paths, tier_paths;
    for (uint32_t i = 0; i < a.chunks; ++i) {
      raw_paths.push_back(fmt::format("{}/raw-{}-{}", raw_dir, rep, i));
      tier_paths.push_back(tier.ChunkPath(keys[i]));
    }
    std::atomic<bool> raw_failed{false};
    Status raw_error, tier_error;
    std::mutex raw_mu;
    auto raw_write = [&] {
      double s = Parallel(a.writers, a.chunks, [&](int t, uint32_t i) {
        Status st = raw_write_file(t, raw_paths[i], pool.at(t % bufs).first(chunk));
        if (!st.ok() && !raw_failed.exchange(true)) {
          std::lock_guard<std::mutex> lock(raw_mu);
          raw_error = st;
        }
      });
      raw_w.bytes += a.chunks * chunk;
      raw_w.seconds += s;
      progress("raw write", a.chunks * chunk, s);
    };
    auto tier_write = [&] {
      double s = TierPhase(
          pool, a.chunks,
          [&](uint32_t i, AlignedBuffer& b, auto done) {
            return tier.WriteAsync(keys[i], b.first(chunk), done);
          },
          &tier_error);
      tier_w.bytes += a.chunks * chunk;
      tier_w.seconds += s;
      progress("tier write", a.chunks * chunk, s);
    };
    auto raw_read = [&] {
      double s = Parallel(a.readers, a.chunks, [&](int t, uint32_t i) {
        Status st = raw_read_file(t, raw_paths[i], pool.at(t % bufs).first(chunk));
        if (!st.ok() && !raw_failed.exchange(true)) {
          std::lock_guard<std::mutex> lock(raw_mu);
          raw_error = st;
        }
      });
      raw_r.bytes += a.chunks * chunk;
      raw_r.seconds += s;
      progress("raw read", a.chunks * chunk, s);
    };
    auto tier_read = [&] {
      double s = TierPhase(
          pool, a.chunks,
          [&](uint32_t i, AlignedBuffer& b, auto done) {
            return tier.ReadAsync(keys[i], b.first(chunk), done);
          },
          &tier_error);
      tier_r.bytes += a.chunks * chunk;
      tier_r.seconds += s;
      progress("tier read", a.chunks * chunk, s);
    };
    // Alternate which goes first, so that drift on a shared machine hits both alike.
    if (rep % 2 == 0) {
      raw_write();
      tier_write();
    } else {
      tier_write();
      raw_write();
    }
    if (!raw_error.ok()) return fail(raw_error.ToString());
    if (!tier_error.ok()) return fail(tier_error.ToString());
    if (!remote) {  // over NFS or S3 this client caches nothing; the server's cache is its own
      DropFromPageCache(raw_paths);
      DropFromPageCache(tier_paths);
    }
    if (rep % 2 == 0) {
      raw_read();
      tier_read();
    } else {
      tier_read();
      raw_read();
    }
    if (!raw_error.ok()) return fail(raw_error.ToString());
    if (!tier_error.ok()) return fail(tier_error.ToString());
    FileTierStats st = tier.Stats();
    if (st.hits != a.chunks) {
      return fail(fmt::format("the tier served {} of {} chunks", st.hits, a.chunks));
    }
    // The tier opening its files with O_DIRECT proves nothing by itself: tmpfs accepts the flag
    // and serves every read from the page cache. What counts is that the files read are not in
    // the page cache afterwards (they were dropped from it before the read phase).
    o_direct = o_direct && st.o_direct;
    if (!remote) {
      raw_resident += probe::MeasurePageCacheResidency(raw_paths).resident_bytes;
      tier_resident += probe::MeasurePageCacheResidency(tier_paths).resident_bytes;
    }
    std::string ns_id = o.ns.Id();
    opened.value().reset();
    for (const auto& p : raw_paths) (void)env->Unlink(p);
    if (a.keep) {
      kept_namespaces.push_back(ns_id);
    } else {
      auto purged = PurgeCacheDir(a.dir, ns_id, env);
      if (!purged.ok()) fmt::print(stderr, "warning: {}\n", purged.status().ToString());
    }
  }

  const double rr = tier_r.GBps() / raw_r.GBps(), wr = tier_w.GBps() / raw_w.GBps();
  const uint64_t resident = raw_resident + tier_resident;
  const bool tier_opened_o_direct = o_direct;
  std::string warning;
  if (!tier_opened_o_direct) {
    warning = fmt::format(
        "the file tier could not open its files with O_DIRECT in {}: its reads "
        "went through the page cache",
        a.dir);
  } else if (resident > 0) {
    warning = fmt::format(
        "O_DIRECT was accepted but not honoured in {}: after the read phases the page cache held "
        "{} bytes of the files read ({} of the tier's, {} of the raw files'; tmpfs, or a "
        "filesystem that ignores the flag); these figures are page-cache figures, not storage",
        a.dir, resident, tier_resident, raw_resident);
  }
  o_direct = warning.empty();
  if (a.json) {
    nlohmann::json j = {{"dir", a.dir},
                        {"chunk_mib", a.chunk_mib},
                        {"chunks", a.chunks},
                        {"readers", a.readers},
                        {"writers", a.writers},
                        {"repeats", a.repeats},
                        {"io_engine", io_engine_name},
                        {"o_direct", o_direct},
                        {"write_GBps", tier_w.GBps()},
                        {"read_GBps", tier_r.GBps()},
                        {"raw_write_GBps", raw_w.GBps()},
                        {"raw_read_GBps", raw_r.GBps()},
                        {"write_ratio", wr},
                        {"read_ratio", rr},
                        {"page_cache_resident_bytes", resident},
                        {"tier_page_cache_resident_bytes", tier_resident},
                        {"raw_page_cache_resident_bytes", raw_resident},
                        {"tier_opened_o_direct", tier_opened_o_direct},
                        {"warnings", warning.empty() ? std::vector<std::string>{}
                                                     : std::vector<std::string>{warning}},
                        {"raw_write_includes_fdatasync", true},
                        {"reference", raw_name},
                        {"connections", remote ? connections : 0},
                        {"nfs_connections", nfs ? connections : 0},
                        {"kept_namespaces", kept_namespaces}};
    fmt::print("{}\n", j.dump(2));
  } else {
    fmt::print("tier write   {:6.2f} GB/s   {} write {:6.2f} GB/s   ratio {:.2f}\n", tier_w.GBps(),
               raw_name, raw_w.GBps(), wr);
    fmt::print("tier read    {:6.2f} GB/s   {} read  {:6.2f} GB/s   ratio {:.2f}\n", tier_r.GBps(),
               raw_name, raw_r.GBps(), rr);
    if (remote) {
      fmt::print(
          "{}: {} connections for the tier, one per thread for the reference; this client "
          "caches nothing, the server may serve reads from its memory\n",
          nfs ? "NFS" : "S3", connections);
    } else {
      fmt::print("o_direct {}, io engine {}, page cache holding {} bytes of the files afterwards\n",
                 o_direct, io_engine_name, resident);
    }
    if (a.keep) {
      fmt::print("kept the chunk files in {} (namespaces {})\n", a.dir,
                 fmt::join(kept_namespaces, ", "));
    }
  }
  if (!warning.empty()) {
    // Loud and fatal: a figure that looks like storage but is the page cache must not pass.
    fmt::print(stderr, "kvtier bench tier: WARNING: {} (exit status 1)\n", warning);
    return 1;
  }
  return 0;
}

void AddBenchTier(CLI::App& parent, CommandContext& ctx) {
  auto args = std::make_shared<BenchTierArgs>();
  auto* cmd = parent.add_subcommand(
      "tier",
      "Write then read chunks through the file tier, and compare with plain O_DIRECT writes and "
      "reads of same-size files at the same concurrency, measured in the same run");
  cmd->add_option("--dir", args->dir,
                  "Directory to benchmark (a kvtier cache or a new one): a path, "
                  "nfs://HOST/EXPORT/PATH to speak NFS without a mount, or s3://BUCKET/PREFIX "
                  "(endpoint and credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)")
      ->required();
  cmd->add_option("--connections,--nfs-connections", args->connections,
                  "nfs:// and s3:// only: the tier's connections to the server (default: max of "
                  "--readers and --writers, the reference's connection count, for NFS; four "
                  "times that for S3, whose reads are ranged GETs of several parts at once)");
  cmd->add_option("--s3-part-mib", args->s3_part_mib,
                  "s3:// only: the tier's ranged-GET and upload part size in MiB (5-1024; "
                  "default 64, one GET per chunk)");
  cmd->add_option("--chunk-mib", args->chunk_mib, "Chunk payload size in MiB")
      ->capture_default_str();
  cmd->add_option("--chunks", args->chunks, "Chunks written and read per repeat")
      ->capture_default_str();
  cmd->add_option("--readers", args->readers, "Concurrent reads (tier read threads, raw readers)")
      ->capture_default_str();
  cmd->add_option("--writers", args->writers, "Concurrent writes (tier write threads, raw writers)")
      ->capture_default_str();
  cmd->add_option("--repeats", args->repeats,
                  "Rounds; raw and tier alternate going first, figures are totals over all")
      ->capture_default_str();
  cmd->add_option("--io-engine", args->io_engine, "auto, io_uring or threads")
      ->capture_default_str();
  cmd->add_option("--io-depth", args->io_depth, "Tier requests in flight per chunk")
      ->capture_default_str();
  cmd->add_option("--request-kib", args->request_kib, "Tier read request size in KiB")
      ->capture_default_str();
  cmd->add_option("--write-request-kib", args->write_request_kib, "Tier write request size in KiB")
      ->capture_default_str();
  cmd->add_flag("--keep", args->keep, "Leave the tier's chunk files in --dir");
  cmd->add_flag("--json", args->json, "Print the result as JSON on stdout");
  cmd->callback([args, &ctx] { ctx.exit_code = RunBenchTier(*args); });
}

const bool kRegistered = RegisterCommand("bench", &AddBenchTier);

}  // namespace
}  // namespace kvtier::tools

#include "probe/storage_probe.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <latch>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "kvtier/io.h"
#include "probe/units.h"

namespace kvtier::probe {
namespace {

constexpr uint64_t kAlign = 4096;   // buffer, offset and length alignment for O_DIRECT
constexpr uint64_t kSector = 4096;  // every sector carries a stamp
constexpr uint64_t kStampMagic = 0x6b76746965725052ull;  // "kvtierPR"

// Written at the start of every 4 KiB sector; lets a reader prove the bytes it got were written
// by this run, to this file, at this offset (not stale data, not zeros of a hole).
struct Stamp {
  uint64_t magic;
  uint64_t nonce;
  uint64_t file;
  uint64_t offset;
};
static_assert(sizeof(Stamp) == 32);

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<char, FreeDeleter>;

Result<AlignedBuffer> AllocateAligned(uint64_t bytes) {
  void* p = nullptr;
  if (int rc = posix_memalign(&p, kAlign, bytes); rc != 0) {
    return Status::FromErrno(rc, fmt::format("allocating a {} I/O buffer", FormatBytes(bytes)));
  }
  std::memset(p, 0,
              bytes);  // pre-fault: first touch of fresh memory is slow, keep it out of timing
  return AlignedBuffer(static_cast<char*>(p));
}

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// The probe's private directory and everything in it; removed on destruction unless kept.
class RunDirectory {
 public:
  static Result<std::unique_ptr<RunDirectory>> Create(const std::string& parent, bool keep) {
    std::string pattern = (std::filesystem::path(parent) / ".kvtier-probe-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) {
      return Status::FromErrno(errno, fmt::format("creating a directory in {}", parent));
    }
    return std::unique_ptr<RunDirectory>(new RunDirectory(pattern, keep));
  }
  ~RunDirectory() {
    if (keep_) return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  RunDirectory(std::string path, bool keep) : path_(std::move(path)), keep_(keep) {}
  std::string path_;
  bool keep_;
};

struct ProbeFile {
  std::string path;
  uint64_t id;  // stamped into its sectors
};

// A run's files: the pool (read by the readers), the control files (read once by one stream,
// then again), both in `all`; and the nonce that makes this run's stamps its own.
struct RunFiles {
  std::vector<ProbeFile> pool, control, all;
  uint64_t nonce;
};

RunFiles MakeRunFiles(const std::string& dir, int pool_count, int control_files) {
  RunFiles f;
  f.nonce = std::random_device{}() ^ (static_cast<uint64_t>(::getpid()) << 32) ^
            static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  for (int i = 0; i < pool_count; ++i) {
    f.pool.push_back({fmt::format("{}/pool-{:05}", dir, i), static_cast<uint64_t>(i)});
  }
  for (int i = 0; i < control_files; ++i) {
    f.control.push_back(
        {fmt::format("{}/control-{:05}", dir, i), static_cast<uint64_t>(pool_count + i)});
  }
  f.all = f.pool;
  f.all.insert(f.all.end(), f.control.begin(), f.control.end());
  return f;
}

bool Stopped(const std::atomic<bool>* stop) {
  return stop != nullptr && stop->load(std::memory_order_relaxed);
}

Status Interrupted() { return Status::Aborted("interrupted; the probe's files were removed"); }

void StampBlock(char* buf, uint64_t len, uint64_t nonce, uint64_t file, uint64_t offset) {
  for (uint64_t s = 0; s < len; s += kSector) {
    Stamp stamp{kStampMagic, nonce, file, offset + s};
    std::memcpy(buf + s, &stamp, sizeof(stamp));
  }
}

Status CheckBlock(const char* buf, uint64_t len, uint64_t nonce, const ProbeFile& file,
                  uint64_t offset) {
  for (uint64_t s = 0; s < len; s += kSector) {
    Stamp stamp;
    std::memcpy(&stamp, buf + s, sizeof(stamp));
    if (stamp.magic != kStampMagic || stamp.nonce != nonce || stamp.file != file.id ||
        stamp.offset != offset + s) {
      return Status::Corruption(fmt::format(
          "{} at offset {} holds bytes this run did not write there: the storage returned stale "
          "or foreign data",
          file.path, offset + s));
    }
  }
  return Status::Ok();
}

Status WriteOneFile(const ProbeFile& file, uint64_t file_size, uint64_t block_size, char* buf,
                    uint64_t nonce, bool direct, const std::atomic<bool>* stop) {
  int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | (direct ? O_DIRECT : 0);
  Fd fd(::open(file.path.c_str(), flags, 0644));
  if (fd.get() < 0) return Status::FromErrno(errno, fmt::format("creating {}", file.path));
  // Reserve the whole file first, as the file tier does: O_DIRECT writes then do not extend the
  // file, and concurrent writers do not interleave their files' extents on disk. Filesystems
  // without fallocate (EOPNOTSUPP; fallocate(2), not posix_fallocate, which would emulate it
  // with buffered writes of zeros) just extend the file as it is written.
  if (::fallocate(fd.get(), 0, 0, static_cast<off_t>(file_size)) != 0 && errno != EOPNOTSUPP &&
      errno != ENOSYS) {
    return Status::FromErrno(errno,
                             fmt::format("reserving {} for {}", FormatBytes(file_size), file.path));
  }
  for (uint64_t off = 0; off < file_size; off += block_size) {
    if (Stopped(stop)) return Interrupted();
    const uint64_t len = std::min(block_size, file_size - off);
    StampBlock(buf, len, nonce, file.id, off);
    uint64_t done = 0;
    while (done < len) {
      ssize_t n = ::pwrite(fd.get(), buf + done, len - done, static_cast<off_t>(off + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        return Status::FromErrno(errno,
                                 fmt::format("writing {} at offset {}", file.path, off + done));
      }
      done += static_cast<uint64_t>(n);
    }
  }
  if (::fdatasync(fd.get()) != 0) {
    return Status::FromErrno(errno, fmt::format("fdatasync of {}", file.path));
  }
  return Status::Ok();
}

Status ReadOneFile(const ProbeFile& file, uint64_t file_size, uint64_t block_size, char* buf,
                   uint64_t nonce, bool direct, const std::atomic<bool>* stop,
                   std::atomic<uint64_t>* verified) {
  Fd fd(::open(file.path.c_str(), O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0)));
  if (fd.get() < 0) return Status::FromErrno(errno, fmt::format("opening {}", file.path));
  for (uint64_t off = 0; off < file_size; off += block_size) {
    if (Stopped(stop)) return Interrupted();
    const uint64_t len = std::min(block_size, file_size - off);
    uint64_t done = 0;
    while (done < len) {
      ssize_t n = ::pread(fd.get(), buf + done, len - done, static_cast<off_t>(off + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        return Status::FromErrno(errno,
                                 fmt::format("reading {} at offset {}", file.path, off + done));
      }
      if (n == 0) {
        return Status::IOError(
            fmt::format("{} ended at {} bytes, expected {}", file.path, off + done, file_size));
      }
      done += static_cast<uint64_t>(n);
    }
    KVTIER_RETURN_IF_ERROR(CheckBlock(buf, len, nonce, file, off));
    verified->fetch_add(len, std::memory_order_relaxed);
  }
  return Status::Ok();
}

// Runs `work(thread_index, buffer)` on `threads` threads that start together once each has its
// buffer; returns the wall time from the common start to the last thread's end, or the first
// error any thread returned.
template <typename Work>
Result<double> RunTimed(int threads, uint64_t buffer_size, Work work) {
  std::vector<Status> results(threads);
  std::vector<AlignedBuffer> buffers;
  for (int t = 0; t < threads; ++t) {
    KVTIER_ASSIGN_OR_RETURN(AlignedBuffer buf, AllocateAligned(buffer_size));
    buffers.push_back(std::move(buf));
  }
  std::latch start(threads + 1);
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      start.arrive_and_wait();
      results[t] = work(t, buffers[t].get());
    });
  }
  start.arrive_and_wait();
  const auto t0 = Clock::now();
  for (auto& th : pool) th.join();
  const double seconds = SecondsSince(t0);
  for (const auto& st : results) {
    if (!st.ok()) return st;
  }
  return seconds;
}

// One file's transfer, with the calling thread's block-sized buffer.
using OneFile = std::function<Status(const ProbeFile& file, char* buf)>;

// Runs `one` over every file with `threads` threads, each on its own files: thread t takes files
// t, t + threads, t + 2 x threads, ... With `fill_seed` nonzero, each thread's buffer is first
// filled with random bytes, different per thread, so that written payloads do not compress.
Result<PhaseResult> OverFiles(const std::vector<ProbeFile>& files, int threads, uint64_t file_size,
                              uint64_t block_size, uint64_t fill_seed, const OneFile& one) {
  threads = std::max(1, std::min<int>(threads, static_cast<int>(files.size())));
  auto seconds = RunTimed(threads, block_size, [&](int t, char* buf) -> Status {
    if (fill_seed != 0) {
      std::mt19937_64 rng(fill_seed ^ (0x9e3779b97f4a7c15ull * static_cast<uint64_t>(t + 1)));
      for (uint64_t i = 0; i + sizeof(uint64_t) <= block_size; i += sizeof(uint64_t)) {
        uint64_t v = rng();
        std::memcpy(buf + i, &v, sizeof(v));
      }
    }
    for (size_t i = static_cast<size_t>(t); i < files.size(); i += static_cast<size_t>(threads)) {
      KVTIER_RETURN_IF_ERROR(one(files[i], buf));
    }
    return Status::Ok();
  });
  if (!seconds.ok()) return seconds.status();
  return PhaseResult{threads, file_size * files.size(), *seconds};
}

Result<PhaseResult> ReadFiles(const std::vector<ProbeFile>& files, int streams, uint64_t file_size,
                              uint64_t block_size, uint64_t nonce, bool direct,
                              const std::atomic<bool>* stop, std::atomic<uint64_t>* verified) {
  return OverFiles(files, streams, file_size, block_size, 0, [&](const ProbeFile& f, char* buf) {
    return ReadOneFile(f, file_size, block_size, buf, nonce, direct, stop, verified);
  });
}

Result<PhaseResult> WriteFiles(const std::vector<ProbeFile>& files, int writers, uint64_t file_size,
                               uint64_t block_size, uint64_t nonce, bool direct,
                               const std::atomic<bool>* stop) {
  return OverFiles(files, writers, file_size, block_size, nonce | 1,
                   [&](const ProbeFile& f, char* buf) {
                     return WriteOneFile(f, file_size, block_size, buf, nonce, direct, stop);
                   });
}

void DropFromPageCache(const std::vector<ProbeFile>& files) {
  for (const auto& f : files) {
    Fd fd(::open(f.path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() >= 0) {
      ::fdatasync(fd.get());
      ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED);
    }
  }
}

// Fraction of the files' pages present in the page cache.
double ResidentFraction(const std::vector<ProbeFile>& files) {
  std::vector<std::string> paths;
  for (const auto& f : files) paths.push_back(f.path);
  const PageCacheResidency r = MeasurePageCacheResidency(paths);
  if (r.total_bytes == 0) return 0.0;
  return static_cast<double>(r.resident_bytes) / static_cast<double>(r.total_bytes);
}

// First half of the O_DIRECT check, on a file already written: open flag and alignment.
ODirectCheck CheckODirectOpen(const std::string& path) {
  ODirectCheck check;
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT));
  if (fd.get() < 0) return check;
  check.open_accepted = true;
  int flags = ::fcntl(fd.get(), F_GETFL);
  check.flag_kept = flags >= 0 && (flags & O_DIRECT) != 0;
  void* p = nullptr;
  if (posix_memalign(&p, kAlign, 3 * kAlign) == 0) {
    AlignedBuffer buf(static_cast<char*>(p));
    errno = 0;
    ssize_t misaligned_buffer = ::pread(fd.get(), buf.get() + 1, kAlign, 0);
    const bool buffer_refused = misaligned_buffer < 0 && errno == EINVAL;
    errno = 0;
    ssize_t misaligned_offset = ::pread(fd.get(), buf.get(), kAlign, 1);
    const bool offset_refused = misaligned_offset < 0 && errno == EINVAL;
    check.alignment_enforced = buffer_refused || offset_refused;
  }
  return check;
}

const char* FilesystemName(const std::string& path) {
  struct statfs sf;
  if (::statfs(path.c_str(), &sf) != 0) return "unknown";
  switch (static_cast<unsigned long>(sf.f_type)) {
    case 0xEF53:
      return "ext4";
    case 0x58465342:
      return "xfs";
    case 0x9123683E:
      return "btrfs";
    case 0x01021994:
      return "tmpfs";
    case 0x6969:
      return "nfs";
    case 0xFE534D42:
      return "smb2";
    case 0xFF534D42:
      return "cifs";
    case 0x794c7630:
      return "overlayfs";
    case 0x65735546:
      return "fuse";
    case 0x2FC12FC1:
      return "zfs";
    case 0x00C36400:
      return "ceph";
    case 0x0BD00BD0:
      return "lustre";
    case 0x47504653:
      return "gpfs";
    case 0x5346414F:
      return "afs";
    case 0x858458F6:
      return "ramfs";
    case 0x4d44:
      return "vfat";
    case 0xF2F52010:
      return "f2fs";
    default:
      return "unknown";
  }
}

Status ValidateLocalDirectory(const StorageProbeOptions& o) {
  std::error_code ec;
  if (!std::filesystem::exists(o.directory, ec)) {
    return Status::InvalidArgument(fmt::format("directory {} does not exist", o.directory));
  }
  if (!std::filesystem::is_directory(o.directory, ec)) {
    return Status::InvalidArgument(fmt::format("{} is not a directory", o.directory));
  }
  if (::access(o.directory.c_str(), W_OK | X_OK) != 0) {
    return Status::InvalidArgument(fmt::format("directory {} is not writable", o.directory));
  }
  return Status::Ok();
}

// Everything but the directory, which is checked by the local or the NFS path.
Status ValidateSizes(const StorageProbeOptions& o) {
  if (o.block_size < kAlign || o.block_size % kAlign != 0 || o.block_size > (1ull << 30)) {
    return Status::InvalidArgument(fmt::format(
        "block size {} must be a multiple of 4 KiB between 4 KiB and 1 GiB", o.block_size));
  }
  if (o.file_size < kAlign || o.file_size % kAlign != 0) {
    return Status::InvalidArgument(fmt::format(
        "file size {} must be a positive multiple of 4 KiB (O_DIRECT needs aligned lengths)",
        o.file_size));
  }
  if (o.reader_counts.empty()) return Status::InvalidArgument("no reader counts given");
  for (int r : o.reader_counts) {
    if (r < 1 || r > 1024) {
      return Status::InvalidArgument(fmt::format("reader count {} is out of range [1, 1024]", r));
    }
  }
  if (o.files_per_reader < 1 || o.files_per_reader > 4096) {
    return Status::InvalidArgument("files per reader must be in [1, 4096]");
  }
  if (o.control_files < 1 || o.control_files > 4096) {
    return Status::InvalidArgument("control files must be in [1, 4096]");
  }
  if (o.writers < 1 || o.writers > 1024) {
    return Status::InvalidArgument("writers must be in [1, 1024]");
  }
  if (o.nfs_connections < 0 || o.nfs_connections > 256) {
    return Status::InvalidArgument(fmt::format(
        "NFS connections {} out of range [0, 256] (0: one per reader)", o.nfs_connections));
  }
  return Status::Ok();
}

void AddPlausibilityWarnings(StorageProbeReport& r) {
  const double memory = r.buffered_warm.GBps();
  const double control = r.control.GBps();
  if (r.o_direct.applicable && !r.o_direct.honoured) {
    r.warnings.push_back(fmt::format(
        "O_DIRECT was not honoured ({}): the read figures include the page cache and are not "
        "storage figures",
        r.o_direct.detail));
  }
  if (memory > 0 && control > 0.5 * memory) {
    r.warnings.push_back(fmt::format(
        "the control read ({:.2f} GB/s) is implausibly fast, over half the page-cache speed "
        "({:.2f} GB/s): reads are being served from memory (page cache or a caching layer below "
        "it), not from storage",
        control, memory));
  }
  for (const auto& phase : r.reads) {
    if (memory > 0 && phase.GBps() > 0.5 * memory) {
      r.warnings.push_back(fmt::format(
          "{} readers read at {:.2f} GB/s, over half the page-cache speed ({:.2f} GB/s): not a "
          "storage figure",
          phase.streams, phase.GBps(), memory));
    }
  }
  if (r.nfs && control > 0 && r.control_reread.GBps() > 1.3 * control) {
    r.warnings.push_back(fmt::format(
        "re-reading the control files over NFS ran at {:.2f} GB/s against {:.2f} GB/s the first "
        "time: the NFS server (or storage below it) serves repeated reads from a cache, so "
        "reader counts after the first may be inflated; quote the control",
        r.control_reread.GBps(), control));
  } else if (control > 0 && r.control_reread.GBps() > 1.3 * control) {
    r.warnings.push_back(fmt::format(
        "re-reading the control files with O_DIRECT ran at {:.2f} GB/s against {:.2f} GB/s the "
        "first time: a cache below the page cache (hypervisor, storage server, array) serves "
        "repeated reads, so reader counts after the first may be inflated; quote the control",
        r.control_reread.GBps(), control));
  }
  auto too_short = [&](const char* name, const PhaseResult& p) {
    if (p.bytes > 0 && p.seconds < 0.05) {
      r.warnings.push_back(fmt::format(
          "the {} phase took only {:.1f} ms, too short to time reliably: use a larger --file-size "
          "or more --files-per-reader / --control-files",
          name, p.seconds * 1e3));
    }
  };
  too_short("write", r.write);
  too_short("control", r.control);
  for (const auto& phase : r.reads)
    too_short(fmt::format("{}-reader", phase.streams).c_str(), phase);
}

// ---- nfs://: the same phases through the user-space NFS client ----
//
// libnfs keeps no cache on this side, so every read goes to the server: there is no page cache
// to bypass or to look into, and no buffered read to contrast with. What the server (or the
// storage below it) caches is the server's business; the control re-read shows it.

// The probe's private directory on the NFS server and everything in it; removed on destruction
// unless kept.
class NfsRunDirectory {
 public:
  static Result<std::unique_ptr<NfsRunDirectory>> Create(Env* env, const std::string& parent,
                                                         bool keep) {
    static constexpr char kChars[] =
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    std::random_device rd;
    for (int attempt = 0; attempt < 8; ++attempt) {
      std::string path = parent + "/.kvtier-probe-";
      for (int i = 0; i < 6; ++i) path.push_back(kChars[rd() % (sizeof(kChars) - 1)]);
      // CreateDirs succeeds on an existing directory, so skip names in use. Not atomic as
      // mkdtemp is: two runs drawing the same of 62^6 names at the same moment would share it.
      auto existing = env->Stat(path);
      if (existing.ok()) continue;
      if (existing.status().code() != StatusCode::kNotFound) return existing.status();
      if (Status s = env->CreateDirs(path); !s.ok()) {
        return Status::InvalidArgument(
            fmt::format("directory {} is not writable: {}", parent, s.ToString()));
      }
      return std::unique_ptr<NfsRunDirectory>(new NfsRunDirectory(env, std::move(path), keep));
    }
    return Status::IOError(fmt::format("no free name for the probe's directory in {}", parent));
  }
  ~NfsRunDirectory() {
    if (!keep_) (void)RemoveTree(*env_, path_);
  }
  const std::string& path() const { return path_; }

 private:
  NfsRunDirectory(Env* env, std::string path, bool keep)
      : env_(env), path_(std::move(path)), keep_(keep) {}
  Env* env_;
  std::string path_;
  bool keep_;
};

std::span<uint8_t> Bytes(char* buf, uint64_t len) {
  return {reinterpret_cast<uint8_t*>(buf), static_cast<size_t>(len)};
}

// Creates the file, writes it in `block_size` requests, then COMMITs it (the NFS fdatasync).
// NFSv3 has no preallocation: the writes extend the file.
Status NfsWriteOneFile(Env& env, const ProbeFile& file, uint64_t file_size, uint64_t block_size,
                       char* buf, uint64_t nonce, const std::atomic<bool>* stop) {
  OpenOptions create;
  create.write = create.create = create.exclusive = true;
  KVTIER_ASSIGN_OR_RETURN(auto f, env.Open(file.path, create));
  for (uint64_t off = 0; off < file_size; off += block_size) {
    if (Stopped(stop)) return Interrupted();
    const uint64_t len = std::min(block_size, file_size - off);
    StampBlock(buf, len, nonce, file.id, off);
    IoOp op = IoOp::Write(off, Bytes(buf, len));
    KVTIER_RETURN_IF_ERROR(WriteExact(*f, std::span<IoOp>(&op, 1)));
  }
  return f->Sync();
}

// Opens the file (on the env's next connection, round robin) and reads it one `block_size`
// request at a time, checking every sector's stamp.
Status NfsReadOneFile(Env& env, const ProbeFile& file, uint64_t file_size, uint64_t block_size,
                      char* buf, uint64_t nonce, const std::atomic<bool>* stop,
                      std::atomic<uint64_t>* verified) {
  KVTIER_ASSIGN_OR_RETURN(auto f, env.Open(file.path, OpenOptions{}));
  for (uint64_t off = 0; off < file_size; off += block_size) {
    if (Stopped(stop)) return Interrupted();
    const uint64_t len = std::min(block_size, file_size - off);
    IoOp op = IoOp::Read(off, Bytes(buf, len));
    KVTIER_RETURN_IF_ERROR(ReadExact(*f, std::span<IoOp>(&op, 1)));
    KVTIER_RETURN_IF_ERROR(CheckBlock(buf, len, nonce, file, off));
    verified->fetch_add(len, std::memory_order_relaxed);
  }
  return Status::Ok();
}

// As ReadFiles. Each reader opens its own files from its own thread, one at a time: with one
// file per reader the R readers' opens take R consecutive turns of the env's round robin, so
// with at least R connections no two readers share one.
Result<PhaseResult> NfsReadFiles(Env& env, const std::vector<ProbeFile>& files, int streams,
                                 uint64_t file_size, uint64_t block_size, uint64_t nonce,
                                 const std::atomic<bool>* stop, std::atomic<uint64_t>* verified) {
  return OverFiles(files, streams, file_size, block_size, 0, [&](const ProbeFile& f, char* buf) {
    return NfsReadOneFile(env, f, file_size, block_size, buf, nonce, stop, verified);
  });
}

Result<PhaseResult> NfsWriteFiles(Env& env, const std::vector<ProbeFile>& files, int writers,
                                  uint64_t file_size, uint64_t block_size, uint64_t nonce,
                                  const std::atomic<bool>* stop) {
  return OverFiles(files, writers, file_size, block_size, nonce | 1,
                   [&](const ProbeFile& f, char* buf) {
                     return NfsWriteOneFile(env, f, file_size, block_size, buf, nonce, stop);
                   });
}

// NewNfsEnv's failure, said for people: kUnavailable means nothing answered.
Status NfsConnectError(const std::string& url, const Status& s) {
  if (s.code() != StatusCode::kUnavailable) return s;  // e.g. NotFound: says what it is
  return Status::Unavailable(
      fmt::format("{}: cannot reach an NFS server there: {}", url, s.message()));
}

Result<StorageProbeReport> RunNfsProbe(const StorageProbeOptions& o) {
  auto progress = [&](const std::string& line) {
    if (o.progress) o.progress(line);
  };
  std::string directory = o.directory;
  while (directory.size() > 1 && directory.back() == '/') directory.pop_back();
  const uint64_t block_size = std::min(o.block_size, o.file_size);
  const int max_readers = *std::max_element(o.reader_counts.begin(), o.reader_counts.end());
  const int pool_count = max_readers * o.files_per_reader;
  const uint64_t total_bytes = o.file_size * static_cast<uint64_t>(pool_count + o.control_files);

  NfsEnvOptions no;
  no.url = directory;
  no.connections = o.nfs_connections > 0 ? o.nfs_connections : std::min(max_readers, 256);
  // One probe request of block_size is one NFS READ or WRITE where the server's rsize/wsize
  // allow it; a larger one is split into pieces of those, pipelined.
  no.max_request_bytes = static_cast<size_t>(block_size);
  auto made = NewNfsEnv(no);
  if (!made.ok()) return NfsConnectError(directory, made.status());
  std::unique_ptr<Env> env = std::move(*made);
  auto info = env->Stat(directory);
  if (!info.ok()) {
    if (info.status().code() == StatusCode::kNotFound) {
      return Status::InvalidArgument(fmt::format("directory {} does not exist", directory));
    }
    return info.status();
  }
  if (!info->is_directory) {
    return Status::InvalidArgument(fmt::format("{} is not a directory", directory));
  }

  StorageProbeReport report;
  report.directory = directory;
  report.filesystem = "nfs (libnfs, user space)";
  report.nfs = true;
  report.nfs_connections = no.connections;
  report.file_size = o.file_size;
  report.block_size = block_size;
  report.pool_files = pool_count;
  report.control_files = o.control_files;
  report.o_direct.applicable = false;
  report.o_direct.detail =
      "not applicable: this NFS client (libnfs, user space) has no page cache, every read is "
      "sent to the server; the server may still serve reads from its own cache (see the control "
      "re-read)";

  KVTIER_ASSIGN_OR_RETURN(auto run_dir,
                          NfsRunDirectory::Create(env.get(), directory, o.keep_files));
  auto [pool, control, all, nonce] = MakeRunFiles(run_dir->path(), pool_count, o.control_files);
  std::atomic<uint64_t> verified{0};

  progress(
      fmt::format("writing {} files of {} ({} in all) into {} with {} writers over NFS ({} "
                  "connections, COMMIT per file)",
                  all.size(), FormatBytes(o.file_size), FormatBytes(total_bytes), run_dir->path(),
                  std::min<size_t>(o.writers, all.size()), no.connections));
  KVTIER_ASSIGN_OR_RETURN(
      report.write, NfsWriteFiles(*env, all, o.writers, o.file_size, block_size, nonce, o.stop));
  progress(fmt::format("  write: {:.2f} GB/s", report.write.GBps()));

  for (int readers : o.reader_counts) {
    progress(
        fmt::format("reading {} files with {} readers, each on its own files, over {} NFS "
                    "connections",
                    pool.size(), readers, no.connections));
    KVTIER_ASSIGN_OR_RETURN(PhaseResult phase, NfsReadFiles(*env, pool, readers, o.file_size,
                                                            block_size, nonce, o.stop, &verified));
    progress(fmt::format("  {} readers: {:.2f} GB/s", readers, phase.GBps()));
    report.reads.push_back(phase);
  }

  progress(fmt::format("control: 1 stream reading {} fresh files", control.size()));
  KVTIER_ASSIGN_OR_RETURN(report.control, NfsReadFiles(*env, control, 1, o.file_size, block_size,
                                                       nonce, o.stop, &verified));
  progress(fmt::format("  control: {:.2f} GB/s", report.control.GBps()));
  progress("control again: the same files, second read");
  KVTIER_ASSIGN_OR_RETURN(
      report.control_reread,
      NfsReadFiles(*env, control, 1, o.file_size, block_size, nonce, o.stop, &verified));
  progress(fmt::format("  control re-read: {:.2f} GB/s", report.control_reread.GBps()));
  progress(
      "O_DIRECT check, page-cache residency and buffered reads: not applicable over NFS "
      "(no client cache)");

  report.verified_bytes = verified.load();
  AddPlausibilityWarnings(report);
  if (o.keep_files) progress(fmt::format("files kept in {}", run_dir->path()));
  return report;
}

}  // namespace

PageCacheResidency MeasurePageCacheResidency(const std::vector<std::string>& paths) {
  PageCacheResidency r;
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec;
  for (const auto& path : paths) {
    Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) continue;
    struct stat st;
    if (::fstat(fd.get(), &st) != 0 || st.st_size <= 0) continue;
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd.get(), 0);
    if (map == MAP_FAILED) continue;
    vec.resize((size + page - 1) / page);
    if (::mincore(map, size, vec.data()) == 0) {
      for (size_t i = 0; i < vec.size(); ++i) {
        // The last page counts only the file's bytes in it.
        if (vec[i] & 1) r.resident_bytes += std::min<uint64_t>(page, size - i * page);
      }
      r.total_bytes += size;
    }
    ::munmap(map, size);
  }
  return r;
}

Result<StorageProbeReport> RunStorageProbe(const StorageProbeOptions& o) {
  if (o.directory.empty()) return Status::InvalidArgument("no directory given");
  if (IsS3Url(o.directory)) {
    return Status::InvalidArgument(fmt::format(
        "{}: bench storage probes filesystems (O_DIRECT, page cache); for S3 run `kvtier bench "
        "tier --dir {}`, which compares the tier with plain libcurl GETs and PUTs",
        o.directory, o.directory));
  }
  if (IsNfsUrl(o.directory)) {
    KVTIER_RETURN_IF_ERROR(ValidateSizes(o));
    return RunNfsProbe(o);
  }
  KVTIER_RETURN_IF_ERROR(ValidateLocalDirectory(o));
  KVTIER_RETURN_IF_ERROR(ValidateSizes(o));
  auto progress = [&](const std::string& line) {
    if (o.progress) o.progress(line);
  };
  const uint64_t block_size = std::min(o.block_size, o.file_size);
  const int max_readers = *std::max_element(o.reader_counts.begin(), o.reader_counts.end());
  const int pool_count = max_readers * o.files_per_reader;
  const uint64_t total_bytes = o.file_size * static_cast<uint64_t>(pool_count + o.control_files);

  struct statvfs vfs;
  if (::statvfs(o.directory.c_str(), &vfs) == 0) {
    const uint64_t avail = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    if (total_bytes + total_bytes / 20 > avail) {
      return Status::NoSpace(fmt::format(
          "the probe needs {} in {} but only {} is free: use a smaller --file-size, fewer "
          "--readers or fewer --control-files",
          FormatBytes(total_bytes), o.directory, FormatBytes(avail)));
    }
  }

  StorageProbeReport report;
  report.directory = o.directory;
  report.filesystem = FilesystemName(o.directory);
  report.file_size = o.file_size;
  report.block_size = block_size;
  report.pool_files = pool_count;
  report.control_files = o.control_files;

  KVTIER_ASSIGN_OR_RETURN(auto run_dir, RunDirectory::Create(o.directory, o.keep_files));
  auto [pool, control, all, nonce] = MakeRunFiles(run_dir->path(), pool_count, o.control_files);

  // Does this filesystem take O_DIRECT at all? Try on a scratch file first, so a refusal is a
  // reported fact rather than a failed write.
  bool direct = true;
  {
    const std::string scratch = run_dir->path() + "/o-direct-check";
    Fd fd(::open(scratch.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | O_DIRECT, 0644));
    if (fd.get() < 0) {
      if (errno != EINVAL) return Status::FromErrno(errno, fmt::format("creating {}", scratch));
      direct = false;
    }
    ::unlink(scratch.c_str());
  }

  std::atomic<uint64_t> verified{0};
  progress(fmt::format("writing {} files of {} ({} in all) into {} with {} writers{}", all.size(),
                       FormatBytes(o.file_size), FormatBytes(total_bytes), run_dir->path(),
                       std::min<size_t>(o.writers, all.size()),
                       direct ? ", O_DIRECT" : ", buffered"));
  KVTIER_ASSIGN_OR_RETURN(
      report.write, WriteFiles(all, o.writers, o.file_size, block_size, nonce, direct, o.stop));
  progress(fmt::format("  write: {:.2f} GB/s", report.write.GBps()));

  if (direct) {
    report.o_direct = CheckODirectOpen(control.front().path);
  } else {
    DropFromPageCache(all);  // without O_DIRECT, at least start every read from storage
  }

  for (int readers : o.reader_counts) {
    if (!direct) DropFromPageCache(pool);
    progress(fmt::format("reading {} files with {} readers, each on its own files", pool.size(),
                         readers));
    KVTIER_ASSIGN_OR_RETURN(PhaseResult phase, ReadFiles(pool, readers, o.file_size, block_size,
                                                         nonce, direct, o.stop, &verified));
    progress(fmt::format("  {} readers: {:.2f} GB/s", readers, phase.GBps()));
    report.reads.push_back(phase);
  }
  const double pool_resident = ResidentFraction(pool);

  // The control comes after the pool phases, not right after the writes: storage that is still
  // absorbing the writes (a hypervisor's or server's write-back) would slow it down.
  progress(fmt::format("control: 1 stream reading {} fresh files", control.size()));
  KVTIER_ASSIGN_OR_RETURN(report.control, ReadFiles(control, 1, o.file_size, block_size, nonce,
                                                    direct, o.stop, &verified));
  progress(fmt::format("  control: {:.2f} GB/s", report.control.GBps()));
  const double control_resident = ResidentFraction(control);

  if (!direct) DropFromPageCache(control);
  progress("control again: the same files, second read");
  KVTIER_ASSIGN_OR_RETURN(report.control_reread, ReadFiles(control, 1, o.file_size, block_size,
                                                           nonce, direct, o.stop, &verified));
  progress(fmt::format("  control re-read: {:.2f} GB/s", report.control_reread.GBps()));

  progress(
      "buffered reads for contrast: cold (after dropping the files from the page cache), "
      "then warm");
  DropFromPageCache(pool);
  KVTIER_ASSIGN_OR_RETURN(report.buffered_cold, ReadFiles(pool, 1, o.file_size, block_size, nonce,
                                                          false, o.stop, &verified));
  KVTIER_ASSIGN_OR_RETURN(report.buffered_warm, ReadFiles(pool, 1, o.file_size, block_size, nonce,
                                                          false, o.stop, &verified));
  progress(fmt::format("  buffered: cold {:.2f} GB/s, warm {:.2f} GB/s",
                       report.buffered_cold.GBps(), report.buffered_warm.GBps()));
  DropFromPageCache(pool);

  ODirectCheck& c = report.o_direct;
  c.resident_fraction = std::max(control_resident, pool_resident);
  c.honoured = direct && c.open_accepted && c.flag_kept && c.resident_fraction < 0.02;
  if (!direct || !c.open_accepted) {
    c.detail = fmt::format(
        "{} refuses O_DIRECT (EINVAL); reads were buffered after dropping the "
        "files from the page cache",
        report.filesystem);
  } else if (!c.flag_kept) {
    c.detail = "open() accepted O_DIRECT but the file descriptor does not carry the flag";
  } else if (c.resident_fraction >= 0.02) {
    c.detail = fmt::format(
        "O_DIRECT reads left {:.0f}% of the files' pages in the page cache: the filesystem "
        "ignores O_DIRECT",
        c.resident_fraction * 100);
  } else {
    c.detail = fmt::format(
        "page cache bypassed: no pages of the files were cached after the "
        "reads; misaligned O_DIRECT I/O {}",
        c.alignment_enforced ? "is refused (EINVAL)"
                             : "is accepted (the filesystem does not enforce "
                               "alignment, as NFS and tmpfs do not)");
  }
  report.verified_bytes = verified.load();
  AddPlausibilityWarnings(report);
  if (o.keep_files) progress(fmt::format("files kept in {}", run_dir->path()));
  return report;
}

std::string StorageProbeReportToJson(const StorageProbeReport& r) {
  nlohmann::json j;
  j["directory"] = r.directory;
  j["filesystem"] = r.filesystem;
  j["file_size_bytes"] = r.file_size;
  j["block_size_bytes"] = r.block_size;
  j["pool_files"] = r.pool_files;
  j["control_files"] = r.control_files;
  // What does not apply (over NFS: no client page cache) is null, neither false nor 0.
  const bool pc = r.o_direct.applicable;
  j["o_direct"] = pc ? nlohmann::json(r.o_direct.honoured) : nlohmann::json(nullptr);
  j["o_direct_applicable"] = pc;
  j["o_direct_detail"] = r.o_direct.detail;
  j["o_direct_alignment_enforced"] =
      pc ? nlohmann::json(r.o_direct.alignment_enforced) : nlohmann::json(nullptr);
  j["page_cache_resident_fraction"] =
      pc ? nlohmann::json(r.o_direct.resident_fraction) : nlohmann::json(nullptr);
  j["nfs_connections"] = r.nfs_connections;
  j["readers"] = nlohmann::json::array();
  for (const auto& p : r.reads) {
    j["readers"].push_back({{"readers", p.streams},
                            {"read_GBps", p.GBps()},
                            {"bytes", p.bytes},
                            {"seconds", p.seconds}});
  }
  j["control_GBps"] = r.control.GBps();
  j["control_reread_GBps"] = r.control_reread.GBps();
  j["buffered_read_GBps"] = pc ? nlohmann::json(r.buffered_warm.GBps()) : nlohmann::json(nullptr);
  j["buffered_cold_read_GBps"] =
      pc ? nlohmann::json(r.buffered_cold.GBps()) : nlohmann::json(nullptr);
  j["write_GBps"] = r.write.GBps();
  j["writers"] = r.write.streams;
  j["verified_bytes"] = r.verified_bytes;
  j["warnings"] = r.warnings;
  return j.dump(2);
}

std::string StorageProbeReportToText(const StorageProbeReport& r) {
  std::string out;
  out += fmt::format("storage probe of {} ({}{}), files of {}, requests of {}\n", r.directory,
                     r.filesystem,
                     r.nfs ? fmt::format(", {} connections", r.nfs_connections) : std::string(),
                     FormatBytes(r.file_size), FormatBytes(r.block_size));
  auto line = [&](const std::string& name, const PhaseResult& p, const char* note) {
    out += fmt::format("  {:<34} {:>7.2f} GB/s  ({} in {:.3f} s){}\n", name, p.GBps(),
                       FormatBytes(p.bytes), p.seconds, note);
  };
  const char* mode = !r.o_direct.applicable ? "NFS"
                     : r.o_direct.honoured  ? "O_DIRECT"
                                            : "NOT O_DIRECT";
  line(fmt::format("write, {} writers, {}", r.write.streams, mode), r.write, "");
  for (const auto& p : r.reads) {
    line(fmt::format("read, {} readers, {}", p.streams, mode), p, "");
  }
  line(fmt::format("control, 1 stream, {}", mode), r.control,
       r.nfs ? "  <- server figure" : "  <- storage figure");
  line(fmt::format("control re-read, 1 stream, {}", mode), r.control_reread, "");
  if (r.o_direct.applicable) {
    line("buffered read, cold, 1 stream", r.buffered_cold, "");
    line("buffered read, warm, 1 stream", r.buffered_warm, "  <- page cache, not storage");
    out += fmt::format("O_DIRECT honoured: {} ({})\n", r.o_direct.honoured ? "yes" : "NO",
                       r.o_direct.detail);
  } else {
    out += fmt::format("  {:<34} not applicable (no client page cache)\n", "buffered read");
    out += fmt::format("O_DIRECT: {}\n", r.o_direct.detail);
  }
  out += fmt::format("stamps verified: {} read\n", FormatBytes(r.verified_bytes));
  for (const auto& w : r.warnings) out += fmt::format("WARNING: {}\n", w);
  return out;
}

}  // namespace kvtier::probe

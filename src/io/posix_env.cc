// The POSIX Env: open/stat/rename/... as plain system calls, data transfers through an IoEngine.
#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "io/io_engine.h"
#include "kvtier/io.h"

namespace kvtier {

std::string_view IoEngineKindName(IoEngineKind kind) {
  switch (kind) {
    case IoEngineKind::kAuto:
      return "auto";
    case IoEngineKind::kIoUring:
      return "io_uring";
    case IoEngineKind::kThreadPool:
      return "threads";
  }
  return "?";
}

Result<IoEngineKind> ParseIoEngineKind(std::string_view name) {
  if (name == "auto") return IoEngineKind::kAuto;
  if (name == "io_uring" || name == "uring") return IoEngineKind::kIoUring;
  if (name == "threads" || name == "thread_pool") return IoEngineKind::kThreadPool;
  return Status::InvalidArgument(
      fmt::format("unknown I/O engine '{}' (expected auto, io_uring or threads)", name));
}

namespace {

class PosixEnv;

class PosixFile final : public File {
 public:
  PosixFile(PosixEnv* env, std::string path, int fd, bool direct)
      : env_(env), path_(std::move(path)), fd_(fd), direct_(direct) {}
  ~PosixFile() override { ::close(fd_); }

  const std::string& path() const override { return path_; }
  bool direct() const override { return direct_.load(std::memory_order_relaxed); }
  Status Submit(std::span<IoOp> ops, IoObserver* observer) override;
  Status Sync() override {
    while (::fdatasync(fd_) != 0) {
      if (errno != EINTR) return Status::FromErrno(errno, fmt::format("fdatasync {}", path_));
    }
    return Status::Ok();
  }
  Status Preallocate(uint64_t bytes) override {
    int rc;
    while ((rc = ::fallocate(fd_, 0, 0, static_cast<off_t>(bytes))) != 0 && errno == EINTR) {
    }
    if (rc == 0) return Status::Ok();
    if (errno == EOPNOTSUPP || errno == ENOSYS) {
      return Status::Unimplemented(fmt::format("fallocate {}: not supported here", path_));
    }
    return Status::FromErrno(errno, fmt::format("fallocate {}", path_));
  }
  Result<uint64_t> Size() override {
    struct stat st;
    if (::fstat(fd_, &st) != 0) return Status::FromErrno(errno, fmt::format("fstat {}", path_));
    return static_cast<uint64_t>(st.st_size);
  }

 private:
  PosixEnv* const env_;
  const std::string path_;
  const int fd_;
  std::atomic<bool> direct_;
};

class PosixEnv final : public Env {
 public:
  PosixEnv(std::unique_ptr<io::IoEngine> engine) : engine_(std::move(engine)) {}

  std::string io_engine_name() const override { return engine_->name(); }
  uint64_t direct_fallbacks() const override { return direct_fallbacks_.load(); }

  io::IoEngine& engine() { return *engine_; }

  void ReportFallback(const std::string& path, int err, std::string_view when) {
    direct_fallbacks_.fetch_add(1);
    // Once per env at warning level, then at debug: the count is in direct_fallbacks().
    if (!warned_.exchange(true)) {
      spdlog::warn("O_DIRECT refused {} for {} ({}): using buffered I/O (page cache) instead", when,
                   path, std::strerror(err));
    } else {
      spdlog::debug("O_DIRECT refused {} for {}: buffered", when, path);
    }
  }

  Result<std::unique_ptr<File>> Open(const std::string& path, const OpenOptions& o) override {
    int flags = (o.write ? O_RDWR : O_RDONLY) | O_CLOEXEC;
    if (o.create) flags |= O_CREAT;
    if (o.create && o.exclusive) flags |= O_EXCL;
    if (o.truncate) flags |= O_TRUNC;
    // O_NONBLOCK: a FIFO put where a file should be would block the open until a writer
    // appears (forever, for a cache); non-blocking, the open returns and fstat refuses it.
    // O_NOCTTY: a terminal device must never become our controlling terminal.
    // An exclusive create cannot meet a FIFO or device (anything at the path fails it with
    // EEXIST): the file is a new regular one, and the dance below (three more system calls per
    // chunk written) is skipped.
    const bool fresh = o.create && o.exclusive;
    if (!fresh) flags |= O_NONBLOCK;
    flags |= O_NOCTTY;
    // An exclusive create asks for O_DIRECT only once the file is ours, with fcntl below. Where
    // a filesystem refuses O_DIRECT (ramfs, some FUSE filesystems, tmpfs before Linux 6.6),
    // open(O_CREAT|O_EXCL|O_DIRECT) creates the file and only then fails with EINVAL (the kernel
    // checks O_DIRECT after the create), and nothing says whether this call created it: a
    // retry with O_EXCL fails with EEXIST on our own file, and one without O_EXCL, or an unlink
    // first, could take over or remove a file that another writer created between the two
    // attempts. Created without O_DIRECT, the file is new and ours by O_EXCL alone, and
    // F_SETFL makes the same O_DIRECT check as open. The price: one fcntl per file created.
    bool direct = o.direct;
    int fd = -1;
    for (;;) {
      fd = ::open(path.c_str(), flags | (direct && !fresh ? O_DIRECT : 0), 0644);
      if (fd >= 0) break;
      if (errno == EINTR) continue;
      if (errno == EISDIR) return NotRegular(path, "a directory");
      if (direct && !fresh && errno == EINVAL) {
        // Also what a FIFO or device may answer to O_DIRECT: that is no fallback to report.
        struct stat st;
        if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
          return NotRegular(path, FileTypeName(st.st_mode));
        }
        ReportFallback(path, EINVAL, "at open");
        direct = false;
        continue;
      }
      return Status::FromErrno(errno, fmt::format("open {}", path));
    }
    if (fresh) {
      // F_SETFL sets O_APPEND, O_ASYNC, O_DIRECT, O_NOATIME and O_NONBLOCK together: this
      // descriptor was opened with none of them, so O_DIRECT alone is the whole new set. A
      // refusal (EINVAL where the filesystem has no direct I/O) leaves a usable buffered file.
      if (direct && ::fcntl(fd, F_SETFL, O_DIRECT) != 0) {
        ReportFallback(path, errno, "at open");
        direct = false;
      }
      return std::unique_ptr<File>(new PosixFile(this, path, fd, direct));
    }
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      int err = errno;
      ::close(fd);
      return Status::FromErrno(err, fmt::format("fstat {}", path));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      return NotRegular(path, FileTypeName(st.st_mode));
    }
    // Blocking again for the transfers (io_uring would otherwise answer EAGAIN where it waits).
    if (::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0) {
      int err = errno;
      ::close(fd);
      return Status::FromErrno(err, fmt::format("fcntl {}", path));
    }
    return std::unique_ptr<File>(new PosixFile(this, path, fd, direct));
  }

  static Status NotRegular(const std::string& path, std::string_view what) {
    return Status::InvalidArgument(fmt::format("open {}: not a regular file ({})", path, what));
  }
  static std::string_view FileTypeName(mode_t mode) {
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISFIFO(mode)) return "a FIFO";
    if (S_ISSOCK(mode)) return "a socket";
    if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
    return "not a regular file";
  }

  Status Rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) {
      return Status::FromErrno(errno, fmt::format("rename {} to {}", from, to));
    }
    return Status::Ok();
  }
  Status Unlink(const std::string& path) override {
    if (::unlink(path.c_str()) != 0)
      return Status::FromErrno(errno, fmt::format("unlink {}", path));
    return Status::Ok();
  }
  Status CreateDirs(const std::string& path) override {
    std::error_code ec;
    std::filesystem::create_directories(path, ec);
    if (ec) {
      // Another process may have created it between the check and the mkdir.
      struct stat st;
      if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return Status::Ok();
      return Status::FromErrno(ec.value(), fmt::format("mkdir -p {}", path));
    }
    return Status::Ok();
  }
  Status RemoveDir(const std::string& path) override {
    if (::rmdir(path.c_str()) != 0) return Status::FromErrno(errno, fmt::format("rmdir {}", path));
    return Status::Ok();
  }
  Result<std::vector<DirEntry>> List(const std::string& dir) override {
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) return Status::FromErrno(errno, fmt::format("list {}", dir));
    std::vector<DirEntry> out;
    errno = 0;
    while (dirent* e = ::readdir(d)) {
      if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
      DirEntry entry;
      entry.name = e->d_name;
      unsigned char type = e->d_type;
      if (type == DT_UNKNOWN) {  // some filesystems (and NFS setups) do not fill d_type
        struct stat st;
        std::string full = dir + "/" + entry.name;
        if (::lstat(full.c_str(), &st) == 0) {
          type = S_ISDIR(st.st_mode) ? DT_DIR : S_ISREG(st.st_mode) ? DT_REG : DT_UNKNOWN;
        }
      }
      entry.type = type == DT_DIR   ? DirEntry::Type::kDirectory
                   : type == DT_REG ? DirEntry::Type::kFile
                                    : DirEntry::Type::kOther;
      out.push_back(std::move(entry));
    }
    int err = errno;
    ::closedir(d);
    if (err != 0) return Status::FromErrno(err, fmt::format("readdir {}", dir));
    return out;
  }
  Result<FileInfo> Stat(const std::string& path) override {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0)
      return Status::FromErrno(errno, fmt::format("stat {}", path));
    FileInfo info;
    info.size = static_cast<uint64_t>(st.st_size);
    info.mtime_ns = static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
    info.is_directory = S_ISDIR(st.st_mode);
    info.is_regular = S_ISREG(st.st_mode);
    return info;
  }
  Status SyncDir(const std::string& dir) override {
    int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return Status::FromErrno(errno, fmt::format("open directory {}", dir));
    int rc;
    while ((rc = ::fsync(fd)) != 0 && errno == EINTR) {
    }
    int err = errno;
    ::close(fd);
    if (rc != 0) return Status::FromErrno(err, fmt::format("fsync directory {}", dir));
    return Status::Ok();
  }

 private:
  std::unique_ptr<io::IoEngine> engine_;
  std::atomic<uint64_t> direct_fallbacks_{0};
  std::atomic<bool> warned_{false};
};

bool OpsAligned(std::span<const IoOp> ops) {
  for (const IoOp& op : ops) {
    if (op.offset % kDirectIoAlignment != 0 || op.len % kDirectIoAlignment != 0 ||
        !IsAligned(op.buf)) {
      return false;
    }
  }
  return true;
}

Status PosixFile::Submit(std::span<IoOp> ops, IoObserver* observer) {
  KVTIER_RETURN_IF_ERROR(env_->engine().Execute(fd_, ops, observer));
  if (!direct()) return Status::Ok();
  // Some filesystems accept O_DIRECT at open and refuse it on the first transfer (EINVAL). With
  // aligned requests that can only mean "no direct I/O here": switch this descriptor to buffered
  // I/O, say so, and redo the failed ops.
  bool refused = false;
  for (const IoOp& op : ops) refused |= op.result == -EINVAL;
  if (!refused || !OpsAligned(ops)) return Status::Ok();
  int flags = ::fcntl(fd_, F_GETFL);
  if (flags < 0 || ::fcntl(fd_, F_SETFL, flags & ~O_DIRECT) != 0) return Status::Ok();
  direct_.store(false);
  env_->ReportFallback(path_, EINVAL, "on first transfer");
  std::vector<IoOp> redo;
  std::vector<size_t> where;
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].result == -EINVAL) {
      redo.push_back(ops[i]);
      where.push_back(i);
    }
  }
  KVTIER_RETURN_IF_ERROR(env_->engine().Execute(fd_, redo, nullptr));
  for (size_t j = 0; j < redo.size(); ++j) ops[where[j]].result = redo[j].result;
  return Status::Ok();
}

Result<std::unique_ptr<io::IoEngine>> MakeEngine(const PosixEnvOptions& o) {
  const size_t r = o.max_request_bytes, w = o.max_write_request_bytes;
  if (o.engine == IoEngineKind::kThreadPool) {
    return io::NewThreadPoolEngine(o.pool_threads, o.queue_depth, r, w);
  }
  auto uring = io::NewIoUringEngine(o.queue_depth, r, w);
  if (uring.ok() || o.engine == IoEngineKind::kIoUring) return uring;
  spdlog::warn("{}; using the thread-pool I/O engine", uring.status().message());
  return io::NewThreadPoolEngine(o.pool_threads, o.queue_depth, r, w);
}

// Loops until every op is complete; `reads` selects the end-of-file rule.
Status TransferExact(File& file, std::span<IoOp> ops, bool reads, IoObserver* observer) {
  std::vector<IoOp> todo(ops.begin(), ops.end());
  for (const IoOp& op : todo) {
    if ((op.kind == IoOp::Kind::kRead) != reads) {
      return Status::InvalidArgument("ReadExact/WriteExact given an op of the other kind");
    }
  }
  for (int round = 0; !todo.empty(); ++round) {
    KVTIER_RETURN_IF_ERROR(file.Submit(todo, round == 0 ? observer : nullptr));
    std::vector<IoOp> rest;
    for (const IoOp& op : todo) {
      if (op.result < 0) {
        return Status::FromErrno(
            static_cast<int>(-op.result),
            fmt::format("{} {} at offset {}", reads ? "read" : "write", file.path(), op.offset));
      }
      size_t n = static_cast<size_t>(op.result);
      if (n == op.len) continue;
      // A read that returns nothing is at end of file. So is a short read on an O_DIRECT file
      // that stops off the alignment grid: the kernel only does that at end of file, and a
      // retry from there would be refused as unaligned.
      if (n == 0 || (reads && file.direct() && n % kDirectIoAlignment != 0)) {
        if (reads) {
          return Status::Corruption(
              fmt::format("unexpected end of file in {} at offset {}", file.path(), op.offset + n));
        }
        return Status::IOError(fmt::format("write to {} made no progress", file.path()));
      }
      if (round > 1000) return Status::IOError(fmt::format("{}: no progress", file.path()));
      IoOp more = op;
      more.offset += n;
      more.buf += n;
      more.len -= n;
      rest.push_back(more);
    }
    todo.swap(rest);
  }
  return Status::Ok();
}

}  // namespace

Status RemoveTree(Env& env, const std::string& dir, RemovedCounts* counts) {
  KVTIER_ASSIGN_OR_RETURN(auto entries, env.List(dir));
  for (const DirEntry& e : entries) {
    const std::string child = fmt::format("{}/{}", dir, e.name);
    if (e.type == DirEntry::Type::kDirectory) {
      KVTIER_RETURN_IF_ERROR(RemoveTree(env, child, counts));
      continue;
    }
    Result<FileInfo> info = counts != nullptr ? env.Stat(child) : Result<FileInfo>(FileInfo{});
    Status s = env.Unlink(child);
    if (s.IsNotFound()) continue;  // removed by someone else meanwhile
    KVTIER_RETURN_IF_ERROR(s);
    if (counts != nullptr) {
      ++counts->files;
      if (info.ok()) counts->bytes += info->size;
    }
  }
  Status s = env.RemoveDir(dir);
  if (s.IsNotFound()) return Status::Ok();
  KVTIER_RETURN_IF_ERROR(s);
  if (counts != nullptr) ++counts->directories;
  return Status::Ok();
}

namespace {
Status ListTreeInto(Env& env, const std::string& dir, const std::string& rel,
                    std::vector<TreeEntry>* out) {
  KVTIER_ASSIGN_OR_RETURN(auto entries, env.List(dir));
  for (const DirEntry& e : entries) {
    const std::string child = fmt::format("{}/{}", dir, e.name);
    const std::string child_rel = rel.empty() ? e.name : fmt::format("{}/{}", rel, e.name);
    if (e.type == DirEntry::Type::kDirectory) {
      Status s = ListTreeInto(env, child, child_rel, out);
      if (!s.ok() && !s.IsNotFound()) return s;  // NotFound: removed meanwhile
      continue;
    }
    auto info = env.Stat(child);
    if (!info.ok()) {
      if (info.status().IsNotFound()) continue;
      return info.status();
    }
    out->push_back({child_rel, *info});
  }
  return Status::Ok();
}
}  // namespace

Result<std::vector<TreeEntry>> Env::ListTree(const std::string& dir) {
  std::vector<TreeEntry> out;
  KVTIER_RETURN_IF_ERROR(ListTreeInto(*this, dir, "", &out));
  return out;
}

Status ReadExact(File& file, std::span<IoOp> ops, IoObserver* observer) {
  return TransferExact(file, ops, true, observer);
}
Status WriteExact(File& file, std::span<IoOp> ops, IoObserver* observer) {
  return TransferExact(file, ops, false, observer);
}

Result<std::unique_ptr<Env>> NewPosixEnv(const PosixEnvOptions& options) {
  if (options.queue_depth < 1 || options.queue_depth > 64) {
    return Status::InvalidArgument(
        fmt::format("queue_depth must be in [1, 64], got {}", options.queue_depth));
  }
  for (size_t bytes : {options.max_request_bytes, options.max_write_request_bytes}) {
    if (bytes < kDirectIoAlignment || bytes % kDirectIoAlignment != 0 || bytes > (1u << 30)) {
      return Status::InvalidArgument(
          "max_request_bytes and max_write_request_bytes must be multiples of 4096 between 4 KiB "
          "and 1 GiB");
    }
  }
  if (options.pool_threads < 1 || options.pool_threads > 1024) {
    return Status::InvalidArgument("pool_threads must be in [1, 1024]");
  }
  KVTIER_ASSIGN_OR_RETURN(auto engine, MakeEngine(options));
  return std::unique_ptr<Env>(new PosixEnv(std::move(engine)));
}

Env* Env::Default() {
  static Env* env = [] {
    auto made = NewPosixEnv(PosixEnvOptions{});
    if (!made.ok()) {  // kAuto falls back to threads, so only nonsense options could fail
      spdlog::critical("cannot create the default env: {}", made.status().ToString());
      std::abort();
    }
    return std::move(made).value().release();
  }();
  return env;
}

}  // namespace kvtier

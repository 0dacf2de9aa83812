// The NFS Env: NFSv3 spoken in user space through libnfs, over several TCP connections.
//
// libnfs contexts are not thread-safe, so each connection is owned by one service thread that
// alone calls into its context: other threads post work (a function that starts one libnfs
// asynchronous call) and wait for its completion, which the service thread delivers from the
// libnfs callback. A File's transfers are pipelined: up to `requests_in_flight` requests are out
// at once, and each completion starts the next piece on the service thread itself.
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

#include "io/io_engine.h"
#include "io/nfs_raw.h"
#include "kvtier/io.h"

#ifdef KVTIER_WITH_NFS
extern "C" {
#include <nfsc/libnfs.h>
}
#endif

namespace kvtier {

bool IsNfsUrl(std::string_view path) { return path.starts_with("nfs://"); }

Result<EnvForPath> OpenEnvForPath(const std::string& path, Env* fallback, int connections) {
  EnvForPath r;
  if (IsS3Url(path)) {
    S3EnvOptions o;
    o.url = path;
    o.connections = connections;
    KVTIER_ASSIGN_OR_RETURN(r.owned, NewS3Env(o));
  } else if (IsNfsUrl(path)) {
    NfsEnvOptions o;
    o.url = path;
    o.connections = connections;
    KVTIER_ASSIGN_OR_RETURN(r.owned, NewNfsEnv(o));
  } else {
    r.env = fallback != nullptr ? fallback : Env::Default();
    return r;
  }
  r.env = r.owned.get();
  return r;
}

#ifndef KVTIER_WITH_NFS

bool NfsSupported() { return false; }
Result<std::unique_ptr<Env>> NewNfsEnv(const NfsEnvOptions& options) {
  return Status::Unimplemented(fmt::format(
      "{}: this build of kvtier has no NFS client (built without libnfs)", options.url));
}

namespace io {
Result<std::unique_ptr<NfsRawClient>> NfsRawClient::Connect(const std::string& url) {
  return Status::Unimplemented(
      fmt::format("{}: this build of kvtier has no NFS client (built without libnfs)", url));
}
NfsRawClient::~NfsRawClient() = default;
Status NfsRawClient::WriteFile(const std::string&, std::span<const uint8_t>) {
  return Status::Unimplemented("no NFS client");
}
Status NfsRawClient::ReadFile(const std::string&, std::span<uint8_t>) {
  return Status::Unimplemented("no NFS client");
}
}  // namespace io

#else

bool NfsSupported() { return true; }

namespace {

using Clock = std::chrono::steady_clock;

// What one libnfs call completed with: its status (bytes, 0, or -errno) and, on failure, the
// error text libnfs gave.
struct Completion {
  int status = 0;
  std::string error;
};

// Parsed `nfs://HOST/PATH`.
struct NfsUrl {
  std::string server;  // host name or address
  std::string path;    // absolute, no trailing slash ("/" for the root)
};

Result<NfsUrl> ParseNfsUrl(std::string_view url) {
  const auto bad = [&](std::string_view why) {
    return Status::InvalidArgument(fmt::format(
        "'{}' is not a valid NFS URL ({}); expected nfs://HOST/EXPORT[/PATH]", url, why));
  };
  if (!IsNfsUrl(url)) return bad("it does not start with nfs://");
  std::string_view rest = url.substr(6);
  if (rest.find_first_of("?#") != std::string_view::npos) return bad("options in the URL");
  size_t slash = rest.find('/');
  if (slash == 0 || rest.empty()) return bad("no server");
  if (slash == std::string_view::npos) return bad("no export path");
  NfsUrl u;
  u.server = std::string(rest.substr(0, slash));
  if (u.server.find(':') != std::string::npos && u.server.front() != '[') {
    return bad("a port: the server's portmapper gives the NFS and MOUNT ports");
  }
  std::string path;
  for (char c : rest.substr(slash)) {
    if (c == '/' && !path.empty() && path.back() == '/') continue;  // collapse "//"
    path.push_back(c);
  }
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  u.path = path;
  return u;
}

// A libnfs failure as a Status (a stale handle, a file removed by another host, is NotFound:
// Status::FromErrno).
Status NfsError(int status, const std::string& what, const std::string& error) {
  int err = -status;
  std::string msg = error.empty() ? what : fmt::format("{} ({})", what, error);
  if (err == ETIMEDOUT) return Status::Unavailable(msg + ": the NFS server did not answer in time");
  return Status::FromErrno(err, msg);
}

// The text of a failed call: libnfs's last error on the context (its callbacks' data is not
// always the error string), or ours when the call never reached a context.
std::string ErrorText(nfs_context* nfs, const void* data) {
  if (nfs != nullptr) return nfs_get_error(nfs);
  return data != nullptr ? static_cast<const char*>(data) : "";
}

// libnfs reports some NFS errors under a generic errno (a stale handle as EFAULT in 4.0); its
// error text names the NFS status, which is what counts.
int ErrnoOf(int status, std::string_view error_text) {
  if (error_text.find("NFS3ERR_STALE") != std::string_view::npos ||
      error_text.find("NFS3ERR_BADHANDLE") != std::string_view::npos) {
    return -ESTALE;
  }
  return status;
}

int RpcTimeoutMs(std::chrono::milliseconds t) {
  int ms = static_cast<int>((t.count() + 999) / 1000 * 1000);  // libnfs takes whole seconds
  return ms <= 0 ? -1 : ms;
}

// A new context with `export_path` of the server mounted.
Result<nfs_context*> MountContext(const NfsUrl& url, const std::string& export_path,
                                  int timeout_ms) {
  nfs_context* nfs = nfs_init_context();
  if (nfs == nullptr) return Status::Internal("nfs_init_context failed");
  nfs_set_timeout(nfs, timeout_ms);
  nfs_set_autoreconnect(nfs, 0);  // a broken connection fails what was in flight; callers reconnect
  if (nfs_mount(nfs, url.server.c_str(), export_path.c_str()) != 0) {
    std::string error = nfs_get_error(nfs);
    nfs_destroy_context(nfs);
    return Status::Unavailable(
        fmt::format("mounting nfs://{}{}: {}", url.server, export_path, error));
  }
  return nfs;
}

// The export: the longest prefix of the URL's path that the server lets us mount (the path
// below it may not exist yet). A server that cannot be reached at all is kUnavailable at the
// first attempt (not once per prefix); one that refuses every prefix is kNotFound.
Result<std::string> FindExport(const NfsUrl& url, int timeout_ms) {
  std::string candidate = url.path;
  for (;;) {
    auto nfs = MountContext(url, candidate, timeout_ms);
    if (nfs.ok()) {
      nfs_destroy_context(*nfs);
      return candidate;
    }
    // The MOUNT service answered with an error status (MNT3ERR_NOENT, _ACCES, ...): the server
    // is there, this prefix is not exported to us. Anything else: the server is not there.
    if (nfs.status().message().find("MNT3ERR") == std::string::npos) return nfs.status();
    if (candidate == "/") {
      return Status::NotFound(
          fmt::format("the NFS server {} exports no prefix of {} to this client (last answer: {})",
                      url.server, url.path, nfs.status().message()));
    }
    size_t cut = candidate.rfind('/');
    candidate = cut == 0 ? "/" : candidate.substr(0, cut);
  }
}

// The path inside the export mounted as `prefix` (nfs://server/export) of a URL under it.
Result<std::string> RelativeTo(const std::string& prefix, const std::string& path) {
  auto u = ParseNfsUrl(path);
  if (!u.ok()) return u.status();
  std::string full = "nfs://" + u->server + (u->path == "/" ? "" : u->path);
  if (!(full == prefix || (full.starts_with(prefix) && full[prefix.size()] == '/'))) {
    return Status::InvalidArgument(
        fmt::format("{} is not under {}, the NFS export mounted here", path, prefix));
  }
  std::string rel = full.substr(prefix.size());
  return rel.empty() ? std::string("/") : rel;
}

class NfsEnv;

// One TCP connection to the server: a libnfs context and the thread that drives it.
class Connection {
 public:
  // Starts one libnfs asynchronous call on `nfs` with the given callback; returns its rc.
  using Start = std::function<int(nfs_context* nfs, nfs_cb cb, void* private_data)>;
  // Runs on the service thread with the call's status and data (valid only during the call);
  // `nfs` is the context (null when the call failed before reaching it).
  using Done = std::function<void(int status, nfs_context* nfs, void* data)>;
  // A blocking Call's result handler, on the service thread, for successful calls only.
  using OnDone = std::function<void(nfs_context* nfs, void* data)>;

  Connection(const NfsUrl& url, std::string export_path, int timeout_ms)
      : url_(url), export_(std::move(export_path)), timeout_ms_(timeout_ms) {}
  ~Connection() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    Wake();
    if (thread_.joinable()) thread_.join();
    if (nfs_ != nullptr) DestroyContext(std::exchange(nfs_, nullptr));
    if (wake_fd_ >= 0) ::close(wake_fd_);
  }

  // Mounts, then starts the service thread.
  Status Connect() {
    wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_fd_ < 0) return Status::FromErrno(errno, "eventfd");
    KVTIER_RETURN_IF_ERROR(Mount());
    thread_ = std::thread([this] { Loop(); });
    return Status::Ok();
  }

  // Thread-safe: queues `start`; `done` runs exactly once on the service thread. With
  // `needs_connection`, a call made while the connection is down waits for it to come back
  // instead of failing.
  void Post(Start start, Done done, bool needs_connection = false) {
    {
      std::lock_guard lock(mu_);
      queue_.push_back({std::move(start), std::move(done), needs_connection});
    }
    Wake();
  }

  // Thread-safe: frees libnfs's handle of a closed file. While the connection is down this waits
  // for it to come back (a handle can only be freed through a context, and one with writes not
  // yet committed sends a COMMIT first); at shutdown, one last reconnection is tried.
  void PostClose(nfsfh* fh) {
    Post([fh](nfs_context* nfs, nfs_cb cb, void* p) { return nfs_close_async(nfs, fh, cb, p); },
         [](int, nfs_context*, void*) {}, /*needs_connection=*/true);
  }

  // On the service thread only (from a Done): starts another call right away.
  void StartNow(const Start& start, Done done) { Issue(start, std::move(done)); }

  // Posts one call and waits for it; `on_done` (may be null) runs on the service thread.
  Completion Call(Start start, OnDone on_done = nullptr) {
    std::mutex m;
    std::condition_variable cv;
    bool finished = false;
    Completion c;
    Post(std::move(start), [&](int status, nfs_context* nfs, void* data) {
      if (status < 0) {
        c.error = ErrorText(nfs, data);
        c.status = ErrnoOf(status, c.error);
      } else {
        c.status = status;
      }
      if (status >= 0 && on_done) on_done(nfs, data);
      std::lock_guard lock(m);
      finished = true;
      cv.notify_one();
    });
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return finished; });
    return c;
  }

  // Call, with a failure turned into a Status that names `what`.
  Status Run(const std::string& what, Start start, OnDone on_done = nullptr) {
    Completion c = Call(std::move(start), std::move(on_done));
    return c.status < 0 ? NfsError(c.status, what, c.error) : Status::Ok();
  }

  uint64_t readmax() const { return readmax_.load(std::memory_order_relaxed); }
  uint64_t writemax() const { return writemax_.load(std::memory_order_relaxed); }

 private:
  struct Item {
    Start start;
    Done done;
    bool needs_connection = false;  // waits for a reconnection instead of failing
  };
  // A call in flight: the callback's private data.
  struct Pending {
    Connection* connection;
    uint64_t id;
    Done done;
    bool orphaned = false;  // already failed by us (the context broke); ignore libnfs's answer
  };

  Status Mount() {
    KVTIER_ASSIGN_OR_RETURN(nfs_, MountContext(url_, export_, timeout_ms_));
    readmax_ = nfs_get_readmax(nfs_);
    writemax_ = nfs_get_writemax(nfs_);
    return Status::Ok();
  }

  // REQUIRES: `nfs` is no longer nfs_ (new calls fail at once).
  void DestroyContext(nfs_context* nfs) {
    nfs_destroy_context(nfs);  // may call back orphaned calls: they are ignored
    for (Pending* p : orphans_) delete p;
    orphans_.clear();
  }

  void Wake() {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof one);
  }

  static void Callback(int status, nfs_context* nfs, void* data, void* private_data) {
    auto* p = static_cast<Pending*>(private_data);
    if (p->orphaned) return;
    Connection* c = p->connection;
    c->in_flight_.erase(p->id);
    Done done = std::move(p->done);
    delete p;
    done(status, nfs, data);
  }

  void Issue(const Start& start, Done done) {
    if (nfs_ == nullptr) {
      static const char kDown[] = "not connected to the NFS server";
      done(-ENOTCONN, nullptr, const_cast<char*>(kDown));
      return;
    }
    const uint64_t id = next_id_++;
    auto* p = new Pending{this, id, std::move(done)};
    in_flight_.emplace(id, p);
    if (start(nfs_, &Callback, p) != 0) {
      // Some libnfs calls run the callback before failing to queue (out of memory): then `p` is
      // already gone, and so is its entry (looked up by id: its address may be reused already).
      if (in_flight_.erase(id) == 0) return;
      std::string error = nfs_get_error(nfs_);
      Done d = std::move(p->done);
      delete p;
      d(-EIO, nullptr, error.data());
    }
  }

  // The context is unusable: fail everything in flight, drop the context; the next call
  // reconnects.
  void Break(const std::string& why) {
    spdlog::warn("nfs://{}{}: connection lost ({}); {} requests failed, reconnecting on next use",
                 url_.server, export_, why, in_flight_.size());
    std::string error = "connection to the NFS server lost: " + why;
    // Drop the context first (as far as new calls are concerned): a failed transfer's handler
    // may start its next piece, which must fail at once rather than join the dying context.
    nfs_context* nfs = std::exchange(nfs_, nullptr);
    std::vector<Pending*> failed;
    for (auto& [id, p] : in_flight_) failed.push_back(p);
    in_flight_.clear();
    for (Pending* p : failed) {
      p->orphaned = true;
      orphans_.push_back(p);
      Done d = std::move(p->done);
      d(-EIO, nullptr, error.data());
    }
    DestroyContext(nfs);
  }

  void Loop() {
    for (;;) {
      std::deque<Item> items;
      bool stop;
      {
        std::lock_guard lock(mu_);
        items.swap(queue_);
        stop = stop_;
      }
      const bool work = !items.empty() || !deferred_.empty();
      if (work && nfs_ == nullptr && (stop ? !last_try_ : Clock::now() >= next_reconnect_)) {
        if (stop) last_try_ = true;  // shutting down: one attempt, for the deferred closes
        Status s = Mount();
        if (s.ok()) {
          reconnect_backoff_ = kMinReconnectBackoff;
        } else {
          // Calls fail at once until the next attempt: 50 ms after the first failure, doubling
          // up to a second while the server stays away.
          next_reconnect_ = Clock::now() + reconnect_backoff_;
          reconnect_backoff_ = std::min(2 * reconnect_backoff_, kMaxReconnectBackoff);
          spdlog::warn("{}", s.ToString());
        }
      }
      if (nfs_ != nullptr) {
        for (Item& item : deferred_) items.push_front(std::move(item));
        deferred_.clear();
      }
      for (Item& item : items) {
        if (item.needs_connection && nfs_ == nullptr) {
          deferred_.push_back(std::move(item));
        } else {
          Issue(item.start, std::move(item.done));
        }
      }
      if (stop && in_flight_.empty()) {
        if (!deferred_.empty()) {
          spdlog::debug("nfs://{}{}: {} file handles not freed: the server is away", url_.server,
                        export_, deferred_.size());
        }
        return;
      }

      pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {-1, 0, 0}};
      if (nfs_ != nullptr)
        fds[1] = {nfs_get_fd(nfs_), static_cast<short>(nfs_which_events(nfs_)), 0};
      // A short timeout: libnfs handles its request timeouts inside nfs_service.
      int n = ::poll(fds, nfs_ != nullptr ? 2 : 1, 100);
      if (n < 0 && errno != EINTR) spdlog::error("nfs: poll: {}", std::strerror(errno));
      if (fds[0].revents & POLLIN) {
        uint64_t v;
        [[maybe_unused]] ssize_t r = ::read(wake_fd_, &v, sizeof v);
      }
      if (nfs_ != nullptr && nfs_service(nfs_, n > 0 ? fds[1].revents : 0) < 0) {
        // libnfs's last error text may belong to an earlier call; the socket is what failed.
        Break("the server closed the connection or the socket failed");
      }
    }
  }

  const NfsUrl url_;
  const std::string export_;
  const int timeout_ms_;
  std::atomic<uint64_t> readmax_{0}, writemax_{0};
  int wake_fd_ = -1;
  std::thread thread_;

  std::mutex mu_;
  std::deque<Item> queue_;  // guarded by mu_
  bool stop_ = false;       // guarded by mu_

  // Service thread only:
  nfs_context* nfs_ = nullptr;
  std::unordered_map<uint64_t, Pending*> in_flight_;
  std::deque<Item> deferred_;  // closes waiting for a connection
  bool last_try_ = false;      // the reconnection attempt at shutdown was made
  uint64_t next_id_ = 0;
  std::vector<Pending*> orphans_;
  static constexpr std::chrono::milliseconds kMinReconnectBackoff{50}, kMaxReconnectBackoff{1000};
  Clock::time_point next_reconnect_{};
  std::chrono::milliseconds reconnect_backoff_ = kMinReconnectBackoff;
};

class NfsEnv final : public Env {
 public:
  explicit NfsEnv(const NfsEnvOptions& o) : options_(o) {}

  Status Init() {
    if (options_.connections < 1 || options_.connections > 256) {
      return Status::InvalidArgument("NFS connections must be in [1, 256]");
    }
    if (options_.requests_in_flight < 1 || options_.requests_in_flight > 1024) {
      return Status::InvalidArgument("NFS requests in flight must be in [1, 1024]");
    }
    if (options_.max_request_bytes < 4096) {
      return Status::InvalidArgument("NFS request size must be at least 4 KiB");
    }
    KVTIER_ASSIGN_OR_RETURN(url_, ParseNfsUrl(options_.url));
    const int timeout_ms = RpcTimeoutMs(options_.rpc_timeout);
    KVTIER_ASSIGN_OR_RETURN(export_, FindExport(url_, timeout_ms));
    for (int i = 0; i < options_.connections; ++i) {
      auto c = std::make_unique<Connection>(url_, export_, timeout_ms);
      KVTIER_RETURN_IF_ERROR(c->Connect());
      connections_.push_back(std::move(c));
    }
    prefix_ = "nfs://" + url_.server + (export_ == "/" ? "" : export_);
    spdlog::debug("nfs: mounted {} on {} connections (rsize {}, wsize {})", prefix_,
                  connections_.size(), connections_[0]->readmax(), connections_[0]->writemax());
    return Status::Ok();
  }

  std::string io_engine_name() const override {
    return fmt::format("nfs({} connections)", connections_.size());
  }
  uint64_t direct_fallbacks() const override { return 0; }

  Result<std::unique_ptr<File>> Open(const std::string& path, const OpenOptions& options) override;
  Status Rename(const std::string& from, const std::string& to) override {
    KVTIER_ASSIGN_OR_RETURN(std::string a, Relative(from));
    KVTIER_ASSIGN_OR_RETURN(std::string b, Relative(to));
    return Next().Run(fmt::format("rename {} to {}", from, to),
                      [&](nfs_context* nfs, nfs_cb cb, void* p) {
                        return nfs_rename_async(nfs, a.c_str(), b.c_str(), cb, p);
                      });
  }
  Status Unlink(const std::string& path) override {
    KVTIER_ASSIGN_OR_RETURN(std::string rel, Relative(path));
    return Next().Run("unlink " + path, [&](nfs_context* nfs, nfs_cb cb, void* p) {
      return nfs_unlink_async(nfs, rel.c_str(), cb, p);
    });
  }
  Status CreateDirs(const std::string& path) override {
    KVTIER_ASSIGN_OR_RETURN(std::string rel, Relative(path));
    if (rel == "/") return Status::Ok();
    // Fast path: it exists already.
    auto info = Stat(path);
    if (info.ok() && info->is_directory) return Status::Ok();
    size_t pos = 0;
    while (pos != std::string::npos) {
      pos = rel.find('/', pos + 1);
      std::string part = rel.substr(0, pos);
      Completion c = Next().Call([&](nfs_context* nfs, nfs_cb cb, void* p) {
        return nfs_mkdir_async(nfs, part.c_str(), cb, p);
      });
      if (c.status < 0 && c.status != -EEXIST) {
        return NfsError(c.status, "mkdir " + prefix_ + part, c.error);
      }
    }
    KVTIER_ASSIGN_OR_RETURN(FileInfo made, Stat(path));
    if (!made.is_directory) {
      return Status::IOError(fmt::format("{} exists and is not a directory", path));
    }
    return Status::Ok();
  }
  Status RemoveDir(const std::string& path) override {
    KVTIER_ASSIGN_OR_RETURN(std::string rel, Relative(path));
    return Next().Run("rmdir " + path, [&](nfs_context* nfs, nfs_cb cb, void* p) {
      return nfs_rmdir_async(nfs, rel.c_str(), cb, p);
    });
  }
  Result<std::vector<DirEntry>> List(const std::string& dir) override {
    KVTIER_ASSIGN_OR_RETURN(std::string rel, Relative(dir));
    std::vector<DirEntry> out;
    KVTIER_RETURN_IF_ERROR(Next().Run(
        "list " + dir,
        [&](nfs_context* nfs, nfs_cb cb, void* p) {
          return nfs_opendir_async(nfs, rel.c_str(), cb, p);
        },
        [&](nfs_context* nfs, void* data) {
          // On the service thread: nfs_readdir only walks what opendir
          // fetched.
          auto* d = static_cast<nfsdir*>(data);
          while (nfsdirent* e = nfs_readdir(nfs, d)) {
            std::string_view name = e->name;
            if (name == "." || name == "..") continue;
            DirEntry entry;
            entry.name = std::string(name);
            // The NFSv3 file type (RFC 1813 ftype3): 1 regular, 2 directory.
            entry.type = e->type == 1   ? DirEntry::Type::kFile
                         : e->type == 2 ? DirEntry::Type::kDirectory
                                        : DirEntry::Type::kOther;
            out.push_back(std::move(entry));
          }
          nfs_closedir(nfs, d);
        }));
    return out;
  }
  Result<FileInfo> Stat(const std::string& path) override {
    KVTIER_ASSIGN_OR_RETURN(std::string rel, Relative(path));
    FileInfo info;
    KVTIER_RETURN_IF_ERROR(Next().Run(
        "stat " + path,
        [&](nfs_context* nfs, nfs_cb cb, void* p) {
          return nfs_stat64_async(nfs, rel.c_str(), cb, p);
        },
        [&](nfs_context*, void* data) { info = ToFileInfo(*static_cast<nfs_stat_64*>(data)); }));
    return info;
  }
  // An NFSv3 server makes CREATE, RENAME and REMOVE stable before it answers them.
  Status SyncDir(const std::string&) override { return Status::Ok(); }

  static FileInfo ToFileInfo(const nfs_stat_64& st) {
    FileInfo info;
    info.size = st.nfs_size;
    info.mtime_ns =
        static_cast<int64_t>(st.nfs_mtime) * 1000000000 + static_cast<int64_t>(st.nfs_mtime_nsec);
    info.is_directory = S_ISDIR(st.nfs_mode);
    info.is_regular = S_ISREG(st.nfs_mode);
    return info;
  }

  const NfsEnvOptions& options() const { return options_; }
  // Files and metadata calls take turns on separate counters, so that files opened together
  // spread evenly over the connections whatever metadata calls came before.
  Connection& NextForFile() {
    return *connections_[next_file_.fetch_add(1, std::memory_order_relaxed) % connections_.size()];
  }
  Connection& Next() {
    return *connections_[next_.fetch_add(1, std::memory_order_relaxed) % connections_.size()];
  }

  // The path inside the mounted export of a URL under ours.
  Result<std::string> Relative(const std::string& path) const { return RelativeTo(prefix_, path); }

 private:
  NfsEnvOptions options_;
  NfsUrl url_;
  std::string export_;
  std::string prefix_;  // nfs://server/export
  std::vector<std::unique_ptr<Connection>> connections_;
  std::atomic<uint64_t> next_{0}, next_file_{0};
};

class NfsFile final : public File {
 public:
  // `size`: from the open, and what Size() answers for a file opened read-only (chunk files never
  // change once published; a writable one is asked again).
  NfsFile(NfsEnv* env, Connection* conn, std::string path, nfsfh* fh, uint64_t size, bool writable)
      : env_(env), conn_(conn), path_(std::move(path)), fh_(fh), size_(size), writable_(writable) {}
  ~NfsFile() override {
    // Closing frees libnfs's handle, on the service thread; nobody waits for it (NFSv3 has no
    // open state on the server).
    conn_->PostClose(fh_);
  }

  const std::string& path() const override { return path_; }
  bool direct() const override { return true; }  // libnfs caches nothing on this side

  Status Submit(std::span<IoOp> ops, IoObserver* observer) override;
  Status Sync() override {
    nfsfh* fh = fh_;
    return conn_->Run("commit " + path_, [fh](nfs_context* nfs, nfs_cb cb, void* p) {
      return nfs_fsync_async(nfs, fh, cb, p);
    });
  }
  Result<uint64_t> Size() override {
    if (!writable_) return size_;
    nfsfh* fh = fh_;
    uint64_t size = 0;
    KVTIER_RETURN_IF_ERROR(conn_->Run(
        "stat " + path_,
        [fh](nfs_context* nfs, nfs_cb cb, void* p) { return nfs_fstat64_async(nfs, fh, cb, p); },
        [&](nfs_context*, void* data) { size = static_cast<nfs_stat_64*>(data)->nfs_size; }));
    return size;
  }

 private:
  NfsEnv* const env_;
  Connection* const conn_;
  const std::string path_;
  nfsfh* const fh_;
  const uint64_t size_;
  const bool writable_;
};

Result<std::unique_ptr<File>> NfsEnv::Open(const std::string& path, const OpenOptions& options) {
  KVTIER_ASSIGN_OR_RETURN(std::string rel, Relative(path));
  Connection& conn = NextForFile();
  int flags = options.write ? O_RDWR : O_RDONLY;
  if (options.truncate) flags |= O_TRUNC;
  nfsfh* fh = nullptr;
  Completion c;
  if (options.create) {
    if (options.exclusive) flags |= O_EXCL;
    c = conn.Call([&](nfs_context* nfs, nfs_cb cb,
                      void* p) { return nfs_create_async(nfs, rel.c_str(), flags, 0644, cb, p); },
                  [&](nfs_context*, void* data) { fh = static_cast<nfsfh*>(data); });
  } else {
    c = conn.Call([&](nfs_context* nfs, nfs_cb cb,
                      void* p) { return nfs_open_async(nfs, rel.c_str(), flags, cb, p); },
                  [&](nfs_context*, void* data) { fh = static_cast<nfsfh*>(data); });
  }
  if (c.status < 0) {
    if (c.status == -EISDIR) {
      return Status::InvalidArgument(fmt::format("{} is not a regular file", path));
    }
    return NfsError(c.status, "open " + path, c.error);
  }
  // Only regular files are files here (a FIFO or device over NFS is not ours to read). A file
  // this call created empty is one, with no need to ask.
  FileInfo info;
  info.is_regular = true;
  Status st;
  if (!(options.create && (options.exclusive || options.truncate))) {
    st = conn.Run(
        "stat " + path,
        [&](nfs_context* nfs, nfs_cb cb, void* p) { return nfs_fstat64_async(nfs, fh, cb, p); },
        [&](nfs_context*, void* data) { info = ToFileInfo(*static_cast<nfs_stat_64*>(data)); });
  }
  // Made before the checks: on any error below, its destructor frees the handle.
  auto file = std::make_unique<NfsFile>(this, &conn, path, fh, info.size, options.write);
  KVTIER_RETURN_IF_ERROR(st);
  if (!info.is_regular) {
    return Status::InvalidArgument(fmt::format("{} is not a regular file", path));
  }
  return std::unique_ptr<File>(std::move(file));
}

// Runs a batch of pieces on one connection with a bounded number in flight.
struct Transfer {
  Connection* conn;
  nfsfh* fh;
  bool is_read;
  std::vector<io::IoPiece> pieces;
  size_t next = 0;  // service thread only
  std::mutex mu;
  std::condition_variable cv;
  size_t remaining;            // guarded by mu
  std::vector<char> finished;  // per piece, guarded by mu
  bool notify_each = false;    // wake the submitter at every completion (it reports progress)

  void StartPiece(size_t i, bool from_service_thread) {
    io::IoPiece* piece = &pieces[i];
    const bool read = is_read;
    Connection::Start start = [this, piece, read](nfs_context* nfs, nfs_cb cb, void* p) {
      if (read) return nfs_pread_async(nfs, fh, piece->offset, piece->len, cb, p);
      return nfs_pwrite_async(nfs, fh, piece->offset, piece->len, piece->buf, cb, p);
    };
    Connection::Done done = [this, piece, read](int status, nfs_context* nfs, void* data) {
      if (status > 0 && read) {
        size_t n = std::min<size_t>(static_cast<size_t>(status), piece->len);
        std::memcpy(piece->buf, data, n);
        piece->result = static_cast<int64_t>(n);
      } else {
        piece->result = status < 0 ? ErrnoOf(status, ErrorText(nfs, data)) : status;
      }
      if (next < pieces.size()) StartPiece(next++, true);
      std::lock_guard lock(mu);
      finished[static_cast<size_t>(piece - pieces.data())] = 1;
      if (--remaining == 0 || notify_each) cv.notify_one();
    };
    if (from_service_thread) {
      conn->StartNow(start, std::move(done));
    } else {
      conn->Post(std::move(start), std::move(done));
    }
  }
};

Status NfsFile::Submit(std::span<IoOp> ops, IoObserver* observer) {
  if (ops.empty()) return Status::Ok();
  const bool read = ops[0].kind == IoOp::Kind::kRead;
  for (const IoOp& op : ops) {
    if ((op.kind == IoOp::Kind::kRead) != read) {
      return Status::InvalidArgument("an NFS batch must be all reads or all writes");
    }
  }
  const NfsEnvOptions& o = env_->options();
  size_t rmax = std::min<uint64_t>(o.max_request_bytes, std::max<uint64_t>(conn_->readmax(), 4096));
  size_t wmax =
      std::min<uint64_t>(o.max_request_bytes, std::max<uint64_t>(conn_->writemax(), 4096));
  Transfer t;
  t.conn = conn_;
  t.fh = fh_;
  t.is_read = read;
  t.pieces = io::SplitOps(ops, rmax, wmax);
  t.remaining = t.pieces.size();
  t.finished.assign(t.pieces.size(), 0);
  t.notify_each = observer != nullptr;
  const size_t window =
      std::min<size_t>(t.pieces.size(), static_cast<size_t>(o.requests_in_flight));
  // The first window is posted from here; `next` is touched only by the service thread after
  // these posts, and the posts happen-before their callbacks (through the connection's queue).
  t.next = window;
  for (size_t i = 0; i < window; ++i) t.StartPiece(i, false);
  if (observer != nullptr) observer->Submitted();
  // Tell the observer as each op's leading bytes arrive, so its work on them (the file tier's
  // checksum) overlaps the transfer of the rest. Pieces are in op order, each op's in offset order.
  size_t cursor = 0;    // first piece not reported yet
  uint64_t prefix = 0;  // bytes of pieces[cursor].op reported so far
  std::unique_lock lock(t.mu);
  while (t.remaining > 0) {
    t.cv.wait(lock);
    if (observer == nullptr) continue;
    std::vector<std::pair<size_t, uint64_t>> report;
    for (; cursor < t.pieces.size() && t.finished[cursor]; ++cursor) {
      const io::IoPiece& p = t.pieces[cursor];
      if (cursor > 0 && t.pieces[cursor - 1].op != p.op) prefix = 0;
      if (p.result != static_cast<int64_t>(p.len)) {  // short or failed: no more for this op
        while (cursor + 1 < t.pieces.size() && t.pieces[cursor + 1].op == p.op) ++cursor;
        continue;
      }
      prefix += p.len;
      report.emplace_back(p.op, prefix);
    }
    lock.unlock();
    for (auto [op, bytes] : report) observer->Progress(op, bytes);
    lock.lock();
  }
  lock.unlock();
  io::GatherResults(ops, t.pieces);
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Env>> NewNfsEnv(const NfsEnvOptions& options) {
  auto env = std::make_unique<NfsEnv>(options);
  KVTIER_RETURN_IF_ERROR(env->Init());
  return std::unique_ptr<Env>(std::move(env));
}

namespace io {

Result<std::unique_ptr<NfsRawClient>> NfsRawClient::Connect(const std::string& url) {
  KVTIER_ASSIGN_OR_RETURN(NfsUrl u, ParseNfsUrl(url));
  const int timeout_ms = RpcTimeoutMs(NfsEnvOptions{}.rpc_timeout);
  KVTIER_ASSIGN_OR_RETURN(std::string export_path, FindExport(u, timeout_ms));
  std::unique_ptr<NfsRawClient> c(new NfsRawClient);
  KVTIER_ASSIGN_OR_RETURN(c->nfs_, MountContext(u, export_path, timeout_ms));
  c->prefix_ = "nfs://" + u.server + (export_path == "/" ? "" : export_path);
  return c;
}

NfsRawClient::~NfsRawClient() {
  if (nfs_ != nullptr) nfs_destroy_context(nfs_);
}

namespace {

// Moves a whole buffer in requests of at most `piece` bytes, every one of them in flight at
// once on this one connection, driving the context's event loop until all have answered: libnfs
// at its best, with no reassembly buffer (its synchronous whole-buffer calls allocate and copy
// one). The reference the NFS env is measured against.
Status AllInFlight(nfs_context* nfs, nfsfh* fh, uint8_t* buf, size_t size, bool read,
                   const std::string& what) {
  struct State {
    int pending = 0;
    int error = 0;
    std::string text;
  } state;
  struct Piece {
    State* state;
    uint8_t* dst;
    size_t len;
  };
  const size_t piece =
      std::max<uint64_t>(4096, read ? nfs_get_readmax(nfs) : nfs_get_writemax(nfs));
  auto cb = [](int status, nfs_context* ctx, void* data, void* private_data) {
    auto* p = static_cast<Piece*>(private_data);
    State* st = p->state;
    --st->pending;
    if (status < 0 || static_cast<size_t>(status) < p->len) {
      if (st->error == 0) {
        st->error = status < 0 ? status : -EIO;
        st->text = status < 0 ? nfs_get_error(ctx) : "short transfer";
      }
    } else if (data != nullptr && p->dst != nullptr) {
      std::memcpy(p->dst, data, p->len);  // a read: libnfs hands over its receive buffer
    }
    delete p;
  };
  for (size_t off = 0; off < size && state.error == 0; off += piece) {
    size_t len = std::min(piece, size - off);
    auto* p = new Piece{&state, read ? buf + off : nullptr, len};
    int rc = read ? nfs_pread_async(nfs, fh, off, len, cb, p)
                  : nfs_pwrite_async(nfs, fh, off, len, buf + off, cb, p);
    if (rc != 0) {
      delete p;
      state.error = -EIO;
      state.text = nfs_get_error(nfs);
      break;
    }
    ++state.pending;
  }
  while (state.pending > 0) {
    pollfd pfd{nfs_get_fd(nfs), static_cast<short>(nfs_which_events(nfs)), 0};
    int n = ::poll(&pfd, 1, 100);
    if (nfs_service(nfs, n > 0 ? pfd.revents : 0) < 0) {
      // The connection is gone; the pieces still out are never answered (and leak).
      return Status::IOError(
          fmt::format("{}: the connection failed ({})", what, nfs_get_error(nfs)));
    }
  }
  if (state.error != 0) return NfsError(state.error, what, state.text);
  return Status::Ok();
}

}  // namespace

Status NfsRawClient::WriteFile(const std::string& url, std::span<const uint8_t> data) {
  KVTIER_ASSIGN_OR_RETURN(std::string rel, RelativeTo(prefix_, url));
  nfsfh* fh = nullptr;
  int rc = nfs_create(nfs_, rel.c_str(), O_RDWR | O_TRUNC, 0644, &fh);
  if (rc < 0) return NfsError(rc, "create " + url, nfs_get_error(nfs_));
  Status s =
      AllInFlight(nfs_, fh, const_cast<uint8_t*>(data.data()), data.size(), false, "write " + url);
  if (s.ok() && (rc = nfs_fsync(nfs_, fh)) < 0) {
    s = NfsError(rc, "commit " + url, nfs_get_error(nfs_));
  }
  nfs_close(nfs_, fh);
  return s;
}

Status NfsRawClient::ReadFile(const std::string& url, std::span<uint8_t> out) {
  KVTIER_ASSIGN_OR_RETURN(std::string rel, RelativeTo(prefix_, url));
  nfsfh* fh = nullptr;
  int rc = nfs_open(nfs_, rel.c_str(), O_RDONLY, &fh);
  if (rc < 0) return NfsError(rc, "open " + url, nfs_get_error(nfs_));
  Status s = AllInFlight(nfs_, fh, out.data(), out.size(), true, "read " + url);
  nfs_close(nfs_, fh);
  return s;
}

}  // namespace io

#endif  // KVTIER_WITH_NFS

}  // namespace kvtier

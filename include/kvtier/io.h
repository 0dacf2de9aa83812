// The I/O interface: every file and directory access of the storage tiers goes through an Env.
//
// An Env opens Files and does the metadata operations (rename, unlink, mkdir, list, stat,
// directory sync). A File does positional reads and writes through the Env's I/O engine: an
// io_uring engine (the default where the kernel allows it) or a thread-pool engine. Both split a
// large request into pieces of `max_request_bytes` and keep up to `queue_depth` of them in flight.
//
// O_DIRECT is asked for per open (`OpenOptions::direct`). Where the filesystem refuses it (at open,
// or on the first aligned request), the File falls back to buffered I/O and says so: the Env logs
// it once and counts it (`direct_fallbacks()`), and `File::direct()` turns false. Never silent.
// O_DIRECT needs buffers, offsets and lengths aligned to the device's logical block size; this
// project aligns everything to `kDirectIoAlignment` (4 KiB), which covers every common device.
//
// Tests and benchmarks wrap an Env in the fault-injecting one of src/io/fault_injection_env.h.
//
// Thread-safety: Env and File methods are thread-safe. A File may be used by several threads at
// once (positional I/O has no shared cursor). Env::Default() lives for the whole process.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/status.h"

namespace kvtier {

inline constexpr size_t kDirectIoAlignment = 4096;

inline constexpr uint64_t AlignUp(uint64_t n, uint64_t a = kDirectIoAlignment) {
  return (n + a - 1) / a * a;
}
inline bool IsAligned(const void* p, size_t a = kDirectIoAlignment) {
  return reinterpret_cast<uintptr_t>(p) % a == 0;
}

// A heap buffer aligned to kDirectIoAlignment, its size rounded up to a multiple of it, zero-filled
// (so its pages are already faulted in). Movable, not copyable.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(size_t size);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  std::span<uint8_t> span() const { return {data_, size_}; }
  std::span<uint8_t> first(size_t n) const { return {data_, n}; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

enum class IoEngineKind : uint8_t {
  kAuto,        // io_uring where the kernel allows it, else the thread pool
  kIoUring,     // io_uring, or an error if unavailable
  kThreadPool,  // pread/pwrite on a fixed pool of threads
};
std::string_view IoEngineKindName(IoEngineKind kind);
// Accepts "auto", "io_uring" (or "uring"), "threads" (or "thread_pool").
Result<IoEngineKind> ParseIoEngineKind(std::string_view name);

// One positional transfer. `result` is filled in by File::Submit: the number of bytes moved (which
// may be less than `len`: end of file, or a short transfer), or -errno.
struct IoOp {
  enum class Kind : uint8_t { kRead, kWrite };
  Kind kind = Kind::kRead;
  uint64_t offset = 0;
  uint8_t* buf = nullptr;  // read into / written from; not modified by writes
  size_t len = 0;
  int64_t result = 0;

  static IoOp Read(uint64_t offset, std::span<uint8_t> dst) {
    return IoOp{Kind::kRead, offset, dst.data(), dst.size(), 0};
  }
  static IoOp Write(uint64_t offset, std::span<const uint8_t> src) {
    return IoOp{Kind::kWrite, offset, const_cast<uint8_t*>(src.data()), src.size(), 0};
  }
};

struct OpenOptions {
  bool write = false;      // open read-write (else read-only)
  bool create = false;     // create if absent (mode 0644)
  bool exclusive = false;  // with create: fail if the file exists
  bool truncate = false;
  bool direct = false;  // try O_DIRECT; buffered where refused (File::direct() says which)
  // A promise: the buffers written from stay unchanged until the File is closed. A File that
  // keeps what is written until it publishes it (an object store's) then uses them in place
  // instead of copying them.
  bool buffers_outlive_file = false;
};

// Optional hooks into File::Submit, called on the submitting thread so that CPU work (checksums)
// overlaps the transfers instead of following them.
class IoObserver {
 public:
  virtual ~IoObserver() = default;
  // Once, as soon as the first requests are in flight.
  virtual void Submitted() {}
  // Whenever the leading `bytes` of ops[op] have completed (a hint: it may never be called, e.g.
  // by the thread-pool engine or a fault-injecting wrapper, which may still alter the data).
  virtual void Progress(size_t op, uint64_t bytes) {}
};

class File {
 public:
  virtual ~File() = default;  // closes the file

  virtual const std::string& path() const = 0;
  // True while O_DIRECT is in effect for this file.
  virtual bool direct() const = 0;

  // Performs every op, with several requests in flight, and blocks until all have completed.
  // Each op's `result` says what happened to it; a short transfer is not an error here (see
  // ReadExact/WriteExact). Returns non-OK only if the requests could not be issued at all.
  // REQUIRES: for a direct() file, buffers, offsets and lengths aligned to kDirectIoAlignment
  // (a shorter result at end of file is fine). Buffers stay owned by the caller.
  virtual Status Submit(std::span<IoOp> ops, IoObserver* observer = nullptr) = 0;
  // fdatasync: the data written so far survives a power failure once this returns OK.
  virtual Status Sync() = 0;
  virtual Result<uint64_t> Size() = 0;
  // fallocate: reserves `bytes` from offset 0 and sets the size. Writes into a preallocated file
  // do not extend it, which lets filesystems like ext4 run O_DIRECT writes to it concurrently and
  // without a detour through kernel worker threads. kUnimplemented where unsupported (NFSv3).
  virtual Status Preallocate(uint64_t bytes) {
    return Status::Unimplemented("preallocation is not supported");
  }
};

// Reads every op in full, resubmitting the rest of short transfers. Reaching the end of file
// before an op is full returns kCorruption ("unexpected end of file"); an OS error returns
// kIOError (kNoSpace, ...) via Status::FromErrno. All ops must be reads. `observer` sees the
// first submission only (op indices are those of `ops`).
Status ReadExact(File& file, std::span<IoOp> ops, IoObserver* observer = nullptr);
// Writes every op in full, resubmitting the rest of short transfers. All ops must be writes.
Status WriteExact(File& file, std::span<IoOp> ops, IoObserver* observer = nullptr);

struct DirEntry {
  enum class Type : uint8_t { kFile, kDirectory, kOther };
  std::string name;
  Type type = Type::kOther;
};

struct FileInfo {
  uint64_t size = 0;
  int64_t mtime_ns = 0;  // since the Unix epoch
  bool is_directory = false;
  bool is_regular = false;
};

// A file found by Env::ListTree: its path relative to the listed directory ("a/b/c").
struct TreeEntry {
  std::string path;
  FileInfo info;
};

class Env {
 public:
  virtual ~Env() = default;

  // The process-wide POSIX env with the default engine (kAuto). Never destroyed.
  static Env* Default();

  // "io_uring" or "threads" (the engine that kAuto chose), or a wrapper's description.
  virtual std::string io_engine_name() const = 0;
  // Opens that fell back to buffered I/O because the filesystem refused O_DIRECT.
  virtual uint64_t direct_fallbacks() const = 0;

  // Opens a regular file. Fails with kNotFound when the file (or its directory) does not exist,
  // kInvalidArgument when the path is not a regular file (a directory, a FIFO, a device: never
  // opened in a way that could block), kPermissionDenied, kIOError for anything else (EEXIST
  // with `exclusive` included).
  virtual Result<std::unique_ptr<File>> Open(const std::string& path,
                                             const OpenOptions& options) = 0;
  // rename(2): atomically replaces `to` if it exists.
  virtual Status Rename(const std::string& from, const std::string& to) = 0;
  // kNotFound if `path` does not exist.
  virtual Status Unlink(const std::string& path) = 0;
  // mkdir -p; OK if the directory already exists.
  virtual Status CreateDirs(const std::string& path) = 0;
  // rmdir: the directory must be empty.
  virtual Status RemoveDir(const std::string& path) = 0;
  // The entries of `dir`, without "." and "..", in no particular order.
  virtual Result<std::vector<DirEntry>> List(const std::string& dir) = 0;
  // stat(2) following symlinks; kNotFound if absent.
  virtual Result<FileInfo> Stat(const std::string& path) = 0;
  // fsync of a directory: entries created, renamed or removed in it survive a power failure.
  virtual Status SyncDir(const std::string& dir) = 0;
  // The monotonic clock of the timers that run on this env's behalf (the file tier's negative
  // cache and disk-full hold): steady_clock, unless a test env moves it forward itself.
  virtual std::chrono::steady_clock::time_point Now() const {
    return std::chrono::steady_clock::now();
  }
  // Every file below `dir` that is not a directory (a FIFO, say, with is_regular false), at any
  // depth, with its size and mtime, in no particular order. kNotFound if `dir` does not exist. This
  // default walks List and Stat; an object store lists a whole prefix in a few requests.
  virtual Result<std::vector<TreeEntry>> ListTree(const std::string& dir);
  // False for a filesystem. True for an object store, whose files are objects: one written
  // through this env stays invisible until File::Sync, which publishes it whole (a PUT) and
  // atomically replaces any object of that name; a written file closed without Sync is
  // discarded. A writer then writes to the final name directly: a temporary name and a rename
  // would cost a second copy of the data on the server.
  virtual bool publishes_at_sync() const { return false; }
};

// What RemoveTree removed.
struct RemovedCounts {
  uint64_t files = 0, bytes = 0, directories = 0;
};
// Removes `dir` and everything below it through `env` (rm -r). A file that vanishes meanwhile
// (removed by someone else) is skipped, as is `dir` itself if it is gone by the end. With
// `counts`, each file is stat'ed before its removal so that its bytes are counted too.
Status RemoveTree(Env& env, const std::string& dir, RemovedCounts* counts = nullptr);

struct PosixEnvOptions {
  IoEngineKind engine = IoEngineKind::kAuto;
  // Requests in flight per Submit call, and the size a large op is split into.
  int queue_depth = 8;
  size_t max_request_bytes = 4u << 20;
  // Writes are split more coarsely: one large O_DIRECT write already puts every block of it in
  // flight in the kernel, and each extra request costs CPU (and, on ext4, may be serialized).
  size_t max_write_request_bytes = 64u << 20;
  // Worker threads of the thread-pool engine (shared by every caller of this Env).
  int pool_threads = 8;
};

// A POSIX env with its own engine. Fails if `engine` is kIoUring and io_uring is unavailable, or
// on nonsensical options.
Result<std::unique_ptr<Env>> NewPosixEnv(const PosixEnvOptions& options);

// An Env that speaks NFSv3 itself (libnfs, in user space), for directories given as
// `nfs://HOST/EXPORT[/PATH]`: no kernel mount needed. The paths it takes are URLs under that
// one (`nfs://HOST/EXPORT/PATH/a/b`), so a tier's root and every path below it read the same as
// a local directory's. docs/file-format.md says what NFS changes for the file tier.
//
// `connections` TCP connections (one libnfs context each, driven asynchronously by a thread of
// its own): the user-space counterpart of the kernel's `nconnect`. A File is opened on one
// connection (round robin) and its transfers go there, `requests_in_flight` READ/WRITE requests
// of up to the server's rsize/wsize at a time. libnfs keeps no cache: every read asks the
// server (File::direct() is true). Sync is an NFS COMMIT; SyncDir does nothing, since an NFSv3
// server commits namespace changes before it answers them. A connection that breaks is
// reconnected on its next use; a request that the server does not answer within `rpc_timeout`
// fails with ETIMEDOUT.
struct NfsEnvOptions {
  std::string url;  // nfs://HOST/EXPORT[/PATH]: the server and the export to mount
  int connections = 4;
  int requests_in_flight = 16;                   // per File::Submit
  size_t max_request_bytes = 1u << 20;           // capped at the server's rsize / wsize
  std::chrono::milliseconds rpc_timeout{10000};  // rounded up to whole seconds (libnfs)
};

// True for `nfs://...`.
bool IsNfsUrl(std::string_view path);
// Whether this build can speak NFS (it was built with libnfs).
bool NfsSupported();
// Mounts the export of `options.url` on every connection. Fails with kInvalidArgument for a
// malformed URL or options, kUnavailable when the server cannot be reached, kNotFound when no
// prefix of the URL's path is exported, kUnimplemented in a build without libnfs.
Result<std::unique_ptr<Env>> NewNfsEnv(const NfsEnvOptions& options);

// An Env over an S3 bucket (or any S3-compatible object store), for directories given as
// `s3://BUCKET[/PREFIX]`: the paths it takes are URLs under that one, objects stand for files
// and key prefixes (up to a '/') for directories. docs/s3.md says how the file tier uses it.
//
// Configured the standard way, from the environment, unless the options say otherwise:
// AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN (optional), AWS_REGION (or
// AWS_DEFAULT_REGION; us-east-1 when neither is set), AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL
// (an on-premises server; AWS's regional endpoint when unset).
//
// Requests are signed with AWS Signature Version 4 and run through libcurl, `connections` at a
// time over kept-alive connections. A read of a File is one ranged GET, or several of
// `part_bytes` in flight at once for a larger one; a File written is kept in memory and
// published by Sync:
// one PUT up to `multipart_threshold`, a multipart upload of `part_bytes` parts (in parallel)
// above. Open of a file for reading sends nothing: a missing object is the first read's
// kNotFound (ENOENT). Unlink of a missing object succeeds (S3's DELETE cannot tell). Rename is
// a server-side copy and a delete. CreateDirs, RemoveDir and SyncDir have nothing to do.
// Throttling (503 SlowDown) and transient server errors are retried with backoff within
// `request_timeout`; a request that runs past it fails (ETIMEDOUT).
struct S3EnvOptions {
  std::string url;  // s3://BUCKET[/PREFIX]
  // Empty: from the environment, as above.
  std::string endpoint, region, access_key_id, secret_access_key, session_token;
  // "path" (endpoint/BUCKET/KEY), "virtual" (BUCKET.endpoint/KEY), or "auto": path-style for
  // an endpoint given by the user (on-premises servers), virtual-hosted for AWS.
  std::string addressing = "auto";
  int connections = 16;
  // Reads: a File's reads that follow each other in the file are one range, fetched in ranged
  // GETs of up to `part_bytes`, all at once. On AWS, where one connection moves roughly
  // 100 MB/s, 8-16 MiB parts make a large object come back faster; a server that reads the
  // whole object for every ranged GET (moto does) wants them as large as the objects.
  // Writes: a multipart upload's part size.
  size_t part_bytes = 64u << 20;
  size_t multipart_threshold = 64u << 20;  // larger objects are uploaded in parts
  std::chrono::milliseconds request_timeout{10000};
  std::chrono::milliseconds connect_timeout{2000};
  int max_retries = 4;
  int list_page_keys = 1000;  // objects per listing request (S3's maximum)
};

// True for `s3://...`.
bool IsS3Url(std::string_view path);
// Whether this build can speak S3 (it was built with libcurl and pugixml).
bool S3Supported();
// Checks the bucket with one listing request. Fails with kInvalidArgument (a malformed URL, no
// credentials), kNotFound (no such bucket), kPermissionDenied (unknown key, wrong secret,
// clock skew, expired token, access denied: the message says which), kUnavailable (nothing
// answers at the endpoint), kUnimplemented in a build without S3.
Result<std::unique_ptr<Env>> NewS3Env(const S3EnvOptions& options);

// The Env for a directory given by the user: `fallback` (Env::Default() when null) for a local
// path, a new NFS or S3 env (not shared, owned by the result) for an `nfs://` or `s3://` URL,
// with `connections` connections to the server. The returned pointer is valid as long as the
// result lives.
struct EnvForPath {
  Env* env = nullptr;
  std::unique_ptr<Env> owned;
};
Result<EnvForPath> OpenEnvForPath(const std::string& path, Env* fallback = nullptr,
                                  int connections = 4);
// True for a directory that OpenEnvForPath opens remotely (nfs:// or s3://).
inline bool IsRemoteUrl(std::string_view path) { return IsNfsUrl(path) || IsS3Url(path); }

}  // namespace kvtier

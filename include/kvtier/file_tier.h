// FileTier (L2): chunks as files in a directory on a local or shared filesystem.
//
// One file per chunk at root/<namespace id>/<aa>/<bb>/<hex key>, with a checksummed header and a
// 4 KiB-aligned payload; written to a temporary name and published by rename, so readers on any
// host see a whole chunk or none. docs/file-format.md pins the format and what several processes
// and hosts sharing one directory may assume of each other.
//
//   FileTierOptions o;  o.root = "/mnt/kv";  o.ns = ns;  o.chunk_bytes =
//   layout.bytes_per_chunk(256); auto tier = FileTier::Open(o);                 // scans the
//   directory, rebuilds the index tier.value()->Write(key, chunk);               // idempotent,
//   crash-safe publish Status s = tier.value()->Read(key, buffer);    // OK, NotFound (a miss), or
//   an error
//
// Reads verify the header and an XXH3 checksum of the payload; a corrupt file is a miss (counted,
// logged, removed), a foreign one (another namespace or chunk size) is a miss left in place: a
// wrong chunk is never served. Capacity is enforced before each publish by evicting the least
// recently used chunks. Temporary files older than `temp_grace` (left by crashed writers) are
// removed at Open.
//
// Lookups answer from an in-memory index and never touch the storage: no system call, no Env
// call, no network round trip, whatever the filesystem (docs/file-format.md, "The index"). The
// index is rebuilt from the directory at Open and kept current without the lookup's help: by
// this tier's own writes, evictions and reads; by a background rescan that lists the namespace
// every `rescan_interval` (adding what other processes and hosts published, dropping what
// vanished); and by probes: a lookup that misses queues the missing key (and the keys after it)
// for a background thread, which looks for their files and indexes those it finds, so the next
// lookup hits. A key found absent is not probed again for `negative_cache_ttl`. So a chunk
// another host published is seen one probe after the first lookup that wanted it, or one rescan
// interval at worst; Rescan() catches up at once.
//
// I/O uses O_DIRECT where the filesystem allows it: caller buffers that are 4 KiB-aligned are read
// into and written from in place; others go through a per-thread aligned bounce buffer (one extra
// memcpy of the chunk, ~0.1 ms per MiB, and chunk_bytes of memory per calling thread). Where
// O_DIRECT is refused, the tier uses buffered I/O, logs it once and reports o_direct = false in
// Stats(): never silently.
//
// A storage that hangs (a hung NFS server: a read stuck in the kernel cannot be interrupted)
// must not hang its users. A path that is not a regular file (a directory, a FIFO) is a miss,
// never opened in a way that could block. An asynchronous read or write that runs longer than
// `stall_timeout` counts as stalled: the pool starts a replacement thread for it (up to
// `max_replacement_threads`), and Drain and the destructor stop waiting for it after a stall
// timeout without progress, abandoning it: its thread is detached and its callback never runs.
// Asynchronous reads into the tier's own buffers (ReadAsync without a destination) are safe to
// abandon; a caller buffer given to the other ReadAsync or to WriteAsync must then stay valid
// (the engine keeps its L1 arena mapped).
//
// Write failures are never silent: each is counted once, by reason (FileTierStats), and logged at
// a limited rate. ENOSPC is also a capacity signal: the tier evicts its least recently used
// chunks and retries, and keeps its byte budget at what the filesystem held when it filled up
// (`effective_capacity_bytes`) for a while, so an L2 whose configured capacity exceeds the free
// space still evicts when the disk is full.
//
// Thread-safety: every method is thread-safe. No lock is held across I/O; at most one write or
// eviction per key is in flight in a process.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "kvtier/chunk_key.h"
#include "kvtier/io.h"
#include "kvtier/status.h"
#include "kvtier/tier_listener.h"

namespace kvtier {

struct FileTierOptions {
  // The cache directory (created if absent): a local path, nfs://HOST/EXPORT/PATH (docs/
  // file-format.md, "On NFS") or s3://BUCKET/PREFIX (docs/s3.md).
  std::string root;
  KeyNamespace ns;              // files go under root/<ns.Id()>/<aa>/<bb>/<hex key>
  uint64_t chunk_bytes = 0;     // REQUIRED: payload bytes of every chunk in this namespace
  uint64_t capacity_bytes = 0;  // 0 = unlimited; counts whole files (header and padding included)
  int read_threads = 4, write_threads = 2;               // ReadAsync / WriteAsync pools
  size_t max_queued_reads = 64, max_queued_writes = 64;  // bounded queues: full -> kRejected
  IoEngineKind io_engine = IoEngineKind::kAuto;          // used when env is null
  int io_queue_depth = 8;                                // requests in flight per chunk (env null)
  size_t io_request_bytes = 4u << 20;         // size of each of those read requests (env null)
  size_t io_write_request_bytes = 64u << 20;  // and of write requests (env null)
  bool use_o_direct = true;  // falls back to buffered I/O (logged once, in stats) where refused
  // Index upkeep (see above). A key a probe or a read found absent is neither probed nor read
  // again for `negative_cache_ttl` (0: no negative cache, every lookup miss queues a probe);
  // the cache holds at most `negative_cache_entries` keys (the oldest go first).
  std::chrono::milliseconds negative_cache_ttl{500};
  size_t negative_cache_entries = 65536;
  // Keys queued for probing, at most (a lookup that misses queues the key it stopped at and up to
  // 31 keys after it; when the queue is full the miss is not probed). 0: no probes, only
  // rescans find other hosts' chunks.
  size_t max_queued_probes = 1024;
  // The background listing of the namespace: at most this often, and never more often than
  // four times its own last duration, so a slow listing (a large cache, NFS, S3) costs at most a
  // fifth of one background thread. 0: no rescans.
  std::chrono::milliseconds rescan_interval{5000};
  // Several hosts share this directory and its capacity. A tier counts only what it knows of
  // (its index), so without this the directory goes over the capacity by what the other hosts
  // published since this tier last listed it (up to a whole capacity per host in a burst). With
  // it, every publish also leaves a marker, <ns>/recent/<key>.<unix_ms>, and every write first
  // lists those markers and counts the chunks it did not know of before it makes room: the
  // directory then goes over by at most the writes in flight on the other hosts (one chunk per
  // write thread). Costs a listing of that folder per write and a marker per publish; markers
  // older than `shared_capacity_window` are removed by whoever lists them. docs/multi-node.md.
  bool shared_capacity = false;
  std::chrono::milliseconds shared_capacity_window{30000};
  std::chrono::seconds temp_grace{600};  // temporary files older than this are removed at Open
  bool sync_data = true;        // fdatasync a chunk before publishing it (see file-format.md)
  // Caps the tier's chunk reads, all readers together, at this many bytes per second (0: no
  // cap): to leave a shared storage's bandwidth to others, or to see what a slower storage
  // does (the connector's cost-aware lookups are tested on a tier slowed so). A read returns no
  // sooner than its turn's share of the budget ends; a cap so low that one chunk's share
  // outlasts stall_timeout makes reads count as stalled.
  double read_limit_bytes_per_s = 0;
  bool sync_directory = false;  // also fsync the directory after publishing (power-loss safe)
  // nullptr = an env of our own: POSIX, or NFS (NewNfsEnv) for an nfs:// root. Tests pass a
  // fault-injecting one, which must outlive the tier and any operation it abandons at shutdown.
  Env* env = nullptr;
  // An nfs:// or s3:// root with env null: connections to the server (0: 4 for NFS, 16 for S3).
  int connections = 0;
  // An s3:// root with env null: the size of a ranged GET and of an upload part (0: the env's
  // default, 64 MiB: one GET per chunk). 8-16 MiB fetch a chunk over several connections.
  size_t s3_part_bytes = 0;
  // An asynchronous read or write running longer than this is stalled (see above). 0 = never:
  // Drain and the destructor wait for every operation, however long.
  std::chrono::milliseconds stall_timeout{5000};
  int max_replacement_threads = 16;  // per pool, beyond read_threads / write_threads
  // After the filesystem answered ENOSPC, the byte budget stays at what it held then for this
  // long before the configured capacity is tried again.
  std::chrono::seconds disk_full_hold{30};
  // Told of every chunk entering the index (a publish, a file found) or leaving it (eviction,
  // a corrupt or vanished file) (kvtier/tier_listener.h); none when null.
  std::shared_ptr<TierListener> listener;
};

struct FileTierStats {
  uint64_t chunks = 0;                         // chunks in the index
  uint64_t bytes = 0;                          // their file bytes
  uint64_t capacity_bytes = 0;                 // 0 = unlimited
  uint64_t reads = 0, writes = 0;              // Read/Write calls (async ones included)
  uint64_t hits = 0, misses = 0;               // reads that returned data / NotFound
  uint64_t bytes_read = 0, bytes_written = 0;  // payload bytes
  uint64_t evictions = 0;                      // chunks removed to make room
  uint64_t rejections = 0;     // async calls refused (queue full) and writes refused (no room)
  uint64_t errors = 0;         // I/O errors returned to callers
  uint64_t corrupt = 0;        // files that failed a check (removed)
  uint64_t foreign = 0;        // files of another namespace or chunk size (left in place)
  uint64_t disk_rechecks = 0;  // reads of keys not in the index (they go to the file)
  // Chunks another process or host had written, indexed when a read, a probe or a rescan found
  // them.
  uint64_t found_on_disk = 0;
  // Index upkeep in the background (and Rescan()).
  uint64_t rescans = 0;                 // listings of the namespace completed
  uint64_t rescan_failures = 0;         // listings that failed (the index was left as it was)
  uint64_t rescan_added = 0;            // chunks the listings found that the index lacked
  uint64_t rescan_dropped = 0;          // indexed chunks the listings found gone
  uint64_t last_rescan_us = 0;          // how long the last listing and its update took
  uint64_t probes = 0;                  // keys looked up on the storage after a lookup missed
  uint64_t probe_hits = 0;              // of those, found (and indexed)
  uint64_t probes_dropped = 0;          // misses not probed because the probe queue was full
  uint64_t queued_probes = 0;           // keys waiting to be probed now
  uint64_t negative_cache_entries = 0;  // keys known absent now (not probed, reads are misses)
  uint64_t stale_temps_removed = 0;     // at Open
  uint64_t bounce_copies = 0;  // transfers that went through a bounce buffer (unaligned caller)
  uint64_t queued_reads = 0, queued_writes = 0;  // now
  // Failed writes by reason (each also counted once in `errors`, or in `rejections` for
  // capacity taken by writes in flight).
  uint64_t write_no_space = 0;    // ENOSPC / EDQUOT even after evicting to make room
  uint64_t write_read_only = 0;   // EROFS
  uint64_t write_permission = 0;  // EACCES / EPERM
  // Async calls refused because the queue was full (counted in `rejections` too).
  uint64_t read_queue_full = 0, write_queue_full = 0;
  uint64_t reads_unwanted = 0;  // queued reads skipped: their caller no longer wanted them
  uint64_t disk_full = 0;                 // ENOSPC answers seen (evicted and retried)
  uint64_t effective_capacity_bytes = 0;  // the budget now: capacity, or lower after ENOSPC
  uint64_t non_regular = 0;  // chunk paths that were not regular files (counted as foreign)
  uint64_t stalled_reads = 0, stalled_writes = 0;  // running longer than stall_timeout now
  uint64_t replacement_threads = 0;  // threads started to replace stalled ones, so far
  // The numbers above are FileTierStatFields()' rows; the two below are written by name.
  bool o_direct = false;             // every file so far was opened with O_DIRECT in effect
  std::string io_engine;             // "io_uring", "threads", ...
};

// The schema of FileTierStats' numbers, as the engine's counters have theirs (kvtier/engine.h):
// the server's /stats (tiers.file.detail) and the Python binding's file_detail iterate it, so a
// new number is its field and one row. file_tier_stats.cc checks at compile time that every
// number has its row.
struct FileTierStatField {
  std::string_view name;
  std::string_view help;
  uint64_t FileTierStats::*field;
};
// In the order of the struct.
std::span<const FileTierStatField> FileTierStatFields();

class FileTier {
 public:
  // Validates the options (chunk_bytes > 0, a valid namespace, sane thread and queue counts),
  // creates the directory, marks it as a kvtier cache, scans the namespace folder to rebuild the
  // index (by publish time), removes stale temporary files and evicts down to the capacity.
  // Fails with kInvalidArgument, or kIOError/kPermissionDenied if the directory is unusable.
  static Result<std::unique_ptr<FileTier>> Open(const FileTierOptions& options);
  ~FileTier();  // Shutdown(), then releases what no abandoned operation still uses
  FileTier(const FileTier&) = delete;
  FileTier& operator=(const FileTier&) = delete;

  // Number of leading keys in the index. Never blocks on the storage: no system call, no Env
  // call. If a key is missing, it and up to 31 keys after it are queued for a probe on a
  // background thread (unless they are queued already, known absent, or the queue is full), so
  // a chunk another host wrote is found by a later lookup.
  size_t LookupPrefix(std::span<const ChunkKey> keys);
  bool Contains(const ChunkKey& key);  // LookupPrefix of one key

  // Lists the namespace now, on the calling thread, and brings the index up to date: chunks that
  // other processes or hosts published are added (and the negative cache forgets them), indexed
  // chunks whose files are gone are dropped (unless this process wrote or evicted them since the
  // listing began), and the capacity is enforced. What the background rescan does every
  // `rescan_interval`; for tools and tests that need another host's chunks seen now. Blocks for
  // one listing (on S3 one request per 1,000 objects; on a local or NFS directory one per
  // folder and file). Returns the listing's error, with the index unchanged, or kAborted after
  // Shutdown.
  Status Rescan();

  // Reads the chunk into dst (REQUIRES: dst.size() >= chunk_bytes). If dst is 4 KiB-aligned and
  // at least chunk_bytes rounded up to 4 KiB long, the payload is read in place and the bytes
  // past chunk_bytes up to that rounding are overwritten (with the file's zero padding); nothing
  // else past chunk_bytes is touched. Synchronous, on the calling thread. Returns OK; NotFound for
  // a miss (absent, vanished, corrupt or foreign: never wrong data); or an I/O error.
  Status Read(const ChunkKey& key, std::span<uint8_t> dst);
  // The descriptor in the header of the chunk file of `key` (docs/file-format.md, "The
  // descriptor"; written from FileTierOptions::listener): empty if the file has none. One
  // 4 KiB read on the calling thread; the payload is not read, and the index is not changed.
  // NotFound if there is no file; kCorruption for a header that fails its checks, names another
  // namespace or key, or holds a descriptor this build cannot take; an I/O error otherwise.
  Result<std::string> ReadDescriptor(const ChunkKey& key);
  // Stores the chunk (REQUIRES: src.size() == chunk_bytes). Idempotent: OK at once if the key is
  // already indexed; waits for a write of the same key already in flight in this process.
  // Returns kNoSpace when the capacity cannot be met (everything else is being written) or the
  // filesystem is full, kIOError for other failures; nothing is published on failure.
  Status Write(const ChunkKey& key, std::span<const uint8_t> src);

  // Asynchronous versions, run on the tier's own read / write pools. Return kRejected (and queue
  // nothing, and never call `done`) when the queue is full, kAborted after Shutdown; otherwise
  // OK, and `done` runs later on a pool thread with what Read/Write returned, unless the
  // operation is abandoned at shutdown (then never). The caller keeps the buffer alive until
  // `done` runs, or, if it never does, for as long as the process lives.
  Status ReadAsync(const ChunkKey& key, std::span<uint8_t> dst, std::function<void(Status)> done);
  Status WriteAsync(const ChunkKey& key, std::span<const uint8_t> src,
                    std::function<void(Status)> done);
  // Reads into a buffer of the pool thread's own; `done` gets the status and, when OK, the
  // chunk_bytes of the chunk, valid only during the call. Nothing of the caller's is written,
  // so an abandoned read harms nobody. `wanted`, when given, is asked as the read leaves the
  // queue: false skips it (`done` gets kAborted; counted in reads_unwanted), so that reads
  // queued for a caller that gave up (a load past its deadline) do not hold up the next ones.
  using ReadDone = std::function<void(Status, std::span<const uint8_t>)>;
  Status ReadAsync(const ChunkKey& key, ReadDone done, std::function<bool()> wanted = {});

  // Blocks until every queued and running asynchronous write (and read) has finished: true. Or
  // false once only stalled operations have run for a stall timeout (they go on).
  bool Drain();
  // Stops the pools: waits for queued and running operations like Drain, abandons stalled ones
  // (their callbacks never run), and refuses asynchronous calls from then on (kAborted).
  // Returns the number of operations abandoned. Idempotent; the destructor calls it.
  // Background probes and rescans stop too: a probe between two keys, a rescan after its
  // listing; one stuck in the storage (a hung NFS server) is abandoned like a stalled read,
  // after `stall_timeout` (not counted in the result).
  size_t Shutdown();

  FileTierStats Stats() const;
  const FileTierOptions& options() const { return options_; }
  // Where the chunk of `key` lives (whether or not it exists).
  std::string ChunkPath(const ChunkKey& key) const;
  // The namespace folder: root/<ns id>.
  const std::string& namespace_dir() const { return ns_dir_; }
  // Bytes one chunk file takes on disk: header + payload rounded up to 4 KiB.
  uint64_t file_bytes() const;

  class Impl;

 private:
  explicit FileTier(const FileTierOptions& options);
  FileTierOptions options_;
  std::string ns_dir_;
  std::shared_ptr<Impl> impl_;  // shared with operations in flight, which may outlive us
};

}  // namespace kvtier

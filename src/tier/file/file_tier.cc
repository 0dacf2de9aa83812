#include "kvtier/file_tier.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <shared_mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "common/log_limiter.h"
#include "common/task_pool.h"
#include "tier/file/chunk_file.h"

namespace kvtier {

using namespace file_tier_internal;  // NOLINT: the format helpers of this component
using Clock = std::chrono::steady_clock;

namespace {

// Per-thread aligned scratch: the header block, a tail block for payloads that are not a multiple
// of 4 KiB, and a bounce buffer for unaligned caller buffers (grown on demand, kept for reuse so
// that page faults are paid once per thread, not once per chunk).
// `owned` receives the reads that hand the tier's own buffer to their callback: being the
// thread's, it stays valid for as long as a read stuck in the kernel may still write into it.
struct ThreadScratch {
  AlignedBuffer header{kHeaderBytes};
  AlignedBuffer tail{kDirectIoAlignment};
  AlignedBuffer bounce;
  AlignedBuffer owned;
  std::span<uint8_t> Bounce(size_t n) {
    if (bounce.size() < n) bounce = AlignedBuffer(n);
    return bounce.first(n);
  }
  std::span<uint8_t> Owned(size_t n) {
    if (owned.size() < n) owned = AlignedBuffer(n);
    return owned.first(n);
  }
};
thread_local ThreadScratch tls_scratch;

// A lookup that misses queues the key it stopped at and up to this many keys in all from there:
// another host that wrote a prefix wrote all of it, and one probe round finds it all.
constexpr size_t kProbeRunKeys = 32;
// Index updates of a rescan are applied this many keys per hold of the index lock, so that
// lookups never wait long behind a rescan of a large cache.
constexpr size_t kRescanBatch = 4096;

uint64_t NowUnixMs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

// Writes `text` to `path` atomically (temporary name, then rename) unless `path` exists.
Status WriteSmallFileOnce(Env* env, const std::string& dir, std::string_view name,
                          const std::string& text) {
  const std::string path = fmt::format("{}/{}", dir, name);
  if (env->Stat(path).ok()) return Status::Ok();
  // An object store publishes at Sync, whole: no temporary name to rename.
  const bool direct_publish = env->publishes_at_sync();
  const std::string tmp_path =
      direct_publish ? path : fmt::format("{}/{}{}{}", dir, name, kTempInfix, UniqueSuffix());
  {
    OpenOptions o;
    o.write = o.create = true;
    o.exclusive = !direct_publish;
    o.truncate = direct_publish;
    KVTIER_ASSIGN_OR_RETURN(auto file, env->Open(tmp_path, o));
    std::vector<uint8_t> bytes(text.begin(), text.end());
    IoOp op = IoOp::Write(0, bytes);
    Status s = WriteExact(*file, std::span<IoOp>(&op, 1));
    if (s.ok()) s = file->Sync();
    if (!s.ok()) {
      file.reset();
      if (!direct_publish) (void)env->Unlink(tmp_path);
      return s;
    }
  }
  if (direct_publish) return Status::Ok();
  Status s = env->Rename(tmp_path, path);
  if (!s.ok()) (void)env->Unlink(tmp_path);
  return s;
}

}  // namespace

class FileTier::Impl : public std::enable_shared_from_this<FileTier::Impl> {
 public:
  Impl(const FileTierOptions& o, std::string ns_dir)
      : options_(o),
        ns_dir_(std::move(ns_dir)),
        ns_root_(o.ns.Root()),
        file_bytes_(ChunkFileBytes(o.chunk_bytes)) {}

  ~Impl() { Shutdown(); }

  Status Init();
  // Stops the background work and both pools (see FileTier::Shutdown); then no callback runs any
  // more.
  size_t Shutdown() {
    size_t abandoned = 0;
    {
      std::lock_guard<std::mutex> lock(shutdown_mu_);
      {
        std::lock_guard<std::mutex> index_lock(mu_);
        stopping_ = true;
      }
      background_cv_.notify_all();
      // The scheduler does no I/O: it leaves at once. (It never holds the last reference to us,
      // so this never runs on it; detaching would be the safe answer if it did.)
      if (scheduler_.joinable()) {
        if (scheduler_.get_id() == std::this_thread::get_id()) {
          scheduler_.detach();
        } else {
          scheduler_.join();
        }
      }
      // A probe stops between two keys, a rescan after its listing; one stuck in the storage is
      // abandoned after a stall timeout, like a stalled read (its task owns a reference to us).
      if (background_pool_) (void)background_pool_->Shutdown();
      if (read_pool_) abandoned += read_pool_->Shutdown();
      if (write_pool_) abandoned += write_pool_->Shutdown();
    }
    std::unique_lock<std::shared_mutex> gate(callbacks_mu_);
    callbacks_closed_ = true;
    return abandoned;
  }
  // Runs an operation's completion callback unless the tier has shut down: a callback of an
  // operation abandoned at shutdown would call into objects its owner has since destroyed.
  template <typename F>
  void Deliver(F&& f) {
    std::shared_lock<std::shared_mutex> gate(callbacks_mu_);
    if (!callbacks_closed_) f();
  }
  void CountUnwantedRead() { reads_unwanted_.fetch_add(1, std::memory_order_relaxed); }

  size_t LookupPrefix(std::span<const ChunkKey> keys);
  Status Rescan();
  Status Read(const ChunkKey& key, std::span<uint8_t> dst);
  Result<std::string> ReadDescriptor(const ChunkKey& key);
  Status Write(const ChunkKey& key, std::span<const uint8_t> src);
  Status Submit(bool write, std::function<void()> task);
  bool Drain() {
    bool writes = write_pool_->Drain();
    bool reads = read_pool_->Drain();
    return writes && reads;
  }
  FileTierStats Stats() const;
  std::string ChunkPath(const ChunkKey& key) const {
    std::string hex = key.ToHex();
    return fmt::format("{}/{}", LeafDir(ns_dir_, hex), hex);
  }
  uint64_t file_bytes() const { return file_bytes_; }

 private:
  struct Entry {
    uint64_t bytes;
    std::list<ChunkKey>::iterator lru;  // position in lru_
    uint64_t seq;                       // index_seq_ when last inserted or confirmed on disk
  };

  // --- index; every *Locked method REQUIRES mu_ held ---
  void InsertLocked(const ChunkKey& key, uint64_t bytes) {
    auto it = index_.find(key);
    if (it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second.lru);
      it->second.seq = ++index_seq_;
      return;
    }
    lru_.push_front(key);
    index_.emplace(key, Entry{bytes, lru_.begin(), ++index_seq_});
    used_bytes_ += bytes;
    if (options_.listener) options_.listener->OnTierChange(TierId::kFile, key, true);
  }
  bool EraseLocked(const ChunkKey& key) {
    auto it = index_.find(key);
    if (it == index_.end()) return false;
    used_bytes_ -= it->second.bytes;
    lru_.erase(it->second.lru);
    index_.erase(it);
    if (options_.listener) options_.listener->OnTierChange(TierId::kFile, key, false);
    // A rescan in progress may have listed this file before it went: it must not put it back.
    if (rescans_running_ > 0) erased_during_rescan_.insert(key);
    return true;
  }
  // Picks least recently used victims (removing them from the index and marking them as being
  // mutated) until `incoming` more bytes fit under the capacity. False, with nothing changed, if
  // they cannot fit even with the index empty (the rest of the room is reserved by writes).
  bool MakeRoomLocked(uint64_t incoming, std::vector<ChunkKey>* victims) {
    const uint64_t cap = EffectiveCapacityLocked();
    if (cap == 0) return true;
    if (reserved_bytes_ + incoming > cap) return false;
    while (used_bytes_ + reserved_bytes_ + incoming > cap && !lru_.empty()) {
      ChunkKey victim = lru_.back();
      EraseLocked(victim);
      mutating_.insert(victim);
      victims->push_back(victim);
    }
    return true;
  }
  // The byte budget: the configured capacity (0 = unlimited), or less for a while after the
  // filesystem said ENOSPC (what we held on it then).
  uint64_t EffectiveCapacityLocked() const {
    const uint64_t cap = options_.capacity_bytes;
    if (disk_full_cap_ == 0 || env_->Now() >= disk_full_until_) return cap;
    return cap == 0 ? disk_full_cap_ : std::min(cap, disk_full_cap_);
  }
  // The negative cache: keys found absent, each until its expiry. Entries leave when they
  // expire (the scheduler purges them, so that a lookup needs no clock) or, oldest first, when
  // the cache is full. `negative_order_` lists (key, expiry) by expiry, the TTL being fixed; an
  // entry there whose key has since left or been renewed is skipped.
  void NegativeInsertLocked(const ChunkKey& key) {
    const size_t cap = options_.negative_cache_entries;
    if (options_.negative_cache_ttl.count() <= 0 || cap == 0) return;
    const Clock::time_point expiry = env_->Now() + options_.negative_cache_ttl;
    const bool was_empty = negative_.empty();
    negative_[key] = expiry;
    negative_order_.emplace_back(key, expiry);
    while (negative_.size() > cap) PopNegativeLocked();
    if (negative_order_.size() > 2 * cap + 1024) {  // renewed keys left stale entries behind
      std::erase_if(negative_order_, [&](const auto& e) {
        auto it = negative_.find(e.first);
        return it == negative_.end() || it->second != e.second;
      });
    }
    if (was_empty) background_cv_.notify_all();  // the scheduler's next wake-up moved
  }
  void PopNegativeLocked() {
    auto [key, expiry] = negative_order_.front();
    negative_order_.pop_front();
    auto it = negative_.find(key);
    if (it != negative_.end() && it->second == expiry) negative_.erase(it);
  }
  // Drops expired entries; returns the next expiry, if any.
  std::optional<Clock::time_point> PurgeNegativeLocked() {
    if (negative_.empty()) {
      negative_order_.clear();
      return std::nullopt;
    }
    const Clock::time_point now = env_->Now();
    while (!negative_order_.empty() && negative_order_.front().second <= now) PopNegativeLocked();
    if (negative_order_.empty()) return std::nullopt;
    return negative_order_.front().second;
  }
  bool NegativeHitLocked(const ChunkKey& key) const { return negative_.count(key) != 0; }
  // Queues a probe of `missing` (the key a lookup stopped at) and the keys after it, unless it
  // is queued already or known absent. True when the scheduler needs a wake-up.
  bool QueueProbeLocked(std::span<const ChunkKey> missing) {
    const ChunkKey& first = missing.front();
    if (options_.max_queued_probes == 0 || stopping_ || probe_pending_.contains(first) ||
        NegativeHitLocked(first)) {
      return false;
    }
    const size_t n = std::min(missing.size(), kProbeRunKeys);
    if (probe_queued_keys_ + n > options_.max_queued_probes) {
      probes_dropped_.fetch_add(1, std::memory_order_relaxed);
      return false;
    }
    probe_queue_.emplace_back(missing.begin(), missing.begin() + n);
    probe_queued_keys_ += n;
    for (const ChunkKey& k : probe_queue_.back()) ++probe_pending_[k];
    return !probe_task_running_;
  }
  void EndMutation(const ChunkKey& key) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      mutating_.erase(key);
    }
    mutation_cv_.notify_all();
  }

  // Unlinks victims picked by MakeRoomLocked. A victim already gone (another host evicted it) is
  // fine: the point is that it is not on disk.
  // A victim whose unlink fails is still on disk, so it goes back into the index (as the least
  // recently used) and the first such error is returned: a write must not publish on top of it.
  // `count_errors`: false where the caller counts the failure it causes (a write).
  Status RemoveVictims(const std::vector<ChunkKey>& victims, bool count_errors = true) {
    Status first;
    for (const ChunkKey& v : victims) {
      Status s = env_->Unlink(ChunkPath(v));
      bool kept = !s.ok() && !s.IsNotFound();
      {
        std::lock_guard<std::mutex> lock(mu_);
        mutating_.erase(v);
        if (kept) {
          InsertLocked(v, file_bytes_);
          lru_.splice(lru_.end(), lru_, index_.find(v)->second.lru);
        }
      }
      mutation_cv_.notify_all();
      if (kept) {
        if (count_errors) errors_.fetch_add(1);
        if (auto held = evict_log_.Allow()) {
          spdlog::warn("file tier: evicting {}: {}{}", ChunkPath(v), s.ToString(),
                       LogLimiter::Suppressed(*held));
        }
        if (first.ok()) first = s;
      } else {
        evictions_.fetch_add(1);
      }
    }
    return first;
  }
  // Adds a chunk found on disk (written by another process or host) and evicts if that pushed the
  // index over the capacity.
  void AdoptFromDisk(const ChunkKey& key) {
    std::vector<ChunkKey> victims;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (mutating_.count(key)) return;  // our own write or eviction of it is in flight
      if (!index_.count(key)) found_on_disk_.fetch_add(1);
      InsertLocked(key, file_bytes_);
      negative_.erase(key);
      const uint64_t cap = EffectiveCapacityLocked();
      // After Shutdown (an abandoned background task returning late) nothing is removed.
      if (cap != 0 && used_bytes_ + reserved_bytes_ > cap && !stopping_) {
        // Evict others first; the found chunk is the most recent.
        while (used_bytes_ + reserved_bytes_ > cap && lru_.size() > 1) {
          ChunkKey victim = lru_.back();
          EraseLocked(victim);
          mutating_.insert(victim);
          victims.push_back(victim);
        }
      }
    }
    (void)RemoveVictims(victims);  // on failure the victims stay indexed: retried next time
  }
  // A file vanished or is unusable: forget it and remember the miss for a while. `seen` is
  // index_seq_ when the reader looked (before its I/O): a key written or confirmed on disk since
  // then names a newer file than the one found missing or bad, and stays. (Forgetting it would
  // leave a published file out of the index, and out of the capacity.)
  void Forget(const ChunkKey& key, uint64_t seen) {
    std::lock_guard<std::mutex> lock(mu_);
    if (mutating_.count(key) || IndexedSinceLocked(key, seen)) return;
    EraseLocked(key);
    NegativeInsertLocked(key);
  }
  bool IndexedSinceLocked(const ChunkKey& key, uint64_t seen) const {
    auto it = index_.find(key);
    return it != index_.end() && it->second.seq > seen;
  }
  Status Corrupt(const ChunkKey& key, uint64_t seen, const std::string& path,
                 const std::string& why);
  Status Foreign(const ChunkKey& key, uint64_t seen, const std::string& path,
                 const std::string& why);
  Status EnsureLeafDir(const std::string& dir, bool force);
  Status WriteDirectoryFiles();
  Status WriteAndPublish(const ChunkKey& key, std::span<const uint8_t> src);
  // FileTierOptions::shared_capacity: indexes the chunks other tiers published lately (their
  // markers in recent_dir_) that this one has not counted yet, and removes expired markers.
  void AdoptRecentPublishes();
  // Leaves the marker of a chunk this tier just published.
  void MarkPublished(const ChunkKey& key);
  // The filesystem is full: lower the budget to what we hold on it minus this write's file, and
  // pick victims to make that room. False if there is nothing of ours to evict.
  bool DiskFull(std::vector<ChunkKey>* victims);
  void CountWriteFailure(const ChunkKey& key, const Status& s);
  // A listing of the namespace folder: the chunk files in it with their publish times. At Open
  // (`at_open`) also removes stale temporary files and counts misplaced or wrong-sized files.
  struct Found {
    ChunkKey key;
    int64_t mtime_ns;
  };
  Result<std::vector<Found>> ListNamespace(bool at_open);
  Status ScanNamespace();
  // The background: a scheduler thread (no I/O) that hands probes and rescans to
  // background_pool_ and purges the negative cache; the pool's tasks, which own a reference to
  // us (an abandoned one may return after we are gone).
  void SchedulerLoop();
  void RunProbes();
  void RunScheduledRescan();
  void NoteDirect(const File& f) {
    if (!f.direct() && options_.use_o_direct) all_direct_.store(false);
  }
  // FileTierOptions::read_limit_bytes_per_s: each read books the next `bytes / rate` of the
  // budget after those booked before it and returns at its end, so all readers together move at
  // most the rate (a token bucket without a burst).
  void PaceRead(uint64_t bytes) {
    const double rate = options_.read_limit_bytes_per_s;
    if (!(rate > 0)) return;
    const auto share = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(static_cast<double>(bytes) / rate));
    std::chrono::steady_clock::time_point until;
    {
      std::lock_guard<std::mutex> lock(pace_mu_);
      pace_next_ = std::max(pace_next_, std::chrono::steady_clock::now()) + share;
      until = pace_next_;
    }
    std::this_thread::sleep_until(until);
  }

  const FileTierOptions options_;
  const std::string ns_dir_;
  const ChunkKey ns_root_;
  const uint64_t file_bytes_;
  std::unique_ptr<Env> owned_env_;
  Env* env_ = nullptr;

  std::mutex pace_mu_;  // PaceRead's booking
  std::chrono::steady_clock::time_point pace_next_{};

  mutable std::mutex mu_;
  std::condition_variable mutation_cv_;  // signalled whenever a mutation ends
  std::unordered_map<ChunkKey, Entry, ChunkKeyHash> index_;
  std::list<ChunkKey> lru_;                              // front = most recently used
  uint64_t used_bytes_ = 0;                              // file bytes of the index
  uint64_t reserved_bytes_ = 0;                          // file bytes of writes in flight
  std::unordered_set<ChunkKey, ChunkKeyHash> mutating_;  // writes and evictions in flight
  // The negative cache: key -> expiry, and (key, expiry) in order of expiry.
  std::unordered_map<ChunkKey, Clock::time_point, ChunkKeyHash> negative_;
  std::deque<std::pair<ChunkKey, Clock::time_point>> negative_order_;
  uint64_t disk_full_cap_ = 0;           // 0: no ENOSPC lately
  Clock::time_point disk_full_until_{};  // the lowered budget holds until then
  uint64_t index_seq_ = 0;               // bumped by every InsertLocked (Entry::seq)
  // Rescans listing or applying now, and what left the index meanwhile (see EraseLocked).
  int rescans_running_ = 0;
  std::unordered_set<ChunkKey, ChunkKeyHash> erased_during_rescan_;
  // Probes: runs of keys from lookups that missed. Every key of a run is in probe_pending_
  // (counted: runs may overlap) from queueing until its run ends, so a lookup that stops at a
  // key a run is probing now queues nothing (a lookup polling a run in progress used to queue
  // the rest of it again).
  std::deque<std::vector<ChunkKey>> probe_queue_;
  size_t probe_queued_keys_ = 0;
  std::unordered_map<ChunkKey, uint32_t, ChunkKeyHash> probe_pending_;
  bool probe_task_running_ = false, rescan_task_running_ = false;
  Clock::time_point next_rescan_{};  // real time (steady_clock), not env_->Now()
  bool stopping_ = false;
  std::condition_variable background_cv_;  // wakes the scheduler

  std::mutex dirs_mu_;
  std::unordered_set<std::string> leaf_dirs_;  // created (or seen) by us

  // FileTierOptions::shared_capacity. A marker is counted once: recent_seen_ holds the names of
  // those already adopted (or our own) that the last listing still showed, so a chunk that has
  // since been evicted is not counted again from its marker.
  std::string recent_dir_;
  std::mutex recent_mu_;  // one listing at a time; guards recent_seen_
  std::unordered_set<std::string> recent_seen_;

  std::atomic<uint64_t> reads_{0}, writes_{0}, hits_{0}, misses_{0}, bytes_read_{0},
      bytes_written_{0}, evictions_{0}, rejections_{0}, errors_{0}, corrupt_{0}, foreign_{0},
      disk_rechecks_{0}, found_on_disk_{0}, stale_temps_removed_{0}, bounce_copies_{0},
      write_no_space_{0}, write_read_only_{0}, write_permission_{0}, read_queue_full_{0},
      write_queue_full_{0}, reads_unwanted_{0}, disk_full_{0}, non_regular_{0}, rescans_{0},
      rescan_failures_{0}, rescan_added_{0}, rescan_dropped_{0}, last_rescan_us_{0}, probes_{0},
      probe_hits_{0}, probes_dropped_{0};
  std::atomic<bool> all_direct_{true};
  LogLimiter write_log_, reject_log_, evict_log_, read_log_, rescan_log_;

  std::mutex shutdown_mu_;
  std::shared_mutex callbacks_mu_;
  bool callbacks_closed_ = false;
  std::unique_ptr<TaskPool> read_pool_, write_pool_, background_pool_;
  std::thread scheduler_;
};

Status FileTier::Impl::Init() {
  if (options_.env != nullptr) {
    env_ = options_.env;
  } else if (IsS3Url(options_.root)) {
    S3EnvOptions so;
    so.url = options_.root;
    if (options_.connections > 0) so.connections = options_.connections;
    if (options_.s3_part_bytes > 0) so.part_bytes = options_.s3_part_bytes;
    KVTIER_ASSIGN_OR_RETURN(owned_env_, NewS3Env(so));
    env_ = owned_env_.get();
  } else if (IsNfsUrl(options_.root)) {
    NfsEnvOptions no;
    no.url = options_.root;
    if (options_.connections > 0) no.connections = options_.connections;
    no.requests_in_flight = std::max(1, options_.io_queue_depth);
    KVTIER_ASSIGN_OR_RETURN(owned_env_, NewNfsEnv(no));
    env_ = owned_env_.get();
  } else {
    PosixEnvOptions eo;
    eo.engine = options_.io_engine;
    eo.queue_depth = options_.io_queue_depth;
    eo.max_request_bytes = options_.io_request_bytes;
    eo.max_write_request_bytes = options_.io_write_request_bytes;
    KVTIER_ASSIGN_OR_RETURN(owned_env_, NewPosixEnv(eo));
    env_ = owned_env_.get();
  }
  const std::string& root = options_.root;
  KVTIER_RETURN_IF_ERROR(env_->CreateDirs(root).WithContext("creating the cache directory"));
  // Refuse to scatter files into a directory that holds something else.
  KVTIER_ASSIGN_OR_RETURN(auto entries, env_->List(root));
  const bool marked = std::any_of(entries.begin(), entries.end(),
                                  [](const DirEntry& e) { return e.name == kMarkerName; });
  for (const DirEntry& e : entries) {
    bool ours = e.name.starts_with(kMarkerName) || e.name[0] == '.' || e.name == "lost+found" ||
                (IsNamespaceName(e.name) && e.type == DirEntry::Type::kDirectory);
    if (!marked && !ours) {
      return Status::InvalidArgument(fmt::format(
          "{} is not empty and is not a kvtier cache (no {}; found '{}'): refusing to use it", root,
          kMarkerName, e.name));
    }
  }
  KVTIER_RETURN_IF_ERROR(WriteDirectoryFiles());
  if (options_.shared_capacity) {
    recent_dir_ = ns_dir_ + "/" + std::string(kRecentDirName);
    KVTIER_RETURN_IF_ERROR(env_->CreateDirs(recent_dir_).WithContext("creating " + recent_dir_));
  }
  KVTIER_RETURN_IF_ERROR(ScanNamespace());
  if (options_.capacity_bytes != 0) {
    // Informational: a capacity above the free space is legal (ENOSPC makes the tier evict), but
    // an operator should know.
    struct statvfs vfs;
    if (::statvfs(ns_dir_.c_str(), &vfs) == 0) {
      const uint64_t free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
      if (options_.capacity_bytes > used_bytes_ + free_bytes) {
        spdlog::warn(
            "file tier: capacity {:.2f} GB at {} exceeds what the filesystem can hold "
            "({:.2f} GB free + {:.2f} GB cached); the tier will evict when it is full",
            options_.capacity_bytes / 1e9, options_.root, free_bytes / 1e9, used_bytes_ / 1e9);
      }
    }
  }
  auto pool_options = [&](int threads, size_t queued, const char* name) {
    TaskPoolOptions p;
    p.threads = threads;
    p.max_queued = queued;
    p.name = fmt::format("file tier {} at {}", name, options_.root);
    p.stall_timeout = options_.stall_timeout;
    p.max_extra_threads = options_.max_replacement_threads;
    return p;
  };
  read_pool_ = std::make_unique<TaskPool>(
      pool_options(options_.read_threads, options_.max_queued_reads, "reads"));
  write_pool_ = std::make_unique<TaskPool>(
      pool_options(options_.write_threads, options_.max_queued_writes, "writes"));
  // Two threads: a slow listing does not hold up probes. At most one probe task and one rescan
  // task exist at a time (the scheduler sees to it), so the queue never refuses them.
  background_pool_ = std::make_unique<TaskPool>(pool_options(2, 2, "background"));
  next_rescan_ = Clock::now() + options_.rescan_interval;
  scheduler_ = std::thread([this] { SchedulerLoop(); });
  return Status::Ok();
}

Result<std::vector<FileTier::Impl::Found>> FileTier::Impl::ListNamespace(bool at_open) {
  std::vector<Found> found;
  const int64_t now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
  const int64_t grace_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(options_.temp_grace).count();
  uint64_t wrong_size = 0;
  // One listing of the whole namespace (an object store lists a prefix in pages of 1,000;
  // walking its 65,536 leaf folders one by one would take as many requests).
  auto listed = env_->ListTree(ns_dir_);
  if (!listed.ok() && listed.status().IsNotFound() && !at_open) {
    // The folder is gone (purged) if a stat agrees; then so is every chunk.
    auto dir = env_->Stat(ns_dir_);
    if (dir.status().IsNotFound()) return found;
  }
  KVTIER_ASSIGN_OR_RETURN(auto tree, std::move(listed));
  for (const TreeEntry& e : tree) {
    // <aa>/<bb>/<name>
    const size_t s1 = e.path.find('/'), s2 = e.path.find('/', s1 + 1);
    if (s1 != 2 || s2 != 5 || e.path.find('/', s2 + 1) != std::string::npos) continue;
    const std::string a = e.path.substr(0, 2), b = e.path.substr(3, 2), name = e.path.substr(6);
    if (!IsHexByteName(a) || !IsHexByteName(b)) continue;
    const bool chunk = IsChunkName(name), temp = !chunk && IsTempName(name);
    if (!chunk && !temp) continue;
    const std::string bdir = fmt::format("{}/{}/{}", ns_dir_, a, b);
    {
      std::lock_guard<std::mutex> lock(dirs_mu_);
      leaf_dirs_.insert(bdir);
    }
    const std::string path = fmt::format("{}/{}", bdir, name);
    if (temp) {
      if (at_open && now_ns - e.info.mtime_ns > grace_ns) {
        Status s = env_->Unlink(path);
        if (s.ok()) {
          stale_temps_removed_.fetch_add(1);
        } else if (!s.IsNotFound()) {
          spdlog::warn("file tier: removing stale temporary file {}: {}", path, s.ToString());
        }
      }
      continue;
    }
    if (name.compare(0, 4, a + b) != 0) {
      ++wrong_size;  // a chunk in the wrong folder: never ours to serve
      continue;
    }
    if (e.info.size != file_bytes_ || !e.info.is_regular) {
      ++wrong_size;
      continue;
    }
    found.push_back({ChunkKey::FromHex(name).value(), e.info.mtime_ns});
  }
  if (wrong_size > 0 && at_open) {  // rescans see them again: reported once
    foreign_.fetch_add(wrong_size);
    spdlog::warn(
        "file tier: {} files in {} do not have this tier's chunk size ({} bytes) or "
        "place; they are ignored (run kvtier fsck)",
        wrong_size, ns_dir_, file_bytes_);
  }
  // Oldest first, so that the newest ends up at the front of the LRU list.
  std::sort(found.begin(), found.end(),
            [](const Found& x, const Found& y) { return x.mtime_ns < y.mtime_ns; });
  return found;
}

Status FileTier::Impl::ScanNamespace() {
  KVTIER_ASSIGN_OR_RETURN(std::vector<Found> found, ListNamespace(/*at_open=*/true));
  std::vector<ChunkKey> victims;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Found& f : found) InsertLocked(f.key, file_bytes_);
    MakeRoomLocked(0, &victims);
  }
  (void)RemoveVictims(victims);  // on failure the victims stay indexed: retried next time
  if (stale_temps_removed_.load() > 0) {
    spdlog::info("file tier: removed {} stale temporary files from {}", stale_temps_removed_.load(),
                 ns_dir_);
  }
  spdlog::debug("file tier: {} chunks indexed in {}", found.size() - victims.size(), ns_dir_);
  return Status::Ok();
}

size_t FileTier::Impl::LookupPrefix(std::span<const ChunkKey> keys) {
  // The index only: no Env call, no system call (a miss may wake the scheduler: a futex wake,
  // once per probe queued).
  size_t n = 0;
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    while (n < keys.size() && index_.count(keys[n]) != 0) ++n;
    if (n < keys.size()) wake = QueueProbeLocked(keys.subspan(n));
  }
  if (wake) background_cv_.notify_all();
  return n;
}

void FileTier::Impl::RunProbes() {
  for (;;) {
    std::vector<ChunkKey> run;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_ || probe_queue_.empty()) {
        probe_task_running_ = false;
        break;
      }
      run = std::move(probe_queue_.front());
      probe_queue_.pop_front();
      probe_queued_keys_ -= run.size();
    }
    // In order, up to the first key absent: the keys after it cannot extend a prefix.
    for (const ChunkKey& key : run) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stopping_ || NegativeHitLocked(key) || mutating_.count(key)) break;
        if (index_.count(key)) continue;
      }
      probes_.fetch_add(1, std::memory_order_relaxed);
      auto info = env_->Stat(ChunkPath(key));
      if (info.ok() && info->is_regular && info->size == file_bytes_) {
        probe_hits_.fetch_add(1, std::memory_order_relaxed);
        AdoptFromDisk(key);
        continue;
      }
      // Absent, or not a chunk of ours, or the storage failed: a miss for a while either way
      // (a failing server is not asked again and again).
      std::lock_guard<std::mutex> lock(mu_);
      if (!index_.count(key)) NegativeInsertLocked(key);
      break;
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (const ChunkKey& k : run) {
      auto it = probe_pending_.find(k);
      if (--it->second == 0) probe_pending_.erase(it);
    }
  }
  background_cv_.notify_all();
}

Status FileTier::Impl::Rescan() {
  const auto t0 = Clock::now();
  uint64_t start_seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return Status::Aborted("file tier is shut down");
    start_seq = index_seq_;
    ++rescans_running_;
  }
  // Whatever happens below, the rescan ends here.
  struct End {
    Impl* impl;
    ~End() {
      std::lock_guard<std::mutex> lock(impl->mu_);
      if (--impl->rescans_running_ == 0) impl->erased_during_rescan_.clear();
    }
  } end{this};
  auto listed = ListNamespace(/*at_open=*/false);
  if (!listed.ok()) {
    rescan_failures_.fetch_add(1, std::memory_order_relaxed);
    if (auto held = rescan_log_.Allow()) {
      spdlog::warn("file tier: rescanning {}: {}{}", ns_dir_, listed.status().ToString(),
                   LogLimiter::Suppressed(*held));
    }
    return listed.status();
  }
  std::vector<Found>& found = *listed;
  std::unordered_set<ChunkKey, ChunkKeyHash> on_disk;
  on_disk.reserve(found.size());
  for (const Found& f : found) on_disk.insert(f.key);

  // Dropped: indexed before the listing began (so the listing would have seen them) and not in
  // it. Candidates are gathered under the lock, checked against the listing outside it.
  std::vector<ChunkKey> candidates;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return Status::Aborted("file tier is shut down");
    candidates.reserve(index_.size());
    for (const auto& [key, entry] : index_) {
      if (entry.seq <= start_seq) candidates.push_back(key);
    }
  }
  std::erase_if(candidates, [&](const ChunkKey& k) { return on_disk.count(k) != 0; });
  uint64_t added = 0, dropped = 0;
  std::vector<ChunkKey> victims;
  for (size_t i = 0; i < std::max(candidates.size(), found.size()); i += kRescanBatch) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return Status::Aborted("file tier is shut down");
    for (size_t k = i; k < std::min(i + kRescanBatch, candidates.size()); ++k) {
      // Written or confirmed since the listing began, or being written or evicted now: the
      // listing is older news.
      auto it = index_.find(candidates[k]);
      if (it == index_.end() || it->second.seq > start_seq || mutating_.count(candidates[k])) {
        continue;
      }
      EraseLocked(candidates[k]);
      ++dropped;
    }
    // Added oldest first, each to the front of the LRU list: what others published lately is
    // recent, and the newest is the most recent.
    for (size_t k = i; k < std::min(i + kRescanBatch, found.size()); ++k) {
      const ChunkKey& key = found[k].key;
      if (index_.count(key) || mutating_.count(key) || erased_during_rescan_.count(key)) continue;
      InsertLocked(key, file_bytes_);
      negative_.erase(key);
      ++added;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) MakeRoomLocked(0, &victims);
  }
  (void)RemoveVictims(victims);  // on failure the victims stay indexed: retried next time
  found_on_disk_.fetch_add(added, std::memory_order_relaxed);
  rescan_added_.fetch_add(added, std::memory_order_relaxed);
  rescan_dropped_.fetch_add(dropped, std::memory_order_relaxed);
  rescans_.fetch_add(1, std::memory_order_relaxed);
  const auto took = Clock::now() - t0;
  last_rescan_us_.store(
      static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(took).count()),
      std::memory_order_relaxed);
  if (added > 0 || dropped > 0) {
    spdlog::debug("file tier: rescan of {}: {} chunks listed, {} added, {} dropped, {:.1f} ms",
                  ns_dir_, found.size(), added, dropped,
                  std::chrono::duration<double, std::milli>(took).count());
  }
  return Status::Ok();
}

void FileTier::Impl::RunScheduledRescan() {
  const auto t0 = Clock::now();
  (void)Rescan();  // counted and logged there
  const auto t1 = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  rescan_task_running_ = false;
  // A slow listing (a large cache, a remote store) is spaced out so that it costs at most a
  // fifth of a thread.
  next_rescan_ = t1 + std::max<Clock::duration>(options_.rescan_interval, 4 * (t1 - t0));
  background_cv_.notify_all();
}

void FileTier::Impl::SchedulerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    const std::optional<Clock::time_point> expiry = PurgeNegativeLocked();
    // The tasks own a reference to us: a task abandoned at shutdown (stuck in the storage) may
    // return after the FileTier is gone.
    if (!probe_queue_.empty() && !probe_task_running_) {
      probe_task_running_ = true;
      if (!background_pool_->TrySubmit([self = shared_from_this()] { self->RunProbes(); }).ok()) {
        probe_task_running_ = false;  // shutting down
      }
    }
    const bool rescans = options_.rescan_interval.count() > 0;
    if (rescans && !rescan_task_running_ && Clock::now() >= next_rescan_) {
      rescan_task_running_ = true;
      if (!background_pool_->TrySubmit([self = shared_from_this()] { self->RunScheduledRescan(); })
               .ok()) {
        rescan_task_running_ = false;
      }
    }
    // Sleep until the next rescan or expiry, or until a lookup queues a probe (or a task ends).
    std::optional<Clock::time_point> wake;
    if (rescans && !rescan_task_running_) wake = next_rescan_;
    if (expiry) {
      // The negative cache runs on the env's clock (a test may move it); sleeping is real time.
      const Clock::time_point at = Clock::now() + (*expiry - env_->Now());
      wake = wake ? std::min(*wake, at) : at;
    }
    if (wake) {
      background_cv_.wait_until(lock, *wake);
    } else {
      background_cv_.wait(lock);
    }
  }
}

Status FileTier::Impl::Corrupt(const ChunkKey& key, uint64_t seen, const std::string& path,
                               const std::string& why) {
  corrupt_.fetch_add(1);
  misses_.fetch_add(1);
  bool remove;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // If this process is rewriting or evicting the key right now, or wrote it since the read
    // began, the file at `path` is or will be another one: leave it to that mutation.
    remove = !IndexedSinceLocked(key, seen) && mutating_.insert(key).second;
    if (remove) EraseLocked(key);
  }
  spdlog::warn("file tier: corrupt chunk file {} ({}){}", path, why, remove ? "; removed" : "");
  if (remove) {
    Status s = env_->Unlink(path);
    if (!s.ok() && !s.IsNotFound()) {
      spdlog::warn("file tier: removing corrupt {}: {}", path, s.ToString());
    }
    EndMutation(key);
  }
  return Status::NotFound(fmt::format("chunk {} is corrupt ({})", key.ToHex(), why));
}

Status FileTier::Impl::Foreign(const ChunkKey& key, uint64_t seen, const std::string& path,
                               const std::string& why) {
  foreign_.fetch_add(1);
  misses_.fetch_add(1);
  spdlog::warn("file tier: {} is not a chunk of this namespace ({}); not served", path, why);
  Forget(key, seen);
  return Status::NotFound(fmt::format("chunk {} is foreign ({})", key.ToHex(), why));
}

// The header alone: the descriptor is for events, so a file found wanting here is left to the
// reads, which judge and remove it (one verdict, docs/file-format.md), and the index is untouched.
Result<std::string> FileTier::Impl::ReadDescriptor(const ChunkKey& key) {
  const std::string path = ChunkPath(key);
  OpenOptions oo;
  oo.direct = options_.use_o_direct;
  KVTIER_ASSIGN_OR_RETURN(std::unique_ptr<File> file, env_->Open(path, oo));
  ThreadScratch& scratch = tls_scratch;
  IoOp op = IoOp::Read(0, scratch.header.span());
  KVTIER_RETURN_IF_ERROR(ReadExact(*file, std::span<IoOp>(&op, 1)));
  file.reset();
  DecodedHeader d =
      DecodeHeader(std::span<const uint8_t, kHeaderBytes>(scratch.header.data(), kHeaderBytes));
  if (d.verdict != HeaderVerdict::kOk) return Status::Corruption(d.reason);
  if (d.header.namespace_root != ns_root_ || d.header.key != key) {
    return Status::Corruption("the header names another namespace or key");
  }
  if (!d.descriptor_problem.empty()) return Status::Corruption(d.descriptor_problem);
  return std::move(d.header.descriptor);
}

Status FileTier::Impl::Read(const ChunkKey& key, std::span<uint8_t> dst) {
  reads_.fetch_add(1);
  const uint64_t n = options_.chunk_bytes;
  if (dst.size() < n) {
    return Status::InvalidArgument(
        fmt::format("read buffer holds {} bytes, a chunk is {}", dst.size(), n));
  }
  bool indexed;
  uint64_t seen;  // what the index knew before the I/O below (see Forget)
  {
    std::lock_guard<std::mutex> lock(mu_);
    seen = index_seq_;
    indexed = index_.count(key) != 0;
    if (!indexed && NegativeHitLocked(key)) {
      misses_.fetch_add(1);
      return Status::NotFound("chunk not in the file tier");
    }
  }
  if (!indexed) disk_rechecks_.fetch_add(1);
  const std::string path = ChunkPath(key);
  OpenOptions oo;
  oo.direct = options_.use_o_direct;
  auto opened = env_->Open(path, oo);
  if (!opened.ok()) {
    if (opened.status().IsNotFound()) {
      misses_.fetch_add(1);
      Forget(key, seen);
      return Status::NotFound("chunk not in the file tier");
    }
    if (opened.status().code() == StatusCode::kInvalidArgument) {
      // Not a regular file (a directory, a FIFO): not ours to serve or to remove. fsck names it.
      non_regular_.fetch_add(1);
      return Foreign(key, seen, path, opened.status().message());
    }
    errors_.fetch_add(1);
    if (auto held = read_log_.Allow()) {
      spdlog::warn("file tier: {}{}", opened.status().ToString(), LogLimiter::Suppressed(*held));
    }
    return opened.status();
  }
  File& file = **opened;
  NoteDirect(file);

  // Plan the transfer: header block, then the payload straight into dst where alignment allows.
  ThreadScratch& scratch = tls_scratch;
  const uint64_t padded = AlignUp(n);
  std::vector<IoOp> ops;
  ops.push_back(IoOp::Read(0, scratch.header.span()));
  std::span<uint8_t> bounce;  // whole payload through the bounce buffer
  size_t tail_len = 0;        // or only the last partial block through scratch.tail
  // The checksum follows the payload op as it completes, so that it overlaps the transfer.
  struct Hashing final : IoObserver {
    PayloadHasher hasher;
    const uint8_t* base = nullptr;
    uint64_t limit = 0, done = 0;
    size_t op = 1;
    void Progress(size_t which, uint64_t bytes) override {
      uint64_t upto = std::min(bytes, limit);
      if (which != op || upto <= done) return;
      hasher.Update({base + done, upto - done});
      done = upto;
    }
    void Finish(const uint8_t* data, uint64_t n) {  // hashes what Progress did not
      if (base != data) done = 0, base = data;
      if (done < n) hasher.Update({data + done, n - done});
      done = n;
    }
  } hashing;
  hashing.base = dst.data();
  if (!file.direct() || (IsAligned(dst.data()) && dst.size() >= padded)) {
    ops.push_back(IoOp::Read(kHeaderBytes, dst.first(file.direct() ? padded : n)));
    hashing.limit = n;
  } else if (IsAligned(dst.data())) {
    uint64_t main = n / kDirectIoAlignment * kDirectIoAlignment;
    tail_len = n - main;
    hashing.limit = main;
    if (main > 0) ops.push_back(IoOp::Read(kHeaderBytes, dst.first(main)));
    ops.push_back(IoOp::Read(kHeaderBytes + main, scratch.tail.span()));
  } else {
    bounce = scratch.Bounce(padded);
    ops.push_back(IoOp::Read(kHeaderBytes, bounce));
    bounce_copies_.fetch_add(1);
  }
  Status s = ReadExact(file, ops, &hashing);
  if (s.ok()) PaceRead(n);
  // The header records the payload's length, so a file of any other size than the one it
  // implies is not a chunk as written (docs/file-format.md, check 1): judged after the header.
  // Asked after the reads, which tell an object store's client the size as they go.
  auto file_size = file.Size();
  if (s.code() == StatusCode::kCorruption) {
    // Shorter than a chunk of ours: truncated, or a chunk of another size (foreign)?
    IoOp op = IoOp::Read(0, scratch.header.span());
    bool header_ok = ReadExact(file, std::span<IoOp>(&op, 1)).ok();
    opened.value().reset();
    DecodedHeader d =
        DecodeHeader(std::span<const uint8_t, kHeaderBytes>(scratch.header.data(), kHeaderBytes));
    if (header_ok && d.verdict == HeaderVerdict::kOk && d.header.payload_bytes != n) {
      return Foreign(key, seen, path,
                     fmt::format("payload of {} bytes, not {}", d.header.payload_bytes, n));
    }
    return Corrupt(key, seen, path, "truncated");
  }
  opened.value().reset();  // close before any unlink below
  if (!s.ok()) {
    if (s.IsNotFound()) {  // e.g. ESTALE mapped by a network filesystem: gone
      misses_.fetch_add(1);
      Forget(key, seen);
      return s;
    }
    errors_.fetch_add(1);
    if (auto held = read_log_.Allow()) {
      spdlog::warn("file tier: reading {}: {}{}", path, s.ToString(),
                   LogLimiter::Suppressed(*held));
    }
    return s;
  }
  if (!bounce.empty()) std::memcpy(dst.data(), bounce.data(), n);
  if (tail_len > 0) std::memcpy(dst.data() + (n - tail_len), scratch.tail.data(), tail_len);

  DecodedHeader d =
      DecodeHeader(std::span<const uint8_t, kHeaderBytes>(scratch.header.data(), kHeaderBytes));
  if (d.verdict == HeaderVerdict::kCorrupt) return Corrupt(key, seen, path, d.reason);
  if (d.verdict == HeaderVerdict::kForeign) return Foreign(key, seen, path, d.reason);
  const ChunkHeader& h = d.header;
  if (h.namespace_root != ns_root_) return Foreign(key, seen, path, "another namespace");
  if (h.layout_fingerprint != options_.ns.layout_fingerprint) {
    return Foreign(key, seen, path, "another layout");
  }
  if (h.payload_bytes != n) {
    return Foreign(key, seen, path, fmt::format("payload of {} bytes, not {}", h.payload_bytes, n));
  }
  if (h.key != key) return Foreign(key, seen, path, "header names another key");
  if (file_size.ok() && *file_size != file_bytes_) {
    return Corrupt(key, seen, path,
                   fmt::format("file size {} does not match a payload of {} bytes", *file_size, n));
  }
  hashing.Finish(dst.data(), n);
  if (hashing.hasher.Digest() != h.payload_checksum) {
    return Corrupt(key, seen, path, "payload checksum mismatch");
  }
  if (indexed) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find(key);
    if (it != index_.end()) lru_.splice(lru_.begin(), lru_, it->second.lru);
  } else {
    AdoptFromDisk(key);
  }
  hits_.fetch_add(1);
  bytes_read_.fetch_add(n);
  return Status::Ok();
}

// The cache directory's marker (what fsck and purge look for) and the namespace's description,
// each written unless present. At open, and again whenever a write makes a leaf folder (the
// cache directory may have been removed under the running tier: without them fsck and purge
// refused the directory the tier went on filling).
Status FileTier::Impl::WriteDirectoryFiles() {
  KVTIER_RETURN_IF_ERROR(env_->CreateDirs(ns_dir_));  // and the cache directory above it
  KVTIER_RETURN_IF_ERROR(WriteSmallFileOnce(
      env_, options_.root, kMarkerName,
      nlohmann::json{{"format", "kvtier-file-tier"}, {"version", kFormatVersion}}.dump() + "\n"));
  const KeyNamespace& ns = options_.ns;
  nlohmann::json nsj = {{"namespace_id", ns.Id()},
                        {"model_id", ns.model_id},
                        {"layout_fingerprint", fmt::format("{:016x}", ns.layout_fingerprint)},
                        {"chunk_tokens", ns.chunk_tokens},
                        {"rank", ns.rank},
                        {"world_size", ns.world_size},
                        {"chunk_bytes", options_.chunk_bytes},
                        {"tenant_salted", !ns.tenant_salt.empty()}};
  return WriteSmallFileOnce(env_, ns_dir_, kNamespaceFileName, nsj.dump(2) + "\n");
}

Status FileTier::Impl::EnsureLeafDir(const std::string& dir, bool force) {
  if (!force) {
    std::lock_guard<std::mutex> lock(dirs_mu_);
    if (leaf_dirs_.count(dir)) return Status::Ok();
  }
  // A folder to make (new, or removed since): the cache directory may be gone with it.
  KVTIER_RETURN_IF_ERROR(WriteDirectoryFiles());
  KVTIER_RETURN_IF_ERROR(env_->CreateDirs(dir));
  std::lock_guard<std::mutex> lock(dirs_mu_);
  leaf_dirs_.insert(dir);
  return Status::Ok();
}

Status FileTier::Impl::WriteAndPublish(const ChunkKey& key, std::span<const uint8_t> src) {
  const uint64_t n = options_.chunk_bytes;
  const std::string hex = key.ToHex();
  const std::string dir = LeafDir(ns_dir_, hex);
  const std::string final_path = fmt::format("{}/{}", dir, hex);
  // An object store publishes the chunk whole at Sync (a PUT): written under its final name,
  // with no temporary name and rename (a second copy on the server). Elsewhere the rename is
  // what makes the publication atomic.
  const bool direct_publish = env_->publishes_at_sync();
  const std::string tmp_path =
      direct_publish ? final_path : fmt::format("{}/{}", dir, TempName(hex));
  KVTIER_RETURN_IF_ERROR(EnsureLeafDir(dir, false));
  OpenOptions oo;
  oo.write = oo.create = true;
  oo.exclusive = !direct_publish;
  oo.truncate = direct_publish;
  oo.direct = options_.use_o_direct;
  // `src` and this thread's scratch buffers are left alone until the file is closed below.
  oo.buffers_outlive_file = true;
  auto opened = env_->Open(tmp_path, oo);
  if (opened.status().IsNotFound()) {  // the leaf folder was removed (purge) since we made it
    KVTIER_RETURN_IF_ERROR(EnsureLeafDir(dir, true));
    opened = env_->Open(tmp_path, oo);
  }
  if (!opened.ok()) return opened.status();
  std::unique_ptr<File> file = std::move(opened).value();
  NoteDirect(*file);
  // Unsupported is fine (the writes then extend the file); no space is not.
  if (Status p = file->Preallocate(file_bytes_);
      !p.ok() && p.code() != StatusCode::kUnimplemented) {
    file.reset();
    if (!direct_publish) (void)env_->Unlink(tmp_path);
    return p;
  }

  ThreadScratch& scratch = tls_scratch;
  // The payload goes first; its checksum is computed while it is in flight, then the header
  // (which holds the checksum) is written. Nobody reads a temporary file, so the order is free.
  struct HeaderMaker final : IoObserver {
    ChunkHeader h;
    std::span<const uint8_t> src;
    uint8_t* out = nullptr;
    bool made = false;
    void Submitted() override {
      if (made) return;
      h.payload_checksum = PayloadChecksum(src);
      EncodeHeader(h, std::span<uint8_t, kHeaderBytes>(out, kHeaderBytes));
      made = true;
    }
  } maker;
  ChunkHeader& h = maker.h;
  h.namespace_root = ns_root_;
  h.key = key;
  h.layout_fingerprint = options_.ns.layout_fingerprint;
  h.payload_bytes = n;
  h.created_unix_ms = NowUnixMs();
  h.chunk_tokens = options_.ns.chunk_tokens;
  h.rank = options_.ns.rank;
  h.world_size = options_.ns.world_size;
  h.model_id = options_.ns.model_id;
  // Asked as late as the write allows: a descriptor that arrives after this point is not in the
  // file (a published file never changes), and the write never waits for one.
  if (options_.listener) h.descriptor = options_.listener->ChunkDescriptor(key);
  maker.src = src;
  maker.out = scratch.header.data();

  std::vector<IoOp> ops;
  const uint64_t main = n / kDirectIoAlignment * kDirectIoAlignment;
  const uint64_t tail = n - main;
  if (!file->direct() || IsAligned(src.data())) {
    if (main > 0) ops.push_back(IoOp::Write(kHeaderBytes, src.first(main)));
    if (tail > 0) {
      std::memset(scratch.tail.data(), 0, kDirectIoAlignment);
      std::memcpy(scratch.tail.data(), src.data() + main, tail);
      ops.push_back(IoOp::Write(kHeaderBytes + main, scratch.tail.span()));
    }
  } else {
    std::span<uint8_t> bounce = scratch.Bounce(AlignUp(n));
    std::memcpy(bounce.data(), src.data(), n);
    std::memset(bounce.data() + n, 0, bounce.size() - n);
    ops.push_back(IoOp::Write(kHeaderBytes, bounce));
    bounce_copies_.fetch_add(1);
  }
  Status s = WriteExact(*file, ops, &maker);
  if (s.ok()) {
    maker.Submitted();  // no-op if it already ran
    IoOp header = IoOp::Write(0, scratch.header.span());
    s = WriteExact(*file, std::span<IoOp>(&header, 1));
  }
  if (s.ok() && (options_.sync_data || direct_publish)) s = file->Sync();
  file.reset();  // unsynced, a publishing env's file is discarded
  if (direct_publish) return s;
  if (s.ok()) s = env_->Rename(tmp_path, final_path);
  if (!s.ok()) {
    Status u = env_->Unlink(tmp_path);
    if (!u.ok() && !u.IsNotFound()) {
      spdlog::warn("file tier: removing {} after a failed write: {}", tmp_path, u.ToString());
    }
    return s;
  }
  if (options_.sync_directory) {
    // The chunk is published either way; a failed directory sync only weakens durability.
    Status d = env_->SyncDir(dir);
    if (!d.ok()) spdlog::warn("file tier: {}", d.ToString());
  }
  return Status::Ok();
}

Status FileTier::Impl::Write(const ChunkKey& key, std::span<const uint8_t> src) {
  writes_.fetch_add(1);
  if (src.size() != options_.chunk_bytes) {
    return Status::InvalidArgument(
        fmt::format("chunk of {} bytes, this tier stores {}", src.size(), options_.chunk_bytes));
  }
  // Count what the other hosts published lately before deciding what room this write needs
  // (unless there is nothing to write: the listing is a round trip to the storage).
  if (options_.shared_capacity) {
    bool known;
    {
      std::lock_guard<std::mutex> lock(mu_);
      known = index_.count(key) != 0;
    }
    if (known) return Status::Ok();  // idempotent, as below
    AdoptRecentPublishes();
  }
  std::vector<ChunkKey> victims;
  {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (index_.count(key)) return Status::Ok();  // idempotent: the key names its content
      if (!mutating_.count(key)) break;
      mutation_cv_.wait(lock);  // a write or eviction of this key is in flight
    }
    if (!MakeRoomLocked(file_bytes_, &victims)) {
      rejections_.fetch_add(1);
      const uint64_t cap = EffectiveCapacityLocked();
      lock.unlock();
      if (auto held = reject_log_.Allow()) {
        spdlog::warn(
            "file tier: write of {} refused: the budget of {} bytes is taken by writes "
            "in flight{}",
            key.ToHex(), cap, LogLimiter::Suppressed(*held));
      }
      return Status::NoSpace(
          fmt::format("file tier budget {} bytes is taken by writes in flight", cap));
    }
    mutating_.insert(key);
    reserved_bytes_ += file_bytes_;
  }
  // Victims go before we publish: published bytes never exceed the capacity, crash or not.
  Status s = RemoveVictims(victims, /*count_errors=*/false);
  if (s.ok()) s = WriteAndPublish(key, src);
  // A full filesystem is a capacity signal: make room among our own chunks and retry (a few
  // times: other writers may fill what we free).
  for (int attempt = 0; s.code() == StatusCode::kNoSpace && attempt < 4; ++attempt) {
    victims.clear();
    if (!DiskFull(&victims)) break;
    s = RemoveVictims(victims, /*count_errors=*/false);
    if (s.ok()) s = WriteAndPublish(key, src);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    reserved_bytes_ -= file_bytes_;
    mutating_.erase(key);
    if (s.ok()) {
      InsertLocked(key, file_bytes_);
      negative_.erase(key);
    }
  }
  mutation_cv_.notify_all();
  if (!s.ok()) {
    CountWriteFailure(key, s);
    return s;
  }
  if (options_.shared_capacity) MarkPublished(key);
  bytes_written_.fetch_add(options_.chunk_bytes);
  return Status::Ok();
}

namespace {
int64_t UnixMillis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A marker of shared_capacity, <64 hex digits>.<unix ms>: its key and time, or nothing.
std::optional<std::pair<ChunkKey, int64_t>> ParseMarker(std::string_view name) {
  if (name.size() < 66 || name[64] != '.' || !IsChunkName(name.substr(0, 64))) return std::nullopt;
  int64_t ms = 0;
  const char* end = name.data() + name.size();
  auto [ptr, ec] = std::from_chars(name.data() + 65, end, ms);
  if (ec != std::errc() || ptr != end) return std::nullopt;
  return std::make_pair(ChunkKey::FromHex(name.substr(0, 64)).value(), ms);
}
}  // namespace

void FileTier::Impl::MarkPublished(const ChunkKey& key) {
  const std::string name = fmt::format("{}.{}", key.ToHex(), UnixMillis());
  {
    std::lock_guard<std::mutex> lock(recent_mu_);
    recent_seen_.insert(name);  // ours: already counted
  }
  // One byte: an object store stores no file that was never written to.
  Status s;
  {
    OpenOptions oo;
    oo.write = oo.create = oo.truncate = true;
    auto f = env_->Open(fmt::format("{}/{}", recent_dir_, name), oo);
    if (f.ok()) {
      std::vector<uint8_t> byte = {'\n'};
      IoOp op = IoOp::Write(0, byte);
      s = WriteExact(**f, std::span<IoOp>(&op, 1));
      // An object store publishes a file at its Sync; a filesystem has it at its creation.
      if (s.ok() && env_->publishes_at_sync()) s = (*f)->Sync();
    } else {
      s = f.status();
    }
  }
  if (!s.ok()) {
    // The chunk is published either way; other hosts count it at their next rescan instead.
    if (auto held = write_log_.Allow()) {
      spdlog::warn("file tier: marking {} published: {}{}", key.ToHex(), s.ToString(),
                   LogLimiter::Suppressed(*held));
    }
  }
}

void FileTier::Impl::AdoptRecentPublishes() {
  std::lock_guard<std::mutex> one_listing(recent_mu_);
  auto listed = env_->List(recent_dir_);
  if (!listed.ok()) {
    if (auto held = rescan_log_.Allow()) {
      spdlog::warn("file tier: listing {}: {}{}", recent_dir_, listed.status().ToString(),
                   LogLimiter::Suppressed(*held));
    }
    return;  // this write counts what the index knows, as without shared_capacity
  }
  const int64_t now_ms = UnixMillis();
  const int64_t window_ms = options_.shared_capacity_window.count();
  std::unordered_set<std::string> present;
  std::vector<ChunkKey> fresh;
  std::vector<std::string> expired;
  for (const DirEntry& e : *listed) {
    auto marker = ParseMarker(e.name);
    if (!marker) continue;  // not a marker: left alone
    if (now_ms - marker->second > window_ms) {
      expired.push_back(e.name);
      continue;
    }
    present.insert(e.name);
    if (!recent_seen_.contains(e.name)) fresh.push_back(marker->first);
  }
  for (const std::string& name : recent_seen_) {
    // Our own markers just made may not be listed yet (an object store's listing may lag).
    auto marker = ParseMarker(name);
    if (marker && now_ms - marker->second <= window_ms) present.insert(name);
  }
  recent_seen_ = std::move(present);
  uint64_t added = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const ChunkKey& key : fresh) {
      // Ours in flight, or known: nothing to count. Adopted as the most recently used: others
      // published it just now.
      if (index_.count(key) || mutating_.count(key)) continue;
      InsertLocked(key, file_bytes_);
      negative_.erase(key);
      ++added;
    }
  }
  found_on_disk_.fetch_add(added, std::memory_order_relaxed);
  // Every tier's rescan has seen these chunks by now (or their absence): the markers have done
  // their work. Whoever lists them first removes them; losing that race is fine.
  constexpr size_t kMaxRemovals = 64;  // per write, so that a backlog costs no single write much
  for (size_t i = 0; i < expired.size() && i < kMaxRemovals; ++i) {
    (void)env_->Unlink(fmt::format("{}/{}", recent_dir_, expired[i]));
  }
}

bool FileTier::Impl::DiskFull(std::vector<ChunkKey>* victims) {
  disk_full_.fetch_add(1);
  uint64_t budget, evicted_bytes = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // What we hold on the filesystem (published plus in flight), this write's file aside: the
    // filesystem could not take one more file on top of it.
    const uint64_t held = used_bytes_ + reserved_bytes_ - file_bytes_;
    budget = std::max<uint64_t>(held, file_bytes_);
    disk_full_cap_ = budget;
    disk_full_until_ = env_->Now() + options_.disk_full_hold;
    while (used_bytes_ + reserved_bytes_ > budget && !lru_.empty()) {
      ChunkKey victim = lru_.back();
      EraseLocked(victim);
      mutating_.insert(victim);
      victims->push_back(victim);
      evicted_bytes += file_bytes_;
    }
  }
  if (auto held = write_log_.Allow()) {
    spdlog::warn(
        "file tier: the filesystem at {} is full (ENOSPC); budget lowered to {:.3f} GB "
        "for {} s, evicting {} chunks to retry{}",
        options_.root, budget / 1e9, options_.disk_full_hold.count(), victims->size(),
        LogLimiter::Suppressed(*held));
  }
  return !victims->empty();
}

void FileTier::Impl::CountWriteFailure(const ChunkKey& key, const Status& s) {
  errors_.fetch_add(1);
  // Status keeps the errno only as text: EROFS has no code of its own.
  static const std::string kReadOnly = std::strerror(EROFS);
  const char* reason = "I/O error";
  if (s.code() == StatusCode::kNoSpace) {
    write_no_space_.fetch_add(1);
    reason = "no space";
  } else if (s.code() == StatusCode::kPermissionDenied) {
    write_permission_.fetch_add(1);
    reason = "permission denied";
  } else if (s.message().find(kReadOnly) != std::string::npos) {
    write_read_only_.fetch_add(1);
    reason = "read-only filesystem";
  }
  if (auto held = write_log_.Allow()) {
    spdlog::warn("file tier: writing chunk {} failed ({}): {}{}", key.ToHex(), reason, s.ToString(),
                 LogLimiter::Suppressed(*held));
  }
}

Status FileTier::Impl::Submit(bool write, std::function<void()> task) {
  TaskPool& pool = write ? *write_pool_ : *read_pool_;
  Status s = pool.TrySubmit(std::move(task));
  if (s.ok() || !s.IsRejected()) return s;  // OK, or kAborted after shutdown
  rejections_.fetch_add(1);
  (write ? write_queue_full_ : read_queue_full_).fetch_add(1);
  // Counted here; logged by the caller, which knows what the refusal means (the engine defers a
  // refused write and waits for room for a read, so a warning here would only be noise).
  if (auto held = reject_log_.Allow()) {
    spdlog::debug("file tier: {} queue full ({} queued, {} stalled): operation refused{}",
                  write ? "write" : "read", pool.queued(), pool.stalled(),
                  LogLimiter::Suppressed(*held));
  }
  return Status::Rejected(fmt::format("file tier {} queue is full", write ? "write" : "read"));
}

FileTierStats FileTier::Impl::Stats() const {
  FileTierStats st;
  {
    std::lock_guard<std::mutex> lock(mu_);
    st.chunks = index_.size();
    st.bytes = used_bytes_;
    st.effective_capacity_bytes = EffectiveCapacityLocked();
    st.queued_probes = probe_queued_keys_;
    st.negative_cache_entries = negative_.size();
  }
  st.write_no_space = write_no_space_.load();
  st.write_read_only = write_read_only_.load();
  st.write_permission = write_permission_.load();
  st.read_queue_full = read_queue_full_.load();
  st.write_queue_full = write_queue_full_.load();
  st.reads_unwanted = reads_unwanted_.load();
  st.disk_full = disk_full_.load();
  st.non_regular = non_regular_.load();
  if (read_pool_) {
    st.stalled_reads = read_pool_->stalled();
    st.replacement_threads += read_pool_->replacements();
  }
  if (write_pool_) {
    st.stalled_writes = write_pool_->stalled();
    st.replacement_threads += write_pool_->replacements();
  }
  st.capacity_bytes = options_.capacity_bytes;
  st.reads = reads_.load();
  st.writes = writes_.load();
  st.hits = hits_.load();
  st.misses = misses_.load();
  st.bytes_read = bytes_read_.load();
  st.bytes_written = bytes_written_.load();
  st.evictions = evictions_.load();
  st.rejections = rejections_.load();
  st.errors = errors_.load();
  st.corrupt = corrupt_.load();
  st.foreign = foreign_.load();
  st.disk_rechecks = disk_rechecks_.load();
  st.found_on_disk = found_on_disk_.load();
  st.rescans = rescans_.load();
  st.rescan_failures = rescan_failures_.load();
  st.rescan_added = rescan_added_.load();
  st.rescan_dropped = rescan_dropped_.load();
  st.last_rescan_us = last_rescan_us_.load();
  st.probes = probes_.load();
  st.probe_hits = probe_hits_.load();
  st.probes_dropped = probes_dropped_.load();
  st.stale_temps_removed = stale_temps_removed_.load();
  st.bounce_copies = bounce_copies_.load();
  st.queued_reads = read_pool_ ? read_pool_->queued() : 0;
  st.queued_writes = write_pool_ ? write_pool_->queued() : 0;
  st.o_direct = options_.use_o_direct && all_direct_.load();
  st.io_engine = env_ ? env_->io_engine_name() : "";
  return st;
}

// --- FileTier ---

FileTier::FileTier(const FileTierOptions& options) : options_(options) {}
FileTier::~FileTier() {
  if (impl_) impl_->Shutdown();
}

Result<std::unique_ptr<FileTier>> FileTier::Open(const FileTierOptions& options) {
  if (options.root.empty()) return Status::InvalidArgument("file tier root is empty");
  KVTIER_RETURN_IF_ERROR(options.ns.Validate());
  if (options.chunk_bytes == 0 || options.chunk_bytes > (uint64_t{16} << 30)) {
    return Status::InvalidArgument(
        fmt::format("chunk_bytes must be in [1, 16 GiB], got {}", options.chunk_bytes));
  }
  if (options.read_threads < 1 || options.read_threads > 256 || options.write_threads < 1 ||
      options.write_threads > 256) {
    return Status::InvalidArgument("read_threads and write_threads must be in [1, 256]");
  }
  if (options.max_queued_reads == 0 || options.max_queued_writes == 0) {
    return Status::InvalidArgument("max_queued_reads and max_queued_writes must be positive");
  }
  if (!(options.read_limit_bytes_per_s >= 0) || std::isinf(options.read_limit_bytes_per_s)) {
    return Status::InvalidArgument("read_limit_bytes_per_s must be a finite number >= 0");
  }
  if (options.rescan_interval.count() < 0 || options.negative_cache_ttl.count() < 0 ||
      options.stall_timeout.count() < 0) {
    return Status::InvalidArgument(
        "rescan_interval, negative_cache_ttl and stall_timeout must not be negative");
  }
  const uint64_t file_bytes = ChunkFileBytes(options.chunk_bytes);
  if (options.capacity_bytes != 0 && options.capacity_bytes < file_bytes) {
    return Status::InvalidArgument(
        fmt::format("capacity {} bytes is below one chunk file ({} bytes)", options.capacity_bytes,
                    file_bytes));
  }
  std::unique_ptr<FileTier> tier(new FileTier(options));
  tier->ns_dir_ = fmt::format("{}/{}", options.root, options.ns.Id());
  tier->impl_ = std::make_shared<Impl>(options, tier->ns_dir_);
  KVTIER_RETURN_IF_ERROR(
      tier->impl_->Init().WithContext(fmt::format("opening file tier at {}", options.root)));
  return tier;
}

size_t FileTier::LookupPrefix(std::span<const ChunkKey> keys) { return impl_->LookupPrefix(keys); }

bool FileTier::Contains(const ChunkKey& key) {
  return impl_->LookupPrefix(std::span<const ChunkKey>(&key, 1)) == 1;
}

Status FileTier::Rescan() { return impl_->Rescan(); }

Result<std::string> FileTier::ReadDescriptor(const ChunkKey& key) {
  return impl_->ReadDescriptor(key);
}

Status FileTier::Read(const ChunkKey& key, std::span<uint8_t> dst) { return impl_->Read(key, dst); }

Status FileTier::Write(const ChunkKey& key, std::span<const uint8_t> src) {
  return impl_->Write(key, src);
}

// Each task holds a reference to the Impl: a task abandoned at shutdown may return long after
// the FileTier is gone, and must still find everything it touches.
Status FileTier::ReadAsync(const ChunkKey& key, std::span<uint8_t> dst,
                           std::function<void(Status)> done) {
  std::shared_ptr<Impl> impl = impl_;
  return impl->Submit(false, [impl, key, dst, done = std::move(done)] {
    Status s = impl->Read(key, dst);
    if (done) impl->Deliver([&] { done(std::move(s)); });
  });
}

Status FileTier::ReadAsync(const ChunkKey& key, ReadDone done, std::function<bool()> wanted) {
  std::shared_ptr<Impl> impl = impl_;
  const uint64_t n = options_.chunk_bytes;
  return impl->Submit(false, [impl, key, n, done = std::move(done), wanted = std::move(wanted)] {
    if (wanted) {
      // Asked behind the callbacks' gate, as `done` is: after shutdown its owner may be gone.
      bool unwanted = true;
      impl->Deliver([&] { unwanted = !wanted(); });
      if (unwanted) {
        impl->CountUnwantedRead();
        if (done) impl->Deliver([&] { done(Status::Aborted("read no longer wanted"), {}); });
        return;
      }
    }
    std::span<uint8_t> buf = tls_scratch.Owned(AlignUp(n));
    Status s = impl->Read(key, buf);
    if (done) {
      impl->Deliver([&] { done(s, s.ok() ? buf.first(n) : std::span<uint8_t>()); });
    }
  });
}

Status FileTier::WriteAsync(const ChunkKey& key, std::span<const uint8_t> src,
                            std::function<void(Status)> done) {
  std::shared_ptr<Impl> impl = impl_;
  return impl->Submit(true, [impl, key, src, done = std::move(done)] {
    Status s = impl->Write(key, src);
    if (done) impl->Deliver([&] { done(std::move(s)); });
  });
}

bool FileTier::Drain() { return impl_->Drain(); }
size_t FileTier::Shutdown() { return impl_->Shutdown(); }
FileTierStats FileTier::Stats() const { return impl_->Stats(); }
std::string FileTier::ChunkPath(const ChunkKey& key) const { return impl_->ChunkPath(key); }
uint64_t FileTier::file_bytes() const { return impl_->file_bytes(); }

}  // namespace kvtier

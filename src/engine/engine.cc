#include "kvtier/engine.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <deque>
#include <iterator>
#include <mutex>
#include <thread>
#include <unordered_map>

#if defined(__SANITIZE_ADDRESS__)
#define KVTIER_LSAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVTIER_LSAN 1
#endif
#endif
#if KVTIER_LSAN
#include <sanitizer/lsan_interface.h>
#endif

#include "common/log_limiter.h"
#include "common/sync_point.h"
#include "common/task_pool.h"
#include "engine/engine_internals.h"

namespace kvtier {

Result<WritePolicy> ParseWritePolicy(std::string_view name) {
  if (name == "write_through" || name == "write-through") return WritePolicy::kWriteThrough;
  if (name == "write_back" || name == "write-back") return WritePolicy::kWriteBack;
  if (name == "none") return WritePolicy::kNone;
  return Status::InvalidArgument(fmt::format(
      "unknown write policy \"{}\" (expected write_through, write_back or none)", name));
}

std::string_view WritePolicyName(WritePolicy policy) {
  switch (policy) {
    case WritePolicy::kWriteThrough:
      return "write_through";
    case WritePolicy::kWriteBack:
      return "write_back";
    case WritePolicy::kNone:
      return "none";
  }
  return "unknown";
}

// Completion state of one Store or Load: one outcome per chunk, the result computed once the
// last chunk reports or the deadline passes, whichever comes first. After that, late
// completions change nothing the caller can see.
struct OpHandle::State {
  using Clock = std::chrono::steady_clock;
  enum class Kind { kStore, kLoad };
  enum Outcome : uint8_t { kPending, kDone, kFailed };

  State(Kind k, size_t n) : kind(k), outcome(n, kPending), slots(n, kNoSlot), remaining(n) {}

  // Records chunk i's outcome. `deliver` (may be empty) runs first, only if the operation is
  // still open: it is where data reaches the caller. It runs outside the lock, so the chunks of
  // one operation are copied in parallel, and the operation can neither finish nor expire while
  // a delivery is under way: nothing is written into caller memory once the caller has been
  // told the operation is over. Returns false if the operation had already finished (the chunk
  // came too late).
  bool ChunkDone(size_t i, const Status& s, const std::function<void()>& deliver = {}) {
    std::unique_lock lock(mu);
    if (done) return false;
    if (s.ok() && deliver) {
      ++delivering;
      lock.unlock();
      deliver();
      lock.lock();
      --delivering;
    }
    outcome[i] = s.ok() ? kDone : kFailed;
    if (!s.ok() && error.ok()) error = s;
    if (--remaining == 0) {
      Finish();
    } else if (delivering == 0 && deadline != Clock::time_point::max()) {
      ExpireIfLate();  // the deadline may have passed while deliveries held the operation open
    }
    RunOnDone(lock);
    return true;
  }
  // With mu held through `lock`: once the operation has finished, runs the OnDone callback (at
  // most once, outside the lock, so that it may call into the engine). Leaves `lock` unlocked
  // if it ran one.
  void RunOnDone(std::unique_lock<std::mutex>& lock) {
    if (!done || !on_done) return;
    auto callback = std::move(on_done);
    on_done = nullptr;
    const OpResult r = result;
    lock.unlock();
    callback(r);
  }
  // Ends the operation if its deadline has passed (or now, with `now`: engine shutdown).
  void Expire(bool now) {
    std::unique_lock lock(mu);
    if (now) deadline = std::min(deadline, Clock::now());
    ExpireIfLate();
    RunOnDone(lock);
  }
  // With mu held: when a waiter should wake up next (the deadline, unless deliveries hold the
  // operation open past it: then their end, which notifies).
  Clock::time_point WakeAt() const {
    return delivering > 0 && Clock::now() >= deadline ? Clock::time_point::max() : deadline;
  }
  // False once the operation is over (every chunk reported, or the deadline passed).
  bool Open() {
    std::unique_lock lock(mu);
    ExpireIfLate();
    const bool open = !done;
    RunOnDone(lock);
    return open;
  }
  // With mu held: gives up on pending chunks once the deadline has passed.
  void ExpireIfLate() {
    if (done || delivering > 0 || Clock::now() < deadline) return;
    size_t late = 0;
    for (auto& o : outcome) {
      if (o == kPending) {
        o = kFailed;
        ++late;
      }
    }
    if (deadline_misses) deadline_misses->fetch_add(late, std::memory_order_relaxed);
    remaining = 0;
    Finish();
  }
  // With mu held, once every chunk has reported or expired.
  void Finish() {
    size_t n = 0;
    if (kind == Kind::kLoad) {
      while (n < outcome.size() && outcome[n] == kDone) ++n;
    } else {
      for (auto o : outcome) n += o == kDone;
    }
    result.chunks = n;
    if (n == outcome.size()) {
      result.status = Status::Ok();
    } else if (!error.ok() && !error.IsNotFound()) {
      result.status = error;
    } else {
      result.status =
          Status::NotFound(fmt::format("{} of {} leading chunks available", n, outcome.size()));
    }
    if (on_finish) on_finish(*this);
    done = true;
    cv.notify_all();
  }

  const Kind kind;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Outcome> outcome;
  std::vector<SlotId> slots;  // PrepareLoad: the pinned slot of each delivered chunk
  size_t remaining;
  size_t delivering = 0;  // deliveries running outside the lock
  Status error;
  bool done = false;
  OpResult result;
  Clock::time_point deadline = Clock::time_point::max();
  std::atomic<uint64_t>* deadline_misses = nullptr;
  std::function<void(State&)> on_finish;         // runs under mu as the operation finishes
  std::function<void(const OpResult&)> on_done;  // OnDone's callback
};

bool OpHandle::Done() const { return !state_->Open(); }

OpResult OpHandle::Wait() const {
  std::unique_lock lock(state_->mu);
  while (!state_->done) {
    const auto wake = state_->WakeAt();
    if (wake == State::Clock::time_point::max()) {
      state_->cv.wait(lock);
    } else {
      state_->cv.wait_until(lock, wake);
    }
    state_->ExpireIfLate();
  }
  OpResult r = state_->result;
  state_->RunOnDone(lock);
  return r;
}

std::optional<OpResult> OpHandle::WaitFor(std::chrono::nanoseconds timeout) const {
  auto until = State::Clock::now() + timeout;
  std::unique_lock lock(state_->mu);
  while (!state_->done) {
    auto wake = std::min(until, state_->WakeAt());
    state_->cv.wait_until(lock, wake);
    state_->ExpireIfLate();
    if (!state_->done && State::Clock::now() >= until) return std::nullopt;
  }
  OpResult r = state_->result;
  state_->RunOnDone(lock);
  return r;
}

void OpHandle::OnDone(std::function<void(const OpResult&)> done) const {
  std::unique_lock lock(state_->mu);
  state_->ExpireIfLate();
  state_->on_done = std::move(done);
  state_->RunOnDone(lock);
}

namespace {

// One buffer of exactly chunk_bytes per key, for Store ("source") and Load ("destination").
template <typename Byte>
Status CheckChunkBuffers(std::string_view op, std::string_view kind, size_t keys,
                         std::span<const std::span<Byte>> buffers, uint64_t chunk_bytes) {
  if (keys != buffers.size()) {
    return Status::InvalidArgument(
        fmt::format("{}: {} keys but {} {} buffers", op, keys, buffers.size(), kind));
  }
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (buffers[i].size() != chunk_bytes) {
      return Status::InvalidArgument(fmt::format("{}: buffer {} holds {} bytes, a chunk is {}", op,
                                                 i, buffers[i].size(), chunk_bytes));
    }
  }
  return Status::Ok();
}

}  // namespace

// Everything of an Engine behind its public methods: the tiers, the worker pool, the flusher,
// the shared L2 reads and the deadline watch, with the steps the public methods share.
struct Engine::Impl {
  Impl(const EngineOptions& o, std::unique_ptr<MemoryTier> memory, std::unique_ptr<FileTier> file)
      : options(o),
        l1(std::move(memory)),
        l2(std::move(file)),
        pool(o.worker_threads, o.max_queued_chunks, "engine copy queue") {}

  bool StoresDirty() const;
  // Reserve in L1, reporting a dirty eviction (counted by L1, logged here).
  Result<MemoryTier::Reservation> ReserveInMemory(
      const ChunkKey& key, const ChunkKey* parent,
      MemoryTier::Victims victims = MemoryTier::Victims::kAny);
  void PublishStored(SlotId slot, const ChunkKey& key);
  void FlusherLoop();
  void WatchDeadlines();     // the thread that ends loads at their deadline
  void StopDeadlineWatch();  // at shutdown: ends every load still open
  // One flusher round: starts L2 writes of the dirty chunks within the headroom. Returns how
  // many it started.
  size_t FlushPass();
  // Shared promotions. What JoinFileRead found for a chunk a load wants from L2: the chunk in L1
  // (pinned for the caller: a read of it ended and promoted it), a read under way (`on_read`
  // joined it), or neither, or only a read older than the load deadline: a read recorded under
  // `generation`, which the caller starts; its completion hands the bytes to every waiter, taking
  // them in rounds (TakeFileReadWaiters: empty once none is left, and then the read is forgotten).
  // L1 is looked at under the lock that forgets a read, so a load never misses both the read
  // and the promotion it made.
  struct FileReadJoin {
    std::optional<SlotId> in_l1 = std::nullopt;
    std::optional<uint64_t> generation = std::nullopt;
  };
  FileReadJoin JoinFileRead(const ChunkKey& key, const FileTier::ReadDone& on_read,
                            std::chrono::steady_clock::time_point deadline);
  std::vector<FileTier::ReadDone> TakeFileReadWaiters(const ChunkKey& key, uint64_t generation);
  // Asked by the file tier as the read of `generation` leaves its queue: false once no load
  // waits for it any more (every waiter's deadline has passed; the read is then forgotten, and
  // a later load of the chunk starts its own), or a newer read has taken its waiters over.
  bool ReadWanted(const ChunkKey& key, uint64_t generation);
  Result<OpHandle> StartLoad(std::span<const ChunkKey> keys,
                             std::span<const std::span<uint8_t>> dst);
  void WriteThrough(const ChunkKey& key);
  // What StartWriteThrough did with a chunk.
  enum class WriteStart {
    kStarted,   // its write is under way
    kNothing,   // nothing to write: L1 holds it no longer, or L2 has it already
    kBusy,      // another writer (the flusher, FlushDirty) has it now, and may yet fail
    kNoRoom,    // enough write-throughs in flight, or L2's write queue full
    kShutDown,  // the file tier is shutting down
  };
  WriteStart StartWriteThrough(const ChunkKey& key);
  void DeferWriteThrough(const ChunkKey& key);
  void ResubmitDeferred() { RetryWriteThroughs(deferred); }
  // Up to 8 chunks of `list` (deferred or failed) tried again.
  void RetryWriteThroughs(std::deque<ChunkKey>& list);
  // Starts the L2 reads of the given chunks of a load, each into a reserved L1 slot.
  void StartFileReads(std::shared_ptr<OpHandle::State> state, std::span<const ChunkKey> keys,
                      const std::vector<size_t>& chunks, std::span<const std::span<uint8_t>> dst);

  const EngineOptions options;  // as given to Open

  // The tiers first, so that they are destroyed last: the worker pool and the threads below
  // before L2 (whose callbacks touch L1), L2 before L1.
  std::unique_ptr<MemoryTier> l1;
  std::unique_ptr<FileTier> l2;  // null without L2

  // lookups, hits, misses: what Lookup() answered; served: chunks this tier delivered to
  // loads (a load's own walk is not a lookup: counted there too, a looked-up prefix was counted
  // twice, and chunks found but never delivered were hits).
  struct Counters {
    std::atomic<uint64_t> lookups{0}, hits{0}, misses{0}, served{0}, errors{0}, rejections{0};
    void CountLookup(size_t asked, size_t found) {
      lookups++;
      hits += found;
      misses += asked - found;
    }
  };
  TaskPool pool;
  Counters memory, file;
  std::atomic<uint64_t> stores{0}, loads{0}, rejected_ops{0};
  std::atomic<uint64_t> promotions{0}, deadline_misses{0};

  // Under write-through, a dirty chunk is always being written or waiting in one of these lists:
  // nothing else comes back to it (stores never evict it, and the flusher looks only at the
  // chunks next in eviction order). `deferred`: chunks refused for want of room (the file tier's
  // write queue full, or enough writes in flight) or held by another writer, retried as writes
  // complete. `failed`: chunks whose write failed, retried a few at a time on the flusher's
  // rounds. Bounded (a chunk past the bound stays dirty in L1, counted in
  // write_through_dropped).
  std::mutex deferred_mu;
  std::deque<ChunkKey> deferred, failed;
  size_t max_deferred = 0;
  // Write-through writes in flight pin their L1 slots; a quarter of L1 at most, so that a slow
  // L2 leaves stores room to evict (the rest wait in `deferred`).
  std::atomic<size_t> write_through_in_flight{0};
  size_t max_write_through = 1;
  std::atomic<uint64_t> write_through_deferred{0}, write_through_dropped{0};
  LogLimiter deferred_log;

  // The flusher: a thread that keeps the chunks next in L1's eviction order clean. Its state is
  // shared with the L2 writes it starts, whose callbacks may outlive the engine if abandoned.
  struct Flusher {
    std::mutex mu;
    std::condition_variable cv;
    bool kicked = false, stop = false;
    std::atomic<size_t> in_flight{0};
    std::atomic<uint64_t> written{0}, failed{0};
    void Kick() {
      {
        std::lock_guard lock(mu);
        kicked = true;
      }
      cv.notify_one();
    }
  };
  std::shared_ptr<Flusher> flusher = std::make_shared<Flusher>();
  std::thread flusher_thread;
  std::mutex pass_mu;     // one flusher pass at a time (the thread's, or Drain's)
  uint32_t headroom = 1;  // L1 slots kept clean or free
  size_t max_flushing = 1;
  LogLimiter dirty_eviction_log;
  LogLimiter refusal_log;  // write-through stores refused for want of a clean victim

  // L2 reads in flight, by key, with the loads waiting for each (shared promotions).
  struct FileRead {
    std::vector<FileTier::ReadDone> waiters;
    std::chrono::steady_clock::time_point started;
    // The latest deadline of the waiters' loads: once it has passed, every one of them is over
    // and a read still queued is skipped (ReadWanted), leaving the disk to the loads after them.
    std::chrono::steady_clock::time_point wanted_until{};
    uint64_t generation = 0;  // of the read that serves them
  };
  std::mutex reads_mu;
  std::unordered_map<ChunkKey, FileRead, ChunkKeyHash> reads;
  uint64_t read_generation = 0;  // under reads_mu
  std::atomic<uint64_t> shared_reads{0};

  // Ends loads at their deadline whether or not anyone waits on them (OnDone's callbacks must
  // come even when storage hangs). Every deadline is start + load_deadline, so they fall due in
  // the order the loads started: a queue, not a heap.
  struct DeadlineWatch {
    std::mutex mu;
    std::condition_variable cv;
    bool stop = false;
    std::deque<std::weak_ptr<OpHandle::State>> loads;
    std::thread thread;
  } deadlines;
};

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Engine::~Engine() {
  if (impl_->flusher_thread.joinable()) {
    {
      std::lock_guard lock(impl_->flusher->mu);
      impl_->flusher->stop = true;
    }
    impl_->flusher->cv.notify_one();
    impl_->flusher_thread.join();
  }
  // Queued copies, and deferred write-throughs (bounded: gives up on storage stuck in the kernel).
  Drain();
  if (!impl_->l2) return;
  // Bounded: operations stuck in the kernel (a hung NFS server) are abandoned after the file
  // tier's stall timeout. An abandoned write may still read from its L1 slot and an abandoned
  // read may still write into L2's own buffer, so L1's arena must outlive them: it is left
  // mapped (the process is usually exiting anyway).
  size_t abandoned = impl_->l2->Shutdown();
  impl_->StopDeadlineWatch();  // loads still open end now, as misses, their callbacks run
  if (abandoned > 0) {
    spdlog::error(
        "engine: {} file-tier operations are stuck in the kernel; leaving the L1 arena "
        "mapped for them",
        abandoned);
    MemoryTier* kept = impl_->l1.release();
#if KVTIER_LSAN
    __lsan_ignore_object(kept);  // kept on purpose: not a leak for the sanitizer to report
#else
    (void)kept;
#endif
  }
}

Result<std::unique_ptr<Engine>> Engine::Open(const EngineOptions& options) {
  KVTIER_RETURN_IF_ERROR(options.ns.Validate().WithContext("engine namespace"));
  if (options.chunk_bytes == 0)
    return Status::InvalidArgument("engine: chunk_bytes must be positive");
  if (options.worker_threads < 1 || options.worker_threads > 256) {
    return Status::InvalidArgument(
        fmt::format("engine: worker_threads must be in [1, 256], got {}", options.worker_threads));
  }
  if (options.max_queued_chunks == 0) {
    return Status::InvalidArgument("engine: max_queued_chunks must be positive");
  }
  if (options.load_deadline.count() < 0) {
    return Status::InvalidArgument("engine: load_deadline must not be negative");
  }
  if (!(options.flush_headroom > 0 && options.flush_headroom <= 1)) {
    return Status::InvalidArgument(
        fmt::format("engine: flush_headroom must be in (0, 1], got {}", options.flush_headroom));
  }
  MemoryTierOptions mem = options.memory;
  mem.chunk_bytes = options.chunk_bytes;
  auto memory = MemoryTier::Open(mem);
  if (!memory.ok()) return memory.status().WithContext("engine");
  std::unique_ptr<FileTier> l2;
  if (options.file) {
    FileTierOptions fo = *options.file;
    fo.ns = options.ns;
    fo.chunk_bytes = options.chunk_bytes;
    auto file = FileTier::Open(fo);
    if (!file.ok()) return file.status().WithContext("engine: file tier");
    l2 = std::move(file).value();
  }
  std::unique_ptr<Engine> engine(
      new Engine(std::make_unique<Impl>(options, std::move(memory).value(), std::move(l2))));
  Impl& impl = *engine->impl_;
  const uint32_t slots = impl.l1->num_slots();
  // Dirty chunks never outnumber L1's slots; twice that leaves room for re-stored keys.
  impl.max_deferred = 2 * static_cast<size_t>(slots);
  if (impl.l2) {
    impl.max_write_through =
        std::clamp<size_t>(slots / 4, 1, std::max<size_t>(1, impl.l2->options().max_queued_writes));
  }
  if (impl.StoresDirty()) {
    impl.headroom = std::clamp<uint32_t>(
        static_cast<uint32_t>(std::ceil(options.flush_headroom * slots)), 1, slots);
    // Half of L2's write queue, so that write-through's own writes still find room.
    impl.max_flushing = std::max<size_t>(1, impl.l2->options().max_queued_writes / 2);
    impl.flusher_thread = std::thread([i = &impl] { i->FlusherLoop(); });
  }
  if (impl.l2 && options.load_deadline.count() > 0) {
    impl.deadlines.thread = std::thread([i = &impl] { i->WatchDeadlines(); });
  }
  return engine;
}

// A filled L1 slot becomes visible, and the write policy takes it from there.
void Engine::Impl::PublishStored(SlotId slot, const ChunkKey& key) {
  l1->Commit(slot, StoresDirty());
  l1->AddBytesIn(options.chunk_bytes);
  if (!StoresDirty()) return;
  if (options.write_policy == WritePolicy::kWriteThrough) WriteThrough(key);
  flusher->Kick();
}

bool Engine::Impl::StoresDirty() const { return l2 && options.write_policy != WritePolicy::kNone; }

Result<MemoryTier::Reservation> Engine::Impl::ReserveInMemory(const ChunkKey& key,
                                                              const ChunkKey* parent,
                                                              MemoryTier::Victims victims) {
  // Under write-through an acknowledged store is kept until L2 has it: nothing may evict it.
  const bool keeps_unwritten = l2 && options.write_policy == WritePolicy::kWriteThrough;
  if (keeps_unwritten) victims = MemoryTier::Victims::kCleanOnly;
  auto r = l1->Reserve(key, parent, victims);
  if (!r.ok() && keeps_unwritten) {
    if (auto held = refusal_log.Allow()) {
      spdlog::warn(
          "engine: no L1 slot for a store ({}): L1 holds only chunks the file tier has not "
          "taken yet, which write_through keeps; the store is refused until its writes catch "
          "up{}",
          r.status().message(), LogLimiter::Suppressed(*held));
    }
  }
  if (r.ok() && r->evicted_dirty) {
    if (auto held = dirty_eviction_log.Allow()) {
      spdlog::warn(
          "engine: chunk {} left L1 before it reached L2 (stores outran L2's writes for longer "
          "than the flusher's headroom of {} slots); {} chunks lost so far{}",
          r->evicted_key.ToHex(), headroom, l1->Stats().dirty_evictions,
          LogLimiter::Suppressed(*held));
    }
  }
  return r;
}

void Engine::Impl::WatchDeadlines() {
  auto& w = deadlines;
  std::unique_lock lock(w.mu);
  while (!w.stop) {
    if (w.loads.empty()) {
      w.cv.wait(lock);
      continue;
    }
    auto load = w.loads.front().lock();
    if (!load) {  // finished and released: nothing to end
      w.loads.pop_front();
      continue;
    }
    // Written before the load was queued and not again until StopDeadlineWatch.
    const auto due = load->deadline;
    if (OpHandle::State::Clock::now() < due) {
      w.cv.wait_until(lock, due);
      continue;
    }
    w.loads.pop_front();
    lock.unlock();
    load->Expire(/*now=*/false);  // a load held open by a delivery ends when that delivery does
    load.reset();
    lock.lock();
  }
}

void Engine::Impl::StopDeadlineWatch() {
  auto& w = deadlines;
  if (!w.thread.joinable()) return;
  {
    std::lock_guard lock(w.mu);
    w.stop = true;
  }
  w.cv.notify_one();
  w.thread.join();
  for (auto& weak : w.loads) {
    if (auto load = weak.lock()) load->Expire(/*now=*/true);
  }
  w.loads.clear();
}

void Engine::Impl::FlusherLoop() {
  Flusher& f = *flusher;
  for (;;) {
    {
      std::unique_lock lock(f.mu);
      // The timeout retries writes that failed (their completions do not kick).
      f.cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return f.kicked || f.stop; });
      if (f.stop) return;
      f.kicked = false;
    }
    FlushPass();
    // Deferred write-throughs are retried as writes complete; one deferred while the last write
    // was completing has no completion left to retry it, and would stay dirty (not in L2) until
    // the next store.
    ResubmitDeferred();
    // Failed write-throughs, a few a round (never from completions: storage that fails every
    // write would otherwise be retried as fast as it fails); a failed chunk is dirty for good
    // otherwise, under write-through.
    RetryWriteThroughs(failed);
  }
}

size_t Engine::Impl::FlushPass() {
  std::lock_guard pass(pass_mu);
  std::shared_ptr<Flusher> f = flusher;  // the writes' callbacks keep their own
  const size_t in_flight = f->in_flight.load();
  if (in_flight >= max_flushing) return 0;
  auto taken = l1->TakeFlushCandidates(headroom, max_flushing - in_flight);
  if (!taken.empty()) TEST_SYNC_POINT_CALLBACK("Engine::FlushPass:Taken", &taken);
  MemoryTier* tier = l1.get();  // outlives abandoned writes (see ~Engine)
  size_t started = 0;
  for (; started < taken.size(); ++started) {
    const SlotId slot = taken[started].slot;
    f->in_flight++;
    Status s = l2->WriteAsync(taken[started].key, tier->SlotData(slot), [tier, f, slot](Status st) {
      tier->EndClean(slot, st.ok());
      (st.ok() ? f->written : f->failed)++;
      f->in_flight--;
      if (st.ok()) f->Kick();
    });
    if (!s.ok()) {  // queue full (a completion kicks the next pass) or shutting down
      f->in_flight--;
      break;
    }
  }
  for (size_t i = started; i < taken.size(); ++i) l1->EndClean(taken[i].slot, false);
  return started;
}

// Write-through: the chunk goes to L2 in the background, from its L1 slot, pinned meanwhile.
// It stays dirty until L2 has it, and nothing evicts it meanwhile, so until then it is this
// path's to write: a refused write (queue full under a burst) is deferred and retried as earlier
// writes complete, a failed one (counted by the file tier) is retried on the flusher's rounds,
// never skipped in silence.
void Engine::Impl::WriteThrough(const ChunkKey& key) {
  const WriteStart started = StartWriteThrough(key);
  if (started == WriteStart::kNoRoom || started == WriteStart::kBusy) DeferWriteThrough(key);
}

Engine::Impl::WriteStart Engine::Impl::StartWriteThrough(const ChunkKey& key) {
  if (write_through_in_flight.fetch_add(1) >= max_write_through) {
    write_through_in_flight--;
    return WriteStart::kNoRoom;  // enough L1 slots pinned by writes in flight
  }
  auto slot = l1->BeginClean(key);
  if (!slot.ok()) {
    write_through_in_flight--;
    // A chunk another writer holds (the flusher, keeping the chunks next in eviction order
    // clean, or FlushDirty) is not in L2 yet: that write may be refused (the queue full, as in
    // the burst that deferred this one) or fail, and the flusher comes back only to the chunks
    // next in eviction order. So the caller keeps it, to look again once that writer is done.
    return slot.status().IsRejected() ? WriteStart::kBusy : WriteStart::kNothing;
  }
  SlotId pinned = *slot;
  Status s = l2->WriteAsync(key, l1->SlotData(pinned), [this, key, pinned](Status st) {
    l1->EndClean(pinned, st.ok());
    write_through_in_flight--;
    if (!st.ok()) {
      // Retried later, not by the completions below: storage that fails every write would
      // otherwise be retried in a loop as fast as it fails.
      std::lock_guard lock(deferred_mu);
      if (failed.size() < max_deferred) {
        failed.push_back(key);
      } else {
        write_through_dropped++;
      }
    }
    ResubmitDeferred();
  });
  if (s.ok()) return WriteStart::kStarted;
  l1->EndClean(pinned, false);
  write_through_in_flight--;
  return s.IsRejected() ? WriteStart::kNoRoom : WriteStart::kShutDown;
}

void Engine::Impl::DeferWriteThrough(const ChunkKey& key) {
  bool dropped;
  size_t depth;
  {
    std::lock_guard lock(deferred_mu);
    dropped = deferred.size() >= max_deferred;
    if (!dropped) deferred.push_back(key);
    depth = deferred.size();
  }
  (dropped ? write_through_dropped : write_through_deferred)++;
  if (auto held = deferred_log.Allow()) {
    if (dropped) {
      spdlog::warn(
          "engine: write-through of {} not queued (file tier write queue full, {} "
          "deferred already); the chunk stays dirty in L1 and is written back on "
          "eviction or at shutdown{}",
          key.ToHex(), depth, LogLimiter::Suppressed(*held));
    } else {
      spdlog::info("engine: L2 writes are behind; write-through deferred ({} waiting){}", depth,
                   LogLimiter::Suppressed(*held));
    }
  }
}

// As writes complete (the deferred list: refills the file tier's write queue) and on the
// flusher's rounds (both lists).
void Engine::Impl::RetryWriteThroughs(std::deque<ChunkKey>& list) {
  for (int i = 0; i < 8; ++i) {
    ChunkKey key;
    {
      std::lock_guard lock(deferred_mu);
      if (list.empty()) return;
      key = list.front();
      list.pop_front();
    }
    const WriteStart started = StartWriteThrough(key);
    if (started == WriteStart::kNoRoom) {
      std::lock_guard lock(deferred_mu);
      list.push_front(key);  // still full: the next completion or flusher round retries
      return;
    }
    if (started == WriteStart::kBusy) {
      // Another writer has it. Dropped here, it stayed dirty for good whenever that write was
      // refused: the flusher gives up a chunk whose write the queue refuses, and comes back to
      // it only while it is next in eviction order (a chunk read since is not). Kept, it is
      // looked at again after the chunks behind it.
      std::lock_guard lock(deferred_mu);
      list.push_back(key);
    }
  }
}

LookupResult Engine::Lookup(std::span<const ChunkKey> keys) {
  // A prefix may alternate between tiers (write-back moves some chunks of it down), so walk it
  // in runs: the longest run in L1, then in L2, and so on until neither tier has the next chunk.
  LookupResult r;
  size_t in_memory = 0, in_file = 0;
  while (r.total < keys.size()) {
    size_t m = impl_->l1->LookupPrefix(keys.subspan(r.total));
    if (r.total == 0) r.memory = m;
    r.total += m;
    in_memory += m;
    if (r.total == keys.size() || !impl_->l2) break;
    size_t f = impl_->l2->LookupPrefix(keys.subspan(r.total));
    r.total += f;
    in_file += f;
    if (f == 0) break;
  }
  impl_->memory.CountLookup(keys.size(), in_memory);
  if (impl_->l2 && in_memory < keys.size()) {
    impl_->file.CountLookup(keys.size() - in_memory, in_file);
  }
  return r;
}

Result<OpHandle> Engine::Store(std::span<const ChunkKey> keys,
                               std::span<const std::span<const uint8_t>> src) {
  KVTIER_RETURN_IF_ERROR(
      CheckChunkBuffers("store", "source", keys.size(), src, impl_->options.chunk_bytes));
  auto state = std::make_shared<OpHandle::State>(OpHandle::State::Kind::kStore, keys.size());
  if (keys.empty()) {
    std::lock_guard lock(state->mu);
    state->Finish();
    return OpHandle(state);
  }
  std::vector<std::function<void()>> tasks;
  tasks.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    tasks.push_back([this, state, i, key = keys[i], parent = i ? keys[i - 1] : ChunkKey(),
                     has_parent = i > 0, data = src[i]] {
      auto r = impl_->ReserveInMemory(key, has_parent ? &parent : nullptr);
      if (!r.ok()) {
        state->ChunkDone(i, r.status());
        return;
      }
      if (!r->already_present) {
        std::memcpy(impl_->l1->SlotData(r->slot).data(), data.data(), data.size());
        impl_->PublishStored(r->slot, key);
      }
      state->ChunkDone(i, Status::Ok());
    });
  }
  Status submitted = impl_->pool.TrySubmit(std::move(tasks));
  if (!submitted.ok()) {
    impl_->rejected_ops++;
    return submitted;
  }
  impl_->stores++;
  return OpHandle(state);
}

// Each L2 chunk is read into the file tier's own buffer, never into L1 or caller memory, and
// reaches them only if the load is still open when the data arrives: a read stuck past the
// load's deadline (a hung NFS server) holds no L1 slot, and whatever it delivers late lands
// nowhere the caller can see (promoted into L1 at most).
Engine::Impl::FileReadJoin Engine::Impl::JoinFileRead(
    const ChunkKey& key, const FileTier::ReadDone& on_read,
    std::chrono::steady_clock::time_point deadline) {
  const auto now = OpHandle::State::Clock::now();
  std::lock_guard lock(reads_mu);
  auto it = reads.find(key);
  if (it == reads.end()) {
    // No read under way: perhaps one has just ended, after promoting the chunk.
    if (auto slot = l1->Pin(key); slot.ok()) return {.in_l1 = *slot};
    it = reads.try_emplace(key).first;
  } else if (options.load_deadline.count() == 0 ||
             now - it->second.started < options.load_deadline) {
    it->second.waiters.push_back(on_read);
    it->second.wanted_until = std::max(it->second.wanted_until, deadline);
    shared_reads++;
    return {};
  }
  // A new read, or one for a read older than a load's deadline, which may be stuck in the
  // kernel: no load can wait for it any more, so a new one starts and takes over the stuck one's
  // waiters (a newer generation: the stuck read, if it ever ends, finds nobody to serve).
  auto& read = it->second;
  read.waiters.push_back(on_read);
  read.wanted_until = std::max(read.wanted_until, deadline);
  read.started = now;
  read.generation = ++read_generation;
  return {.generation = read.generation};
}

bool Engine::Impl::ReadWanted(const ChunkKey& key, uint64_t generation) {
  std::vector<FileTier::ReadDone> over;  // destroyed outside the lock
  std::lock_guard lock(reads_mu);
  auto it = reads.find(key);
  if (it == reads.end() || it->second.generation != generation) return false;
  if (OpHandle::State::Clock::now() < it->second.wanted_until) return true;
  over = std::move(it->second.waiters);
  reads.erase(it);
  return false;
}

std::vector<FileTier::ReadDone> Engine::Impl::TakeFileReadWaiters(const ChunkKey& key,
                                                                  uint64_t generation) {
  std::lock_guard lock(reads_mu);
  auto it = reads.find(key);
  if (it == reads.end() || it->second.generation != generation) return {};
  std::vector<FileTier::ReadDone> waiters = std::move(it->second.waiters);
  it->second.waiters.clear();
  if (waiters.empty()) reads.erase(it);  // every waiter served: the read is over
  return waiters;
}

void Engine::Impl::StartFileReads(std::shared_ptr<OpHandle::State> state,
                                  std::span<const ChunkKey> keys, const std::vector<size_t>& chunks,
                                  std::span<const std::span<uint8_t>> dst) {
  const bool pin_for_caller = dst.empty();  // PrepareLoad: leave the chunk pinned in L1
  const auto deadline = [&] {
    std::lock_guard lock(state->mu);  // engine shutdown may move it
    return state->deadline;
  }();
  std::vector<std::function<void()>> tasks;
  for (size_t i : chunks) {
    std::span<uint8_t> out = pin_for_caller ? std::span<uint8_t>() : dst[i];
    tasks.push_back([this, state, i, key = keys[i], parent = i ? keys[i - 1] : ChunkKey(),
                     has_parent = i > 0, out, pin_for_caller, deadline] {
      // Another store or promotion may have put the chunk in L1 meanwhile: serve it from there.
      auto serve_pinned = [&](SlotId slot) {
        bool unpinned = false;
        bool taken = state->ChunkDone(i, Status::Ok(), [&] {
          if (pin_for_caller) {
            state->slots[i] = slot;
          } else {
            std::memcpy(out.data(), l1->SlotData(slot).data(), out.size());
            l1->Unpin(slot);  // before the operation can finish (see Engine::Load)
            unpinned = true;
          }
          memory.served++;
        });
        if (!unpinned && (!taken || !pin_for_caller)) l1->Unpin(slot);
      };
      if (auto slot = l1->Pin(key); slot.ok()) return serve_pinned(*slot);
      FileTier::ReadDone on_read = [this, state, i, key, parent, has_parent, out, pin_for_caller](
                                       Status st, std::span<const uint8_t> data) {
        if (!st.ok()) {  // a miss, or an error the file tier counted
          state->ChunkDone(i, st);
          return;
        }
        // Promoted into L1 first, so that stats never lag what the caller has been told. A
        // promotion into caller buffers is optional: it never costs a dirty chunk (the only copy
        // of that one) for one the file tier keeps anyway. PrepareLoad hands the caller the L1
        // slot, so it needs the room as a store does.
        Status promoted = Status::Ok();
        if (pin_for_caller || options.promote_on_load) {
          auto r = ReserveInMemory(
              key, has_parent ? &parent : nullptr,
              pin_for_caller ? MemoryTier::Victims::kAny : MemoryTier::Victims::kCleanOnly);
          if (!r.ok()) {
            promoted = r.status();  // full of pinned chunks (or, optional, of dirty ones)
          } else if (!r->already_present) {
            std::memcpy(l1->SlotData(r->slot).data(), data.data(), data.size());
            l1->Commit(r->slot, /*dirty=*/false);
            promotions++;
          }
        }
        if (!pin_for_caller) {
          state->ChunkDone(i, Status::Ok(), [&] {
            std::memcpy(out.data(), data.data(), out.size());
            file.served++;
          });
          return;
        }
        if (!promoted.ok()) {  // for PrepareLoad, a miss
          state->ChunkDone(i, promoted);
          return;
        }
        auto pinned = l1->Pin(key);
        bool taken = state->ChunkDone(i, pinned.status(), [&] {
          state->slots[i] = *pinned;
          file.served++;
        });
        if (!taken && pinned.ok()) l1->Unpin(*pinned);
      };
      // A read of this chunk already under way (another load's promotion) serves this load
      // too: one read, one promotion, every waiter handed the same bytes.
      const FileReadJoin join = JoinFileRead(key, on_read, deadline);
      TEST_SYNC_POINT("Engine::StartFileReads:AfterJoin");
      if (join.in_l1) return serve_pinned(*join.in_l1);
      if (!join.generation) return;
      FileTier::ReadDone shared = [this, key, g = *join.generation](Status st,
                                                                    std::span<const uint8_t> data) {
        // Loads that join while the waiters run are served too, in the next round; the read is
        // forgotten only after the first waiter has promoted the chunk into L1, so a load that
        // comes later finds it there rather than reading it again.
        for (auto waiters = TakeFileReadWaiters(key, g); !waiters.empty();
             waiters = TakeFileReadWaiters(key, g)) {
          for (auto& waiter : waiters) waiter(st, data);
        }
      };
      // Skipped if it is still queued when every load waiting for it is over (cut at its
      // deadline): a load of many chunks cut short leaves no queue of reads before the next.
      auto wanted = [this, key, g = *join.generation] { return ReadWanted(key, g); };
      // The file tier's read queue is bounded. A load of more chunks than it holds (or several
      // loads together) waits here for room, which the queue makes at the disk's pace, rather
      // than turning the rest of its prefix into misses; the deadline still bounds the wait.
      Status s = l2->ReadAsync(key, shared, wanted);
      for (auto pause = std::chrono::microseconds(50); s.IsRejected() && state->Open();
           pause = std::min(2 * pause, std::chrono::microseconds(2000))) {
        std::this_thread::sleep_for(pause);
        s = l2->ReadAsync(key, shared, wanted);
      }
      // Shut down, or still full at the deadline: a miss, for every load that joined it too.
      if (!s.ok()) shared(s, {});
    });
  }
  Status submitted = pool.TrySubmit(std::move(tasks));
  if (!submitted.ok()) {
    for (size_t i : chunks) state->ChunkDone(i, submitted);
  }
}

Result<OpHandle> Engine::Load(std::span<const ChunkKey> keys,
                              std::span<const std::span<uint8_t>> dst) {
  KVTIER_RETURN_IF_ERROR(
      CheckChunkBuffers("load", "destination", keys.size(), dst, impl_->options.chunk_bytes));
  return impl_->StartLoad(keys, dst);
}

Result<OpHandle> Engine::PrepareLoad(std::span<const ChunkKey> keys) {
  return impl_->StartLoad(keys, {});
}

// The common case of a server's prepare_load (a prefix L1 holds whole) without StartLoad's
// operation state, callbacks and result copies: a walk, its pins and its stats.
std::optional<std::vector<SlotId>> Engine::PrepareLoadFromMemory(std::span<const ChunkKey> keys) {
  std::vector<SlotId> pinned;
  pinned.reserve(keys.size());
  for (const ChunkKey& key : keys) {
    auto slot = impl_->l1->Pin(key);
    if (!slot.ok()) break;
    pinned.push_back(*slot);
  }
  const size_t rest = keys.size() - pinned.size();
  if (rest > 0 && impl_->l2) {
    if (impl_->l2->LookupPrefix(keys.subspan(pinned.size(), 1)) == 1) {
      for (SlotId s : pinned) impl_->l1->Unpin(s);
      return std::nullopt;
    }
  }
  impl_->memory.served += pinned.size();
  impl_->loads++;
  return pinned;
}

// Shared by Load (copy into dst) and PrepareLoad (dst empty: leave chunks pinned in L1).
Result<OpHandle> Engine::Impl::StartLoad(std::span<const ChunkKey> keys,
                                         std::span<const std::span<uint8_t>> dst) {
  const bool pin_for_caller = dst.empty();
  // Walk the prefix now, on the caller's thread: pin each chunk found in L1 (once pinned it
  // cannot be evicted before the copy) and note each found in L2, stopping at the first chunk
  // neither has. The prefix reported is then the prefix delivered, deadline permitting.
  std::vector<SlotId> pinned(keys.size(), kNoSlot);
  std::vector<size_t> from_memory, from_file;
  size_t available = 0;
  for (; available < keys.size(); ++available) {
    auto slot = l1->Pin(keys[available]);
    if (slot.ok()) {
      pinned[available] = *slot;
      from_memory.push_back(available);
    } else if (l2 && l2->LookupPrefix(keys.subspan(available, 1)) == 1) {
      from_file.push_back(available);
    } else {
      break;
    }
  }

  auto state = std::make_shared<OpHandle::State>(OpHandle::State::Kind::kLoad, keys.size());
  state->deadline_misses = &deadline_misses;
  if (!from_file.empty() && options.load_deadline.count() > 0) {
    state->deadline = OpHandle::State::Clock::now() + options.load_deadline;
    auto& w = deadlines;
    {
      std::lock_guard lock(w.mu);
      w.loads.push_back(state);
    }
    w.cv.notify_one();
  }
  if (pin_for_caller) {
    // The caller keeps the pins of the delivered prefix; chunks delivered past a gap are
    // useless to it and are unpinned here.
    MemoryTier* tier = l1.get();
    state->on_finish = [tier](OpHandle::State& st) {
      st.result.slots.assign(st.slots.begin(), st.slots.begin() + st.result.chunks);
      for (size_t i = st.result.chunks; i < st.slots.size(); ++i) {
        if (st.outcome[i] == OpHandle::State::kDone && st.slots[i] != kNoSlot) {
          tier->Unpin(st.slots[i]);
        }
      }
    };
  }
  {
    std::lock_guard lock(state->mu);
    for (size_t i = available; i < keys.size(); ++i) {
      state->outcome[i] = OpHandle::State::kFailed;
      --state->remaining;
    }
    if (pin_for_caller) {
      for (size_t i : from_memory) {
        state->slots[i] = pinned[i];
        state->outcome[i] = OpHandle::State::kDone;
        --state->remaining;
      }
      memory.served += from_memory.size();
    }
    if (state->remaining == 0) state->Finish();
  }
  if (!pin_for_caller && !from_memory.empty()) {
    std::vector<std::function<void()>> tasks;
    tasks.reserve(from_memory.size());
    for (size_t i : from_memory) {
      tasks.push_back([this, state, i, slot = pinned[i], out = dst[i]] {
        // Counted before the caller can see the chunk delivered, so stats never lag a Wait(),
        // and unpinned before too: unpinned after, a caller that stores right after its Wait()
        // found the slots still pinned, and its stores evicted what it had just stored instead.
        bool unpinned = false;
        state->ChunkDone(i, Status::Ok(), [&] {
          std::memcpy(out.data(), l1->SlotData(slot).data(), out.size());
          l1->AddBytesOut(out.size());
          memory.served++;
          l1->Unpin(slot);
          unpinned = true;
        });
        if (!unpinned) l1->Unpin(slot);
      });
    }
    Status submitted = pool.TrySubmit(std::move(tasks));
    if (!submitted.ok()) {
      for (size_t i : from_memory) l1->Unpin(pinned[i]);
      rejected_ops++;
      return submitted;
    }
  }
  if (!from_file.empty()) StartFileReads(state, keys, from_file, dst);
  loads++;
  return OpHandle(state);
}

std::vector<SlotId> Engine::ReserveSlots(std::span<const ChunkKey> keys) {
  std::vector<SlotId> slots;
  slots.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    auto r = impl_->ReserveInMemory(keys[i], i ? &keys[i - 1] : nullptr);
    if (!r.ok()) break;
    slots.push_back(r->already_present ? kNoSlot : r->slot);
  }
  return slots;
}

void Engine::CommitSlots(std::span<const ChunkKey> keys, std::span<const SlotId> slots) {
  impl_->stores++;  // a server's store: its reservation (ReserveSlots) committed
  for (size_t i = 0; i < slots.size() && i < keys.size(); ++i) {
    if (slots[i] != kNoSlot) impl_->PublishStored(slots[i], keys[i]);
  }
}

void Engine::AbortSlots(std::span<const SlotId> slots) {
  for (SlotId s : slots) {
    if (s != kNoSlot) impl_->l1->Abort(s);
  }
}

void Engine::Unpin(std::span<const SlotId> slots) {
  for (SlotId s : slots) {
    impl_->l1->Unpin(s);
    impl_->l1->AddBytesOut(impl_->options.chunk_bytes);
  }
}

bool Engine::Drain() {
  impl_->pool.Drain();
  if (!impl_->l2) return true;
  uint64_t failed = impl_->flusher->failed;
  for (;;) {
    // The flusher's headroom, cleaned now rather than at its next wake-up. Chunks whose writes
    // failed are not retried here (the flusher's thread retries them).
    size_t flushing = impl_->StoresDirty() ? impl_->FlushPass() : 0;
    if (!impl_->l2->Drain()) return false;  // stuck in the kernel: stop waiting
    bool deferred;
    {
      std::lock_guard lock(impl_->deferred_mu);
      deferred = !impl_->deferred.empty();
    }
    const bool new_failures = impl_->flusher->failed != failed;
    if (!deferred && (flushing == 0 || new_failures)) return true;
    failed = impl_->flusher->failed;
    // Deferred write-throughs whose retry no completion triggered (all finished before they
    // were deferred).
    impl_->ResubmitDeferred();
  }
}

Status Engine::FlushDirty() {
  struct Outcome {
    std::mutex mu;
    std::condition_variable cv;
    size_t in_flight = 0;
    Status first;
    void Done(const Status& s) {
      std::lock_guard lock(mu);
      if (!s.ok() && first.ok()) first = s;
      --in_flight;
      cv.notify_all();
    }
  };
  auto outcome = std::make_shared<Outcome>();
  auto note = [&](const Status& s) {
    std::lock_guard lock(outcome->mu);
    if (outcome->first.ok()) outcome->first = s;
  };
  if (impl_->StoresDirty()) {
    // Through the write pool, several at a time but never more than its queue holds, so the
    // flush itself causes no refusals. If the tier's writes are stuck in the kernel, the flush
    // stops after a stall timeout and the rest stays unwritten (kTimeout).
    const FileTierOptions& fo = impl_->l2->options();
    const size_t limit = std::max<size_t>(1, fo.max_queued_writes);
    const auto stall = fo.stall_timeout;
    bool gave_up = false;
    for (const ChunkKey& key : impl_->l1->DirtyKeys()) {
      {
        std::unique_lock lock(outcome->mu);
        auto since = std::chrono::steady_clock::now();
        while (outcome->in_flight >= limit) {
          outcome->cv.wait_for(lock, std::chrono::milliseconds(50));
          if (stall.count() == 0 || outcome->in_flight < limit) continue;
          lock.unlock();
          const bool stalled = impl_->l2->Stats().stalled_writes > 0;
          lock.lock();
          if (!stalled) since = std::chrono::steady_clock::now();
          if (stalled && std::chrono::steady_clock::now() - since >= stall) {
            gave_up = true;
            break;
          }
        }
        if (gave_up) break;
      }
      auto slot = impl_->l1->BeginClean(key);
      // Evicted or clean; or another writer's now, whose write Drain waits for, and retries if
      // it was refused (the flusher's, in Drain's own flush pass; a write-through's, deferred).
      if (!slot.ok()) continue;
      const SlotId pinned = *slot;
      int64_t refusals = 0;
      for (;;) {
        {
          std::lock_guard lock(outcome->mu);
          ++outcome->in_flight;
        }
        Status s = impl_->l2->WriteAsync(key, impl_->l1->SlotData(pinned),
                                         [this, pinned, outcome](Status st) {
                                           impl_->l1->EndClean(pinned, st.ok());
                                           outcome->Done(st);
                                         });
        if (s.ok()) break;
        {
          std::lock_guard lock(outcome->mu);
          --outcome->in_flight;
        }
        if (s.IsRejected() && !(stall.count() > 0 && ++refusals > stall.count() &&
                                impl_->l2->Stats().stalled_writes > 0)) {
          // Other writers filled the queue: wait for room (about a stall timeout at most, if
          // writes are stuck).
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
          continue;
        }
        impl_->l1->EndClean(pinned, false);
        if (s.IsRejected()) {
          gave_up = true;
        } else {
          note(s);
        }
        break;
      }
      if (gave_up) break;
    }
    if (gave_up) note(Status::Timeout("file tier writes are stalled; write-back incomplete"));
  }
  if (!Drain()) note(Status::Timeout("file tier writes are stalled"));
  std::lock_guard lock(outcome->mu);
  return outcome->first;
}

std::span<uint8_t> Engine::SlotData(SlotId slot) const { return impl_->l1->SlotData(slot); }

Engine::Pool Engine::pool() const {
  const MemoryTier& m = *impl_->l1;
  return Pool{m.base(), m.arena_bytes(), m.fd(), m.num_slots(), m.slot_bytes()};
}

bool Engine::has_file_tier() const { return impl_->l2 != nullptr; }

Result<std::string> Engine::ReadChunkDescriptor(const ChunkKey& key) {
  if (!impl_->l2) return Status::NotFound("no file tier");
  return impl_->l2->ReadDescriptor(key);
}

const EngineOptions& Engine::options() const { return impl_->options; }

MemoryTier& EngineInternals::memory(Engine& e) { return *e.impl_->l1; }
FileTier* EngineInternals::file(Engine& e) { return e.impl_->l2.get(); }
void EngineInternals::ResubmitDeferred(Engine& e) { e.impl_->ResubmitDeferred(); }

EngineStats Engine::Stats() const {
  EngineStats st;
  st.memory_detail = impl_->l1->Stats();
  st.memory.lookups = impl_->memory.lookups;
  st.memory.hits = impl_->memory.hits;
  st.memory.misses = impl_->memory.misses;
  st.memory.served = impl_->memory.served;
  st.memory.errors = impl_->memory.errors;
  st.memory.bytes_in = st.memory_detail.bytes_in;
  st.memory.bytes_out = st.memory_detail.bytes_out;
  st.memory.evictions = st.memory_detail.evictions;
  st.memory.rejections = st.memory_detail.rejections + impl_->pool.rejections();
  if (impl_->l2) {
    st.has_file = true;
    st.file_detail = impl_->l2->Stats();
    st.file.lookups = impl_->file.lookups;
    st.file.hits = impl_->file.hits;
    st.file.misses = impl_->file.misses;
    st.file.served = impl_->file.served;
    st.file.bytes_in = st.file_detail.bytes_written;
    st.file.bytes_out = st.file_detail.bytes_read;
    st.file.evictions = st.file_detail.evictions;
    // The file tier counts each of its failures once; the engine adds nothing to them.
    st.file.rejections = st.file_detail.rejections;
    st.file.errors = st.file_detail.errors;
  }
  st.stores = impl_->stores;
  st.loads = impl_->loads;
  st.rejected_ops = impl_->rejected_ops;
  st.promotions = impl_->promotions;
  st.shared_reads = impl_->shared_reads;
  st.deadline_misses = impl_->deadline_misses;
  st.write_through_deferred = impl_->write_through_deferred;
  st.write_through_dropped = impl_->write_through_dropped;
  st.write_backs = impl_->flusher->written;
  st.write_back_failures = impl_->flusher->failed;
  st.dirty_evictions = st.memory_detail.dirty_evictions;
  st.dirty_refusals = st.memory_detail.dirty_refusals;
  return st;
}

namespace {
constexpr TierCounterField kTierCounterFields[] = {
    {"lookups", "Lookups per tier", &TierCounters::lookups},
    {"hits", "Chunks lookups found per tier", &TierCounters::hits},
    {"served", "Chunks delivered to loads per tier", &TierCounters::served},
    {"misses", "Chunks not found per tier", &TierCounters::misses},
    {"bytes_written", "Chunk bytes written into each tier", &TierCounters::bytes_in},
    {"bytes_read", "Chunk bytes read out of each tier", &TierCounters::bytes_out},
    {"evictions", "Chunks evicted per tier", &TierCounters::evictions},
    {"rejections", "Operations refused (pool or queue full) per tier", &TierCounters::rejections},
    {"errors", "Errors per tier", &TierCounters::errors},
};
// TierCounters is its counters and nothing else: a field without a row does not compile.
static_assert(sizeof(TierCounters) == std::size(kTierCounterFields) * sizeof(uint64_t));

constexpr EngineCounterField kEngineCounterFields[] = {
    {"promotions", "promotion", "Chunks copied from L2 into L1 by loads", &EngineStats::promotions},
    {"shared_reads", "shared_read", "Chunks a load took from another load's L2 read under way",
     &EngineStats::shared_reads},
    {"deadline_misses", "deadline_miss",
     "Chunks reported missing because L2 missed the load deadline", &EngineStats::deadline_misses},
    {"write_through_deferred", "write_through_deferred",
     "Write-through chunks L2's full write queue refused, retried as writes completed",
     &EngineStats::write_through_deferred},
    {"write_through_dropped", "write_through_dropped",
     "Write-through chunks left dirty in L1 for the flusher past the retry bound",
     &EngineStats::write_through_dropped},
    {"write_backs", "write_back", "Chunks the flusher wrote to L2", &EngineStats::write_backs},
    {"write_back_failures", "write_back_failure",
     "Flusher writes L2 refused or failed (retried later)", &EngineStats::write_back_failures},
    {"dirty_evictions", "dirty_eviction", "Chunks evicted from L1 before they reached L2 (lost)",
     &EngineStats::dirty_evictions},
    {"dirty_refusals", "dirty_refusal",
     "Reservations refused because only chunks not yet in L2 were evictable",
     &EngineStats::dirty_refusals},
    {"stores", "store", "Store operations", &EngineStats::stores},
    {"loads", "load", "Load operations", &EngineStats::loads},
    {"rejected_ops", "rejected", "Operations refused (queue full)", &EngineStats::rejected_ops},
};
// The engine's counters are the fields from `promotions` to `rejected_ops`, the last of
// EngineStats: one added among them, or after them, without a row does not compile.
static_assert(offsetof(EngineStats, rejected_ops) - offsetof(EngineStats, promotions) ==
              (std::size(kEngineCounterFields) - 1) * sizeof(uint64_t));
static_assert(sizeof(EngineStats) == offsetof(EngineStats, rejected_ops) + sizeof(uint64_t));
}  // namespace

std::span<const TierCounterField> TierCounterFields() { return kTierCounterFields; }
std::span<const EngineCounterField> EngineCounterFields() { return kEngineCounterFields; }

}  // namespace kvtier

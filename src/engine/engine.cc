#include "kvtier/engine.h"

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include <fmt/format.h>

#include "common/task_pool.h"

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
    case WritePolicy::kWriteThrough: return "write_through";
    case WritePolicy::kWriteBack: return "write_back";
    case WritePolicy::kNone: return "none";
  }
  return "unknown";
}

// Completion state of one Store or Load: one outcome per chunk, the result computed once the
// last chunk reports.
struct OpHandle::State {
  enum class Kind { kStore, kLoad };
  enum Outcome : uint8_t { kPending, kDone, kFailed };

  State(Kind k, size_t n) : kind(k), outcome(n, kPending), remaining(n) {}

  void ChunkDone(size_t i, const Status& s) {
    std::lock_guard lock(mu);
    outcome[i] = s.ok() ? kDone : kFailed;
    if (!s.ok() && error.ok()) error = s;
    if (--remaining == 0) Finish();
  }
  // Called with mu held, once every chunk has reported.
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
      result.status = Status::NotFound(
          fmt::format("{} of {} leading chunks available", n, outcome.size()));
    }
    done = true;
    cv.notify_all();
  }

  const Kind kind;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Outcome> outcome;
  size_t remaining;
  Status error;
  bool done = false;
  OpResult result;
};

bool OpHandle::Done() const {
  std::lock_guard lock(state_->mu);
  return state_->done;
}

OpResult OpHandle::Wait() const {
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [this] { return state_->done; });
  return state_->result;
}

std::optional<OpResult> OpHandle::WaitFor(std::chrono::nanoseconds timeout) const {
  std::unique_lock lock(state_->mu);
  if (!state_->cv.wait_for(lock, timeout, [this] { return state_->done; })) return std::nullopt;
  return state_->result;
}

struct Engine::Impl {
  explicit Impl(const EngineOptions& o)
      : pool(o.worker_threads, o.max_queued_chunks, "engine copy queue") {}

  TaskPool pool;
  struct Counters {
    std::atomic<uint64_t> lookups{0}, hits{0}, misses{0}, errors{0};
  } memory;
  std::atomic<uint64_t> stores{0}, loads{0}, rejected_ops{0};
};

Engine::Engine(const EngineOptions& options) : options_(options) {}

Engine::~Engine() {
  if (impl_) impl_->pool.Drain();
}

Result<std::unique_ptr<Engine>> Engine::Open(const EngineOptions& options) {
  KVTIER_RETURN_IF_ERROR(options.ns.Validate().WithContext("engine namespace"));
  if (options.chunk_bytes == 0) return Status::InvalidArgument("engine: chunk_bytes must be positive");
  if (options.worker_threads < 1 || options.worker_threads > 256) {
    return Status::InvalidArgument(
        fmt::format("engine: worker_threads must be in [1, 256], got {}", options.worker_threads));
  }
  if (options.max_queued_chunks == 0) {
    return Status::InvalidArgument("engine: max_queued_chunks must be positive");
  }
  std::unique_ptr<Engine> engine(new Engine(options));
  MemoryTierOptions mem = options.memory;
  mem.chunk_bytes = options.chunk_bytes;
  auto memory = MemoryTier::Open(mem);
  if (!memory.ok()) return memory.status().WithContext("engine");
  engine->memory_ = std::move(memory).value();
  engine->impl_ = std::make_unique<Impl>(options);
  return engine;
}

LookupResult Engine::Lookup(std::span<const ChunkKey> keys) {
  LookupResult r;
  r.memory = memory_->LookupPrefix(keys);
  r.total = r.memory;
  impl_->memory.lookups++;
  impl_->memory.hits += r.memory;
  impl_->memory.misses += keys.size() - r.memory;
  return r;
}

Result<OpHandle> Engine::Store(std::span<const ChunkKey> keys,
                               std::span<const std::span<const uint8_t>> src) {
  if (keys.size() != src.size()) {
    return Status::InvalidArgument(
        fmt::format("store: {} keys but {} source buffers", keys.size(), src.size()));
  }
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i].size() != options_.chunk_bytes) {
      return Status::InvalidArgument(fmt::format("store: buffer {} holds {} bytes, a chunk is {}",
                                                 i, src[i].size(), options_.chunk_bytes));
    }
  }
  auto state = std::make_shared<OpHandle::State>(OpHandle::State::Kind::kStore, keys.size());
  if (keys.empty()) {
    std::lock_guard lock(state->mu);
    state->Finish();
    return OpHandle(state);
  }
  // Only chunks destined for a lower tier on eviction are dirty.
  const bool dirty = options_.write_policy == WritePolicy::kWriteBack && false;
  std::vector<std::function<void()>> tasks;
  tasks.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    tasks.push_back([this, state, i, key = keys[i], parent = i ? keys[i - 1] : ChunkKey(),
                     has_parent = i > 0, data = src[i], dirty] {
      auto r = memory_->Reserve(key, has_parent ? &parent : nullptr);
      if (!r.ok()) {
        state->ChunkDone(i, r.status());
        return;
      }
      if (!r->already_present) {
        std::memcpy(memory_->SlotData(r->slot).data(), data.data(), data.size());
        memory_->Commit(r->slot, dirty);
        memory_->AddBytesIn(data.size());
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

Result<OpHandle> Engine::Load(std::span<const ChunkKey> keys,
                              std::span<const std::span<uint8_t>> dst) {
  if (keys.size() != dst.size()) {
    return Status::InvalidArgument(
        fmt::format("load: {} keys but {} destination buffers", keys.size(), dst.size()));
  }
  for (size_t i = 0; i < dst.size(); ++i) {
    if (dst[i].size() != options_.chunk_bytes) {
      return Status::InvalidArgument(fmt::format("load: buffer {} holds {} bytes, a chunk is {}",
                                                 i, dst[i].size(), options_.chunk_bytes));
    }
  }
  // Pin the leading resident chunks now, on the caller's thread: once pinned they cannot be
  // evicted before the copy, so the prefix reported is the prefix delivered.
  std::vector<SlotId> pinned;
  pinned.reserve(keys.size());
  for (const ChunkKey& key : keys) {
    auto slot = memory_->Pin(key);
    if (!slot.ok()) break;
    pinned.push_back(*slot);
  }
  impl_->memory.lookups++;
  impl_->memory.hits += pinned.size();
  impl_->memory.misses += keys.size() - pinned.size();

  auto state = std::make_shared<OpHandle::State>(OpHandle::State::Kind::kLoad, keys.size());
  std::vector<std::function<void()>> tasks;
  tasks.reserve(pinned.size());
  for (size_t i = 0; i < pinned.size(); ++i) {
    tasks.push_back([this, state, i, slot = pinned[i], out = dst[i]] {
      std::memcpy(out.data(), memory_->SlotData(slot).data(), out.size());
      memory_->Unpin(slot);
      memory_->AddBytesOut(out.size());
      state->ChunkDone(i, Status::Ok());
    });
  }
  {
    // Chunks after the available prefix are misses; reported before the copies can finish.
    std::lock_guard lock(state->mu);
    for (size_t i = pinned.size(); i < keys.size(); ++i) {
      state->outcome[i] = OpHandle::State::kFailed;
      --state->remaining;
    }
    if (state->remaining == 0 && !state->done) state->Finish();
  }
  if (!tasks.empty()) {
    Status submitted = impl_->pool.TrySubmit(std::move(tasks));
    if (!submitted.ok()) {
      for (SlotId s : pinned) memory_->Unpin(s);
      impl_->rejected_ops++;
      return submitted;
    }
  }
  impl_->loads++;
  return OpHandle(state);
}

std::vector<SlotId> Engine::ReserveSlots(std::span<const ChunkKey> keys) {
  std::vector<SlotId> slots;
  slots.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    auto r = memory_->Reserve(keys[i], i ? &keys[i - 1] : nullptr);
    if (!r.ok()) break;
    slots.push_back(r->already_present ? kNoSlot : r->slot);
  }
  return slots;
}

void Engine::CommitSlots(std::span<const ChunkKey> keys, std::span<const SlotId> slots) {
  for (size_t i = 0; i < slots.size() && i < keys.size(); ++i) {
    if (slots[i] == kNoSlot) continue;
    memory_->Commit(slots[i], /*dirty=*/false);
    memory_->AddBytesIn(options_.chunk_bytes);
  }
}

void Engine::AbortSlots(std::span<const SlotId> slots) {
  for (SlotId s : slots) {
    if (s != kNoSlot) memory_->Abort(s);
  }
}

Result<OpHandle> Engine::PrepareLoad(std::span<const ChunkKey> keys) {
  auto state = std::make_shared<OpHandle::State>(OpHandle::State::Kind::kLoad, keys.size());
  std::vector<SlotId> pinned;
  for (const ChunkKey& key : keys) {
    auto slot = memory_->Pin(key);
    if (!slot.ok()) break;
    pinned.push_back(*slot);
  }
  impl_->memory.lookups++;
  impl_->memory.hits += pinned.size();
  impl_->memory.misses += keys.size() - pinned.size();
  impl_->loads++;
  std::lock_guard lock(state->mu);
  for (size_t i = 0; i < keys.size(); ++i) {
    state->outcome[i] = i < pinned.size() ? OpHandle::State::kDone : OpHandle::State::kFailed;
  }
  state->remaining = 0;
  state->Finish();
  state->result.slots = std::move(pinned);
  return OpHandle(state);
}

void Engine::Unpin(std::span<const SlotId> slots) {
  for (SlotId s : slots) {
    memory_->Unpin(s);
    memory_->AddBytesOut(options_.chunk_bytes);
  }
}

void Engine::Drain() { impl_->pool.Drain(); }

EngineStats Engine::Stats() const {
  EngineStats st;
  st.memory_detail = memory_->Stats();
  st.memory.lookups = impl_->memory.lookups;
  st.memory.hits = impl_->memory.hits;
  st.memory.misses = impl_->memory.misses;
  st.memory.errors = impl_->memory.errors;
  st.memory.bytes_in = st.memory_detail.bytes_in;
  st.memory.bytes_out = st.memory_detail.bytes_out;
  st.memory.evictions = st.memory_detail.evictions;
  st.memory.rejections = st.memory_detail.rejections + impl_->pool.rejections();
  st.stores = impl_->stores;
  st.loads = impl_->loads;
  st.rejected_ops = impl_->rejected_ops;
  return st;
}

}  // namespace kvtier

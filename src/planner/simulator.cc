#include "planner/simulator.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <limits>
#include <optional>
#include <queue>
#include <set>
#include <unordered_map>

#include "kvtier/eviction.h"
#include "planner/units.h"

namespace kvtier::planner {

Result<WritePolicy> ParseWritePolicy(std::string_view name) {
  if (name == "write_through" || name == "write-through") return WritePolicy::kWriteThrough;
  if (name == "write_back" || name == "write-back") return WritePolicy::kWriteBack;
  if (name == "none") return WritePolicy::kNone;
  return Status::InvalidArgument(
      fmt::format("unknown write policy '{}' (write_through, write_back or none)", name));
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
  return "?";
}

Result<TierSpec> ParseTierSpec(std::string_view text) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    size_t colon = text.find(':', start);
    parts.push_back(text.substr(start, colon == std::string_view::npos ? colon : colon - start));
    if (colon == std::string_view::npos) break;
    start = colon + 1;
  }
  if (parts.size() < 3 || parts.size() > 4) {
    return Status::InvalidArgument(fmt::format(
        "tier '{}' is not NAME:CAPACITY:READ_BW[:WRITE_BW] (e.g. cpu:8GiB:20GB/s)", text));
  }
  TierSpec tier;
  tier.name = std::string(parts[0]);
  if (tier.name.empty()) return Status::InvalidArgument(fmt::format("tier '{}' has no name", text));
  if (tier.name == "gpu" || tier.name == "recompute") {
    return Status::InvalidArgument(
        fmt::format("tier name '{}' is reserved for the hit-rate report", tier.name));
  }
  auto capacity = ParseBytes(parts[1]);
  if (!capacity.ok())
    return capacity.status().WithContext(fmt::format("tier {} capacity", tier.name));
  tier.capacity_bytes = *capacity;
  auto read = ParseBandwidth(parts[2]);
  if (!read.ok())
    return read.status().WithContext(fmt::format("tier {} read bandwidth", tier.name));
  tier.read_bytes_per_s = *read;
  tier.write_bytes_per_s = tier.read_bytes_per_s;
  if (parts.size() == 4) {
    auto write = ParseBandwidth(parts[3]);
    if (!write.ok()) {
      return write.status().WithContext(fmt::format("tier {} write bandwidth", tier.name));
    }
    tier.write_bytes_per_s = *write;
  }
  return tier;
}

Status Workload::Validate() const {
  if (users == 0) return Status::InvalidArgument("--users must be >= 1");
  if (rounds == 0) return Status::InvalidArgument("--rounds must be >= 1");
  if (answer_tokens == 0) return Status::InvalidArgument("--answer-tokens must be >= 1");
  if (question_tokens == 0) return Status::InvalidArgument("--question-tokens must be >= 1");
  if (!(duration_s > 0)) return Status::InvalidArgument("--duration must be > 0");
  if (!(qps > 0) || !std::isfinite(qps)) return Status::InvalidArgument("--qps must be > 0");
  return Status::Ok();
}

double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  double rank = p / 100.0 * static_cast<double>(sorted.size() - 1);
  size_t lo = static_cast<size_t>(std::floor(rank));
  size_t hi = std::min(lo + 1, sorted.size() - 1);
  double frac = rank - static_cast<double>(lo);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * frac;
}

namespace {

constexpr uint32_t kShared = 0;  // pseudo-conversation holding the shared system prompt
// kvtier's flusher wakes on every store, and every 50 ms without one (Engine::FlusherLoop).
constexpr double kFlusherPeriodS = 0.05;

uint64_t FloorTo(uint64_t v, uint64_t unit) { return v / unit * unit; }
uint64_t CeilTo(uint64_t v, uint64_t unit) { return (v + unit - 1) / unit * unit; }

// A chunk of a conversation: (owner, chunk index); owner kShared for the shared system prompt.
using ChunkRef = std::pair<uint32_t, size_t>;

// One offload tier: which chunks of which conversation it holds, and what it evicts to make room.
// Two eviction models:
//  * with `policy` (the first tier: kvtier's L1), one slot per chunk ordered by kvtier's own
//    EvictionPolicy (eviction.h), fed what the server sees: a load pins and touches the chunks it
//    reads (Access) and holds them until its copy is done, a save or a promotion inserts chunks
//    linked to the previous chunk of the same call (the server knows a chunk's parent only within
//    one call), lookups touch nothing. Under write-back a saved chunk is dirty until the flusher
//    writes it down; the flusher starts writes of the dirty chunks among the next `headroom` in
//    eviction order (Flush, run between calls), which stay pinned and dirty until the tier below
//    has taken them on its channel, and a victim is the first clean unpinned chunk in that order
//    (MemoryTier::Reserve), a dirty one only when none is (its data is lost). So promoted chunks,
//    clean, go before the dirty chains of recent saves: near the threshold the model keeps what
//    kvtier's L1 keeps (an LRU by conversation under users taking turns always evicts the user
//    asked next; docs/planner.md).
//  * without (lower tiers), LRU over conversations and tail-first inside one (Touch).
class TierState {
 public:
  TierState(const TierSpec& spec, double chunk_bytes, size_t chunks_per_conversation,
            std::optional<EvictionPolicyKind> policy)
      : spec_(spec), chunk_bytes_(chunk_bytes), per_conv_(chunks_per_conversation) {
    if (policy) {
      double slots = std::floor(spec.capacity_bytes / chunk_bytes);
      slots_ = static_cast<uint32_t>(std::clamp(slots, 0.0, 1e8));
      policy_ = MakeEvictionPolicy(*policy, std::max<uint32_t>(slots_, 1));
      slot_chunk_.resize(slots_);
      pinned_.assign(slots_, 0);
      dirty_.assign(slots_, 0);
      for (uint32_t s = slots_; s > 0; --s) free_.push_back(s - 1);
      // EngineOptions::flush_headroom (0.125 of the slots, at least one), as the engine sets it.
      headroom_ = std::clamp<uint32_t>(static_cast<uint32_t>(std::ceil(0.125 * slots_)), 1,
                                       std::max<uint32_t>(slots_, 1));
    }
  }

  bool Has(uint32_t conv, size_t chunk) const {
    if (policy_) return index_.contains(Key(conv, chunk));
    return conv < convs_.size() && chunk < convs_[conv].present.size() &&
           convs_[conv].present[chunk];
  }
  // A load read the chunk from this tier (kvtier's L1: pinned, which touches it).
  void Access(uint32_t conv, size_t chunk) {
    if (!policy_) return;
    auto it = index_.find(Key(conv, chunk));
    if (it != index_.end()) policy_->OnAccess(it->second);
  }
  // Pins (or unpins) a chunk while a load of it is under way: it cannot be evicted meanwhile.
  // Loads of the same chunk overlap (a shared prefix), so pins count.
  void SetPinned(uint32_t conv, size_t chunk, bool pinned) {
    if (!policy_) return;
    auto it = index_.find(Key(conv, chunk));
    if (it == index_.end()) return;
    uint16_t& pins = pinned_[it->second];
    if (pinned) {
      ++pins;
    } else if (pins > 0) {
      --pins;
    }
  }
  // The LRU-by-conversation model's recency; kvtier's L1 learns recency from Access and Insert.
  void Touch(uint32_t conv, double now) {
    if (policy_) return;
    Ensure(conv);
    Conv& c = convs_[conv];
    if (c.count > 0) lru_.erase({c.last_use, conv});
    c.last_use = now;
    if (c.count > 0) lru_.insert({c.last_use, conv});
  }
  // Inserts one chunk; `parent` is the previous chunk of the same call, if any; `dirty`: in no
  // tier below yet (the caller touched `conv` first). Evicted chunks are appended to `evicted`,
  // those evicted dirty (lost: kvtier's L1 only) also to `lost`. Returns false when the chunk
  // cannot be held (LRU by conversation: not without dropping a head chunk of the same
  // conversation).
  bool Insert(uint32_t conv, size_t chunk, const ChunkRef* parent, bool dirty, double now,
              std::vector<ChunkRef>* evicted, std::vector<ChunkRef>* lost) {
    if (policy_) return InsertSlot(conv, chunk, parent, dirty, now, evicted, lost);
    Ensure(conv);
    if (Has(conv, chunk)) return true;
    if (chunk_bytes_ > spec_.capacity_bytes) return false;
    while (used_ + chunk_bytes_ > spec_.capacity_bytes) {
      if (lru_.empty()) return false;
      uint32_t victim = lru_.begin()->second;
      Conv& v = convs_[victim];
      while (v.top > 0 && !v.present[v.top - 1]) --v.top;
      size_t idx = v.top - 1;
      if (victim == conv && idx < chunk) {
        // Only this conversation is left; keep its head rather than store its tail.
        if (std::next(lru_.begin()) == lru_.end()) return false;
        victim = std::next(lru_.begin())->second;
        Conv& w = convs_[victim];
        while (w.top > 0 && !w.present[w.top - 1]) --w.top;
        idx = w.top - 1;
      }
      Remove(victim, idx);
      evicted->emplace_back(victim, idx);
    }
    Conv& c = convs_[conv];
    if (c.count == 0) {
      c.last_use = now;
      lru_.insert({c.last_use, conv});
    }
    c.present[chunk] = 1;
    ++c.count;
    c.top = std::max(c.top, chunk + 1);
    used_ += chunk_bytes_;
    peak_ = std::max(peak_, used_);
    return true;
  }

  // The flusher's round (MemoryTier::TakeFlushCandidates): the dirty chunks among the next
  // `headroom` evictable ones in eviction order (less the free slots and those being written)
  // start their writes; returns them, for the caller to write to the tier below and to say
  // when they are clean (EndCleaning). Until then they are pinned, and still dirty.
  std::vector<ChunkRef> Flush(double now) {
    std::vector<ChunkRef> cleaned;
    if (!policy_) return cleaned;
    Settle(now);
    if (free_.size() + cleaning_.size() >= headroom_) return cleaned;
    size_t budget = headroom_ - free_.size() - cleaning_.size();
    policy_->PickVictim([&](SlotId s) {
      if (pinned_[s]) return false;
      if (dirty_[s]) {
        ++pinned_[s];
        cleaning_.emplace_back(s, kNeverClean);
        cleaned.push_back(slot_chunk_[s]);
      }
      return --budget == 0;
    });
    return cleaned;
  }
  // The writes Flush started finish at `done`: those chunks become clean and evictable then.
  void EndCleaning(double done) {
    for (auto& [slot, at] : cleaning_) {
      if (at == kNeverClean) at = done;
    }
  }

  bool kvtier_l1() const { return policy_ != nullptr; }
  uint32_t slots() const { return slots_; }
  const TierSpec& spec() const { return spec_; }
  double used() const { return used_; }
  double peak() const { return peak_; }
  double busy_until = 0;  // the tier's one FIFO channel

 private:
  struct Conv {
    std::vector<uint8_t> present;
    size_t count = 0;
    size_t top = 0;  // one past the highest chunk that may be present
    double last_use = 0;
  };
  static uint64_t Key(uint32_t conv, size_t chunk) {
    return (static_cast<uint64_t>(conv) << 32) | static_cast<uint32_t>(chunk);
  }
  static constexpr double kNeverClean = std::numeric_limits<double>::infinity();
  // Writes that have finished by `now` leave their chunks clean and unpinned.
  void Settle(double now) {
    std::erase_if(cleaning_, [&](const std::pair<SlotId, double>& c) {
      if (c.second > now) return false;
      dirty_[c.first] = 0;
      --pinned_[c.first];
      return true;
    });
  }
  // As MemoryTier::Reserve + Commit: a free slot, else the policy's victim among unpinned slots.
  bool InsertSlot(uint32_t conv, size_t chunk, const ChunkRef* parent, bool dirty, double now,
                  std::vector<ChunkRef>* evicted, std::vector<ChunkRef>* lost) {
    const uint64_t key = Key(conv, chunk);
    if (index_.contains(key)) return true;
    Settle(now);
    SlotId slot = kNoSlot;
    if (!free_.empty()) {
      slot = free_.back();
      free_.pop_back();
    } else {
      if (slots_ == 0) return false;
      slot = policy_->PickVictim([this](SlotId s) { return !pinned_[s] && !dirty_[s]; });
      if (slot == kNoSlot) slot = policy_->PickVictim([this](SlotId s) { return !pinned_[s]; });
      if (slot == kNoSlot) return false;
      policy_->OnRemove(slot);
      index_.erase(Key(slot_chunk_[slot].first, slot_chunk_[slot].second));
      evicted->push_back(slot_chunk_[slot]);
      if (dirty_[slot]) lost->push_back(slot_chunk_[slot]);
      used_ -= chunk_bytes_;
    }
    slot_chunk_[slot] = {conv, chunk};
    pinned_[slot] = 0;
    dirty_[slot] = dirty;
    index_.emplace(key, slot);
    used_ += chunk_bytes_;
    peak_ = std::max(peak_, used_);
    SlotId parent_slot = kNoSlot;
    if (parent) {
      auto it = index_.find(Key(parent->first, parent->second));
      if (it != index_.end()) parent_slot = it->second;
    }
    policy_->OnInsert(slot, parent_slot);
    return true;
  }
  void Ensure(uint32_t conv) {
    if (conv >= convs_.size()) convs_.resize(conv + 1);
    if (convs_[conv].present.empty()) convs_[conv].present.assign(per_conv_, 0);
  }
  void Remove(uint32_t conv, size_t chunk) {
    Conv& c = convs_[conv];
    c.present[chunk] = 0;
    --c.count;
    used_ -= chunk_bytes_;
    if (c.count == 0) {
      lru_.erase({c.last_use, conv});
      c.top = 0;
    }
  }

  TierSpec spec_;
  double chunk_bytes_;
  size_t per_conv_;
  // LRU by conversation.
  std::vector<Conv> convs_;
  std::set<std::pair<double, uint32_t>> lru_;
  // kvtier's L1: slots under an EvictionPolicy.
  std::unique_ptr<EvictionPolicy> policy_;
  uint32_t slots_ = 0;
  std::vector<ChunkRef> slot_chunk_;
  std::vector<uint16_t> pinned_;
  std::vector<uint8_t> dirty_;
  std::vector<std::pair<SlotId, double>> cleaning_;  // slots being written, and when they end
  uint32_t headroom_ = 0;
  std::vector<SlotId> free_;
  std::unordered_map<uint64_t, SlotId> index_;
  double used_ = 0;
  double peak_ = 0;
};

enum class Phase { kWaiting, kLoading, kPrefill, kDecode, kDone };

struct Request {
  uint32_t conv = 0;
  uint32_t round = 0;
  double sent = 0;
  uint64_t prompt = 0;
  uint64_t computed = 0;    // prompt tokens whose KV is on the GPU
  uint64_t generated = 0;   // answer tokens so far
  uint64_t step_chunk = 0;  // prefill tokens scheduled in the current step
  size_t saved_chunks = 0;  // leading chunks the tiers had or were sent (the connector's `saved`)
  size_t declined_end = 0;  // chunks below this were in a tier and not loaded: saved again
  double load_ready = 0;    // when its load's reads end
  struct PinRef {
    uint32_t tier, owner, chunk;
  };
  std::vector<PinRef> pins;  // tier chunks this request's load holds until it is done
  Phase phase = Phase::kWaiting;
  RequestLog log;
};

struct Conversation {
  uint32_t rounds_sent = 0;     // requests sent; also the prompt's round (its own history)
  uint32_t rounds_allowed = 0;  // requests this conversation sends in all
  double last_sent = 0;
  bool busy = false;             // a request of this conversation is in the engine
  uint64_t gpu_end = 0;          // cached prefix on the GPU, in tokens (block aligned, absolute)
  double freed_at = 0;           // when its blocks were last released (LRU key)
  uint64_t computed_before = 0;  // block-aligned tokens computed in earlier rounds
};

// kLoadSchedulable: a request whose load blocks the engine (load_blocking) may be scheduled, the
// step that runs it waiting for the rest of its read; kLoadDone: a load's reads are over.
enum class EventType { kSend, kLoadSchedulable, kLoadDone, kStepEnd, kJoin, kPrefetchDone };
struct Event {
  double t;
  uint64_t seq;
  EventType type;
  uint32_t id;
  // At one instant a joining user sends after the users already there, as bench qa's session
  // manager launches them (it walks its sessions oldest first and appends the new one).
  bool operator>(const Event& o) const {
    if (t != o.t) return t > o.t;
    const bool join = type == EventType::kJoin, other_join = o.type == EventType::kJoin;
    if (join != other_join) return join;
    return seq > o.seq;
  }
};

class Simulation {
 public:
  explicit Simulation(const SimOptions& o) : o_(o), e_(o.engine), w_(o.workload) {}

  Result<SimResult> Run();

 private:
  void Push(double t, EventType type, uint32_t id) { events_.push(Event{t, seq_++, type, id}); }
  uint32_t NewConversation(uint32_t rounds);
  void StartConversation(double now);
  void Send(uint32_t conv, double now);
  void Admit(double now);
  bool TryAdmit(Request& r, double now);
  size_t CostAwareHits(uint64_t prompt, uint64_t local, const std::vector<int>& tier_of) const;
  bool EvictGpu(uint64_t need_tokens, uint32_t keep_conv);
  void MaybeStartStep(double now);
  void EndStep(double now);
  void FinishPrefill(Request& r, double now);
  void Finish(Request& r, double now);
  uint64_t GpuUsed() const { return shared_cached_ + private_used_; }
  uint32_t ChunkOwner(uint32_t conv, size_t chunk) const {
    return chunk < shared_chunks_ ? kShared : conv;
  }
  // The first tier holding each of the conversation's leading chunks, up to `limit` or the first
  // chunk no tier holds.
  std::vector<int> LeadingTiers(uint32_t conv, size_t limit) const {
    std::vector<int> tier_of;
    for (size_t i = 0; i < limit; ++i) {
      int found = -1;
      for (size_t t = 0; t < tiers_.size() && found < 0; ++t) {
        if (tiers_[t].Has(ChunkOwner(conv, i), i)) found = static_cast<int>(t);
      }
      if (found < 0) break;
      tier_of.push_back(found);
    }
    return tier_of;
  }
  bool InAnyTier(uint32_t owner, size_t chunk) const {
    for (const TierState& t : tiers_) {
      if (t.Has(owner, chunk)) return true;
    }
    return false;
  }
  void Pin(Request& r, size_t t, uint32_t owner, size_t chunk);
  void ReleasePins(Request& r);
  void InsertTier(size_t t, uint32_t owner, size_t chunk, const ChunkRef* parent, bool dirty,
                  double now, double* bytes);
  void FlushTier(size_t t, double now);
  void WriteBelow(size_t t, const std::vector<ChunkRef>& chunks, double now);
  void ChargeWrite(size_t t, double bytes, double now);
  void SaveChunks(Request& r, size_t end_chunk, double now);
  // The connector's prefetch (python/kvtier/vllm/prefetch.py, docs/prefetch.md).
  void Expect(const Request& r, double now);
  void Returned(uint32_t conv, double now);
  struct Expected;
  void PlanPrefetch(double now);
  bool StartPrefetch(Expected& e, double now, double back);
  void PrefetchDone(uint32_t conv, double now);
  void Unpin(std::vector<ChunkRef>* pins);

  const SimOptions& o_;
  const EngineModel& e_;
  const Workload& w_;
  SimResult res_;

  std::priority_queue<Event, std::vector<Event>, std::greater<>> events_;
  uint64_t seq_ = 0;
  std::vector<Conversation> convs_;
  std::vector<Request> requests_;
  std::deque<uint32_t> waiting_;
  std::vector<uint32_t> running_;  // admitted, in admission order (loading, prefill, decode)
  std::vector<TierState> tiers_;
  double chunk_bytes_ = 0;
  size_t shared_chunks_ = 0;
  uint64_t shared_end_ = 0;     // block-aligned shared system-prompt tokens
  uint64_t shared_cached_ = 0;  // of those, cached on the GPU
  uint32_t shared_pins_ = 0;
  uint64_t private_used_ = 0;
  uint64_t capacity_tokens_ = 0;
  uint64_t reserved_tokens_ = 0;  // blocks held by running requests
  std::set<std::pair<double, uint32_t>> gpu_lru_;
  bool engine_busy_ = false;
  double step_started_ = 0;
  double gap_s_ = 0;
  double stop_sending_ = 0;
  uint64_t completed_in_window_ = 0;
  double last_flush_s_ = 0;

  // Prefetch: conversations expected back, oldest finish first, and the L1 chunks each holds
  // pinned; the pins of those that came back, held until their request is admitted.
  struct Expected {
    uint32_t conv = 0;
    double finished = 0;
    size_t chunks = 0;
    size_t target = 0;    // leading chunks it may hold
    bool pinned = false;  // promoted up to its target (as far as the tiers held it) and pinned
    // Not prefetched: its read would end after its predicted return, or its return loads it
    // from below anyway.
    bool skip = false;
    std::vector<ChunkRef> pins;
  };
  std::deque<Expected> expected_;
  std::unordered_map<uint32_t, std::vector<ChunkRef>> returning_;
  std::deque<double> return_gaps_;
  std::deque<bool> return_on_gpu_;  // of the same returns: its whole last prompt was on the GPU
  bool prefetching_ = false;        // one promotion at a time
  std::vector<ChunkRef> prefetch_chunks_;  // the promotion under way
};

// The prefetch's rule (python/kvtier/vllm/prefetch.py keeps the same constants): returns are
// predicted from the last kGapWindow finish-to-return gaps, once there are kMinReturns of them
// and their coefficient of variation is at most kMaxGapCv (users who come back at a steady
// pace); a conversation not back within the mean gap plus kHorizonSds standard deviations (at
// least kHorizonSlack of the mean) is given up (its pins released), but remembered for kMaxAgeS,
// so that its return still teaches the gap.
constexpr size_t kGapWindow = 32;
constexpr size_t kMinReturns = 8;
constexpr double kMaxGapCv = 0.5;
constexpr double kHorizonSds = 3.0;
constexpr double kHorizonSlack = 0.25;
constexpr double kMaxAgeS = 3600;
// Nor does it run while more than this share of those returns found their last prompt whole on
// the GPU (its prefix cache holds the rotation: reads would be wasted).
constexpr double kMaxGpuReturns = 0.5;

uint32_t Simulation::NewConversation(uint32_t rounds) {
  convs_.emplace_back();
  convs_.back().rounds_allowed = rounds;
  return static_cast<uint32_t>(convs_.size() - 1);
}

void Simulation::StartConversation(double now) { Send(NewConversation(w_.rounds), now); }

void Simulation::Send(uint32_t id, double now) {
  Conversation& c = convs_[id];
  Request r;
  r.conv = id;
  r.round = c.rounds_sent++;
  r.sent = now;
  r.prompt = w_.PromptTokens(r.round);
  c.last_sent = now;
  c.busy = true;
  Returned(id, now);
  requests_.push_back(std::move(r));
  waiting_.push_back(static_cast<uint32_t>(requests_.size() - 1));
}

bool Simulation::EvictGpu(uint64_t need, uint32_t keep) {
  while (capacity_tokens_ - GpuUsed() < need) {
    if (!gpu_lru_.empty()) {
      auto it = gpu_lru_.begin();
      uint32_t victim = it->second;
      Conversation& v = convs_[victim];
      uint64_t private_tokens = v.gpu_end - shared_end_;
      uint64_t take =
          std::min(private_tokens, CeilTo(need - (capacity_tokens_ - GpuUsed()), e_.block_tokens));
      // Tail first: the conversation keeps its beginning.
      v.gpu_end -= take;
      private_used_ -= take;
      if (v.gpu_end <= shared_end_) {
        v.gpu_end = shared_end_;
        gpu_lru_.erase(it);
      }
      continue;
    }
    if (shared_pins_ == 0 && shared_cached_ > 0) {
      uint64_t take =
          std::min(shared_cached_, CeilTo(need - (capacity_tokens_ - GpuUsed()), e_.block_tokens));
      shared_cached_ -= take;
      continue;
    }
    return false;
  }
  (void)keep;
  return true;
}

bool Simulation::TryAdmit(Request& r, double now) {
  Conversation& c = convs_[r.conv];
  const uint64_t bt = e_.block_tokens;
  // Private blocks are reachable only behind a complete shared prefix (hash chain).
  bool was_listed = c.gpu_end > shared_end_;
  if (was_listed) gpu_lru_.erase({c.freed_at, r.conv});
  uint64_t private_cached = c.gpu_end > shared_end_ ? c.gpu_end - shared_end_ : 0;
  if (shared_cached_ < shared_end_ && private_cached > 0) {
    private_used_ -= private_cached;  // unreachable: free it
    c.gpu_end = shared_end_;
    private_cached = 0;
    was_listed = false;
  }
  uint64_t reachable = shared_cached_ < shared_end_ ? shared_cached_ : shared_end_ + private_cached;
  // vLLM always computes at least the last prompt token.
  uint64_t gpu_hit = std::min(reachable, FloorTo(r.prompt - 1, bt));
  uint64_t total = CeilTo(r.prompt + w_.answer_tokens, bt);
  // Resident blocks that become this request's: the shared part and its private prefix.
  uint64_t resident =
      (shared_cached_ < shared_end_ ? shared_cached_ : shared_end_) + private_cached;
  uint64_t need = total > resident ? total - resident : 0;
  ++shared_pins_;
  if (!EvictGpu(need, r.conv)) {
    --shared_pins_;
    if (was_listed) gpu_lru_.insert({c.freed_at, r.conv});
    return false;
  }
  // The request now owns [0, total): shared blocks plus its private ones.
  private_used_ -= private_cached;
  shared_cached_ = std::max(shared_cached_, std::min(shared_end_, total));
  uint64_t private_total = total - std::min(total, shared_end_);
  private_used_ += private_total;
  c.gpu_end = shared_end_ + private_total;
  reserved_tokens_ += total;
  res_.peak_working_set_tokens =
      std::max(res_.peak_working_set_tokens, static_cast<double>(reserved_tokens_ + shared_end_));
  res_.peak_gpu_used_tokens = std::max(res_.peak_gpu_used_tokens, static_cast<double>(GpuUsed()));

  r.log.conversation = r.conv;
  r.log.round = r.round;
  r.log.sent_s = r.sent;
  r.log.prompt_tokens = r.prompt;
  r.log.gpu_tokens = gpu_hit;
  r.log.tier_tokens.assign(tiers_.size(), 0);
  uint64_t hit_end = gpu_hit;
  double ready = now;
  if (!tiers_.empty()) {
    // The connector's lookup: the leading chunks some tier holds, from the first (a lookup
    // touches nothing). It loads those past the GPU hit; it saves from the end of that run on.
    const size_t chunk = e_.chunk_tokens;
    const size_t usable = (r.prompt - 1) / chunk;             // full chunks before the last token
    std::vector<int> tier_of = LeadingTiers(r.conv, usable);  // of each chunk in [0, hits)
    size_t hits = tier_of.size();
    const size_t first_chunk = gpu_hit / chunk;
    if (o_.cost_aware) {
      const size_t found = hits;
      hits = CostAwareHits(r.prompt, gpu_hit, tier_of);
      tier_of.resize(hits);
      if (hits < found) r.declined_end = found;
    }
    r.saved_chunks = hits;
    std::vector<double> bytes(tiers_.size(), 0);
    for (size_t i = first_chunk; i < hits; ++i) {
      uint64_t lo = std::max<uint64_t>(i * chunk, gpu_hit);
      uint64_t tokens = (i + 1) * chunk - lo;
      r.log.tier_tokens[tier_of[i]] += tokens;
      bytes[tier_of[i]] += static_cast<double>(tokens) * e_.kv_bytes_per_token;
      hit_end = (i + 1) * chunk;
    }
    for (size_t t = 0; t < tiers_.size(); ++t) {
      tiers_[t].Touch(kShared, now);
      tiers_[t].Touch(r.conv, now);
      if (bytes[t] == 0) continue;
      TierState& tier = tiers_[t];
      double start = std::max(now, tier.busy_until);
      double duration = bytes[t] / tier.spec().read_bytes_per_s;
      tier.busy_until = start + duration;
      ready = std::max(ready, tier.busy_until);
      r.log.transfer_s = std::max(r.log.transfer_s, duration);
      res_.bytes_read[t] += bytes[t];
    }
    // One load call over [first_chunk, hits): it pins what the tiers above hold (touching it)
    // and promotes what comes from below into them (it passes through host memory on its way to
    // the GPU, so this costs no extra transfer), each chunk linked to the one before it.
    for (size_t i = first_chunk; i < hits; ++i) {
      Pin(r, tier_of[i], ChunkOwner(r.conv, i), i);
      tiers_[tier_of[i]].Access(ChunkOwner(r.conv, i), i);
    }
    if (o_.write_policy != WritePolicy::kNone) {
      // kvtier's flusher is woken by stores, not by promotions, and else every 50 ms.
      if (now - last_flush_s_ >= kFlusherPeriodS) FlushTier(0, now);
      for (size_t i = first_chunk; i < hits; ++i) {
        const ChunkRef parent{ChunkOwner(r.conv, i - 1), i - 1};
        for (int t = 0; t < tier_of[i]; ++t) {
          double unused = 0;
          InsertTier(t, ChunkOwner(r.conv, i), i, i > first_chunk ? &parent : nullptr, false, now,
                     &unused);
          Pin(r, t, ChunkOwner(r.conv, i), i);
        }
      }
    }
  }
  // The prefetch's pins of this conversation go once the request's own load holds what it reads.
  if (auto it = returning_.find(r.conv); it != returning_.end()) {
    Unpin(&it->second);
    returning_.erase(it);
  }
  r.computed = hit_end;
  r.log.recomputed_tokens = r.prompt - hit_end;
  if (c.computed_before > hit_end) res_.evicted_recompute_tokens += c.computed_before - hit_end;
  r.load_ready = ready;
  if (ready > now) {
    const auto id = static_cast<uint32_t>(&r - requests_.data());
    // The blocking part of the read is waited for by the step that runs the request
    // (MaybeStartStep), so the request joins the schedule that much before the read ends: it
    // waits for its read once, and the others in that step wait with it.
    const double schedulable = ready - e_.load_blocking * (ready - now);
    if (schedulable <= now) {
      r.phase = Phase::kPrefill;
    } else {
      r.phase = Phase::kLoading;
      if (schedulable < ready) Push(schedulable, EventType::kLoadSchedulable, id);
    }
    Push(ready, EventType::kLoadDone, id);
  } else {
    r.phase = Phase::kPrefill;
    ReleasePins(r);
  }
  return true;
}

// kvtier's cost-aware lookup (python/kvtier/vllm/cost.py, CostModel.choose): of the leading
// chunks the tiers hold, load them all, only the first tier's leading run (its copy overlaps
// the compute), or none, whichever gives the first token soonest by the prefill cost of what is
// left to compute and each lower tier's read at its bandwidth (the tiers read side by side, as
// the load runs them). A tie loads more.
size_t Simulation::CostAwareHits(uint64_t prompt, uint64_t local,
                                 const std::vector<int>& tier_of) const {
  const size_t chunk = e_.chunk_tokens;
  const size_t hits = tier_of.size();
  size_t memory = std::min<size_t>(local / chunk, hits);
  while (memory < hits && tier_of[memory] == 0) ++memory;
  if (memory == hits) return hits;
  std::vector<double> bytes(tiers_.size(), 0);
  for (size_t i = memory; i < hits; ++i) {
    bytes[tier_of[i]] += static_cast<double>(chunk) * e_.kv_bytes_per_token;
  }
  double read = 0;
  for (size_t t = 0; t < tiers_.size(); ++t) {
    read = std::max(read, bytes[t] / tiers_[t].spec().read_bytes_per_s);
  }
  auto end = [&](size_t chunks) { return std::min<uint64_t>(chunks * chunk, prompt - 1); };
  auto compute = [&](uint64_t from) { return e_.prefill.Suffix(from, prompt - from); };
  size_t best = hits;
  double best_s = read + compute(end(hits));
  if (end(memory) > local && compute(end(memory)) < best_s) {
    best = memory;
    best_s = compute(end(memory));
  }
  if (compute(local) < best_s) best = 0;
  return best;
}

// A load holds its chunks pinned in the tiers it reads and promotes into until its copy to the
// GPU is over (the connector releases them then), so a burst of loads and saves cannot evict
// them and may have only dirty chunks left to evict.
void Simulation::Pin(Request& r, size_t t, uint32_t owner, size_t chunk) {
  if (!tiers_[t].Has(owner, chunk)) return;  // a promotion that found no room
  tiers_[t].SetPinned(owner, chunk, true);
  r.pins.push_back({static_cast<uint32_t>(t), owner, static_cast<uint32_t>(chunk)});
}

void Simulation::ReleasePins(Request& r) {
  for (const Request::PinRef& p : r.pins) tiers_[p.tier].SetPinned(p.owner, p.chunk, false);
  r.pins.clear();
}

void Simulation::InsertTier(size_t t, uint32_t owner, size_t chunk, const ChunkRef* parent,
                            bool dirty, double now, double* bytes) {
  if (tiers_[t].Has(owner, chunk)) return;
  std::vector<ChunkRef> evicted, lost;
  tiers_[t].Touch(owner, now);
  if (!tiers_[t].Insert(owner, chunk, parent, dirty, now, &evicted, &lost)) return;
  *bytes += chunk_bytes_;
  res_.tier_peak_bytes[t] = std::max(res_.tier_peak_bytes[t], tiers_[t].used());
  res_.dirty_evictions += lost.size();
  // Under write-back kvtier's L1 wrote its clean victims down before (FlushTier) and loses its
  // dirty ones; a lower tier writes down what it evicts.
  if (o_.write_policy == WritePolicy::kWriteBack && !tiers_[t].kvtier_l1()) {
    WriteBelow(t, evicted, now);
  }
}

// kvtier's flusher after a call: the chunks it cleans are written to the tier below.
void Simulation::FlushTier(size_t t, double now) {
  if (o_.write_policy != WritePolicy::kWriteBack) return;
  last_flush_s_ = now;
  WriteBelow(t, tiers_[t].Flush(now), now);
  // The writes end when the tier below has taken them on its channel.
  tiers_[t].EndCleaning(t + 1 < tiers_.size() ? std::max(now, tiers_[t + 1].busy_until) : now);
}

void Simulation::WriteBelow(size_t t, const std::vector<ChunkRef>& chunks, double now) {
  if (t + 1 >= tiers_.size() || chunks.empty()) return;
  double below = 0;
  for (const auto& [conv, idx] : chunks) InsertTier(t + 1, conv, idx, nullptr, false, now, &below);
  ChargeWrite(t + 1, below, now);
}

// Writes of `bytes` into tier t take its one channel after what it is doing.
void Simulation::ChargeWrite(size_t t, double bytes, double now) {
  if (bytes <= 0) return;
  TierState& tier = tiers_[t];
  tier.busy_until = std::max(now, tier.busy_until) + bytes / tier.spec().write_bytes_per_s;
  res_.bytes_written[t] += bytes;
}

// The connector's save after a step: one call with the chunks completed since the last one,
// [saved_chunks, end_chunk), those that no tier holds yet (a chunk some tier holds is not
// copied again: promotion on read brings it back up).
void Simulation::SaveChunks(Request& r, size_t end_chunk, double now) {
  if (end_chunk <= r.saved_chunks) return;
  const size_t begin = r.saved_chunks;
  r.saved_chunks = end_chunk;
  if (tiers_.empty() || o_.write_policy == WritePolicy::kNone) return;
  std::vector<uint8_t> fresh(end_chunk - begin, 0);
  for (size_t i = begin; i < end_chunk; ++i) {
    // A chunk declined at the lookup was recomputed: it is saved again, into the tiers that
    // lack it (kvtier's L1 takes it; a tier that has it keeps its copy).
    fresh[i - begin] = i < r.declined_end || !InAnyTier(ChunkOwner(r.conv, i), i);
  }
  const bool write_back = o_.write_policy == WritePolicy::kWriteBack;
  const size_t last_tier = write_back ? 1 : tiers_.size();
  for (size_t t = 0; t < last_tier; ++t) {
    double bytes = 0;
    tiers_[t].Touch(kShared, now);
    tiers_[t].Touch(r.conv, now);
    for (size_t i = begin; i < end_chunk; ++i) {
      if (!fresh[i - begin]) continue;
      const ChunkRef parent{ChunkOwner(r.conv, i - 1), i - 1};
      InsertTier(t, ChunkOwner(r.conv, i), i, i > begin ? &parent : nullptr,
                 write_back && tiers_.size() > 1, now, &bytes);
    }
    ChargeWrite(t, bytes, now);
  }
  FlushTier(0, now);
}

void Simulation::Unpin(std::vector<ChunkRef>* pins) {
  for (const auto& [owner, chunk] : *pins) tiers_[0].SetPinned(owner, chunk, false);
  pins->clear();
}

// A request finished: its conversation (the chunks it saved) is expected back.
void Simulation::Expect(const Request& r, double now) {
  if (!o_.prefetch || tiers_.empty()) return;
  Expected e;
  e.conv = r.conv;
  e.finished = now;
  e.chunks = r.saved_chunks;
  expected_.push_back(std::move(e));
}

// A conversation sent its next question: the gap since its last answer is learned, and its pins
// wait for the request's own load.
void Simulation::Returned(uint32_t conv, double now) {
  auto it = std::find_if(expected_.begin(), expected_.end(),
                         [&](const Expected& e) { return e.conv == conv; });
  if (it == expected_.end()) return;
  return_gaps_.push_back(now - it->finished);
  const uint64_t prompt = w_.PromptTokens(convs_[conv].rounds_sent - 2);
  return_on_gpu_.push_back(convs_[conv].gpu_end >= FloorTo(prompt, e_.block_tokens));
  if (return_gaps_.size() > kGapWindow) {
    return_gaps_.pop_front();
    return_on_gpu_.pop_front();
  }
  returning_[conv] = std::move(it->pins);
  expected_.erase(it);
}

// Keeps pinned in L1 the expected conversations, oldest finish first, as far as they fit in
// prefetch_fraction of its slots (with the pins of those that came back): the first that does
// not fit gets its leading chunks up to the budget, the ones after it nothing. Promotions from the
// tiers below run one at a time.
void Simulation::PlanPrefetch(double now) {
  if (tiers_.empty() || return_gaps_.size() < kMinReturns) return;
  // The gaps to predict from (prefetch.py, predictable): the whole window if its returns are
  // steady and mostly missed the GPU's cache, else the newest kMinReturns if theirs are.
  double mean = 0, var = 0;
  bool steady = false;
  for (size_t n : {return_gaps_.size(), kMinReturns}) {
    const size_t first = return_gaps_.size() - n;
    mean = var = 0;
    for (size_t i = first; i < return_gaps_.size(); ++i) mean += return_gaps_[i];
    mean /= static_cast<double>(n);
    for (size_t i = first; i < return_gaps_.size(); ++i) {
      var += (return_gaps_[i] - mean) * (return_gaps_[i] - mean);
    }
    var /= static_cast<double>(n);
    const auto on_gpu = std::count(return_on_gpu_.begin() + static_cast<std::ptrdiff_t>(first),
                                   return_on_gpu_.end(), true);
    steady = std::sqrt(var) <= kMaxGapCv * mean &&
             static_cast<double>(on_gpu) <= kMaxGpuReturns * static_cast<double>(n);
    if (steady) break;
  }
  const double horizon = mean + std::max(kHorizonSds * std::sqrt(var), kHorizonSlack * mean);
  const auto budget = static_cast<size_t>(o_.prefetch_fraction * tiers_[0].slots());
  size_t used = 0;
  for (auto& [conv, pins] : returning_) used += pins.size();
  size_t room = steady && used < budget ? budget - used : 0;
  while (!expected_.empty() && now - expected_.front().finished > kMaxAgeS) {
    Unpin(&expected_.front().pins);
    expected_.pop_front();
  }
  bool shared_counted = false;
  for (auto it = expected_.begin(); it != expected_.end(); ++it) {
    // The shared system prompt's chunks are counted once.
    const size_t counted = shared_counted ? std::min(shared_chunks_, it->chunks) : 0;
    size_t target = 0;
    if (room > 0 && !it->skip && now - it->finished <= horizon) {
      target = std::min(it->chunks, counted + room);
      room -= target - counted;
      shared_counted = true;
    }
    if (target != it->target) {
      Unpin(&it->pins);
      it->target = target;
      it->pinned = false;
    }
    if (target > 0 && !it->pinned && !prefetching_ &&
        !StartPrefetch(*it, now, it->finished + mean)) {
      // Its budget goes to the ones after it from the next plan on.
      it->skip = true;
    }
  }
}

// Pins the leading chunks of `e` up to its target that L1 holds, and reads those only a tier
// below holds (up to the first no tier holds): they are promoted and pinned when the read is done.
// Does nothing and returns false when its return would load it from below anyway (the
// cost-aware lookup takes the tier's chunks: prefetching would only add reads), or when the reads
// would end after `back`, its predicted return.
bool Simulation::StartPrefetch(Expected& e, double now, double back) {
  const std::vector<int> tier_of = LeadingTiers(e.conv, e.chunks);
  if (o_.cost_aware) {
    const bool below = std::any_of(tier_of.begin(), tier_of.end(), [](int t) { return t > 0; });
    const uint64_t prompt = w_.PromptTokens(convs_[e.conv].rounds_sent);
    if (below && CostAwareHits(prompt, 0, tier_of) == tier_of.size()) return false;
  }
  prefetch_chunks_.clear();
  std::vector<double> bytes(tiers_.size(), 0);
  std::vector<ChunkRef> resident;
  for (size_t i = 0; i < std::min(e.target, tier_of.size()); ++i) {
    const ChunkRef chunk{ChunkOwner(e.conv, i), i};
    if (tier_of[i] == 0) {
      resident.push_back(chunk);
      continue;
    }
    bytes[tier_of[i]] += chunk_bytes_;
    prefetch_chunks_.push_back(chunk);
  }
  double ready = now;
  for (size_t t = 1; t < tiers_.size(); ++t) {
    if (bytes[t] == 0) continue;
    ready = std::max(
        ready, std::max(now, tiers_[t].busy_until) + bytes[t] / tiers_[t].spec().read_bytes_per_s);
  }
  if (ready > back) {
    prefetch_chunks_.clear();
    return false;
  }
  for (const auto& [owner, i] : resident) {
    tiers_[0].SetPinned(owner, i, true);
    tiers_[0].Access(owner, i);
    e.pins.emplace_back(owner, i);
  }
  e.pinned = true;
  if (prefetch_chunks_.empty()) return true;
  for (size_t t = 1; t < tiers_.size(); ++t) {
    if (bytes[t] == 0) continue;
    TierState& tier = tiers_[t];
    tier.busy_until = std::max(now, tier.busy_until) + bytes[t] / tier.spec().read_bytes_per_s;
    res_.bytes_read[t] += bytes[t];
  }
  prefetching_ = true;
  Push(ready, EventType::kPrefetchDone, e.conv);
  return true;
}

// A promotion's reads are done: its chunks enter L1 (linked as one call), pinned if their
// conversation is still expected and within the budget.
void Simulation::PrefetchDone(uint32_t conv, double now) {
  prefetching_ = false;
  auto it = std::find_if(expected_.begin(), expected_.end(),
                         [&](const Expected& e) { return e.conv == conv && e.pinned; });
  std::vector<ChunkRef>* pins = it != expected_.end() ? &it->pins : nullptr;
  if (auto back = returning_.find(conv); back != returning_.end()) pins = &back->second;
  for (const ChunkRef& c : prefetch_chunks_) {
    double unused = 0;
    const ChunkRef parent{ChunkOwner(conv, c.second - 1), c.second - 1};
    InsertTier(0, c.first, c.second, c.second > 0 ? &parent : nullptr, false, now, &unused);
    if (pins != nullptr && tiers_[0].Has(c.first, c.second)) {
      tiers_[0].SetPinned(c.first, c.second, true);
      pins->push_back(c);
    }
  }
  prefetch_chunks_.clear();
}

void Simulation::Admit(double now) {
  while (!waiting_.empty()) {
    Request& r = requests_[waiting_.front()];
    if (!TryAdmit(r, now)) {
      ++res_.admission_waits;
      return;  // first come first served: nobody overtakes the head
    }
    running_.push_back(waiting_.front());
    waiting_.pop_front();
  }
}

void Simulation::MaybeStartStep(double now) {
  if (engine_busy_) return;
  Admit(now);
  double duration = e_.step_overhead_s;
  uint64_t budget = e_.max_batched_tokens;
  bool any = false;
  double kv_tokens = 0;
  uint32_t decodes = 0;
  for (uint32_t id : running_) {
    Request& r = requests_[id];
    if (r.phase == Phase::kDecode) {
      ++decodes;
      kv_tokens += static_cast<double>(r.prompt + r.generated);
    }
  }
  if (decodes > 0) {
    any = true;
    budget = budget > decodes ? budget - decodes : 0;
    duration += e_.decode_weights_s + kv_tokens * e_.decode_s_per_kv_token;
  }
  double saved_bytes = 0;
  double load_wait = 0;
  for (uint32_t id : running_) {
    Request& r = requests_[id];
    r.step_chunk = 0;
    if (r.phase != Phase::kPrefill || budget == 0) continue;
    uint64_t chunk = std::min<uint64_t>(budget, r.prompt - r.computed);
    r.step_chunk = chunk;
    budget -= chunk;
    any = true;
    // A request whose read has not ended (load_blocking) holds the whole step until it has, as
    // LMCache's synchronous retrieval does before the forward pass. The tiers read side by side
    // and each channel queues its reads, so the step waits for the last to end.
    load_wait = std::max(load_wait, r.load_ready - now);
    duration += e_.prefill.Suffix(r.computed, chunk);
    if (!tiers_.empty() && o_.write_policy != WritePolicy::kNone) {
      // KV of the chunks this step completes and no tier holds yet is copied out at its end.
      const size_t end = (r.computed + chunk) / e_.chunk_tokens;
      for (size_t i = r.saved_chunks; i < end; ++i) {
        if (!InAnyTier(ChunkOwner(r.conv, i), i)) saved_bytes += chunk_bytes_;
      }
    }
  }
  if (!any) return;
  duration += e_.save_blocking * saved_bytes / e_.save_copy_bytes_per_s;
  duration += load_wait;
  res_.load_wait_s += load_wait;
  engine_busy_ = true;
  step_started_ = now;
  ++res_.steps;
  res_.engine_busy_s += duration;
  Push(now + duration, EventType::kStepEnd, 0);
}

void Simulation::FinishPrefill(Request& r, double now) {
  r.log.ttft_s = now - r.sent + e_.request_overhead_s;
  r.generated = 1;  // the first token comes out of the step that finishes the prefill
  r.phase = Phase::kDecode;
  if (r.generated >= w_.answer_tokens) Finish(r, now);
}

void Simulation::Finish(Request& r, double now) {
  r.phase = Phase::kDone;
  r.log.finish_s = now + e_.request_overhead_s;
  // The connector saves the chunks the answer completes too (its save_decode_tokens): the next
  // turn's prompt starts with them.
  SaveChunks(r, (r.prompt + w_.answer_tokens) / e_.chunk_tokens, now);
  Conversation& c = convs_[r.conv];
  const uint64_t total = CeilTo(r.prompt + w_.answer_tokens, e_.block_tokens);
  reserved_tokens_ -= total;
  // Only full blocks stay cached; the partial last block is freed.
  const uint64_t cached = FloorTo(r.prompt + w_.answer_tokens, e_.block_tokens);
  if (cached < c.gpu_end) {
    private_used_ -= c.gpu_end - std::max(cached, shared_end_);
    c.gpu_end = std::max(cached, shared_end_);
  }
  c.computed_before = cached;
  c.freed_at = now;
  if (c.gpu_end > shared_end_) gpu_lru_.insert({c.freed_at, r.conv});
  --shared_pins_;
  c.busy = false;
  Expect(r, now);
  if (o_.saturate && now >= stop_sending_ * 0.25 && now <= stop_sending_) ++completed_in_window_;

  uint32_t conv_id = r.conv;
  if (c.rounds_sent < c.rounds_allowed) {
    double next = std::max(now + e_.request_overhead_s, c.last_sent + gap_s_);
    if (next < stop_sending_) Push(next, EventType::kSend, conv_id);
  } else if (o_.saturate && now < stop_sending_) {
    Push(now, EventType::kJoin, 0);  // a new user takes the finished one's place
  }
}

void Simulation::EndStep(double now) {
  engine_busy_ = false;
  std::vector<uint32_t> still;
  still.reserve(running_.size());
  for (uint32_t id : running_) {
    Request& r = requests_[id];
    if (r.phase == Phase::kDecode) {
      ++r.generated;
      if (r.generated >= w_.answer_tokens) Finish(r, now);
    } else if (r.phase == Phase::kPrefill && r.step_chunk > 0) {
      r.computed += r.step_chunk;
      r.step_chunk = 0;
      SaveChunks(r, r.computed / e_.chunk_tokens, now);
      if (r.computed == r.prompt) FinishPrefill(r, now);
    }
    if (r.phase != Phase::kDone) still.push_back(id);
  }
  running_.swap(still);
}

Result<SimResult> Simulation::Run() {
  auto wall_start = std::chrono::steady_clock::now();
  KVTIER_RETURN_IF_ERROR(w_.Validate());
  if (e_.kv_bytes_per_token == 0) return Status::InvalidArgument("KV bytes per token is 0");
  if (e_.block_tokens == 0 || e_.chunk_tokens == 0 || e_.max_batched_tokens == 0) {
    return Status::InvalidArgument("block, chunk and batch sizes must be >= 1");
  }
  if (!(e_.step_overhead_s >= 0) || !(e_.save_blocking >= 0) || !(e_.save_copy_bytes_per_s > 0) ||
      !(e_.request_overhead_s >= 0)) {
    return Status::InvalidArgument(
        "step and request overheads, save blocking and save bandwidth must be >= 0");
  }
  if (!(e_.load_blocking >= 0 && e_.load_blocking <= 1)) {
    return Status::InvalidArgument("load blocking must be in [0, 1]");
  }
  if (!(e_.prefill.Full(1024) > 0)) return Status::InvalidArgument("prefill cost model is empty");
  for (const TierSpec& t : o_.tiers) {
    if (!(t.read_bytes_per_s > 0) || !(t.write_bytes_per_s > 0) || !(t.capacity_bytes >= 0)) {
      return Status::InvalidArgument(fmt::format("tier {}: bandwidths must be > 0", t.name));
    }
  }
  capacity_tokens_ =
      FloorTo(static_cast<uint64_t>(e_.gpu_kv_bytes / e_.kv_bytes_per_token), e_.block_tokens);
  shared_end_ = FloorTo(w_.system_prompt_tokens, e_.block_tokens);
  const uint64_t peak = CeilTo(w_.PeakConversationTokens(), e_.block_tokens);
  if (peak > capacity_tokens_) {
    return Status::InvalidArgument(fmt::format(
        "one conversation at its peak ({} tokens, {}) does not fit in the GPU KV memory ({} "
        "tokens, {}): shorten --context/--rounds or give more --gpu-kv-gb",
        w_.PeakConversationTokens(), FormatBytes(double(peak) * e_.kv_bytes_per_token),
        capacity_tokens_, FormatBytes(e_.gpu_kv_bytes)));
  }
  chunk_bytes_ = static_cast<double>(e_.chunk_tokens) * e_.kv_bytes_per_token;
  shared_chunks_ = w_.system_prompt_tokens / e_.chunk_tokens;
  const size_t chunks_per_conv = peak / e_.chunk_tokens + 1;
  for (const TierSpec& t : o_.tiers) {
    // The first tier is kvtier's L1, evicted by its own policy; lower tiers LRU by conversation.
    std::optional<EvictionPolicyKind> policy;
    if (tiers_.empty()) policy = o_.l1_eviction;
    tiers_.emplace_back(t, chunk_bytes_, chunks_per_conv, policy);
  }

  res_.source_names.push_back("gpu");
  for (const TierSpec& t : o_.tiers) res_.source_names.push_back(t.name);
  res_.source_names.push_back("recompute");
  res_.requests_by_source.assign(res_.source_names.size(), 0);
  res_.tokens_by_source.assign(res_.source_names.size(), 0);
  res_.bytes_written.assign(o_.tiers.size(), 0);
  res_.bytes_read.assign(o_.tiers.size(), 0);
  res_.tier_peak_bytes.assign(o_.tiers.size(), 0);
  res_.gpu_capacity_tokens = static_cast<double>(capacity_tokens_);

  convs_.emplace_back();  // kShared
  stop_sending_ = w_.duration_s;
  if (o_.saturate) {
    gap_s_ = 0;
    for (uint32_t u = 0; u < w_.users; ++u) Push(0, EventType::kJoin, 0);
  } else {
    // LMCache's pacing, as `kvtier bench qa` sends it: a user asks every users/qps seconds and
    // lives rounds - 1 gaps; a new user joins every (rounds - 1)/qps seconds. The run starts in
    // steady state: `users` sessions already under way, spread evenly over a session's life,
    // their question numbers advanced and their history empty (their text starts at the current
    // question), plus one user joining at 0.
    gap_s_ = w_.users / w_.qps;
    const double join_every = w_.JoinInterval();
    const double life = join_every * w_.users;
    for (uint32_t i = 0; i < w_.users; ++i) {
      const double offset = life - i * join_every;
      const auto passed = static_cast<uint32_t>(offset / gap_s_) + 1;
      if (passed >= w_.rounds) continue;  // its last question is behind it
      const uint32_t id = NewConversation(w_.rounds - passed);
      const double next = -offset + passed * gap_s_;  // previous send + gap, >= 0
      if (next < stop_sending_) Push(std::max(0.0, next), EventType::kSend, id);
    }
    for (double t = 0; t < stop_sending_; t += join_every) Push(t, EventType::kJoin, 0);
  }

  while (!events_.empty()) {
    Event ev = events_.top();
    events_.pop();
    const double now = ev.t;
    switch (ev.type) {
      case EventType::kJoin:
        StartConversation(now);
        break;
      case EventType::kSend:
        Send(ev.id, now);
        break;
      case EventType::kLoadSchedulable: {
        Request& r = requests_[ev.id];
        if (r.phase == Phase::kLoading) r.phase = Phase::kPrefill;
        break;
      }
      case EventType::kLoadDone: {
        Request& r = requests_[ev.id];
        if (r.phase == Phase::kLoading) r.phase = Phase::kPrefill;
        ReleasePins(r);
        break;
      }
      case EventType::kStepEnd:
        EndStep(now);
        break;
      case EventType::kPrefetchDone:
        PrefetchDone(ev.id, now);
        break;
    }
    if (o_.prefetch) PlanPrefetch(now);
    // Only an idle engine schedules: a request arriving mid-step waits for the step to end.
    if (!engine_busy_) MaybeStartStep(now);
    res_.end_s = now;
  }
  if (!waiting_.empty() || !running_.empty()) {
    return Status::Internal("simulation ended with requests still in the engine");
  }

  double min_slack = std::numeric_limits<double>::infinity();
  double sum = 0;
  for (Request& r : requests_) {
    RequestLog& log = r.log;
    std::vector<uint64_t> tokens;
    tokens.push_back(log.gpu_tokens);
    for (uint64_t t : log.tier_tokens) tokens.push_back(t);
    tokens.push_back(log.recomputed_tokens);
    size_t best = 0;
    for (size_t s = 0; s < tokens.size(); ++s) {
      res_.tokens_by_source[s] += static_cast<double>(tokens[s]);
      if (tokens[s] > tokens[best]) best = s;
    }
    log.source = static_cast<int>(best);
    ++res_.requests_by_source[best];
    res_.ttft_sorted_s.push_back(log.ttft_s);
    sum += log.ttft_s;
    res_.prompt_tokens += log.prompt_tokens;
    min_slack = std::min(min_slack, log.ttft_s - log.transfer_s);
  }
  res_.requests = requests_.size();
  std::sort(res_.ttft_sorted_s.begin(), res_.ttft_sorted_s.end());
  res_.mean_ttft_s = res_.requests ? sum / res_.requests : 0;
  res_.median_ttft_s = Percentile(res_.ttft_sorted_s, 50);
  res_.p90_ttft_s = Percentile(res_.ttft_sorted_s, 90);
  res_.p99_ttft_s = Percentile(res_.ttft_sorted_s, 99);
  res_.min_ttft_minus_transfer_s = res_.requests ? min_slack : 0;
  if (o_.saturate) {
    res_.throughput_rps = completed_in_window_ / (0.75 * stop_sending_);
  } else {
    res_.throughput_rps = res_.end_s > 0 ? res_.requests / res_.end_s : 0;
  }
  if (o_.keep_requests) {
    for (Request& r : requests_) res_.request_log.push_back(std::move(r.log));
  }
  res_.wall_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  return std::move(res_);
}

}  // namespace

Result<SimResult> Simulate(const SimOptions& options) {
  Simulation sim(options);
  return sim.Run();
}

}  // namespace kvtier::planner

#include "planner/simulator.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <limits>
#include <queue>
#include <set>

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

uint64_t FloorTo(uint64_t v, uint64_t unit) { return v / unit * unit; }
uint64_t CeilTo(uint64_t v, uint64_t unit) { return (v + unit - 1) / unit * unit; }

// One offload tier: which chunks of which conversation it holds, with LRU over conversations and
// tail-first eviction inside one.
class TierState {
 public:
  TierState(const TierSpec& spec, double chunk_bytes, size_t chunks_per_conversation)
      : spec_(spec), chunk_bytes_(chunk_bytes), per_conv_(chunks_per_conversation) {}

  bool Has(uint32_t conv, size_t chunk) const {
    return conv < convs_.size() && chunk < convs_[conv].present.size() &&
           convs_[conv].present[chunk];
  }
  void Touch(uint32_t conv, double now) {
    Ensure(conv);
    Conv& c = convs_[conv];
    if (c.count > 0) lru_.erase({c.last_use, conv});
    c.last_use = now;
    if (c.count > 0) lru_.insert({c.last_use, conv});
  }
  // Inserts one chunk (the caller touched `conv` first). Evicted chunks are appended to
  // `evicted` as (conversation, chunk). Returns false when the chunk cannot be held without
  // dropping a head chunk of the same conversation.
  bool Insert(uint32_t conv, size_t chunk, double now,
              std::vector<std::pair<uint32_t, size_t>>* evicted) {
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
  std::vector<Conv> convs_;
  std::set<std::pair<double, uint32_t>> lru_;
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

enum class EventType { kSend, kLoadDone, kStepEnd, kJoin };
struct Event {
  double t;
  uint64_t seq;
  EventType type;
  uint32_t id;
  bool operator>(const Event& o) const { return t != o.t ? t > o.t : seq > o.seq; }
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
  bool EvictGpu(uint64_t need_tokens, uint32_t keep_conv);
  void MaybeStartStep(double now);
  void EndStep(double now);
  void FinishPrefill(Request& r, double now);
  void Finish(Request& r, double now);
  uint64_t GpuUsed() const { return shared_cached_ + private_used_; }
  uint32_t ChunkOwner(uint32_t conv, size_t chunk) const {
    return chunk < shared_chunks_ ? kShared : conv;
  }
  bool InAnyTier(uint32_t owner, size_t chunk) const {
    for (const TierState& t : tiers_) {
      if (t.Has(owner, chunk)) return true;
    }
    return false;
  }
  void InsertTier(size_t t, uint32_t owner, size_t chunk, double now, double* bytes);

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
};

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
    const size_t chunk = e_.chunk_tokens;
    const size_t usable = (r.prompt - 1) / chunk;  // full chunks before the last token
    std::vector<int> from;                         // tier of each chunk from first_chunk on
    size_t first_chunk = gpu_hit / chunk;
    for (size_t i = first_chunk; i < usable; ++i) {
      int found = -1;
      for (size_t t = 0; t < tiers_.size(); ++t) {
        if (tiers_[t].Has(ChunkOwner(r.conv, i), i)) {
          found = static_cast<int>(t);
          break;
        }
      }
      if (found < 0) break;
      from.push_back(found);
    }
    std::vector<double> bytes(tiers_.size(), 0);
    for (size_t k = 0; k < from.size(); ++k) {
      size_t i = first_chunk + k;
      uint64_t lo = std::max<uint64_t>(i * chunk, gpu_hit);
      uint64_t tokens = (i + 1) * chunk - lo;
      r.log.tier_tokens[from[k]] += tokens;
      bytes[from[k]] += static_cast<double>(tokens) * e_.kv_bytes_per_token;
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
    // Promote chunks read from a lower tier into the tiers above (they pass through host
    // memory on their way to the GPU, so this costs no extra transfer).
    if (o_.write_policy != WritePolicy::kNone) {
      for (size_t k = 0; k < from.size(); ++k) {
        size_t i = first_chunk + k;
        for (int t = 0; t < from[k]; ++t) {
          double unused = 0;
          InsertTier(t, ChunkOwner(r.conv, i), i, now, &unused);
        }
      }
    }
  }
  r.computed = hit_end;
  r.log.recomputed_tokens = r.prompt - hit_end;
  if (c.computed_before > hit_end) res_.evicted_recompute_tokens += c.computed_before - hit_end;
  if (ready > now) {
    r.phase = Phase::kLoading;
    Push(ready, EventType::kLoadDone, static_cast<uint32_t>(&r - requests_.data()));
  } else {
    r.phase = Phase::kPrefill;
  }
  return true;
}

void Simulation::InsertTier(size_t t, uint32_t owner, size_t chunk, double now, double* bytes) {
  if (tiers_[t].Has(owner, chunk)) return;
  std::vector<std::pair<uint32_t, size_t>> evicted;
  tiers_[t].Touch(owner, now);
  if (!tiers_[t].Insert(owner, chunk, now, &evicted)) return;
  *bytes += chunk_bytes_;
  res_.tier_peak_bytes[t] = std::max(res_.tier_peak_bytes[t], tiers_[t].used());
  if (o_.write_policy == WritePolicy::kWriteBack && t + 1 < tiers_.size()) {
    double below = 0;
    for (const auto& [conv, idx] : evicted) InsertTier(t + 1, conv, idx, now, &below);
    if (below > 0) {
      TierState& next = tiers_[t + 1];
      next.busy_until = std::max(now, next.busy_until) + below / next.spec().write_bytes_per_s;
      res_.bytes_written[t + 1] += below;
    }
  }
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
  for (uint32_t id : running_) {
    Request& r = requests_[id];
    r.step_chunk = 0;
    if (r.phase != Phase::kPrefill || budget == 0) continue;
    uint64_t chunk = std::min<uint64_t>(budget, r.prompt - r.computed);
    r.step_chunk = chunk;
    budget -= chunk;
    any = true;
    duration += e_.prefill.Suffix(r.computed, chunk);
    if (r.computed + chunk == r.prompt && !tiers_.empty() &&
        o_.write_policy != WritePolicy::kNone) {
      // KV of the prompt's full chunks the first tier lacks is copied out at the end of the step.
      // Only KV that no tier holds yet is copied out.
      size_t full = r.prompt / e_.chunk_tokens;
      for (size_t i = 0; i < full; ++i) {
        if (!InAnyTier(ChunkOwner(r.conv, i), i)) saved_bytes += chunk_bytes_;
      }
    }
  }
  if (!any) return;
  duration += e_.save_blocking * saved_bytes / e_.save_copy_bytes_per_s;
  engine_busy_ = true;
  step_started_ = now;
  ++res_.steps;
  res_.engine_busy_s += duration;
  Push(now + duration, EventType::kStepEnd, 0);
}

void Simulation::FinishPrefill(Request& r, double now) {
  r.log.ttft_s = now - r.sent + e_.request_overhead_s;
  if (!tiers_.empty() && o_.write_policy != WritePolicy::kNone) {
    // A save carries the chunks no tier holds; chunks still somewhere below are not copied
    // again (promotion on read brings them back up).
    size_t full = r.prompt / e_.chunk_tokens;
    std::vector<uint8_t> fresh(full, 0);
    for (size_t i = 0; i < full; ++i) fresh[i] = !InAnyTier(ChunkOwner(r.conv, i), i);
    size_t last_tier = o_.write_policy == WritePolicy::kWriteThrough ? tiers_.size() : 1;
    for (size_t t = 0; t < last_tier; ++t) {
      double bytes = 0;
      tiers_[t].Touch(kShared, now);
      tiers_[t].Touch(r.conv, now);
      for (size_t i = 0; i < full; ++i) {
        if (!fresh[i]) continue;
        InsertTier(t, ChunkOwner(r.conv, i), i, now, &bytes);
      }
      if (bytes > 0) {
        TierState& tier = tiers_[t];
        tier.busy_until = std::max(now, tier.busy_until) + bytes / tier.spec().write_bytes_per_s;
        res_.bytes_written[t] += bytes;
      }
    }
  }
  r.generated = 1;  // the first token comes out of the step that finishes the prefill
  r.phase = Phase::kDecode;
  if (r.generated >= w_.answer_tokens) Finish(r, now);
}

void Simulation::Finish(Request& r, double now) {
  r.phase = Phase::kDone;
  r.log.finish_s = now + e_.request_overhead_s;
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
  for (const TierSpec& t : o_.tiers) tiers_.emplace_back(t, chunk_bytes_, chunks_per_conv);

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
      case EventType::kLoadDone: {
        Request& r = requests_[ev.id];
        if (r.phase == Phase::kLoading) r.phase = Phase::kPrefill;
        break;
      }
      case EventType::kStepEnd:
        EndStep(now);
        break;
    }
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

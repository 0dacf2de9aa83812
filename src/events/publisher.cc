#include "events/publisher.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "events/encoder.h"
#include "events/record_queue.h"

namespace kvtier::events {

namespace {

using Clock = std::chrono::steady_clock;

// What a tier hook or Bind pushes: 80 bytes, copied into the queue.
struct Record {
  enum Kind : uint8_t { kStored, kRemoved, kBind };
  uint8_t kind = kStored;
  uint8_t medium = 0;  // 0: L1 (CPU), 1: the file tier (STORAGE)
  uint32_t rank = 0;
  uint64_t group = 0;
  std::array<uint8_t, ChunkKey::kSize> stored{};
  std::array<uint8_t, ChunkKey::kSize> client{};
};

struct ChunkId {
  uint64_t group = 0;
  ChunkKey client;
  bool operator==(const ChunkId&) const = default;
};
struct ChunkIdHash {
  size_t operator()(const ChunkId& c) const { return ChunkKeyHash()(c.client) ^ c.group; }
};

bool StartsWith(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

bool ShouldBind(const std::string& ep) {
  return ep.find('*') != std::string::npos || ep.find("::") != std::string::npos ||
         StartsWith(ep, "ipc://") || StartsWith(ep, "inproc://");
}

std::string WithBindHost(const std::string& ep, const std::string& host) {
  if (host.empty()) return ep;
  const size_t star = ep.find('*');
  if (star == std::string::npos) return ep;
  const std::string h = host.find(':') != std::string::npos ? "[" + host + "]" : host;
  return ep.substr(0, star) + h + ep.substr(star + 1);
}

Status CheckEndpoint(const std::string& ep, const char* what) {
  if (ep.empty()) return Status::Ok();
  if (StartsWith(ep, "ipc://") || StartsWith(ep, "inproc://")) {
    if (ep.size() <= (StartsWith(ep, "ipc://") ? 6u : 9u)) {
      return Status::InvalidArgument(fmt::format("{} '{}' names no path", what, ep));
    }
    return Status::Ok();
  }
  if (StartsWith(ep, "tcp://")) {
    const size_t colon = ep.rfind(':');
    if (colon == std::string::npos || colon < 6 || colon + 1 >= ep.size() ||
        ep.find_first_not_of("0123456789", colon + 1) != std::string::npos || colon == 6) {
      return Status::InvalidArgument(
          fmt::format("{} '{}' is not tcp://HOST:PORT (HOST may be * to bind)", what, ep));
    }
    return Status::Ok();
  }
  return Status::InvalidArgument(fmt::format(
      "{} '{}' is not a ZMQ endpoint: use tcp://HOST:PORT, ipc://PATH or inproc://NAME", what, ep));
}

std::string SeqBytes(uint64_t seq) {
  std::string b(8, '\0');
  for (int i = 7; i >= 0; --i, seq >>= 8) b[i] = static_cast<char>(seq & 0xff);
  return b;
}

double WallSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string HostName() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

std::string Replace(std::string s, std::string_view from, std::string_view to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) {
    s.replace(at, from.size(), to);
  }
  return s;
}

}  // namespace

Status ValidatePublisherOptions(const PublisherOptions& o) {
  KVTIER_RETURN_IF_ERROR(CheckEndpoint(o.endpoint, "--kv-events-endpoint"));
  KVTIER_RETURN_IF_ERROR(CheckEndpoint(o.replay_endpoint, "--kv-events-replay-endpoint"));
  if (o.topic.empty()) return Status::InvalidArgument("--kv-events-topic is empty");
  if (o.medium_cpu.empty() || o.medium_storage.empty()) {
    return Status::InvalidArgument("--kv-events-media needs two non-empty names");
  }
  if (o.batch_interval.count() < 1 || o.batch_interval.count() > 10000) {
    return Status::InvalidArgument(
        fmt::format("--kv-events-batch-ms must be 1 to 10000, got {}", o.batch_interval.count()));
  }
  if (o.max_batch_events == 0 || o.buffer_steps == 0 || o.buffer_bytes == 0 ||
      o.max_queue_size < 16 || o.hwm < 0 || o.replay_max_chunks == 0 ||
      o.max_pending_descriptors == 0) {
    return Status::InvalidArgument(
        "KV-events sizes must be positive (buffer steps and MB, replay chunks, pending "
        "descriptors), the queue at least 16 records and the HWM not negative");
  }
  if (o.max_queue_size > (1u << 26) || o.buffer_steps > 10'000'000) {
    return Status::InvalidArgument("--kv-events-max-queue-size or buffer-steps is too large");
  }
  return Status::Ok();
}

class Publisher::Impl {
  friend class Publisher;

 public:
  explicit Impl(const PublisherOptions& o) : o_(o), queue_(o.max_queue_size) {
    host_ = o.pod.empty() ? HostName() : o.pod;
    media_[0] = o.medium_cpu;
    media_[1] = o.medium_storage;
  }
  ~Impl() { Stop(); }

  Status Open() {
    KVTIER_RETURN_IF_ERROR(ValidatePublisherOptions(o_));
    ctx_ = zmq_ctx_new();
    if (!ctx_) return Status::Internal("zmq_ctx_new failed");
    if (!o_.endpoint.empty()) {
      pub_ = zmq_socket(ctx_, ZMQ_PUB);
      zmq_setsockopt(pub_, ZMQ_SNDHWM, &o_.hwm, sizeof(int));
      // The batches published at Stop get a moment to leave; a subscriber that is gone costs
      // the drain no more than this.
      int linger = 200;
      zmq_setsockopt(pub_, ZMQ_LINGER, &linger, sizeof(int));
      KVTIER_ASSIGN_OR_RETURN(
          endpoint_, Attach(pub_, o_.endpoint, ShouldBind(o_.endpoint), "--kv-events-endpoint"));
    }
    if (!o_.replay_endpoint.empty()) {
      router_ = zmq_socket(ctx_, ZMQ_ROUTER);
      int one = 1, linger = 0;
      zmq_setsockopt(router_, ZMQ_ROUTER_MANDATORY, &one, sizeof(int));
      zmq_setsockopt(router_, ZMQ_LINGER, &linger, sizeof(int));
      KVTIER_ASSIGN_OR_RETURN(replay_endpoint_, Attach(router_, o_.replay_endpoint, true,
                                                       "--kv-events-replay-endpoint"));
    }
    thread_ = std::thread([this] { Run(); });
    describer_ = std::thread([this] { DescribeFromFiles(); });
    return Status::Ok();
  }

  void Stop() {
    if (stop_.exchange(true)) return;
    {
      std::lock_guard lock(describe_mu_);
      describe_cv_.notify_all();
    }
    if (describer_.joinable()) describer_.join();
    if (thread_.joinable()) thread_.join();
    if (pub_) zmq_close(pub_);
    if (router_) zmq_close(router_);
    if (ctx_) zmq_ctx_term(ctx_);
    pub_ = router_ = ctx_ = nullptr;
  }

  // --- called from any thread ---
  void Push(const Record& r) {
    if (!queue_.TryPush(r)) dropped_queue_.fetch_add(1, std::memory_order_relaxed);
  }
  void RegisterGroup(uint64_t group, const GroupInfo& info) {
    std::lock_guard lock(groups_mu_);
    groups_.try_emplace(group, info);
  }
  Status Describe(uint64_t group, const ChunkKey& client, std::span<const uint8_t> bytes) {
    uint32_t chunk_tokens = 0;
    {
      std::lock_guard lock(groups_mu_);
      auto it = groups_.find(group);
      if (it != groups_.end()) chunk_tokens = it->second.chunk_tokens;
    }
    auto d = ParseDescriptor(bytes, chunk_tokens);
    if (!d.ok()) {
      dropped_descriptors_.fetch_add(1, std::memory_order_relaxed);
      return d.status();
    }
    return Accept(ChunkId{group, client}, std::make_shared<const Descriptor>(std::move(d).value()));
  }
  // Files a checked descriptor for the publisher thread, and for the chunk's file headers.
  Status Accept(const ChunkId& id, std::shared_ptr<const Descriptor> d) {
    {
      std::lock_guard lock(header_mu_);
      // The first descriptor stays, as in the publisher's state.
      if (header_descs_.try_emplace(id, d).second) {
        header_desc_order_.push_back(id);
        if (header_desc_order_.size() > o_.max_pending_descriptors) {
          header_descs_.erase(header_desc_order_.front());
          header_desc_order_.pop_front();
        }
      }
    }
    std::lock_guard lock(inbox_mu_);
    // The inbox is bounded like the pending descriptors: a client describing faster than the
    // publisher files costs it descriptors, never memory.
    if (inbox_.size() >= o_.max_pending_descriptors) {
      dropped_descriptors_.fetch_add(1, std::memory_order_relaxed);
      return Status::Rejected("too many descriptors waiting");
    }
    inbox_.push_back({id, std::move(d)});
    return Status::Ok();
  }
  void BindForHeaders(uint64_t group, const ChunkKey& client, uint32_t rank,
                      const ChunkKey& stored) {
    std::lock_guard lock(header_mu_);
    const bool fresh =
        header_bindings_.insert_or_assign(stored, HeaderBinding{{group, client}, rank}).second;
    if (!fresh) return;
    header_binding_order_.push_back(stored);
    if (header_binding_order_.size() > o_.max_queue_size) {
      header_bindings_.erase(header_binding_order_.front());
      header_binding_order_.pop_front();
    }
  }
  std::string ChunkDescriptor(const ChunkKey& stored) noexcept {
    try {
      FileDescriptor f;
      {
        std::lock_guard lock(header_mu_);
        auto b = header_bindings_.find(stored);
        if (b == header_bindings_.end()) return {};
        auto d = header_descs_.find(b->second.id);
        if (d == header_descs_.end()) return {};
        f.group = b->second.id.group;
        f.rank = b->second.rank;
        f.client_key = b->second.id.client.bytes();
        f.descriptor = *d->second;
      }
      {
        std::lock_guard lock(groups_mu_);
        auto g = groups_.find(f.group);
        if (g == groups_.end()) return {};
        f.model_id = g->second.model_id;
        f.chunk_tokens = g->second.chunk_tokens;
        f.world_size = g->second.world_size;
      }
      // --kv-events-token-ids off keeps the prompts out of the files too (Security).
      if (!o_.token_ids) f.descriptor.token_ids.clear();
      std::string out = EncodeFileDescriptor(f, kMaxChunkDescriptorBytes);
      Count([&](PublisherStats& s) {
        ++(out.empty() ? s.file_descriptors_too_large : s.file_descriptors_written);
      });
      return out;
    } catch (...) {  // no memory: the file goes without
      return {};
    }
  }
  void SetDescriptorReader(DescriptorReader reader) {
    std::lock_guard lock(describe_mu_);
    reader_ = std::move(reader);
    describe_cv_.notify_all();
  }
  bool Flush(std::chrono::milliseconds timeout) {
    std::unique_lock lock(flush_mu_);
    const uint64_t ticket = ++flush_requested_;
    return flush_cv_.wait_for(lock, timeout, [&] { return flushed_ >= ticket || stopped_; }) &&
           flushed_ >= ticket;
  }
  PublisherStats Stats() const {
    std::lock_guard lock(stats_mu_);
    PublisherStats s = stats_;
    s.dropped_queue_full = dropped_queue_.load();
    s.dropped_descriptors += dropped_descriptors_.load();
    return s;
  }

  std::string endpoint_, replay_endpoint_;

 private:
  struct Chunk {
    std::shared_ptr<const Descriptor> desc;
    uint64_t mask[2] = {0, 0};  // ranks whose shard is in the medium
    bool announced[2] = {false, false};
  };
  struct Binding {
    ChunkId id;
    uint32_t rank = 0;
    bool bound = false;
    uint8_t media = 0;  // bit m: the stored key is in medium m
  };
  struct Pending {
    std::vector<std::string> events;
    size_t bytes = 0;
    Clock::time_point opened;
  };
  struct RingEntry {
    uint64_t seq;
    std::string topic;
    std::string payload;
  };
  struct ReplayMessage {
    std::string topic, seq, payload;
  };
  struct ReplayJob {
    std::string identity;
    std::deque<ReplayMessage> messages;  // the end marker last
    bool snapshot = false;
    Clock::time_point progress;
  };

  Result<std::string> Attach(void* socket, const std::string& ep, bool bind, const char* what) {
    const std::string target = WithBindHost(ep, o_.bind_host);
    const int rc = bind ? zmq_bind(socket, target.c_str()) : zmq_connect(socket, target.c_str());
    if (rc != 0) {
      return Status::InvalidArgument(fmt::format("{}: cannot {} '{}': {}", what,
                                                 bind ? "bind" : "connect to", target,
                                                 zmq_strerror(zmq_errno())));
    }
    if (!bind) return target;
    char last[1024] = {};
    size_t len = sizeof(last);
    zmq_getsockopt(socket, ZMQ_LAST_ENDPOINT, last, &len);
    std::string bound = last;
    if (StartsWith(bound, "ipc://")) {
      // Owner only: the stream tells which prefixes are cached (docs/kv-events.md, Security).
      ::chmod(bound.c_str() + 6, 0600);
    }
    if (bound.find("0.0.0.0") != std::string::npos || bound.find("[::]") != std::string::npos) {
      spdlog::warn(
          "kv-events: {} is bound to every interface ({}): the stream has no "
          "authentication, keep it on a private network (--kv-events-bind-host)",
          what, bound);
    }
    return bound;
  }

  // --- the publisher thread ---
  void Run() {
    last_sweep_ = Clock::now();
    for (;;) {
      const bool stopping = stop_.load();
      uint64_t want_flush;
      {
        std::lock_guard lock(flush_mu_);
        want_flush = flush_requested_;
      }
      DrainInbox();
      while (DrainRecords(65536) == 65536 && (want_flush > flushed_ || stopping)) {
      }
      DrainInbox();
      ServeReplayRequests();
      ContinueReplay();
      const auto now = Clock::now();
      const bool force = stopping || want_flush > flushed_;
      for (auto& [topic, b] : batches_) {
        if (!b.events.empty() && (force || now - b.opened >= o_.batch_interval)) {
          PublishBatch(topic, b);
        }
      }
      if (now - last_sweep_ >= std::chrono::seconds(1) || force) Sweep(now);
      if (want_flush > flushed_) {
        std::lock_guard lock(flush_mu_);
        flushed_ = want_flush;
        flush_cv_.notify_all();
      }
      if (stopping) break;
      zmq_pollitem_t item{router_, 0, ZMQ_POLLIN, 0};
      const long wait_ms = std::min<long>(o_.batch_interval.count(), 5);
      if (job_active()) {
        zmq_poll(&item, router_ ? 1 : 0, 1);
      } else {
        zmq_poll(&item, router_ ? 1 : 0, wait_ms);
      }
    }
    std::lock_guard lock(flush_mu_);
    stopped_ = true;
    flush_cv_.notify_all();
  }
  bool job_active() const { return !jobs_.empty(); }

  size_t DrainRecords(size_t max) {
    Record r;
    size_t n = 0;
    while (n < max && queue_.TryPop(&r)) {
      ++n;
      Apply(r);
    }
    return n;
  }

  void DrainInbox() {
    std::vector<std::pair<ChunkId, std::shared_ptr<const Descriptor>>> in;
    {
      std::lock_guard lock(inbox_mu_);
      in.swap(inbox_);
    }
    for (auto& [id, d] : in) {
      Chunk& c = chunks_[id];
      if (c.desc) {
        if (!(*c.desc == *d)) Count([](PublisherStats& s) { ++s.descriptor_conflicts; });
        continue;  // the first descriptor stays
      }
      c.desc = std::move(d);
      by_last_[HashKey(id.group, c.desc->block_hashes.back())] = id;
      if (c.desc->index > 0) children_.emplace(HashKey(id.group, c.desc->parent), id);
      if (c.mask[0] == 0 && c.mask[1] == 0) pending_.emplace_back(id, Clock::now());
      Evaluate(id);
    }
  }

  void Apply(const Record& r) {
    const ChunkKey stored(r.stored);
    if (r.kind == Record::kBind) {
      Binding& b = bindings_[stored];
      const ChunkId id{r.group, ChunkKey(r.client)};
      if (b.bound && b.id == id && b.rank == r.rank) return;
      const uint8_t media = b.media;
      if (b.bound) SetMedia(b, 0);  // rebound (cannot happen with derived keys): start over
      b.id = id;
      b.rank = r.rank;
      b.bound = true;
      b.media = 0;
      unbound_.emplace_back(stored, Clock::now());
      SetMedia(b, media);
      return;
    }
    const uint8_t bit = static_cast<uint8_t>(1u << r.medium);
    auto it = bindings_.find(stored);
    if (it == bindings_.end()) {
      if (r.kind == Record::kRemoved) return;
      it = bindings_.emplace(stored, Binding{}).first;
    }
    Binding& b = it->second;
    // A file this process did not bind (another host's, or found at start): its header may
    // say what it is.
    if (!b.bound && r.kind == Record::kStored && r.medium == 1) QueueDescribe(stored);
    SetMedia(b, r.kind == Record::kStored ? (b.media | bit) : (b.media & ~bit));
    if (b.media == 0) bindings_.erase(it);
  }

  void QueueDescribe(const ChunkKey& stored) {
    if (o_.describe_reads_per_s <= 0) return;
    std::lock_guard lock(describe_mu_);
    // Bounded like the records: past it a file stays undescribed (counted as such).
    if (describe_queue_.size() >= o_.max_queue_size) return;
    if (!describe_queued_.insert(stored).second) return;
    describe_queue_.push_back(stored);
    describe_cv_.notify_one();
  }

  // The describer thread: reads queued files' headers, paced, off the publisher thread (I/O) and
  // off the tiers' threads; what it finds enters like a client's describe and bind.
  void DescribeFromFiles() {
    const auto gap = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(1.0 / std::max(o_.describe_reads_per_s, 1e-3)));
    Clock::time_point next = Clock::now();
    std::unique_lock lock(describe_mu_);
    for (;;) {
      describe_cv_.wait(lock,
                        [&] { return stop_.load() || (reader_ && !describe_queue_.empty()); });
      if (stop_.load()) return;
      if (describe_cv_.wait_until(lock, next, [&] { return stop_.load(); })) return;
      const ChunkKey stored = describe_queue_.front();
      describe_queue_.pop_front();
      describe_queued_.erase(stored);
      DescriptorReader reader = reader_;
      lock.unlock();
      next = Clock::now() + gap;
      DescribeFromFile(reader, stored);
      lock.lock();
    }
  }

  void DescribeFromFile(const DescriptorReader& reader, const ChunkKey& stored) {
    auto bytes = reader(stored);
    if (!bytes.ok()) {
      // Gone since it was found: nothing to say. Anything else is counted; the chunk stays
      // undescribed (and the read that loads it judges the file).
      if (!bytes.status().IsNotFound()) {
        Count([](PublisherStats& s) { ++s.file_descriptor_errors; });
      }
      return;
    }
    if (bytes->empty()) return;  // written without one: undescribed
    auto f = ParseFileDescriptor(
        std::span(reinterpret_cast<const uint8_t*>(bytes->data()), bytes->size()));
    if (!f.ok()) {
      Count([](PublisherStats& s) { ++s.file_descriptor_errors; });
      return;
    }
    RegisterGroup(f->group, {f->model_id, "", f->chunk_tokens, f->world_size});
    const ChunkKey client(f->client_key);
    // Either order works; the descriptor first, so the binding's record finds it at once.
    (void)Accept(ChunkId{f->group, client},
                 std::make_shared<const Descriptor>(std::move(f->descriptor)));
    PushBind(f->group, client, f->rank, stored);
    Count([](PublisherStats& s) { ++s.file_descriptors_read; });
  }

  void PushBind(uint64_t group, const ChunkKey& client, uint32_t rank, const ChunkKey& stored) {
    Record r;
    r.kind = Record::kBind;
    r.rank = rank;
    r.group = group;
    r.stored = stored.bytes();
    r.client = client.bytes();
    Push(r);
  }

  // Moves a binding to `media`, updating its chunk's shard masks.
  void SetMedia(Binding& b, uint8_t media) {
    const uint8_t before = b.media;
    b.media = media;
    if (!b.bound || before == media || b.rank >= 64) return;
    Chunk& c = chunks_[b.id];
    for (int m = 0; m < 2; ++m) {
      const bool was = before & (1u << m), is = media & (1u << m);
      if (was == is) continue;
      if (is) {
        c.mask[m] |= 1ull << b.rank;
      } else {
        c.mask[m] &= ~(1ull << b.rank);
      }
    }
    Evaluate(b.id);
    auto it = chunks_.find(b.id);
    if (it != chunks_.end() && it->second.mask[0] == 0 && it->second.mask[1] == 0) {
      if (!it->second.desc) {
        chunks_.erase(it);
      } else {
        pending_.emplace_back(b.id, Clock::now());  // kept a while: it may come back
      }
    }
  }

  static std::string HashKey(uint64_t group, const PackedHash& h) {
    std::string k(reinterpret_cast<const char*>(&group), 8);
    k += h;
    return k;
  }

  const GroupInfo* Group(uint64_t group) {
    auto it = group_cache_.find(group);
    if (it != group_cache_.end()) return &it->second;
    std::lock_guard lock(groups_mu_);
    auto g = groups_.find(group);
    if (g == groups_.end()) return nullptr;
    auto [at, _] = group_cache_.emplace(group, g->second);
    const std::string topic = TopicOf(g->second, group);
    topics_[group] = topic;
    // clear_on_start: a topic's first event clears what subscribers kept from an earlier run.
    if (o_.clear_on_start && cleared_.insert(topic).second) {
      Emit(topic, EncodeAllBlocksCleared(), -1);
    }
    return &at->second;
  }

  std::string TopicOf(const GroupInfo& g, uint64_t group) const {
    std::string t = Replace(o_.topic, "{host}", host_);
    t = Replace(std::move(t), "{model}", g.model_id);
    return Replace(std::move(t), "{ns}", g.ns_id.empty() ? fmt::format("{:016x}", group) : g.ns_id);
  }

  bool ParentAnnounced(uint64_t group, const Descriptor& d) {
    if (d.index == 0) return true;
    auto it = by_last_.find(HashKey(group, d.parent));
    if (it == by_last_.end()) return false;
    auto c = chunks_.find(it->second);
    return c != chunks_.end() && (c->second.announced[0] || c->second.announced[1]);
  }

  // Announces or withdraws the chunk in each medium as its shards and its parent say, then its
  // children whose parent rule changed with it (a worklist: prefixes may be long).
  void Evaluate(const ChunkId& first) {
    std::vector<ChunkId> work{first};
    while (!work.empty()) {
      const ChunkId id = work.back();
      work.pop_back();
      auto it = chunks_.find(id);
      if (it == chunks_.end()) continue;
      Chunk& c = it->second;
      const GroupInfo* g = Group(id.group);
      if (!g) continue;
      const bool any_before = c.announced[0] || c.announced[1];
      const uint32_t world = std::clamp<uint32_t>(g->world_size, 1, 64);
      const uint64_t full = world == 64 ? ~0ull : (1ull << world) - 1;
      const bool parent_ok = c.desc && ParentAnnounced(id.group, *c.desc);
      for (int m = 0; m < 2; ++m) {
        const bool want = parent_ok && (c.mask[m] & full) == full;
        if (want == c.announced[m]) continue;
        c.announced[m] = want;
        if (want) {
          Announce(topics_[id.group], *c.desc, m);
        } else {
          Withdraw(topics_[id.group], *c.desc, m);
        }
      }
      const bool any_after = c.announced[0] || c.announced[1];
      if (any_before != any_after && c.desc) {
        auto range = children_.equal_range(HashKey(id.group, c.desc->block_hashes.back()));
        for (auto ch = range.first; ch != range.second; ++ch) work.push_back(ch->second);
      }
    }
  }

  std::string RefKey(const std::string& topic, int m, const PackedHash& h) const {
    std::string k = topic;
    k += '\0';
    k += static_cast<char>('0' + m);
    k += h;
    return k;
  }

  // One BlockStored per contiguous run of hashes in `fresh`.
  template <typename Emitter>
  void StoredRuns(const Descriptor& d, int m, const std::vector<bool>& fresh, Emitter emit) {
    const size_t n = d.block_hashes.size();
    for (size_t i = 0; i < n;) {
      if (!fresh[i]) {
        ++i;
        continue;
      }
      size_t j = i;
      while (j < n && fresh[j]) ++j;
      StoredEvent e;
      e.block_hashes = std::span(d.block_hashes).subspan(i, j - i);
      e.parent = i == 0 ? d.parent : d.block_hashes[i - 1];
      if (o_.token_ids && !d.token_ids.empty()) {
        e.token_ids = std::span(d.token_ids).subspan(i * d.block_size, (j - i) * d.block_size);
        e.block_size = d.block_size;
      }
      e.lora_id = d.lora_id;
      e.medium = media_[m];
      if (d.lora_name) e.lora_name = *d.lora_name;
      if (d.extra_keys) e.extra_keys = *d.extra_keys;
      e.group_idx = d.group_idx;
      emit(EncodeBlockStored(e));
      i = j;
    }
  }

  void Announce(const std::string& topic, const Descriptor& d, int m) {
    std::vector<bool> fresh(d.block_hashes.size());
    for (size_t i = 0; i < fresh.size(); ++i) {
      fresh[i] = refs_[RefKey(topic, m, d.block_hashes[i])]++ == 0;
    }
    StoredRuns(d, m, fresh, [&](std::string ev) { Emit(topic, std::move(ev), m); });
    Count([&](PublisherStats& s) { ++s.announced_chunks; });
  }

  void Withdraw(const std::string& topic, const Descriptor& d, int m) {
    std::vector<PackedHash> gone;
    for (const PackedHash& h : d.block_hashes) {
      auto it = refs_.find(RefKey(topic, m, h));
      if (it == refs_.end()) continue;
      if (--it->second == 0) {
        refs_.erase(it);
        gone.push_back(h);
      }
    }
    if (!gone.empty()) Emit(topic, EncodeBlockRemoved(gone, media_[m], d.group_idx), m, true);
    Count([&](PublisherStats& s) { --s.announced_chunks; });
  }

  void Emit(const std::string& topic, std::string ev, int m, bool removed = false) {
    Count([&](PublisherStats& s) {
      if (m < 0) {
        ++s.cleared_events;
      } else if (removed) {
        ++s.removed_events[m];
      } else {
        ++s.stored_events[m];
      }
    });
    Pending& b = batches_[topic];
    if (b.events.empty()) b.opened = Clock::now();
    b.bytes += ev.size();
    b.events.push_back(std::move(ev));
    if (b.events.size() >= o_.max_batch_events || b.bytes >= o_.max_batch_bytes) {
      PublishBatch(topic, b);
    }
  }

  void PublishBatch(const std::string& topic, Pending& b) {
    const uint64_t seq = next_seq_++;
    std::string payload = EncodeBatch(WallSeconds(), b.events, 0);
    b.events.clear();
    b.bytes = 0;
    if (pub_) {
      const std::string seq_bytes = SeqBytes(seq);
      // PUB never blocks: past the HWM a subscriber loses messages and sees the gap in seq.
      zmq_send(pub_, topic.data(), topic.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT);
      zmq_send(pub_, seq_bytes.data(), 8, ZMQ_SNDMORE | ZMQ_DONTWAIT);
      zmq_send(pub_, payload.data(), payload.size(), ZMQ_DONTWAIT);
    }
    ring_bytes_ += payload.size() + topic.size();
    ring_.push_back({seq, topic, std::move(payload)});
    while (!ring_.empty() && (ring_.size() > o_.buffer_steps || ring_bytes_ > o_.buffer_bytes)) {
      ring_bytes_ -= ring_.front().payload.size() + ring_.front().topic.size();
      ring_.pop_front();
    }
    Count([](PublisherStats& s) { ++s.batches; });
  }

  void Sweep(Clock::time_point now) {
    last_sweep_ = now;
    // Descriptors of chunks in no tier: at most max_pending_descriptors, each descriptor_ttl.
    while (!pending_.empty() && (pending_.size() > o_.max_pending_descriptors ||
                                 now - pending_.front().second >= o_.descriptor_ttl)) {
      const ChunkId id = pending_.front().first;
      pending_.pop_front();
      auto it = chunks_.find(id);
      if (it == chunks_.end() || it->second.mask[0] != 0 || it->second.mask[1] != 0) continue;
      if (it->second.announced[0] || it->second.announced[1]) continue;
      EraseChunk(it);
      dropped_descriptors_.fetch_add(1, std::memory_order_relaxed);
    }
    // Bindings of reservations that never committed.
    while (!unbound_.empty() && (now - unbound_.front().second >= std::chrono::seconds(120) ||
                                 unbound_.size() > 4 * o_.max_queue_size)) {
      auto it = bindings_.find(unbound_.front().first);
      unbound_.pop_front();
      if (it != bindings_.end() && it->second.media == 0) bindings_.erase(it);
    }
    uint64_t undescribed = 0;
    for (const auto& [key, b] : bindings_) {
      if (!b.bound) ++undescribed;
    }
    for (const auto& [id, c] : chunks_) {
      if (!c.desc && (c.mask[0] != 0 || c.mask[1] != 0)) ++undescribed;
    }
    Count([&](PublisherStats& s) { s.undescribed_chunks = undescribed; });
  }

  void EraseChunk(std::unordered_map<ChunkId, Chunk, ChunkIdHash>::iterator it) {
    const ChunkId id = it->first;
    if (const auto& d = it->second.desc) {
      auto last = by_last_.find(HashKey(id.group, d->block_hashes.back()));
      if (last != by_last_.end() && last->second == id) by_last_.erase(last);
      auto range = children_.equal_range(HashKey(id.group, d->parent));
      for (auto ch = range.first; ch != range.second; ++ch) {
        if (ch->second == id) {
          children_.erase(ch);
          break;
        }
      }
    }
    chunks_.erase(it);
  }

  // --- replay ---
  void ServeReplayRequests() {
    if (!router_) return;
    for (int i = 0; i < 16; ++i) {
      std::vector<std::string> frames;
      for (;;) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, router_, ZMQ_DONTWAIT) < 0) {
          zmq_msg_close(&msg);
          break;
        }
        frames.emplace_back(static_cast<const char*>(zmq_msg_data(&msg)), zmq_msg_size(&msg));
        const bool more = zmq_msg_more(&msg);
        zmq_msg_close(&msg);
        if (!more) break;
      }
      if (frames.empty()) return;
      // [identity, empty, start_seq (8 bytes, big-endian)]; anything else is ignored, as vLLM does.
      if (frames.size() != 3 || !frames[1].empty() || frames[2].size() != 8) continue;
      uint64_t start = 0;
      for (unsigned char c : frames[2]) start = (start << 8) | c;
      StartReplay(frames[0], start);
    }
  }

  void StartReplay(const std::string& identity, uint64_t start) {
    ReplayJob job;
    job.identity = identity;
    job.progress = Clock::now();
    const bool in_ring = start >= next_seq_ || (!ring_.empty() && start >= ring_.front().seq);
    if (in_ring) {
      for (const RingEntry& e : ring_) {
        if (e.seq >= start) job.messages.push_back({e.topic, SeqBytes(e.seq), e.payload});
      }
      Count([](PublisherStats& s) { ++s.replays_ring; });
    } else {
      const bool busy =
          std::any_of(jobs_.begin(), jobs_.end(), [](const ReplayJob& j) { return j.snapshot; });
      if (!busy) {
        job.snapshot = true;
        Snapshot(&job);
        Count([](PublisherStats& s) { ++s.replays_snapshot; });
      }
    }
    job.messages.push_back({"", SeqBytes(~0ull), ""});  // the end marker
    jobs_.push_back(std::move(job));
  }

  // Every chunk announced now, as batches stamped with the last published seq: per topic one
  // AllBlocksCleared, then BlockStored for each medium, shallow chunks first (parents before
  // children), each hash once per topic and medium.
  void Snapshot(ReplayJob* job) {
    const std::string seq = SeqBytes(next_seq_ - 1);
    std::vector<std::pair<uint32_t, const std::pair<const ChunkId, Chunk>*>> order;
    for (const auto& entry : chunks_) {
      if (entry.second.desc && (entry.second.announced[0] || entry.second.announced[1])) {
        order.emplace_back(entry.second.desc->index, &entry);
      }
    }
    std::sort(order.begin(), order.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    if (order.size() > o_.replay_max_chunks) order.resize(o_.replay_max_chunks);
    std::map<std::string, std::vector<std::string>> events;
    for (const auto& [g, topic] : topics_) {
      if (events.find(topic) == events.end()) events[topic].push_back(EncodeAllBlocksCleared());
    }
    std::unordered_set<std::string> sent;
    for (const auto& [index, entry] : order) {
      const std::string& topic = topics_[entry->first.group];
      const Descriptor& d = *entry->second.desc;
      for (int m = 0; m < 2; ++m) {
        if (!entry->second.announced[m]) continue;
        std::vector<bool> fresh(d.block_hashes.size());
        for (size_t i = 0; i < fresh.size(); ++i) {
          fresh[i] = sent.insert(RefKey(topic, m, d.block_hashes[i])).second;
        }
        StoredRuns(d, m, fresh, [&](std::string ev) { events[topic].push_back(std::move(ev)); });
      }
    }
    const double ts = WallSeconds();
    for (auto& [topic, evs] : events) {
      for (size_t at = 0; at < evs.size(); at += o_.max_batch_events) {
        const size_t n = std::min(o_.max_batch_events, evs.size() - at);
        job->messages.push_back({topic, seq, EncodeBatch(ts, std::span(evs).subspan(at, n), 0)});
      }
    }
  }

  // Sends what the front job's peer takes now (ROUTER_MANDATORY, non-blocking), at most 256
  // messages a turn, so that a replay never delays the live stream by much; a peer that takes
  // nothing for 30 s, or is gone, loses its replay.
  void ContinueReplay() {
    if (jobs_.empty()) return;
    ReplayJob& job = jobs_.front();
    for (int sent = 0; sent < 256 && !job.messages.empty(); ++sent) {
      const ReplayMessage& m = job.messages.front();
      if (zmq_send(router_, job.identity.data(), job.identity.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT) <
          0) {
        if (zmq_errno() != EAGAIN) job.messages.clear();  // the peer is gone
        break;
      }
      zmq_send(router_, "", 0, ZMQ_SNDMORE);
      zmq_send(router_, m.topic.data(), m.topic.size(), ZMQ_SNDMORE);
      zmq_send(router_, m.seq.data(), m.seq.size(), ZMQ_SNDMORE);
      zmq_send(router_, m.payload.data(), m.payload.size(), 0);
      job.messages.pop_front();
      job.progress = Clock::now();
    }
    if (job.messages.empty() || Clock::now() - job.progress > std::chrono::seconds(30)) {
      jobs_.pop_front();
    }
  }

  template <typename F>
  void Count(F f) {
    std::lock_guard lock(stats_mu_);
    f(stats_);
  }

  const PublisherOptions o_;
  std::string host_;
  std::string media_[2];
  RecordQueue<Record> queue_;
  std::atomic<uint64_t> dropped_queue_{0}, dropped_descriptors_{0};

  mutable std::mutex groups_mu_;
  std::unordered_map<uint64_t, GroupInfo> groups_;
  std::mutex inbox_mu_;
  std::vector<std::pair<ChunkId, std::shared_ptr<const Descriptor>>> inbox_;

  // What chunk files' headers get (any thread).
  struct HeaderBinding {
    ChunkId id;
    uint32_t rank = 0;
  };
  std::mutex header_mu_;
  std::unordered_map<ChunkKey, HeaderBinding, ChunkKeyHash> header_bindings_;
  std::deque<ChunkKey> header_binding_order_;  // oldest first, for the bound
  std::unordered_map<ChunkId, std::shared_ptr<const Descriptor>, ChunkIdHash> header_descs_;
  std::deque<ChunkId> header_desc_order_;

  // Files to read descriptors from (the publisher thread queues, the describer reads).
  std::mutex describe_mu_;
  std::condition_variable describe_cv_;
  DescriptorReader reader_;
  std::deque<ChunkKey> describe_queue_;
  std::unordered_set<ChunkKey, ChunkKeyHash> describe_queued_;
  std::thread describer_;

  std::mutex flush_mu_;
  std::condition_variable flush_cv_;
  uint64_t flush_requested_ = 0, flushed_ = 0;
  bool stopped_ = false;

  mutable std::mutex stats_mu_;
  PublisherStats stats_;

  void* ctx_ = nullptr;
  void* pub_ = nullptr;
  void* router_ = nullptr;
  std::thread thread_;
  std::atomic<bool> stop_{false};

  // The publisher thread's own.
  std::unordered_map<uint64_t, GroupInfo> group_cache_;
  std::unordered_map<uint64_t, std::string> topics_;
  std::unordered_set<std::string> cleared_;
  std::unordered_map<ChunkKey, Binding, ChunkKeyHash> bindings_;
  std::deque<std::pair<ChunkKey, Clock::time_point>> unbound_;
  std::unordered_map<ChunkId, Chunk, ChunkIdHash> chunks_;
  std::deque<std::pair<ChunkId, Clock::time_point>> pending_;
  std::unordered_map<std::string, ChunkId> by_last_;
  std::unordered_multimap<std::string, ChunkId> children_;
  std::unordered_map<std::string, uint32_t> refs_;
  std::map<std::string, Pending> batches_;
  std::deque<RingEntry> ring_;
  uint64_t ring_bytes_ = 0;
  uint64_t next_seq_ = 0;
  std::deque<ReplayJob> jobs_;
  Clock::time_point last_sweep_;
};

Result<std::shared_ptr<Publisher>> Publisher::Start(const PublisherOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  KVTIER_RETURN_IF_ERROR(impl->Open());
  if (!impl->endpoint_.empty()) spdlog::info("kv-events: publishing on {}", impl->endpoint_);
  if (!impl->replay_endpoint_.empty()) {
    spdlog::info("kv-events: replay on {}", impl->replay_endpoint_);
  }
  return std::shared_ptr<Publisher>(new Publisher(std::move(impl)));
}

Publisher::Publisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Publisher::~Publisher() { Stop(); }
void Publisher::Stop() { impl_->Stop(); }
std::string Publisher::endpoint() const { return impl_->endpoint_; }
std::string Publisher::replay_endpoint() const { return impl_->replay_endpoint_; }

void Publisher::RegisterGroup(uint64_t group, const GroupInfo& info) {
  impl_->RegisterGroup(group, info);
}

void Publisher::Bind(uint64_t group, const ChunkKey& client_key, uint32_t rank,
                     const ChunkKey& stored) {
  impl_->BindForHeaders(group, client_key, rank, stored);
  impl_->PushBind(group, client_key, rank, stored);
}

std::string Publisher::ChunkDescriptor(const ChunkKey& key) noexcept {
  return impl_->ChunkDescriptor(key);
}

void Publisher::SetDescriptorReader(DescriptorReader reader) {
  impl_->SetDescriptorReader(std::move(reader));
}

Status Publisher::Describe(uint64_t group, const ChunkKey& client_key,
                           std::span<const uint8_t> descriptor) {
  return impl_->Describe(group, client_key, descriptor);
}

void Publisher::OnTierChange(TierId tier, const ChunkKey& key, bool stored) noexcept {
  Record r;
  r.kind = stored ? Record::kStored : Record::kRemoved;
  r.medium = tier == TierId::kMemory ? 0 : 1;
  r.stored = key.bytes();
  impl_->Push(r);
}

PublisherStats Publisher::Stats() const { return impl_->Stats(); }
bool Publisher::Flush(std::chrono::milliseconds timeout) { return impl_->Flush(timeout); }

}  // namespace kvtier::events

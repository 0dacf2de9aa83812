// The handlers of the protocol's requests after hello (docs/protocol.md), one per opcode.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <shared_mutex>
#include <unordered_map>
#include <unordered_set>

#include "server/server_impl.h"

namespace kvtier::server {

bool Server::Impl::Handle(const std::shared_ptr<Connection>& conn, const FrameHeader& h,
                          std::span<const uint8_t> body) {
  const Request r{conn, *conn, h, body, static_cast<Opcode>(h.opcode), Clock::now()};
  if (r.op == Opcode::kHello) {
    ProtocolError(r.c, h, Status::InvalidArgument("hello sent twice"));
    return false;
  }
  // Counted on arrival: a client that has its reply finds its request in the metrics.
  metrics_.op_requests[h.opcode]->Increment();
  bool keep = true;
  switch (r.op) {
    case Opcode::kLookup:
      keep = HandleLookup(r);
      break;
    case Opcode::kReserve:
      keep = HandleReserve(r);
      break;
    case Opcode::kCommit:
    case Opcode::kAbort:
      keep = HandleCommitOrAbort(r);
      break;
    case Opcode::kPrepareLoad:
      keep = HandlePrepareLoad(r);
      break;
    case Opcode::kRelease:
      keep = HandleRelease(r);
      break;
    case Opcode::kStats:
      keep = HandleStats(r);
      break;
    case Opcode::kPing:
      keep = HandlePing(r);
      break;
    case Opcode::kDescribe:
      keep = HandleDescribe(r);
      break;
    case Opcode::kHello:
      break;
  }
  // A request that broke the protocol closed its connection and is not timed.
  if (!r.malformed) {
    metrics_.op_latency[h.opcode]->Observe(
        std::chrono::duration<double>(Clock::now() - r.started).count());
  }
  return keep;
}

bool Server::Impl::Reply(const Request& r, const Status& s, std::span<const uint8_t> fields) {
  if (!s.ok()) metrics_.request_errors.Increment();
  return Send(r.c, EncodeReply(r.h.opcode, r.h.request_id, s, fields));
}

bool Server::Impl::Malformed(const Request& r, const Status& s) {
  ProtocolError(r.c, r.h, s);
  r.malformed = true;
  return false;
}

void Server::Impl::BindForEvents(Connection& c, const std::vector<ChunkKey>& keys,
                                 const std::vector<ChunkKey>& derived) {
  if (!events_) return;
  for (size_t i = 0; i < keys.size(); ++i) {
    events_->Bind(c.events_group, keys[i], c.ns.rank, derived[i]);
  }
}

std::vector<ChunkKey> Server::Impl::Derive(Connection& c, const std::vector<ChunkKey>& keys) {
  std::vector<ChunkKey> out;
  out.reserve(keys.size());
  for (const ChunkKey& k : keys) out.push_back(c.deriver->Derive(k));
  return out;
}

Status Server::Impl::Allowance(Connection& c, size_t n, size_t* allowed) {
  const size_t quota = std::min<size_t>(SlotQuota(), c.window ? c.window->num_slots() : SIZE_MAX);
  AccountLocked(c);
  const size_t own = c.HeldLocked(), process = HeldByProcess(c.peer_pid);
  const size_t held = std::max(own, process);
  *allowed = held >= quota ? 0 : std::min(n, quota - held);
  if (*allowed < n) metrics_.quota_limited.Increment();
  if (n > 0 && *allowed == 0) {
    return Status::Rejected(fmt::format(
        "this client's process (pid {}) holds {} reserved or pinned slots over its "
        "connections ({} on this one), its limit (--max-client-slots); commit, abort or "
        "release some first",
        c.peer_pid, process, own));
  }
  return Status::Ok();
}

bool Server::Impl::HandleLookup(const Request& r) {
  Connection& c = r.c;
  auto keys = DecodeKeysRequest(r.body, options_.max_keys_per_request);
  if (!keys.ok()) return Malformed(r, keys.status());
  const LookupResult found = engine_->Lookup(Derive(c, *keys));
  return Reply(
      r, Status::Ok(),
      LookupReplyFields({static_cast<uint32_t>(found.total), static_cast<uint32_t>(found.memory)}));
}

bool Server::Impl::HandleReserve(const Request& r) {
  Connection& c = r.c;
  auto keys = DecodeKeysRequest(r.body, options_.max_keys_per_request);
  if (!keys.ok()) return Malformed(r, keys.status());
  size_t allowed;
  Status limited;
  {
    std::lock_guard lock(c.mu);
    limited = Allowance(c, keys->size(), &allowed);
    if (limited.ok()) {
      c.pending_reserves += allowed;  // counted until recorded below
      AccountLocked(c);
    }
  }
  if (!limited.ok()) return Reply(r, limited);
  keys->resize(allowed);  // a short reply, as when the pool is full
  auto derived = Derive(c, *keys);
  BindForEvents(c, *keys, derived);
  std::vector<SlotId> slots = engine_->ReserveSlots(derived);
  std::vector<SlotId> unused;  // pool slots with no window slot to hand out (see below)
  {
    std::lock_guard lock(c.mu);
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i] == kNoSlot) continue;
      const SlotId pool = slots[i];
      if (c.window) {
        // Always free (the allowance counts window slots); were it not, a shorter reply.
        const SlotId w = c.window->Take();
        if (w == kNoSlot) {
          for (size_t j = i; j < slots.size(); ++j) {
            if (slots[j] != kNoSlot) unused.push_back(slots[j]);
          }
          slots.resize(i);
          break;
        }
        slots[i] = w;
      }
      c.reservations[slots[i]] = {derived[i], r.started, pool};
    }
    c.pending_reserves -= allowed;
    AccountLocked(c);
  }
  if (!unused.empty()) engine_->AbortSlots(unused);
  return Reply(r, Status::Ok(), SlotsReplyFields(slots));
}

bool Server::Impl::HandleCommitOrAbort(const Request& r) {
  Connection& c = r.c;
  auto slots = DecodeSlotsRequest(r.body, options_.max_keys_per_request);
  if (!slots.ok()) return Malformed(r, slots.status());
  std::vector<ChunkKey> keys;
  std::vector<SlotId> valid, pool_slots;  // the client's slot numbers, and the pool's
  Status bad;
  Clock::time_point oldest = r.started;
  {
    std::lock_guard lock(c.mu);
    std::unordered_set<SlotId> seen;
    for (SlotId s : *slots) {
      if (s == kNoSlot) continue;
      auto it = c.reservations.find(s);
      if (it == c.reservations.end() || !seen.insert(s).second) {
        bad = Status::InvalidArgument(
            fmt::format("slot {} is not reserved by this connection (or its reservation "
                        "expired: --reservation-timeout-ms)",
                        s));
        break;
      }
      keys.push_back(it->second.key);
      valid.push_back(s);
      pool_slots.push_back(it->second.pool);
      oldest = std::min(oldest, it->second.since);
    }
    if (bad.ok()) {
      for (SlotId s : valid) c.reservations.erase(s);
      AccountLocked(c);
    }
  }
  if (!bad.ok()) return Reply(r, bad);
  if (c.window) {
    // The client's bytes enter the pool here; the window slots are free once copied.
    if (r.op == Opcode::kCommit) {
      const uint64_t n = engine_->options().chunk_bytes;
      for (size_t i = 0; i < valid.size(); ++i) {
        std::memcpy(engine_->SlotData(pool_slots[i]).data(), c.window->Data(valid[i], n).data(), n);
      }
    }
    std::lock_guard lock(c.mu);
    for (SlotId s : valid) c.window->Give(s);
  }
  valid = std::move(pool_slots);
  if (r.op == Opcode::kCommit) {
    engine_->CommitSlots(keys, valid);
    if (!valid.empty()) {
      metrics_.store_latency.Observe(std::chrono::duration<double>(Clock::now() - oldest).count());
    }
    return Reply(r, Status::Ok(), U32ReplyFields(static_cast<uint32_t>(valid.size())));
  } else {
    engine_->AbortSlots(valid);
    return Reply(r, Status::Ok());
  }
}

bool Server::Impl::HandlePrepareLoad(const Request& r) {
  Connection& c = r.c;
  auto keys = DecodeKeysRequest(r.body, options_.max_keys_per_request);
  if (!keys.ok()) return Malformed(r, keys.status());
  size_t allowed;
  Status limited;
  {
    std::lock_guard lock(c.mu);
    limited = Allowance(c, keys->size(), &allowed);
    if (limited.ok()) c.pending_pins += allowed;
    AccountLocked(c);
  }
  if (!limited.ok()) return Reply(r, limited);
  keys->resize(allowed);  // a partial hit beyond the limit: the client recomputes the rest
  const std::vector<ChunkKey> derived = Derive(c, *keys);
  BindForEvents(c, *keys, derived);  // a promotion from the file tier is announced in L1
  // Answered here when L1 alone holds the prefix (the common case, and the latency that
  // matters); else when the promotion from the file tier ends (or its deadline passes),
  // without holding up this connection's other requests.
  if (auto pinned = engine_->PrepareLoadFromMemory(derived)) {
    FinishPrepareLoad(r.conn, r.h.request_id, r.started, allowed, Status::Ok(), std::move(*pinned));
    return true;
  }
  auto handle = engine_->PrepareLoad(derived);
  if (!handle.ok()) {
    {
      std::lock_guard lock(c.mu);
      c.pending_pins -= allowed;
      AccountLocked(c);
    }
    return Reply(r, handle.status());
  }
  handle->OnDone([this, gate = completion_gate_, engine = engine_.get(), conn = r.conn,
                  id = r.h.request_id, started = r.started, allowed](const OpResult& done) {
    std::shared_lock lock(gate->mu);
    if (gate->open) {
      FinishPrepareLoad(conn, id, started, allowed, done.status, done.slots);
    } else {
      engine->Unpin(done.slots);
    }
  });
  return true;
}

bool Server::Impl::HandleRelease(const Request& r) {
  Connection& c = r.c;
  auto slots = DecodeSlotsRequest(r.body, options_.max_keys_per_request);
  if (!slots.ok()) return Malformed(r, slots.status());
  Status bad;
  {
    std::lock_guard lock(c.mu);
    std::unordered_map<SlotId, uint32_t> want;
    for (SlotId s : *slots) want[s]++;
    for (auto& [s, n] : want) {
      auto it = c.pins.find(s);
      if (it == c.pins.end() || it->second < n) {
        bad = Status::InvalidArgument(
            fmt::format("slot {} is not pinned by this connection ({} releases asked)", s, n));
        break;
      }
    }
    if (bad.ok()) {
      for (auto& [s, n] : want) {
        auto it = c.pins.find(s);
        c.pinned -= n;
        if ((it->second -= n) == 0) c.pins.erase(it);
      }
      AccountLocked(c);
    }
  }
  if (bad.ok()) {
    if (c.window) {
      std::lock_guard lock(c.mu);
      for (SlotId s : *slots) c.window->Give(s);
    } else {
      engine_->Unpin(*slots);
    }
  }
  return Reply(r, bad);
}

bool Server::Impl::HandleStats(const Request& r) {
  Status s = DecodeEmptyRequest(r.body);
  if (!s.ok()) return Malformed(r, s);
  return Reply(r, Status::Ok(), TextReplyFields(StatsJson(StatsView::kTenant, r.c.tenant)));
}

bool Server::Impl::HandleDescribe(const Request& r) {
  auto entries = DecodeDescribeRequest(r.body, options_.max_keys_per_request);
  if (!entries.ok()) return Malformed(r, entries.status());
  // Without KV-cache events the descriptors have no use: they are checked for framing only and
  // answered at once, so a client that describes need not know how the server runs. With them,
  // an invalid descriptor is counted and dropped: a describe never fails the client's store.
  if (events_) {
    for (const DescribeEntry& e : *entries) {
      (void)events_->Describe(r.c.events_group, e.key, e.descriptor);
    }
  }
  return Reply(r, Status::Ok());
}

bool Server::Impl::HandlePing(const Request& r) {
  Status s = DecodeEmptyRequest(r.body);
  if (!s.ok()) return Malformed(r, s);
  return Reply(r, Status::Ok());
}

void Server::Impl::FinishPrepareLoad(const std::shared_ptr<Connection>& conn, uint64_t request_id,
                                     Clock::time_point started, size_t asked, const Status& status,
                                     std::vector<SlotId> pinned) {
  Connection& c = *conn;
  const uint16_t opcode = static_cast<uint16_t>(Opcode::kPrepareLoad);
  // The slots the client is given: the pinned pool slots, or window slots they are copied into.
  std::vector<SlotId> slots;
  if (!c.window) {
    slots = std::move(pinned);
  } else if (!pinned.empty()) {
    {
      std::lock_guard lock(c.mu);
      // Free: this load's keys were counted in pending_pins against the window's size.
      for (size_t i = 0; i < pinned.size() && !c.closed; ++i) {
        SlotId w = c.window->Take();
        if (w == kNoSlot) break;
        slots.push_back(w);
      }
    }
    const uint64_t n = engine_->options().chunk_bytes;
    for (size_t i = 0; i < slots.size(); ++i) {
      std::memcpy(c.window->Data(slots[i], n).data(), engine_->SlotData(pinned[i]).data(), n);
    }
    engine_->Unpin(pinned);  // the client holds its copies, never the pool's slots
  }
  std::vector<uint8_t> frame;
  if (slots.empty() && !status.ok() && !status.IsNotFound()) {
    frame = EncodeReply(opcode, request_id, status);
  } else {
    PrepareLoadReply p;
    p.chunks = static_cast<uint32_t>(slots.size());
    p.slots = slots;
    frame = EncodeReply(opcode, request_id, Status::Ok(), PrepareLoadReplyFields(p));
  }
  bool closed = false;
  {
    std::lock_guard lock(c.mu);
    c.pending_pins -= asked;
    closed = c.closed;
    if (closed && c.window) {
      for (SlotId s : slots) c.window->Give(s);
    } else if (!closed) {
      for (SlotId s : slots) c.pins[s]++;
      c.pinned += slots.size();
    }
    AccountLocked(c);
  }
  // Observed before the reply leaves, so that a client that has it finds it counted.
  metrics_.load_latency.Observe(std::chrono::duration<double>(Clock::now() - started).count());
  if (!closed) {
    // If the reply does not reach the client, the connection thread releases c.pins at close.
    Send(c, frame);
  } else if (!c.window) {
    engine_->Unpin(slots);  // the client is gone: nobody will release these pins
  }
}

}  // namespace kvtier::server

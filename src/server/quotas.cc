// What each client process may hold of the pool: its slots counted over all its connections,
// and reservations taken back when not committed in time.
#include <spdlog/spdlog.h>

#include <algorithm>

#include "server/server_impl.h"

namespace kvtier::server {

size_t Server::Impl::ClientsPerProcess() const {
  if (options_.max_clients_per_process > 0) return options_.max_clients_per_process;
  // A quarter of all, but never fewer than 16 (a process may run several clients: a vLLM
  // scheduler and its lookups, tests, tools), nor more than all.
  return std::min<size_t>(options_.max_clients, std::max<size_t>(16, options_.max_clients / 4));
}

// Reservations older than the timeout are aborted: their pool slots (and window slots) go back.
// Called by the accept loop, which wakes at least once a second.
void Server::Impl::ExpireReservations(Clock::time_point now) {
  const auto timeout = options_.reservation_timeout;
  if (timeout.count() <= 0) return;
  std::vector<std::shared_ptr<Connection>> conns;
  {
    std::lock_guard lock(conns_mu_);
    conns.assign(conns_.begin(), conns_.end());
  }
  for (auto& conn : conns) {
    Connection& c = *conn;
    std::vector<SlotId> expired;
    {
      std::lock_guard lock(c.mu);
      if (c.closed) continue;  // its release on disconnect aborts them
      for (auto it = c.reservations.begin(); it != c.reservations.end();) {
        if (now - it->second.since < timeout) {
          ++it;
          continue;
        }
        expired.push_back(it->second.pool);
        if (c.window) c.window->Give(it->first);
        it = c.reservations.erase(it);
      }
      AccountLocked(c);
    }
    if (expired.empty()) continue;
    engine_->AbortSlots(expired);
    metrics_.reservations_expired.Increment(static_cast<double>(expired.size()));
    spdlog::warn("client {} (pid {}, {}): {} reserved slots not committed within {} ms; taken back",
                 c.id, c.peer_pid, c.name, expired.size(), timeout.count());
  }
}

void Server::Impl::AccountLocked(Connection& c) {
  const size_t now = c.HeldLocked();
  if (now == c.accounted) return;
  std::lock_guard lock(held_mu_);
  size_t& total = held_by_process_[c.peer_pid];
  total = total + now - c.accounted;
  if (total == 0) held_by_process_.erase(c.peer_pid);
  c.accounted = now;
}

size_t Server::Impl::HeldByProcess(pid_t pid) {
  std::lock_guard lock(held_mu_);
  auto it = held_by_process_.find(pid);
  return it == held_by_process_.end() ? 0 : it->second;
}

size_t Server::Impl::SlotQuota() const {
  const size_t slots = engine_->pool().num_slots;
  if (options_.max_slots_per_client > 0) return options_.max_slots_per_client;
  return std::max<size_t>(1, slots / 2);
}

}  // namespace kvtier::server

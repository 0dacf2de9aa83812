// One client connection of the server, and the thread that writes what connections' sockets did
// not take at once (see server.h for how the server uses them).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "kvtier/chunk_key.h"
#include "kvtier/eviction.h"
#include "kvtier/status.h"
#include "server/client_window.h"
#include "server/server.h"

namespace prometheus {
class Counter;
}  // namespace prometheus

namespace kvtier::server {

using Clock = std::chrono::steady_clock;

struct Connection;

// Writes what connections' sockets did not take at once, for every connection, from one thread
// (epoll, one-shot EPOLLOUT), and drops a connection whose queued output stays unwritten for
// send_timeout: a client that does not read its replies never blocks a thread of the server.
class OutputPump {
 public:
  OutputPump(std::chrono::milliseconds timeout, prometheus::Counter* dropped)
      : timeout_(timeout), dropped_(dropped) {}
  ~OutputPump() { Stop(); }
  Status Start();
  void Stop();
  // Arms EPOLLOUT for `c`. REQUIRES: c->out_mu held, c->out_closed false.
  void Watch(const std::shared_ptr<Connection>& c);
  // Stops watching `c` (before its fd is closed). REQUIRES: c.out_mu held.
  void Forget(Connection& c);

 private:
  void Run();

  const std::chrono::milliseconds timeout_;
  prometheus::Counter* const dropped_;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  std::mutex mu_;  // after Connection::out_mu in lock order
  std::unordered_map<uint64_t, std::weak_ptr<Connection>> watched_;
};

// The memory of isolated clients' windows, all connections together (ServerOptions::
// max_window_bytes): a window is sized within what is left, so the bound holds however many
// connect.
struct WindowBudget {
  std::mutex mu;
  uint64_t used = 0;
};

// One client connection.
//
// Before its hello is accepted a connection belongs to the door thread alone (`in`,
// `hello_deadline`). After, state under `mu` is shared between the connection's thread, the
// engine threads that end slow prepare_loads (OnDone) and the stats walk; `mu` is never held across
// I/O. Output goes through SendFrame(): frames are written without blocking, in order, and what the
// socket does not take is queued under `out_mu` for the OutputPump; once `out_closed` is set
// nothing is written and `fd` may be closed.
struct Connection : std::enable_shared_from_this<Connection> {
  uint64_t id = 0;
  int fd = -1;
  pid_t peer_pid = 0;
  uid_t peer_uid = 0;
  bool peer_known = false;  // SO_PEERCRED answered (else peer_uid means nothing)
  std::string name;         // printable UTF-8 (checked at hello)
  KeyNamespace ns;
  // KV-cache events: the group (the namespace without its rank, and the tenant) whose chunks
  // this connection's keys name; set at hello when events are on.
  uint64_t events_group = 0;
  // Under isolate_clients: "uid:<uid>" or "tenant:<name>", set at hello by the server alone.
  // Empty with the shared pool, where every client is of one trust domain.
  std::string tenant;
  std::unique_ptr<KeyDeriver> deriver;  // connection thread only
  std::thread thread;
  std::atomic<bool> finished{false};

  // Door thread only, before the handshake.
  std::vector<uint8_t> in;
  Clock::time_point hello_deadline;

  std::mutex mu;
  bool closed = false;
  bool handshaken = false;
  struct Reservation {
    ChunkKey key;
    Clock::time_point since;
    SlotId pool = kNoSlot;  // the pool slot behind a window slot (isolated clients)
  };
  // Keyed by the slot numbers the client uses: pool slots, or window slots when isolated.
  std::unordered_map<SlotId, Reservation> reservations;
  std::unordered_map<SlotId, uint32_t> pins;
  // Isolated clients (ServerOptions::isolate_clients): what the client maps instead of the pool.
  // Set at hello; its free list is guarded by `mu`. Pinned window slots hold no pool pin.
  std::unique_ptr<ClientWindow> window;
  size_t pinned = 0;            // sum of pins
  size_t pending_pins = 0;      // keys of prepare_loads not yet answered (they may all pin)
  size_t pending_reserves = 0;  // slots a reserve was allowed and has not recorded yet
  size_t accounted = 0;         // HeldLocked() as last added to the process's total (AccountLocked)
  // The window's bytes, charged against ServerOptions::max_window_bytes while it exists.
  std::shared_ptr<WindowBudget> window_budget;
  uint64_t window_charge = 0;

  std::mutex out_mu;
  bool out_closed = false;
  bool out_armed = false;  // registered with the pump's epoll set
  std::vector<uint8_t> out;
  size_t out_begin = 0;
  Clock::time_point out_since;  // when the oldest queued byte was queued

  // Slots this connection holds or may soon hold. REQUIRES: mu held.
  size_t HeldLocked() const {
    return reservations.size() + pinned + pending_pins + pending_reserves;
  }
  ~Connection();

  // Writes what is queued without blocking. False if the connection broke (it is then shut down).
  // REQUIRES: out_mu held, !out_closed.
  bool FlushLocked();
  // The connection thread sees EOF and cleans up. REQUIRES: out_mu held.
  void DropLocked();
};

// Writes (or queues) one frame to `c`; `pass_fd` >= 0 rides on its first byte (SCM_RIGHTS). What
// the socket does not take is queued for `pump`; a client with more than `max_output_bytes` of
// replies unread is dropped (counted in `dropped_slow`). False if the connection is closed or
// was just dropped.
bool SendFrame(Connection& c, const std::vector<uint8_t>& frame, int pass_fd,
               uint64_t max_output_bytes, OutputPump& pump, prometheus::Counter& dropped_slow);

}  // namespace kvtier::server

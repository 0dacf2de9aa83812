// Server::Impl, shared by the server's source files (private to src/server):
//   server.cc     lifecycle: options, start, drain
//   socket.cc     the Unix socket            http_listener.cc  /metrics, /healthz, /stats
//   handshake.cc  the door thread, hellos    session.cc        a connection's thread, replies
//   handlers.cc   one handler per opcode     quotas.cc         per-process slot limits, expiry
//   metrics.cc    Prometheus and /stats      connection.cc     a connection, the output pump
#pragma once

#include <atomic>
#include <condition_variable>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "server/codec.h"
#include "server/connection.h"
#include "server/http_listener.h"
#include "server/metrics.h"
#include "server/server.h"
#include "server/tenants.h"

namespace kvtier::server {

class Server::Impl {
 public:
  explicit Impl(const ServerOptions& o) : options_(o), pump_(o.send_timeout, slow_drops_) {}
  ~Impl();

  Status Init();
  void Stop();
  void Wait() {
    std::unique_lock lock(stop_mu_);
    stop_cv_.wait(lock, [this] { return stopped_; });
  }
  // Who asks for the statistics: the operator (in-process) sees every client; HTTP /stats is
  // open to every local user and, under isolate_clients, lists none (a count only); a client's
  // `stats` lists the clients of its own tenant only. Without isolate_clients every view lists
  // every client: the shared pool is one trust domain.
  enum class StatsView { kOperator, kHttp, kTenant };
  std::string StatsJson(StatsView view = StatsView::kOperator, std::string_view tenant = {}) const;
  std::string MetricsText() const;

  int http_port() const { return http_ ? http_->port() : -1; }

  ServerOptions options_;
  std::unique_ptr<Engine> engine_;

 private:
  // One request being handled: by Handle, then by the handler of its opcode.
  struct Request {
    const std::shared_ptr<Connection>& conn;
    Connection& c;
    const FrameHeader& h;
    std::span<const uint8_t> body;
    Opcode op;
    Clock::time_point started;
    mutable bool malformed = false;  // it broke the protocol (see Malformed)
  };

  // The door thread: accepts connections, reads and answers their hellos, closes silent ones,
  // and starts a thread for each accepted handshake.
  void AcceptLoop();
  void AcceptNew(std::list<std::shared_ptr<Connection>>& pending, Clock::time_point* backoff);
  // Reads what a pending connection sent; false when it is done with (handed to its thread or
  // closed).
  bool ReadHello(const std::shared_ptr<Connection>& conn);
  void ReapFinished(bool all);
  void Serve(std::shared_ptr<Connection> conn, std::vector<uint8_t> hello_reply);
  // Reads one frame into conn's buffer; returns false on EOF, error or a protocol violation
  // (after replying).
  bool ReadFrame(Connection& c, std::vector<uint8_t>& buf, size_t& begin, size_t& end,
                 FrameHeader* header, std::span<const uint8_t>* body);
  // Handles one request; false closes the connection.
  bool Handle(const std::shared_ptr<Connection>& conn, const FrameHeader& h,
              std::span<const uint8_t> body);
  // The handlers, one per opcode (commit and abort share one): each answers its request and
  // returns false to close the connection.
  bool HandleLookup(const Request& r);
  bool HandleReserve(const Request& r);
  bool HandleCommitOrAbort(const Request& r);
  bool HandlePrepareLoad(const Request& r);
  bool HandleRelease(const Request& r);
  bool HandleStats(const Request& r);
  bool HandlePing(const Request& r);
  bool HandleDescribe(const Request& r);
  // Answers `r` (an error reply is counted); false if the connection is gone.
  bool Reply(const Request& r, const Status& s, std::span<const uint8_t> fields = {});
  // Answers a request that broke the protocol; returns false (the connection is closed).
  bool Malformed(const Request& r, const Status& s);
  // The keys the engine stores for a client's keys (its namespace's, or its tenant's).
  std::vector<ChunkKey> Derive(Connection& c, const std::vector<ChunkKey>& keys);
  // KV-cache events: tells the publisher which client chunk (and rank) each derived key is.
  void BindForEvents(Connection& c, const std::vector<ChunkKey>& keys,
                     const std::vector<ChunkKey>& derived);
  // How many of `n` new slots `c` may take: reservations and pins are capped per client
  // process, over all its connections (two connections of one process took the whole pool when
  // the cap was per connection), and an isolated connection's by its window. An error when
  // none. REQUIRES: c.mu held.
  Status Allowance(Connection& c, size_t n, size_t* allowed);
  // Checks a hello; on success starts the connection's thread (which sends the reply) and
  // returns true. On failure it has replied with the reason.
  bool HandleHello(const std::shared_ptr<Connection>& conn, const FrameHeader& h,
                   std::span<const uint8_t> body, std::vector<uint8_t> rest);
  // Why a hello is refused: what the client is told, and the reason counted in
  // kvtier_handshakes_refused_total.
  struct Refusal {
    Status status;
    const char* reason;
  };
  // What the client declares (names, version, token, namespace, chunk size), and under
  // isolate_clients which tenant it is (*tenant; left empty otherwise).
  std::optional<Refusal> CheckHello(Connection& c, const HelloRequest& hello,
                                    std::string* tenant) const;
  // Under isolate_clients: the connection's private window, within the windows' memory bound.
  std::optional<Refusal> OpenWindow(Connection& c, HelloReply* reply);
  // The limits on connections, all and per process. REQUIRES: conns_mu_ held.
  std::optional<Refusal> AdmitLocked(const Connection& c) const;
  void FinishPrepareLoad(const std::shared_ptr<Connection>& conn, uint64_t request_id,
                         Clock::time_point started, size_t asked, const Status& status,
                         std::vector<SlotId> pinned);
  // Writes (or queues) one frame; `pass_fd` >= 0 rides on its first byte (SCM_RIGHTS). False if
  // the connection is closed or was just dropped for not reading its replies.
  bool Send(Connection& c, const std::vector<uint8_t>& frame, int pass_fd = -1);
  // Closes a connection that never got a thread.
  void ClosePending(Connection& c);
  void Release(Connection& c);
  void Refuse(Connection& c, const FrameHeader& h, const Status& s, const char* reason);
  void ProtocolError(Connection& c, const FrameHeader& h, const Status& s);
  size_t SlotQuota() const;
  size_t ClientsPerProcess() const;
  // Brings the connection's process's count of held slots up to date with HeldLocked() (a
  // process's connections share one slot limit). REQUIRES: c.mu held; call after every change.
  void AccountLocked(Connection& c);
  size_t HeldByProcess(pid_t pid);
  void ExpireReservations(Clock::time_point now);

  Metrics metrics_;
  // Looked up once: every reply passes it to SendFrame.
  prometheus::Counter* const slow_drops_ = metrics_.dropped_by.at("slow");
  OutputPump pump_;
  TenantTokens tenant_tokens_;
  // Slow prepare_loads (file-tier promotions) are answered from the engine's completion
  // callbacks, with no thread parked per operation. Stop closes the gate: a callback that comes
  // later only gives its pins back, since the members a reply needs may be gone by then.
  struct CompletionGate {
    std::shared_mutex mu;
    bool open = true;
  };
  std::shared_ptr<CompletionGate> completion_gate_ = std::make_shared<CompletionGate>();
  int listen_fd_ = -1;
  bool socket_bound_ = false;  // we created the socket file (and so may remove it)
  int wake_fd_ = -1;
  std::thread accept_thread_;
  std::atomic<bool> stopping_{false};
  std::atomic<uint64_t> next_id_{1};
  bool accept_failing_ = false;  // door thread only: an accept error was logged

  mutable std::mutex conns_mu_;
  // Slots held (reserved or pinned) by each client process, over all its connections. Locked
  // after a connection's mu, never before.
  std::mutex held_mu_;
  std::unordered_map<pid_t, size_t> held_by_process_;
  std::shared_ptr<WindowBudget> window_budget_ = std::make_shared<WindowBudget>();
  std::list<std::shared_ptr<Connection>> conns_;  // past the handshake

  std::unique_ptr<HttpListener> http_;
  // KV-cache events (options_.kv_events); null when off. The tiers hold it as their listener.
  std::shared_ptr<events::Publisher> events_;

  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_started_ = false;
  bool stopped_ = false;
  Clock::time_point started_at_ = Clock::now();
};

}  // namespace kvtier::server

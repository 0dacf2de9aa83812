#include "server/server.h"

#include <arpa/inet.h>
#include <cpp-httplib/httplib.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <grp.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <poll.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <list>
#include <mutex>
#include <nlohmann/json.hpp>
#include <shared_mutex>
#include <sstream>
#include <system_error>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "common/sha256.h"
#include "common/task_pool.h"
#include "kvtier/client.h"
#include "server/client_window.h"
#include "server/codec.h"

namespace kvtier::server {

using Clock = std::chrono::steady_clock;

KeyNamespace ServerNamespace(uint64_t chunk_bytes) {
  KeyNamespace ns;
  ns.model_id = "kvtier-server/v1";
  ns.layout_fingerprint = chunk_bytes;
  ns.chunk_tokens = 1;
  return ns;
}

// SHA-256(ns_root || tag padded to 32 bytes || client key). The first 64 bytes are one SHA-256
// block, so its state is computed once per connection and copied for every key. The copy is a
// struct assignment: EVP_MD_CTX_copy_ex allocates and frees a context per key (OpenSSL 3.0), which
// doubled the cost of a derivation (128 against 60 ns) and is paid 16 times per 16-key lookup.
// SHA256_Init/Update/Final are deprecated in OpenSSL 3 in favour of EVP, but only they let a hash
// state be copied as a plain struct.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
struct KeyDeriver::State {
  SHA256_CTX prefix;
};

KeyDeriver::KeyDeriver(const KeyNamespace& ns) : KeyDeriver(ns.Root()) {}

KeyDeriver::KeyDeriver(const ChunkKey& root) : state_(std::make_unique<State>()) {
  uint8_t block[64] = {};
  std::memcpy(block, root.data(), 32);
  static constexpr char kTag[] = "kvtier/server-key/v1";
  std::memcpy(block + 32, kTag, sizeof(kTag) - 1);
  SHA256_Init(&state_->prefix);
  SHA256_Update(&state_->prefix, block, sizeof(block));
}

KeyDeriver::~KeyDeriver() = default;

ChunkKey KeyDeriver::Derive(const ChunkKey& client_key) {
  SHA256_CTX work = state_->prefix;
  SHA256_Update(&work, client_key.data(), ChunkKey::kSize);
  std::array<uint8_t, 32> out;
  SHA256_Final(out.data(), &work);
  return ChunkKey(out);
}
#pragma GCC diagnostic pop

namespace {
std::array<uint8_t, 32> Sha256Of(std::string_view s) {
  Sha256 h;
  h.Update(s.data(), s.size());
  return h.Final();
}
}  // namespace

ChunkKey TenantRoot(const KeyNamespace& ns, std::string_view tenant) {
  Sha256 h;
  h.UpdateString("kvtier/tenant/v1");
  h.UpdateString(tenant);
  h.Update(ns.Root().data(), ChunkKey::kSize);
  return ChunkKey(h.Final());
}

namespace {

// Valid UTF-8 with no control characters: what a client may put in the names that end up in
// logs and JSON documents.
bool IsPrintableUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<unsigned char>(s[i]);
    if (b < 0x80) {
      if (b < 0x20 || b == 0x7F) return false;
      ++i;
      continue;
    }
    size_t n;
    uint32_t cp;
    if ((b & 0xE0) == 0xC0) {
      n = 2, cp = b & 0x1F;
    } else if ((b & 0xF0) == 0xE0) {
      n = 3, cp = b & 0x0F;
    } else if ((b & 0xF8) == 0xF0) {
      n = 4, cp = b & 0x07;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      const auto c = static_cast<unsigned char>(s[i + k]);
      if ((c & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (c & 0x3F);
    }
    static constexpr uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    if (cp >= 0x80 && cp < 0xA0) return false;  // C1 controls
    i += n;
  }
  return true;
}

// `s` for a log line: bytes that are control characters or not printable UTF-8 become \xNN, so
// a client-chosen string can neither break a line nor forge one.
std::string LogSafe(std::string_view s) {
  if (IsPrintableUtf8(s)) return std::string(s);
  std::string out;
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7F && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      out += fmt::format("\\x{:02x}", c);
    }
  }
  return out;
}

prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  // 5 us .. ~10 s, x2.5 per bucket.
  prometheus::Histogram::BucketBoundaries b;
  for (double v = 5e-6; v < 12; v *= 2.5) b.push_back(v);
  return b;
}

}  // namespace

// Prometheus metrics kept by the server itself; the engine's counters are read at scrape time.
struct Metrics {
  Metrics()
      : registry(std::make_shared<prometheus::Registry>()),
        requests(prometheus::BuildCounter()
                     .Name("kvtier_rpc_requests_total")
                     .Help("Protocol requests received, by operation")
                     .Register(*registry)),
        rpc_latency(prometheus::BuildHistogram()
                        .Name("kvtier_rpc_latency_seconds")
                        .Help("Server-side handling time of a request, by operation")
                        .Register(*registry)),
        load_latency(
            prometheus::BuildHistogram()
                .Name("kvtier_load_latency_seconds")
                .Help("prepare_load: request received to chunks pinned and the reply ready")
                .Register(*registry)
                .Add({}, LatencyBuckets())),
        store_latency(prometheus::BuildHistogram()
                          .Name("kvtier_store_latency_seconds")
                          .Help("Store: slots reserved to slots committed (includes the "
                                "client's copy)")
                          .Register(*registry)
                          .Add({}, LatencyBuckets())),
        connected(prometheus::BuildGauge()
                      .Name("kvtier_connected_clients")
                      .Help("Client connections open now")
                      .Register(*registry)
                      .Add({})),
        connections(prometheus::BuildCounter()
                        .Name("kvtier_connections_total")
                        .Help("Client connections accepted")
                        .Register(*registry)
                        .Add({})),
        refused(prometheus::BuildCounter()
                    .Name("kvtier_handshakes_refused_total")
                    .Help("Handshakes refused, by reason")
                    .Register(*registry)),
        protocol_errors(prometheus::BuildCounter()
                            .Name("kvtier_protocol_errors_total")
                            .Help("Connections closed for a malformed, oversized or "
                                  "out-of-order message")
                            .Register(*registry)
                            .Add({})),
        request_errors(prometheus::BuildCounter()
                           .Name("kvtier_request_errors_total")
                           .Help("Requests answered with an error (connection kept)")
                           .Register(*registry)
                           .Add({})),
        released_on_disconnect(prometheus::BuildCounter()
                                   .Name("kvtier_released_on_disconnect_total")
                                   .Help("Pins and reservations released because their "
                                         "connection closed")
                                   .Register(*registry)
                                   .Add({})),
        dropped(prometheus::BuildCounter()
                    .Name("kvtier_connections_dropped_total")
                    .Help("Connections closed by the server, by reason (slow: replies left "
                          "unread; no_thread: no thread could be started for it)")
                    .Register(*registry)),
        accept_errors(prometheus::BuildCounter()
                          .Name("kvtier_accept_errors_total")
                          .Help("accept() failures (e.g. out of file descriptors)")
                          .Register(*registry)
                          .Add({})),
        quota_limited(prometheus::BuildCounter()
                          .Name("kvtier_quota_limited_total")
                          .Help("reserve/prepare_load requests cut short by the per-client "
                                "slot quota")
                          .Register(*registry)
                          .Add({})),
        reservations_expired(prometheus::BuildCounter()
                                 .Name("kvtier_reservations_expired_total")
                                 .Help("Reserved slots taken back, not committed within "
                                       "--reservation-timeout-ms")
                                 .Register(*registry)
                                 .Add({})) {
    for (uint16_t op = 1; op <= kMaxOpcode; ++op) {
      std::string name(OpcodeName(op));
      op_requests[op] = &requests.Add({{"op", name}});
      op_latency[op] = &rpc_latency.Add({{"op", name}}, LatencyBuckets());
    }
    for (const char* reason :
         {"version", "token", "namespace", "chunk_size", "draining", "too_many_clients", "bad_name",
          "no_thread", "hello_timeout", "too_many_pending", "no_window", "too_many_from_process",
          "no_window_memory", "no_credentials"}) {
      refused_by[reason] = &refused.Add({{"reason", reason}});
    }
    for (const char* reason : {"slow", "no_thread"}) {
      dropped_by[reason] = &dropped.Add({{"reason", reason}});
    }
  }

  std::shared_ptr<prometheus::Registry> registry;
  prometheus::Family<prometheus::Counter>& requests;
  prometheus::Family<prometheus::Histogram>& rpc_latency;
  prometheus::Histogram& load_latency;
  prometheus::Histogram& store_latency;
  prometheus::Gauge& connected;
  prometheus::Counter& connections;
  prometheus::Family<prometheus::Counter>& refused;
  prometheus::Counter& protocol_errors;
  prometheus::Counter& request_errors;
  prometheus::Counter& released_on_disconnect;
  prometheus::Family<prometheus::Counter>& dropped;
  prometheus::Counter& accept_errors;
  prometheus::Counter& quota_limited;
  prometheus::Counter& reservations_expired;
  std::unordered_map<std::string, prometheus::Counter*> dropped_by;
  prometheus::Counter* op_requests[kMaxOpcode + 1] = {};
  prometheus::Histogram* op_latency[kMaxOpcode + 1] = {};
  std::unordered_map<std::string, prometheus::Counter*> refused_by;
};

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

// One client connection.
//
// Before its hello is accepted a connection belongs to the door thread alone (`in`,
// `hello_deadline`). After, state under `mu` is shared between the connection's thread, the
// engine threads that end slow prepare_loads (OnDone) and the stats walk; `mu` is never held across
// I/O. Output goes through Send(): frames are written without blocking, in order, and what the
// socket does not take is queued under `out_mu` for the OutputPump; once `out_closed` is set
// nothing is written and `fd` may be closed.
// The memory of isolated clients' windows, all connections together (ServerOptions::
// max_window_bytes): a window is sized within what is left, so the bound holds however many
// connect.
struct WindowBudget {
  std::mutex mu;
  uint64_t used = 0;
};

struct Connection : std::enable_shared_from_this<Connection> {
  uint64_t id = 0;
  int fd = -1;
  pid_t peer_pid = 0;
  uid_t peer_uid = 0;
  bool peer_known = false;  // SO_PEERCRED answered (else peer_uid means nothing)
  std::string name;         // printable UTF-8 (checked at hello)
  KeyNamespace ns;
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
  size_t pinned = 0;        // sum of pins
  size_t pending_pins = 0;  // keys of prepare_loads not yet answered (they may all pin)
  size_t pending_reserves = 0;  // slots a reserve was allowed and has not recorded yet
  size_t accounted = 0;  // HeldLocked() as last added to the process's total (AccountLocked)
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
  bool FlushLocked() {
    while (out_begin < out.size()) {
      ssize_t w =
          ::send(fd, out.data() + out_begin, out.size() - out_begin, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w > 0) {
        out_begin += static_cast<size_t>(w);
        continue;
      }
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (out_begin > out.size() / 2) {  // the buffer stays under twice what is queued
          out.erase(out.begin(), out.begin() + static_cast<ptrdiff_t>(out_begin));
          out_begin = 0;
        }
        return true;
      }
      DropLocked();
      return false;
    }
    out.clear();
    out_begin = 0;
    return true;
  }
  // The connection thread sees EOF and cleans up. REQUIRES: out_mu held.
  void DropLocked() {
    if (out_closed) return;
    out_closed = true;
    ::shutdown(fd, SHUT_RDWR);
  }
};

Connection::~Connection() {
  if (window_budget) {
    std::lock_guard lock(window_budget->mu);
    window_budget->used -= window_charge;
  }
}

Status OutputPump::Start() {
  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0) return Status::FromErrno(errno, "epoll_create1");
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) return Status::FromErrno(errno, "eventfd");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;  // connection ids start at 1
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev) != 0) {
    return Status::FromErrno(errno, "epoll_ctl");
  }
  thread_ = std::thread([this] { Run(); });
  return Status::Ok();
}

void OutputPump::Stop() {
  stopping_ = true;
  if (wake_fd_ >= 0) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t w = ::write(wake_fd_, &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
  if (epoll_fd_ >= 0) ::close(epoll_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
  epoll_fd_ = wake_fd_ = -1;
}

void OutputPump::Watch(const std::shared_ptr<Connection>& c) {
  epoll_event ev{};
  ev.events = EPOLLOUT | EPOLLONESHOT;
  ev.data.u64 = c->id;
  {
    std::lock_guard lock(mu_);
    watched_[c->id] = c;
  }
  if (::epoll_ctl(epoll_fd_, c->out_armed ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, c->fd, &ev) != 0) {
    c->DropLocked();
    return;
  }
  c->out_armed = true;
}

void OutputPump::Forget(Connection& c) {
  if (c.out_armed && c.fd >= 0) ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c.fd, nullptr);
  c.out_armed = false;
  std::lock_guard lock(mu_);
  watched_.erase(c.id);
}

void OutputPump::Run() {
  epoll_event events[64];
  while (!stopping_) {
    int n = ::epoll_wait(epoll_fd_, events, 64, 250);
    std::vector<std::shared_ptr<Connection>> ready;
    {
      std::lock_guard lock(mu_);
      for (int i = 0; i < n; ++i) {
        auto it = watched_.find(events[i].data.u64);
        if (it == watched_.end()) continue;
        if (auto c = it->second.lock()) ready.push_back(std::move(c));
      }
    }
    for (auto& c : ready) {
      std::lock_guard lock(c->out_mu);
      if (c->out_closed) continue;
      if (c->FlushLocked() && !c->out.empty()) Watch(c);
    }
    // Deadlines: a client whose replies sit unread for timeout_ is dropped.
    std::vector<std::shared_ptr<Connection>> all;
    {
      std::lock_guard lock(mu_);
      for (auto it = watched_.begin(); it != watched_.end();) {
        auto c = it->second.lock();
        if (!c) {
          it = watched_.erase(it);
          continue;
        }
        all.push_back(std::move(c));
        ++it;
      }
    }
    const auto now = Clock::now();
    for (auto& c : all) {
      std::lock_guard lock(c->out_mu);
      if (c->out_closed || c->out.empty() || now - c->out_since < timeout_) continue;
      spdlog::warn(
          "dropping client {} (pid {}, \"{}\"): it left {} bytes of replies unread for "
          "{} ms",
          c->id, c->peer_pid, c->name, c->out.size() - c->out_begin, timeout_.count());
      dropped_->Increment();
      c->DropLocked();
    }
  }
}

class Server::Impl {
 public:
  explicit Impl(const ServerOptions& o)
      : options_(o), pump_(o.send_timeout, metrics_.dropped_by.at("slow")) {}
  ~Impl() {
    Stop();
    if (listen_fd_ >= 0) ::close(listen_fd_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
  }

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

  ServerOptions options_;
  std::unique_ptr<Engine> engine_;
  int http_port_ = -1;

 private:
  Status CheckSocketPath();
  Status BindSocket();
  Status StartHttp();
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
  // Checks a hello; on success starts the connection's thread (which sends the reply) and
  // returns true. On failure it has replied with the reason.
  bool HandleHello(const std::shared_ptr<Connection>& conn, const FrameHeader& h,
                   std::span<const uint8_t> body, std::vector<uint8_t> rest);
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
  // The tenant whose token `token` is, or nullptr. Every entry is compared, in constant time,
  // so the time taken tells nothing about which entry (if any) came close.
  const std::string* TenantOfToken(std::string_view token) const;
  void ExpireReservations(Clock::time_point now);

  Metrics metrics_;
  OutputPump pump_;
  // options_.tenant_tokens as (tenant, SHA-256 of the token): equal-length values to compare.
  struct TenantDigest {
    std::string tenant;
    std::array<uint8_t, 32> digest;
  };
  std::vector<TenantDigest> tenant_digests_;
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

  std::unique_ptr<httplib::Server> http_;
  std::thread http_thread_;
  std::atomic<bool> http_thread_done_{false};

  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_started_ = false;
  bool stopped_ = false;
  Clock::time_point started_at_ = Clock::now();
};

namespace {
bool IsListenAddress(const std::string& host) {
  if (host == "localhost") return true;
  in6_addr a6;
  in_addr a4;
  return ::inet_pton(AF_INET, host.c_str(), &a4) == 1 ||
         ::inet_pton(AF_INET6, host.c_str(), &a6) == 1;
}
}  // namespace

Status Server::Impl::Init() {
  if (options_.socket_path.empty()) return Status::InvalidArgument("server: socket path is empty");
  if (options_.max_clients < 1) return Status::InvalidArgument("server: max_clients must be >= 1");
  if (options_.max_message_bytes < 1024 || options_.max_message_bytes > (64u << 20)) {
    return Status::InvalidArgument("server: max_message_bytes must be in [1 KiB, 64 MiB]");
  }
  if (options_.max_keys_per_request < 1 ||
      options_.max_keys_per_request * 32ull + 64 > options_.max_message_bytes) {
    return Status::InvalidArgument(
        "server: max_keys_per_request must be >= 1 and fit in max_message_bytes");
  }
  if (options_.http_threads < 1 || options_.http_threads > 256) {
    return Status::InvalidArgument("server: http_threads must be in [1, 256]");
  }
  if (options_.http_port >= 0 && !IsListenAddress(options_.http_host)) {
    // A name would be resolved (a DNS wait at start-up, or an address of another host).
    return Status::InvalidArgument(fmt::format(
        "server: HTTP host \"{}\" is not an address: give a numeric IPv4 or IPv6 address of this "
        "host (127.0.0.1, ::1, 0.0.0.0 for every interface) or localhost",
        options_.http_host));
  }
  if (options_.max_pending_handshakes < 1) {
    return Status::InvalidArgument("server: max_pending_handshakes must be >= 1");
  }
  if (options_.hello_timeout.count() < 1 || options_.send_timeout.count() < 1) {
    return Status::InvalidArgument("server: hello_timeout and send_timeout must be positive");
  }
  if (options_.max_output_bytes < options_.max_message_bytes) {
    return Status::InvalidArgument("server: max_output_bytes must be >= max_message_bytes");
  }
  if (!options_.tenant_tokens.empty()) {
    if (!options_.isolate_clients) {
      return Status::InvalidArgument(
          "server: tenant tokens need isolate_clients (with the shared pool every client can "
          "read and write every chunk: there are no tenants to tell apart)");
    }
    if (!options_.token.empty()) {
      return Status::InvalidArgument(
          "server: a shared token and tenant tokens exclude each other (with tenant tokens a "
          "client presents its tenant's token)");
    }
    std::unordered_set<std::string> seen;
    for (const auto& t : options_.tenant_tokens) {
      if (t.tenant.empty() || t.token.empty() || !IsPrintableUtf8(t.tenant)) {
        return Status::InvalidArgument(
            "server: a tenant token needs a printable tenant name and a non-empty token");
      }
      if (!seen.insert(t.token).second) {
        return Status::InvalidArgument(fmt::format(
            "server: tenants \"{}\" and another share a token; each token names one tenant",
            t.tenant));
      }
      tenant_digests_.push_back({t.tenant, Sha256Of(t.token)});
    }
  }
  // Refuse a socket path in use before allocating the pool.
  KVTIER_RETURN_IF_ERROR(CheckSocketPath());
  EngineOptions eo = options_.engine;
  eo.ns = ServerNamespace(eo.chunk_bytes);
  auto engine = Engine::Open(eo);
  if (!engine.ok()) return engine.status();
  engine_ = std::move(engine).value();
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) return Status::FromErrno(errno, "eventfd");
  KVTIER_RETURN_IF_ERROR(pump_.Start());
  KVTIER_RETURN_IF_ERROR(BindSocket());
  Status http = StartHttp();
  if (!http.ok()) return http;  // the destructor removes the socket file
  accept_thread_ = std::thread([this] { AcceptLoop(); });
  return Status::Ok();
}

namespace {
Result<sockaddr_un> SocketAddress(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return Status::InvalidArgument(
        fmt::format("socket path \"{}\" is too long ({} bytes, at most {})", path, path.size(),
                    sizeof(addr.sun_path) - 1));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  return addr;
}
}  // namespace

// The default socket's directory when $XDG_RUNTIME_DIR is unset: /tmp is writable by everyone,
// so the socket lives in a directory only we can write to, created here if needed. Anything else
// at that name (another user's directory, a symlink, a directory others may write to) is
// refused: whoever controls the directory could bind the socket first and collect clients'
// tokens.
static Status EnsurePrivateSocketDir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return Status::FromErrno(errno, fmt::format("creating the socket directory \"{}\"", dir));
  }
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0) {
    return Status::FromErrno(errno, fmt::format("checking the socket directory \"{}\"", dir));
  }
  if (!S_ISDIR(st.st_mode) || st.st_uid != ::getuid() || (st.st_mode & 022) != 0) {
    return Status::PermissionDenied(fmt::format(
        "socket directory \"{}\" is not a directory owned by this user (uid {}) and writable "
        "only by it; remove it or choose --socket",
        dir, ::getuid()));
  }
  return Status::Ok();
}

// A live server at the path is an error; a stale socket file (its server died) is removed.
Status Server::Impl::CheckSocketPath() {
  const std::string& path = options_.socket_path;
  KVTIER_ASSIGN_OR_RETURN(sockaddr_un addr, SocketAddress(path));
  if (const std::string dir = PrivateSocketDir(); path.rfind(dir + "/", 0) == 0) {
    KVTIER_RETURN_IF_ERROR(EnsurePrivateSocketDir(dir));
  }
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return Status::Ok();
  if (!S_ISSOCK(st.st_mode)) {
    return Status::InvalidArgument(
        fmt::format("socket path \"{}\" exists and is not a socket; refusing to replace it", path));
  }
  int probe = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int rc = ::connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int err = errno;
  ::close(probe);
  if (rc == 0) {
    return Status::Unavailable(
        fmt::format("socket path \"{}\" is in use: a server is already listening there", path));
  }
  if (err != ECONNREFUSED && err != ENOENT) {
    return Status::FromErrno(err, fmt::format("probing existing socket \"{}\"", path));
  }
  spdlog::info("removing stale socket file {}", path);
  ::unlink(path.c_str());
  return Status::Ok();
}

Status Server::Impl::BindSocket() {
  const std::string& path = options_.socket_path;
  KVTIER_RETURN_IF_ERROR(CheckSocketPath());
  // Bound and listening under a name of its own first, then linked to its path: whoever sees the
  // path can connect (a script that waits for the file never meets a socket that refuses), and
  // link, unlike rename, fails if another server took the path meanwhile. A path too long for
  // the extra name is bound in place.
  std::string staging = fmt::format("{}.{}", path, ::getpid());
  if (!SocketAddress(staging).ok()) staging = path;
  KVTIER_ASSIGN_OR_RETURN(sockaddr_un addr, SocketAddress(staging));

  // Non-blocking: the door thread accepts until EAGAIN.
  listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listen_fd_ < 0) return Status::FromErrno(errno, "socket");
  gid_t gid = static_cast<gid_t>(-1);
  if (!options_.socket_group.empty()) {
    struct group* g = ::getgrnam(options_.socket_group.c_str());
    if (!g) {
      return Status::InvalidArgument(
          fmt::format("unknown socket group \"{}\"", options_.socket_group));
    }
    gid = g->gr_gid;
  }
  // Created owner-only from the start (no window with wider permissions); widened to the group
  // afterwards if asked.
  mode_t old = ::umask(0177);
  int rc = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  int err = errno;
  ::umask(old);
  if (rc != 0) return Status::FromErrno(err, fmt::format("binding socket \"{}\"", staging));
  auto fail = [&](Status s) {
    ::unlink(staging.c_str());
    return s;
  };
  if (gid != static_cast<gid_t>(-1)) {
    if (::chown(staging.c_str(), static_cast<uid_t>(-1), gid) != 0 ||
        ::chmod(staging.c_str(), 0660)) {
      return fail(Status::FromErrno(
          errno, fmt::format("giving socket \"{}\" to group \"{}\"", path, options_.socket_group)));
    }
  }
  if (::listen(listen_fd_, 128) != 0) return fail(Status::FromErrno(errno, "listen"));
  if (staging != path) {
    if (::link(staging.c_str(), path.c_str()) != 0) {
      if (errno == EEXIST) {
        return fail(Status::Unavailable(fmt::format(
            "socket path \"{}\" is in use: another server took it as this one started", path)));
      }
      return fail(Status::FromErrno(errno, fmt::format("linking socket \"{}\"", path)));
    }
    ::unlink(staging.c_str());
  }
  socket_bound_ = true;
  return Status::Ok();
}

namespace {
constexpr size_t kHttpQueuedConnections = 16;
constexpr size_t kHttpMaxBodyBytes = 4096;
}  // namespace

Status Server::Impl::StartHttp() {
  if (options_.http_port < 0) return Status::Ok();
  http_ = std::make_unique<httplib::Server>();
  // Every HTTP connection ties up a worker while it is read, so a slow one (a stalled scraper,
  // a half-sent request) must neither take all workers nor keep one long: several workers,
  // short read/write timeouts and a short keep-alive. /healthz then answers while a few slow
  // connections are open.
  // Every input is bounded: connections (the workers, and at most kHttpQueuedConnections
  // accepted and waiting for one; beyond that a connection is closed at once, so HTTP holds at
  // most that many descriptors and cannot starve the Unix socket's clients or the file tier),
  // the request line, header lines and their count (compile-time limits of the vendored
  // httplib, CMakeLists.txt), the body (no route takes one), and a range request at most one
  // range (an answer never larger than the document).
  const size_t http_threads = static_cast<size_t>(options_.http_threads);
  http_->new_task_queue = [http_threads] {
    return new httplib::ThreadPool(http_threads, http_threads, kHttpQueuedConnections);
  };
  http_->set_payload_max_length(kHttpMaxBodyBytes);
  // httplib's default socket options add SO_REUSEPORT, with which a second server binds the
  // same port and the kernel splits connections between the two (a stopped server's /healthz
  // answered by a live one): SO_REUSEADDR only (a restart may still bind over TIME_WAIT).
  http_->set_socket_options([](int sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  http_->set_read_timeout(std::chrono::seconds(2));
  http_->set_write_timeout(std::chrono::seconds(2));
  http_->set_keep_alive_timeout(2);
  http_->set_keep_alive_max_count(100);
  http_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(MetricsText(), "text/plain; version=0.0.4; charset=utf-8");
  });
  http_->Get("/healthz", [this](const httplib::Request&, httplib::Response& res) {
    if (stopping_) {
      res.status = 503;
      res.set_content("draining\n", "text/plain");
    } else {
      res.set_content("ok\n", "text/plain");
    }
  });
  http_->Get("/stats", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(StatsJson(StatsView::kHttp), "application/json");
  });
  if (options_.http_port == 0) {
    http_port_ = http_->bind_to_any_port(options_.http_host);
    if (http_port_ < 0) {
      return Status::Unavailable(
          fmt::format("cannot bind an HTTP port on \"{}\"", options_.http_host));
    }
  } else {
    if (!http_->bind_to_port(options_.http_host, options_.http_port)) {
      return Status::Unavailable(
          fmt::format("cannot bind HTTP {}:{} (port in use, or host not a local address)",
                      options_.http_host, options_.http_port));
    }
    http_port_ = options_.http_port;
  }
  http_thread_ = std::thread([this] {
    http_->listen_after_bind();
    http_thread_done_ = true;
  });
  return Status::Ok();
}

void Server::Impl::AcceptLoop() {
  std::list<std::shared_ptr<Connection>> pending;  // accepted, hello not yet complete
  Clock::time_point backoff{};                     // accept paused until then (out of fds)
  std::vector<pollfd> fds;
  std::vector<std::shared_ptr<Connection>> polled;
  Clock::time_point next_expiry_scan{};
  while (!stopping_) {
    auto now = Clock::now();
    // Silent connections are closed at their deadline; they never got a thread.
    for (auto it = pending.begin(); it != pending.end();) {
      if ((*it)->hello_deadline <= now) {
        spdlog::info("closing connection {} (pid {}): no hello within {} ms", (*it)->id,
                     (*it)->peer_pid, options_.hello_timeout.count());
        metrics_.refused_by["hello_timeout"]->Increment();
        ClosePending(**it);
        it = pending.erase(it);
      } else {
        ++it;
      }
    }
    auto wake_at = now + std::chrono::seconds(1);
    for (auto& c : pending) wake_at = std::min(wake_at, c->hello_deadline);
    const bool accepting = now >= backoff;
    if (!accepting) wake_at = std::min(wake_at, backoff);
    fds.clear();
    polled.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    fds.push_back({accepting ? listen_fd_ : -1, POLLIN, 0});
    for (auto& c : pending) {
      fds.push_back({c->fd, POLLIN, 0});
      polled.push_back(c);
    }
    const auto wait = std::chrono::ceil<std::chrono::milliseconds>(wake_at - now);
    int n = ::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(0, wait.count())));
    ReapFinished(false);
    if (Clock::now() >= next_expiry_scan) {
      ExpireReservations(Clock::now());
      next_expiry_scan = Clock::now() + std::chrono::milliseconds(250);
    }
    if (n <= 0 || stopping_) continue;
    for (size_t i = 0; i < polled.size(); ++i) {
      if (!fds[i + 2].revents) continue;
      if (!ReadHello(polled[i])) pending.remove(polled[i]);
    }
    if (fds[1].revents & POLLIN) AcceptNew(pending, &backoff);
  }
  for (auto& c : pending) ClosePending(*c);
}

void Server::Impl::AcceptNew(std::list<std::shared_ptr<Connection>>& pending,
                             Clock::time_point* backoff) {
  for (int round = 0; round < 64; ++round) {
    int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      const int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR || err == ECONNABORTED) return;
      // Out of descriptors or memory: the listening socket stays readable, so retrying at once
      // would spin. Pause accepting briefly; connections wait in the backlog meanwhile.
      metrics_.accept_errors.Increment();
      if (!accept_failing_) {
        accept_failing_ = true;
        spdlog::warn(
            "accept failed: {}; pausing new connections, retrying every 100 ms{}",
            std::strerror(err),
            err == EMFILE || err == ENFILE ? " (raise the open-file limit, ulimit -n)" : "");
      }
      *backoff = Clock::now() + std::chrono::milliseconds(100);
      return;
    }
    if (accept_failing_) {
      accept_failing_ = false;
      spdlog::info("accepting connections again");
    }
    auto conn = std::make_shared<Connection>();
    conn->id = next_id_++;
    conn->fd = fd;
    conn->hello_deadline = Clock::now() + options_.hello_timeout;
    struct ucred cred {};
    socklen_t len = sizeof(cred);
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
      conn->peer_pid = cred.pid;
      conn->peer_uid = cred.uid;
      conn->peer_known = true;
    }
    metrics_.connections.Increment();
    // A real client says hello at once; whoever holds connections open without one is the
    // first to go when room is needed, so they cannot lock real clients out.
    if (pending.size() >= options_.max_pending_handshakes) {
      auto& oldest = pending.front();
      spdlog::info("closing connection {} (pid {}): {} connections are waiting for a hello",
                   oldest->id, oldest->peer_pid, pending.size());
      metrics_.refused_by["too_many_pending"]->Increment();
      ClosePending(*oldest);
      pending.pop_front();
    }
    pending.push_back(conn);
    // The hello is often there already.
    if (!ReadHello(conn)) pending.pop_back();
  }
}

bool Server::Impl::ReadHello(const std::shared_ptr<Connection>& conn) {
  Connection& c = *conn;
  // A hello is small (protocol.md); no more than this is ever buffered for an unknown peer.
  const size_t limit = kHeaderBytes + std::min<size_t>(options_.max_message_bytes, kMaxHelloBytes);
  while (true) {
    if (c.in.size() >= kHeaderBytes) {
      FrameHeader h = DecodeHeader(c.in.data());
      Status s = CheckRequestHeader(h, options_.max_message_bytes);
      if (s.ok() && h.opcode != static_cast<uint16_t>(Opcode::kHello)) {
        s = Status::InvalidArgument("the first message must be hello");
      }
      if (s.ok() && kHeaderBytes + h.body_length > limit) {
        s = Status::InvalidArgument(
            fmt::format("hello of {} bytes exceeds the limit of {}", h.body_length, limit));
      }
      if (!s.ok()) {
        ProtocolError(c, h, s);
        ClosePending(c);
        return false;
      }
      const size_t total = kHeaderBytes + h.body_length;
      if (c.in.size() >= total) {
        std::vector<uint8_t> rest(c.in.begin() + total, c.in.end());
        std::span<const uint8_t> body(c.in.data() + kHeaderBytes, h.body_length);
        // On success the connection and its buffer belong to its thread from here on.
        if (!HandleHello(conn, h, body, std::move(rest))) ClosePending(c);
        return false;
      }
    }
    uint8_t buf[4096];
    ssize_t r = ::recv(c.fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (r <= 0) {
      ClosePending(c);
      return false;
    }
    c.in.insert(c.in.end(), buf, buf + r);
  }
}

void Server::Impl::ClosePending(Connection& c) {
  std::lock_guard lock(c.out_mu);
  c.out_closed = true;
  pump_.Forget(c);
  if (c.fd >= 0) ::close(c.fd);
  c.fd = -1;
}

void Server::Impl::ReapFinished(bool all) {
  std::list<std::shared_ptr<Connection>> done;
  {
    std::lock_guard lock(conns_mu_);
    for (auto it = conns_.begin(); it != conns_.end();) {
      if (all || (*it)->finished) {
        done.push_back(*it);
        it = conns_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& c : done) {
    if (c->thread.joinable()) c->thread.join();
  }
}

bool Server::Impl::Send(Connection& c, const std::vector<uint8_t>& frame, int pass_fd) {
  std::lock_guard lock(c.out_mu);
  if (c.out_closed) return false;
  size_t sent = 0;
  if (c.out.empty()) {
    // Nothing queued: write directly, without blocking.
    while (sent < frame.size()) {
      ssize_t w;
      if (pass_fd >= 0 && sent == 0) {
        iovec iov{const_cast<uint8_t*>(frame.data()), frame.size()};
        alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
        msghdr msg{};
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control;
        msg.msg_controllen = sizeof(control);
        cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
        cmsg->cmsg_level = SOL_SOCKET;
        cmsg->cmsg_type = SCM_RIGHTS;
        cmsg->cmsg_len = CMSG_LEN(sizeof(int));
        std::memcpy(CMSG_DATA(cmsg), &pass_fd, sizeof(int));
        w = ::sendmsg(c.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      } else {
        w = ::send(c.fd, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      }
      if (w > 0) {
        sent += static_cast<size_t>(w);
        continue;
      }
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (pass_fd >= 0 && sent == 0) {  // the descriptor must ride on the first byte
          c.DropLocked();
          return false;
        }
        break;
      }
      c.DropLocked();
      return false;
    }
    if (sent == frame.size()) return true;
  }
  // The client is not reading as fast as it asks: queue, bounded.
  if (c.out.size() - c.out_begin + frame.size() - sent > options_.max_output_bytes) {
    spdlog::warn("dropping client {} (pid {}, \"{}\"): more than {} bytes of replies unread", c.id,
                 c.peer_pid, c.name, options_.max_output_bytes);
    metrics_.dropped_by["slow"]->Increment();
    c.DropLocked();
    return false;
  }
  if (c.out.empty()) c.out_since = Clock::now();
  c.out.insert(c.out.end(), frame.begin() + static_cast<ptrdiff_t>(sent), frame.end());
  pump_.Watch(c.shared_from_this());
  return !c.out_closed;
}

void Server::Impl::Refuse(Connection& c, const FrameHeader& h, const Status& s,
                          const char* reason) {
  spdlog::warn("refusing client {} (pid {}, \"{}\"): {}", c.id, c.peer_pid, LogSafe(c.name),
               LogSafe(s.ToString()));
  if (auto it = metrics_.refused_by.find(reason); it != metrics_.refused_by.end()) {
    it->second->Increment();
  }
  Send(c, EncodeReply(h.opcode, h.request_id, s));
}

void Server::Impl::ProtocolError(Connection& c, const FrameHeader& h, const Status& s) {
  spdlog::warn("closing client {} (pid {}, \"{}\") after a protocol error: {}", c.id, c.peer_pid,
               LogSafe(c.name), LogSafe(s.ToString()));
  metrics_.protocol_errors.Increment();
  Send(c, EncodeReply(h.opcode & ~kReplyBit, h.request_id, s));
}

bool Server::Impl::ReadFrame(Connection& c, std::vector<uint8_t>& buf, size_t& begin, size_t& end,
                             FrameHeader* header, std::span<const uint8_t>* body) {
  auto fill = [&](size_t need) -> bool {
    if (end - begin >= need) return true;
    if (begin > 0) {  // compact: the unread bytes go to the front
      std::memmove(buf.data(), buf.data() + begin, end - begin);
      end -= begin;
      begin = 0;
    }
    if (buf.size() < need) buf.resize(need);
    while (end < need) {
      ssize_t r = ::recv(c.fd, buf.data() + end, buf.size() - end, 0);
      if (r == 0) return false;
      if (r < 0) {
        if (errno == EINTR) continue;
        return false;
      }
      end += static_cast<size_t>(r);
    }
    return true;
  };
  if (!fill(kHeaderBytes)) return false;
  *header = DecodeHeader(buf.data() + begin);
  Status s = CheckRequestHeader(*header, options_.max_message_bytes);
  if (!s.ok()) {
    // Oversized lengths are never read: the connection is closed right away.
    ProtocolError(c, *header, s);
    return false;
  }
  if (!fill(kHeaderBytes + header->body_length)) return false;
  *body = std::span<const uint8_t>(buf.data() + begin + kHeaderBytes, header->body_length);
  begin += kHeaderBytes + header->body_length;
  return true;
}

void Server::Impl::Serve(std::shared_ptr<Connection> conn, std::vector<uint8_t> hello_reply) {
  Connection& c = *conn;
  // What the client sent after its hello came in with it.
  std::vector<uint8_t> buf = std::move(c.in);
  size_t begin = 0, end = buf.size();
  if (buf.size() < 64 * 1024) buf.resize(64 * 1024);
  // Counted (and listed in /stats) before the client hears its reply: a client that has
  // connected must find itself in the metrics it reads next. A failed send undoes it in Release.
  {
    std::lock_guard lock(c.mu);
    c.handshaken = true;
  }
  metrics_.connected.Increment();
  if (Send(c, hello_reply, c.window ? c.window->fd() : engine_->pool().fd)) {
    spdlog::info("client {} connected: pid {}, uid {}, \"{}\", model \"{}\" rank {}/{}{}", c.id,
                 c.peer_pid, c.peer_uid, c.name, c.ns.model_id, c.ns.rank, c.ns.world_size,
                 c.tenant.empty() ? "" : ", tenant " + c.tenant);
    FrameHeader h;
    std::span<const uint8_t> body;
    while (ReadFrame(c, buf, begin, end, &h, &body)) {
      if (!Handle(conn, h, body)) break;
    }
  }
  Release(c);
  c.finished = true;
}

void Server::Impl::Release(Connection& c) {
  std::vector<SlotId> reserved, pinned;
  bool was_handshaken;
  {
    std::lock_guard lock(c.mu);
    c.closed = true;
    was_handshaken = c.handshaken;
    for (auto& [slot, r] : c.reservations) reserved.push_back(r.pool);
    for (auto& [slot, n] : c.pins) {
      for (uint32_t i = 0; i < n; ++i) pinned.push_back(slot);
    }
    if (c.window) {  // window pins hold nothing in the pool
      for (SlotId s : pinned) c.window->Give(s);
    }
    c.reservations.clear();
    c.pins.clear();
    c.pinned = 0;
    AccountLocked(c);  // what is left: prepare_loads still running (FinishPrepareLoad ends them)
  }
  {
    std::lock_guard lock(c.out_mu);
    c.out_closed = true;
    pump_.Forget(c);
    ::close(c.fd);
    c.fd = -1;
  }
  engine_->AbortSlots(reserved);
  if (!c.window) engine_->Unpin(pinned);
  if (was_handshaken) metrics_.connected.Decrement();
  if (!reserved.empty() || !pinned.empty()) {
    metrics_.released_on_disconnect.Increment(static_cast<double>(reserved.size() + pinned.size()));
    spdlog::info(
        "client {} (pid {}, \"{}\") disconnected holding {} reservations and {} pins: "
        "released",
        c.id, c.peer_pid, c.name, reserved.size(), pinned.size());
  } else {
    spdlog::debug("client {} disconnected", c.id);
  }
}

bool Server::Impl::HandleHello(const std::shared_ptr<Connection>& conn, const FrameHeader& h,
                               std::span<const uint8_t> body, std::vector<uint8_t> rest) {
  Connection& c = *conn;
  auto hello = DecodeHelloRequest(body);
  if (!hello.ok()) {
    if (hello.status().code() == StatusCode::kUnimplemented) {
      Refuse(c, h, hello.status(), "version");
    } else {
      ProtocolError(c, h, hello.status());
    }
    return false;
  }
  // Names reach logs, /stats and metrics: they must be printable text.
  for (auto [what, text, max] : {std::tuple{"client_name", &hello->client_name, size_t{256}},
                                 std::tuple{"model_id", &hello->ns.model_id, size_t{1024}}}) {
    if (!IsPrintableUtf8(*text) || text->size() > max) {
      Refuse(c, h,
             Status::InvalidArgument(fmt::format(
                 "{} \"{}\" refused: it must be UTF-8 text of at most {} bytes without control "
                 "characters",
                 what, LogSafe(text->substr(0, 64)), max)),
             "bad_name");
      return false;
    }
  }
  c.name = hello->client_name;
  if (hello->version != kProtocolVersion) {
    Refuse(c, h,
           Status::Unimplemented(fmt::format("protocol version {} not supported (server speaks {})",
                                             hello->version, kProtocolVersion)),
           "version");
    return false;
  }
  if (!options_.token.empty()) {
    const std::string& t = hello->token;
    bool match = t.size() == options_.token.size() &&
                 CRYPTO_memcmp(t.data(), options_.token.data(), t.size()) == 0;
    if (!match) {
      Refuse(c, h, Status::PermissionDenied("wrong or missing token"), "token");
      return false;
    }
  }
  // The tenant comes from what the server knows of the peer (its uid) or from a token the
  // operator issued, never from a field the client fills in: the namespace it declares is
  // public (a model id anyone can name), so it cannot be what keeps tenants apart.
  std::string tenant;
  if (options_.isolate_clients) {
    if (!tenant_digests_.empty()) {
      const std::string* name = TenantOfToken(hello->token);
      if (!name) {
        Refuse(c, h, Status::PermissionDenied("wrong or missing token (not a tenant's token)"),
               "token");
        return false;
      }
      tenant = "tenant:" + *name;
    } else if (c.peer_known) {
      tenant = fmt::format("uid:{}", c.peer_uid);
    } else {
      Refuse(c, h,
             Status::PermissionDenied(
                 "the server cannot tell which user this connection is (SO_PEERCRED failed), "
                 "so not its tenant either"),
             "no_credentials");
      return false;
    }
  }
  Status ns = hello->ns.Validate();
  if (!ns.ok()) {
    Refuse(c, h, ns.WithContext("namespace refused"), "namespace");
    return false;
  }
  const uint64_t pool_chunk = engine_->options().chunk_bytes;
  if (hello->chunk_bytes != 0 && hello->chunk_bytes != pool_chunk) {
    Refuse(c, h,
           Status::InvalidArgument(fmt::format(
               "layout mismatch: a chunk of this client is {} bytes ({} tokens), but this server's "
               "pool holds {}-byte chunks; start a server for this model/layout (--model, "
               "--chunk-size, --chunk-bytes)",
               hello->chunk_bytes, hello->ns.chunk_tokens, pool_chunk)),
           "chunk_size");
    return false;
  }
  if (stopping_) {
    Refuse(c, h, Status::Unavailable("server is draining (shutting down)"), "draining");
    return false;
  }
  c.ns = hello->ns;
  c.tenant = std::move(tenant);
  c.deriver = c.tenant.empty() ? std::make_unique<KeyDeriver>(c.ns)
                               : std::make_unique<KeyDeriver>(TenantRoot(c.ns, c.tenant));
  c.in = std::move(rest);
  const Engine::Pool pool = engine_->pool();
  HelloReply reply;
  reply.session_id = c.id;
  reply.arena_bytes = pool.bytes;
  reply.slot_bytes = pool.slot_bytes;
  reply.chunk_bytes = engine_->options().chunk_bytes;
  reply.num_slots = pool.num_slots;
  if (options_.isolate_clients) {
    // As many window slots as the connection may hold, so one is always free for them, within
    // what the windows' memory bound leaves.
    const uint64_t limit =
        options_.max_window_bytes > 0 ? options_.max_window_bytes : 4 * pool.bytes;
    uint64_t slots = SlotQuota();
    {
      std::lock_guard lock(window_budget_->mu);
      const uint64_t left = limit > window_budget_->used ? limit - window_budget_->used : 0;
      slots = std::min<uint64_t>(slots, left / pool.slot_bytes);
      window_budget_->used += slots * pool.slot_bytes;
    }
    c.window_budget = window_budget_;  // given back when the connection goes
    c.window_charge = slots * pool.slot_bytes;
    if (slots == 0) {
      Refuse(c, h,
             Status::Unavailable(fmt::format(
                 "the isolated clients' windows already take the {} MiB they may "
                 "(--max-window-mb); retry later, or raise it or lower --max-client-slots",
                 limit >> 20)),
             "no_window_memory");
      return false;
    }
    auto window = ClientWindow::Create(static_cast<uint32_t>(slots), pool.slot_bytes);
    if (!window.ok()) {
      Refuse(c, h,
             Status::Unavailable(fmt::format("the server cannot make this client's window: {}",
                                             window.status().ToString())),
             "no_window");
      return false;
    }
    c.window = std::move(window).value();
    reply.arena_bytes = c.window->bytes();
    reply.num_slots = c.window->num_slots();
  }
  reply.max_keys_per_request = options_.max_keys_per_request;
  reply.max_message_bytes = options_.max_message_bytes;
  reply.server_version = KVTIER_VERSION;
  auto frame = EncodeReply(h.opcode, h.request_id, Status::Ok(), HelloReplyFields(reply));
  std::lock_guard lock(conns_mu_);
  size_t live = 0, same_process = 0;
  for (auto& other : conns_) {
    live += !other->finished;
    same_process += !other->finished && other->peer_pid == c.peer_pid;
  }
  if (live >= options_.max_clients) {
    Refuse(c, h, Status::Rejected(fmt::format("too many clients (limit {})", options_.max_clients)),
           "too_many_clients");
    return false;
  }
  if (const size_t per_process = ClientsPerProcess(); same_process >= per_process) {
    Refuse(c, h,
           Status::Rejected(fmt::format("too many connections from process {} (limit {}, "
                                        "--max-clients-per-process)",
                                        c.peer_pid, per_process)),
           "too_many_from_process");
    return false;
  }
  // The connection's socket blocks from now on (its thread reads it); replies never block.
  int fl = ::fcntl(c.fd, F_GETFL);
  if (fl >= 0) ::fcntl(c.fd, F_SETFL, fl & ~O_NONBLOCK);
  try {
    conn->thread = std::thread(
        [this, conn, frame = std::move(frame)]() mutable { Serve(conn, std::move(frame)); });
  } catch (const std::system_error& e) {
    // Out of threads (a task limit, memory): this client is refused, the server goes on.
    Refuse(c, h,
           Status::Unavailable(fmt::format("the server cannot start a thread for this connection "
                                           "({}); try again later",
                                           e.what())),
           "no_thread");
    metrics_.dropped_by["no_thread"]->Increment();
    return false;
  }
  conns_.push_back(conn);
  return true;
}

bool Server::Impl::Handle(const std::shared_ptr<Connection>& conn, const FrameHeader& h,
                          std::span<const uint8_t> body) {
  Connection& c = *conn;
  const auto started = Clock::now();
  const auto op = static_cast<Opcode>(h.opcode);
  if (op == Opcode::kHello) {
    ProtocolError(c, h, Status::InvalidArgument("hello sent twice"));
    return false;
  }
  // Counted on arrival: a client that has its reply finds its request in the metrics.
  metrics_.op_requests[h.opcode]->Increment();
  const uint32_t max_keys = options_.max_keys_per_request;
  auto derive = [&](const std::vector<ChunkKey>& keys) {
    std::vector<ChunkKey> out;
    out.reserve(keys.size());
    for (const ChunkKey& k : keys) out.push_back(c.deriver->Derive(k));
    return out;
  };
  auto reply = [&](const Status& s, std::span<const uint8_t> fields = {}) {
    if (!s.ok()) metrics_.request_errors.Increment();
    return Send(c, EncodeReply(h.opcode, h.request_id, s, fields));
  };
  // How many of `n` new slots this connection may take: reservations and pins are capped per
  // client process, over all its connections (two connections of one process took the whole
  // pool when the cap was per connection), and an isolated connection's by its window. An
  // error when none. REQUIRES: c.mu held.
  const size_t quota = std::min<size_t>(SlotQuota(), c.window ? c.window->num_slots() : SIZE_MAX);
  auto allowance = [&](size_t n, size_t* allowed) -> Status {
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
  };
  bool keep = true;
  switch (op) {
    case Opcode::kLookup: {
      auto keys = DecodeKeysRequest(body, max_keys);
      if (!keys.ok()) {
        ProtocolError(c, h, keys.status());
        return false;
      }
      LookupResult r = engine_->Lookup(derive(*keys));
      keep = reply(Status::Ok(), LookupReplyFields({static_cast<uint32_t>(r.total),
                                                    static_cast<uint32_t>(r.memory)}));
      break;
    }
    case Opcode::kReserve: {
      auto keys = DecodeKeysRequest(body, max_keys);
      if (!keys.ok()) {
        ProtocolError(c, h, keys.status());
        return false;
      }
      size_t allowed;
      Status limited;
      {
        std::lock_guard lock(c.mu);
        limited = allowance(keys->size(), &allowed);
        if (limited.ok()) {
          c.pending_reserves += allowed;  // counted until recorded below
          AccountLocked(c);
        }
      }
      if (!limited.ok()) {
        keep = reply(limited);
        break;
      }
      keys->resize(allowed);  // a short reply, as when the pool is full
      auto derived = derive(*keys);
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
          c.reservations[slots[i]] = {derived[i], started, pool};
        }
        c.pending_reserves -= allowed;
        AccountLocked(c);
      }
      if (!unused.empty()) engine_->AbortSlots(unused);
      keep = reply(Status::Ok(), SlotsReplyFields(slots));
      break;
    }
    case Opcode::kCommit:
    case Opcode::kAbort: {
      auto slots = DecodeSlotsRequest(body, max_keys);
      if (!slots.ok()) {
        ProtocolError(c, h, slots.status());
        return false;
      }
      std::vector<ChunkKey> keys;
      std::vector<SlotId> valid, pool_slots;  // the client's slot numbers, and the pool's
      Status bad;
      Clock::time_point oldest = started;
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
      if (!bad.ok()) {
        keep = reply(bad);
        break;
      }
      if (c.window) {
        // The client's bytes enter the pool here; the window slots are free once copied.
        if (op == Opcode::kCommit) {
          const uint64_t n = engine_->options().chunk_bytes;
          for (size_t i = 0; i < valid.size(); ++i) {
            std::memcpy(engine_->SlotData(pool_slots[i]).data(), c.window->Data(valid[i], n).data(),
                        n);
          }
        }
        std::lock_guard lock(c.mu);
        for (SlotId s : valid) c.window->Give(s);
      }
      valid = std::move(pool_slots);
      if (op == Opcode::kCommit) {
        engine_->CommitSlots(keys, valid);
        if (!valid.empty()) {
          metrics_.store_latency.Observe(
              std::chrono::duration<double>(Clock::now() - oldest).count());
        }
        keep = reply(Status::Ok(), U32ReplyFields(static_cast<uint32_t>(valid.size())));
      } else {
        engine_->AbortSlots(valid);
        keep = reply(Status::Ok());
      }
      break;
    }
    case Opcode::kPrepareLoad: {
      auto keys = DecodeKeysRequest(body, max_keys);
      if (!keys.ok()) {
        ProtocolError(c, h, keys.status());
        return false;
      }
      size_t allowed;
      Status limited;
      {
        std::lock_guard lock(c.mu);
        limited = allowance(keys->size(), &allowed);
        if (limited.ok()) c.pending_pins += allowed;
        AccountLocked(c);
      }
      if (!limited.ok()) {
        keep = reply(limited);
        break;
      }
      keys->resize(allowed);  // a partial hit beyond the limit: the client recomputes the rest
      const std::vector<ChunkKey> derived = derive(*keys);
      // Answered here when L1 alone holds the prefix (the common case, and the latency that
      // matters); else when the promotion from the file tier ends (or its deadline passes),
      // without holding up this connection's other requests.
      if (auto pinned = engine_->PrepareLoadFromMemory(derived)) {
        FinishPrepareLoad(conn, h.request_id, started, allowed, Status::Ok(), std::move(*pinned));
        break;
      }
      auto handle = engine_->PrepareLoad(derived);
      if (!handle.ok()) {
        {
          std::lock_guard lock(c.mu);
          c.pending_pins -= allowed;
          AccountLocked(c);
        }
        keep = reply(handle.status());
        break;
      }
      handle->OnDone([this, gate = completion_gate_, engine = engine_.get(), conn,
                      id = h.request_id, started, allowed](const OpResult& r) {
        std::shared_lock lock(gate->mu);
        if (gate->open) {
          FinishPrepareLoad(conn, id, started, allowed, r.status, r.slots);
        } else {
          engine->Unpin(r.slots);
        }
      });
      break;
    }
    case Opcode::kRelease: {
      auto slots = DecodeSlotsRequest(body, max_keys);
      if (!slots.ok()) {
        ProtocolError(c, h, slots.status());
        return false;
      }
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
      keep = reply(bad);
      break;
    }
    case Opcode::kStats: {
      Status s = DecodeEmptyRequest(body);
      if (!s.ok()) {
        ProtocolError(c, h, s);
        return false;
      }
      keep = reply(Status::Ok(), TextReplyFields(StatsJson(StatsView::kTenant, c.tenant)));
      break;
    }
    case Opcode::kPing: {
      Status s = DecodeEmptyRequest(body);
      if (!s.ok()) {
        ProtocolError(c, h, s);
        return false;
      }
      keep = reply(Status::Ok());
      break;
    }
    case Opcode::kHello:
      break;
  }
  metrics_.op_latency[h.opcode]->Observe(
      std::chrono::duration<double>(Clock::now() - started).count());
  return keep;
}

const std::string* Server::Impl::TenantOfToken(std::string_view token) const {
  const std::array<uint8_t, 32> digest = Sha256Of(token);
  const std::string* found = nullptr;
  for (const TenantDigest& t : tenant_digests_) {
    if (CRYPTO_memcmp(t.digest.data(), digest.data(), digest.size()) == 0) found = &t.tenant;
  }
  return found;
}

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

void Server::Impl::Stop() {
  {
    std::lock_guard lock(stop_mu_);
    if (stop_started_) {
      return;
    }
    stop_started_ = true;
  }
  const bool was_serving = accept_thread_.joinable();
  if (was_serving) spdlog::info("draining: closing the socket and every client connection");
  stopping_ = true;
  if (wake_fd_ >= 0) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t w = ::write(wake_fd_, &one, sizeof(one));
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  if (listen_fd_ >= 0) {
    ::close(listen_fd_);
    listen_fd_ = -1;
  }
  if (socket_bound_) ::unlink(options_.socket_path.c_str());
  {
    std::lock_guard lock(conns_mu_);
    for (auto& c : conns_) {
      std::lock_guard out_lock(c->out_mu);
      if (!c->out_closed) ::shutdown(c->fd, SHUT_RDWR);
    }
  }
  ReapFinished(true);
  {
    std::unique_lock lock(completion_gate_->mu);  // waits for replies being sent
    completion_gate_->open = false;
  }
  pump_.Stop();
  if (engine_ && was_serving) {
    spdlog::info("draining: waiting for queued engine work (write policy {})",
                 WritePolicyName(engine_->options().write_policy));
    if (engine_->options().write_policy == WritePolicy::kWriteBack && engine_->has_file_tier()) {
      // Write-back keeps dirty chunks only in L1, which dies with the process: write them down.
      Status flushed = engine_->FlushDirty();
      if (!flushed.ok())
        spdlog::error("draining: writing back dirty chunks: {}", flushed.ToString());
    }
    engine_->Drain();
  }
  if (http_thread_.joinable()) {
    // httplib's stop() does nothing to a server whose listen loop has not begun yet, and that
    // loop would then accept forever: a SIGTERM right after start hung the drain. (No thread:
    // the bind failed, and there is no loop to wait for; waiting hung a failed start.)
    while (!http_->is_running() && !http_thread_done_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    http_->stop();
    http_thread_.join();
  }
  if (was_serving) spdlog::info("drained");
  std::lock_guard lock(stop_mu_);
  stopped_ = true;
  stop_cv_.notify_all();
}

std::string Server::Impl::StatsJson(StatsView view, std::string_view tenant) const {
  EngineStats st = engine_->Stats();
  const MemoryTierStats& m = st.memory_detail;
  nlohmann::json j;
  j["version"] = KVTIER_VERSION;
  j["protocol_version"] = kProtocolVersion;
  j["uptime_s"] = std::chrono::duration<double>(Clock::now() - started_at_).count();
  j["draining"] = stopping_.load();
  j["socket"] = options_.socket_path;
  j["write_policy"] = WritePolicyName(engine_->options().write_policy);
  j["pool"] = {{"capacity_bytes", m.capacity_bytes},
               {"slot_bytes", m.slot_bytes},
               {"chunk_bytes", engine_->options().chunk_bytes},
               {"num_slots", m.num_slots},
               {"resident", m.resident},
               {"pinned", m.pinned},
               {"huge_pages", m.huge_pages},
               {"eviction_policy", EvictionPolicyName(engine_->options().memory.eviction)}};
  auto tier = [](const TierCounters& t) {
    return nlohmann::json{{"lookups", t.lookups},        {"hits", t.hits},
                          {"served", t.served},          {"misses", t.misses},
                          {"bytes_written", t.bytes_in}, {"bytes_read", t.bytes_out},
                          {"evictions", t.evictions},    {"rejections", t.rejections},
                          {"errors", t.errors}};
  };
  j["tiers"]["memory"] = tier(st.memory);
  j["engine"] = {{"stores", st.stores}, {"loads", st.loads}, {"rejected_ops", st.rejected_ops}};
  if (st.has_file) {
    const FileTierStats& f = st.file_detail;
    j["tiers"]["file"] = tier(st.file);
    j["tiers"]["file"]["path"] = engine_->options().file->root;
    j["tiers"]["file"]["chunks"] = f.chunks;
    j["tiers"]["file"]["bytes"] = f.bytes;
    j["tiers"]["file"]["capacity_bytes"] = f.capacity_bytes;
    j["tiers"]["file"]["o_direct"] = f.o_direct;
    j["tiers"]["file"]["io_engine"] = f.io_engine;
    j["tiers"]["file"]["corrupt"] = f.corrupt;
    j["tiers"]["file"]["queued_writes"] = f.queued_writes;
    j["tiers"]["file"]["index"] = {{"rescans", f.rescans},
                                   {"rescan_failures", f.rescan_failures},
                                   {"last_rescan_us", f.last_rescan_us},
                                   {"probes", f.probes},
                                   {"probe_hits", f.probe_hits},
                                   {"probes_dropped", f.probes_dropped},
                                   {"negative_cache_entries", f.negative_cache_entries},
                                   {"found_on_disk", f.found_on_disk}};
    j["engine"]["promotions"] = st.promotions;
    j["engine"]["shared_reads"] = st.shared_reads;
    j["engine"]["deadline_misses"] = st.deadline_misses;
    j["engine"]["write_backs"] = st.write_backs;
    j["engine"]["write_back_failures"] = st.write_back_failures;
    j["engine"]["dirty_evictions"] = st.dirty_evictions;
    j["engine"]["dirty_refusals"] = m.dirty_refusals;
    j["engine"]["write_through_dropped"] = st.write_through_dropped;
    j["pool"]["dirty"] = m.dirty;
  }
  // The engine-wide numbers above are aggregates over every tenant, as in /metrics, which any
  // local user may read; who the clients are is not (docs/security.md, "A tenant").
  const bool isolated = options_.isolate_clients && view != StatsView::kOperator;
  if (isolated && view == StatsView::kTenant) j["tenant"] = tenant;
  nlohmann::json clients = nlohmann::json::array();
  size_t connected = 0;
  {
    std::lock_guard lock(conns_mu_);
    for (auto& c : conns_) {
      std::lock_guard conn_lock(c->mu);
      if (c->closed || !c->handshaken) continue;
      ++connected;
      if (isolated && (view == StatsView::kHttp || c->tenant != tenant)) continue;
      clients.push_back({{"id", c->id},
                         {"pid", c->peer_pid},
                         {"name", c->name},
                         {"model_id", c->ns.model_id},
                         {"rank", c->ns.rank},
                         {"world_size", c->ns.world_size},
                         {"pins", c->pinned},
                         {"reservations", c->reservations.size()}});
      if (view == StatsView::kOperator && !c->tenant.empty()) clients.back()["tenant"] = c->tenant;
    }
  }
  j["clients_connected"] = connected;
  if (!isolated || view == StatsView::kTenant) j["clients"] = std::move(clients);
  // Paths come from the operator and names were checked at hello, but no byte sequence may make
  // a dump throw (it would take the server down): invalid UTF-8 is replaced.
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

std::string Server::Impl::MetricsText() const {
  std::vector<prometheus::MetricFamily> families = metrics_.registry->Collect();
  EngineStats st = engine_->Stats();
  using prometheus::ClientMetric;
  using prometheus::MetricFamily;
  using prometheus::MetricType;
  auto counter = [&](const char* name, const char* help,
                     std::vector<std::pair<std::string, double>> per_tier) {
    MetricFamily f{name, help, MetricType::Counter, {}};
    for (auto& [tier, v] : per_tier) {
      ClientMetric m;
      m.label.push_back({"tier", tier});
      m.counter.value = v;
      f.metric.push_back(std::move(m));
    }
    families.push_back(std::move(f));
  };
  auto d = [](uint64_t v) { return static_cast<double>(v); };
  auto tiers = [&](auto field) {
    std::vector<std::pair<std::string, double>> v{{"memory", d(field(st.memory))}};
    if (st.has_file) v.emplace_back("file", d(field(st.file)));
    return v;
  };
  counter("kvtier_lookups_total", "Lookups per tier",
          tiers([](const TierCounters& t) { return t.lookups; }));
  counter("kvtier_hits_total", "Chunks lookups found per tier",
          tiers([](const TierCounters& t) { return t.hits; }));
  counter("kvtier_served_total", "Chunks delivered to loads per tier",
          tiers([](const TierCounters& t) { return t.served; }));
  counter("kvtier_misses_total", "Chunks not found per tier",
          tiers([](const TierCounters& t) { return t.misses; }));
  counter("kvtier_bytes_written_total", "Chunk bytes written into each tier",
          tiers([](const TierCounters& t) { return t.bytes_in; }));
  counter("kvtier_bytes_read_total", "Chunk bytes read out of each tier",
          tiers([](const TierCounters& t) { return t.bytes_out; }));
  counter("kvtier_evictions_total", "Chunks evicted per tier",
          tiers([](const TierCounters& t) { return t.evictions; }));
  counter("kvtier_rejections_total", "Operations refused (pool or queue full) per tier",
          tiers([](const TierCounters& t) { return t.rejections; }));
  counter("kvtier_errors_total", "Errors per tier",
          tiers([](const TierCounters& t) { return t.errors; }));
  {
    MetricFamily f{"kvtier_engine_ops_total", "Engine operations", MetricType::Counter, {}};
    for (auto [name, v] :
         {std::pair{"store", st.stores}, std::pair{"load", st.loads},
          std::pair{"rejected", st.rejected_ops}, std::pair{"promotion", st.promotions},
          std::pair{"shared_read", st.shared_reads}, std::pair{"deadline_miss", st.deadline_misses},
          std::pair{"write_back", st.write_backs},
          std::pair{"write_back_failure", st.write_back_failures},
          std::pair{"dirty_eviction", st.dirty_evictions},
          std::pair{"dirty_refusal", st.memory_detail.dirty_refusals}}) {
      ClientMetric m;
      m.label.push_back({"op", name});
      m.counter.value = d(v);
      f.metric.push_back(std::move(m));
    }
    families.push_back(std::move(f));
  }
  auto gauge = [&](const char* name, const char* help,
                   std::vector<std::pair<std::string, double>> by_state, const char* label) {
    MetricFamily f{name, help, MetricType::Gauge, {}};
    for (auto& [k, v] : by_state) {
      ClientMetric m;
      if (label) m.label.push_back({label, k});
      m.gauge.value = v;
      f.metric.push_back(std::move(m));
    }
    families.push_back(std::move(f));
  };
  const MemoryTierStats& m = st.memory_detail;
  gauge(
      "kvtier_pool_slots", "L1 pool slots by state",
      {{"total", m.num_slots}, {"resident", m.resident}, {"pinned", m.pinned}, {"dirty", m.dirty}},
      "state");
  gauge("kvtier_pool_bytes", "L1 pool bytes",
        {{"capacity", d(m.capacity_bytes)},
         {"used", d(static_cast<uint64_t>(m.resident) * m.slot_bytes)}},
        "kind");
  if (st.has_file) {
    gauge("kvtier_file_tier_bytes", "File tier bytes",
          {{"used", d(st.file_detail.bytes)}, {"capacity", d(st.file_detail.capacity_bytes)}},
          "kind");
    gauge("kvtier_file_tier_queued", "File tier operations queued now",
          {{"read", d(st.file_detail.queued_reads)}, {"write", d(st.file_detail.queued_writes)}},
          "op");
    const FileTierStats& f = st.file_detail;
    MetricFamily index{"kvtier_file_tier_index_total",
                       "File tier index upkeep: rescans of the directory, probes of lookup misses",
                       MetricType::Counter,
                       {}};
    for (auto [name, v] :
         {std::pair{"rescan", f.rescans}, std::pair{"rescan_failure", f.rescan_failures},
          std::pair{"probe", f.probes}, std::pair{"probe_hit", f.probe_hits},
          std::pair{"probe_dropped", f.probes_dropped}}) {
      ClientMetric m;
      m.label.push_back({"op", name});
      m.counter.value = d(v);
      index.metric.push_back(std::move(m));
    }
    families.push_back(std::move(index));
    gauge("kvtier_file_tier_negative_cache_entries", "File tier keys known absent now",
          {{"", d(f.negative_cache_entries)}}, nullptr);
    gauge("kvtier_file_tier_last_rescan_seconds", "Duration of the file tier's last rescan",
          {{"", f.last_rescan_us / 1e6}}, nullptr);
  }
  return prometheus::TextSerializer().Serialize(families);
}

Server::Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Server::~Server() = default;

Result<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  Status s = impl->Init();
  if (!s.ok()) return s;
  return std::unique_ptr<Server>(new Server(std::move(impl)));
}

void Server::Stop() { impl_->Stop(); }
void Server::Wait() { impl_->Wait(); }
int Server::http_port() const { return impl_->http_port_; }
const std::string& Server::socket_path() const { return impl_->options_.socket_path; }
std::string Server::StatsJson() const { return impl_->StatsJson(); }
std::string Server::MetricsText() const { return impl_->MetricsText(); }
Engine& Server::engine() { return *impl_->engine_; }

}  // namespace kvtier::server

// Server: one Engine per node, shared with every inference process through a Unix socket and a
// shared-memory pool (docs/protocol.md).
//
// One "door" thread accepts connections and reads their hello with non-blocking I/O: a
// connection gets a thread of its own only once its handshake is accepted, so idle or silent
// connections cost no thread, are closed after hello_timeout, and at most max_pending_handshakes
// of them are kept (the oldest is dropped for a newcomer, so they cannot lock real clients out).
// Each accepted connection is served by its own thread (blocking reads with no polling hop, so a
// control round trip costs two wake-ups). Replies are written without blocking: what the socket
// does not take is queued (bounded) and written by one output thread, and a client that leaves
// replies unread past send_timeout or max_output_bytes is disconnected. prepare_load requests
// that must wait for the file tier complete on a small pool so a slow promotion never blocks a
// connection. Every connection's reservations and pins are tracked and released when it closes,
// however it closes, and are capped per client process (max_slots_per_client). With
// isolate_clients no client maps the pool: each gets a private window and the server copies
// chunks through it, and every connection belongs to a tenant the server determines (its peer
// uid, or the tenant its token names): keys are derived per tenant and stats show a client only
// its own tenant's clients. An HTTP listener serves /metrics (Prometheus text), /healthz and
// /stats.
//
// Thread-safety: Start, Stop and Wait may be called from any thread; StatsJson and MetricsText
// are thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "events/publisher.h"
#include "kvtier/engine.h"
#include "kvtier/status.h"

namespace kvtier::server {

struct ServerOptions {
  // The engine. Its namespace is set by the server (clients bring their own, see protocol.md);
  // chunk_bytes fixes the pool's slot size for every client.
  EngineOptions engine;
  std::string socket_path;   // REQUIRED
  std::string socket_group;  // empty: owner-only socket (0600); else 0660 and this group
  std::string token;         // empty: none required (excludes tenant_tokens)
  std::string http_host = "127.0.0.1";
  int http_port = 8790;        // 0: pick a free port (see http_port()); -1: no HTTP listener
  uint32_t max_clients = 256;  // connections past the handshake served at once
  // Of them, from one process (SO_PEERCRED pid): one process opening connections cannot lock
  // every other client out. 0 = a quarter of max_clients (at least 16, at most all).
  uint32_t max_clients_per_process = 0;
  // A reservation not committed or aborted within this is aborted by the server (a client that
  // hangs or forgets cannot hold pool slots for ever); its late commit is refused. 0 = never.
  std::chrono::milliseconds reservation_timeout{30000};
  uint32_t max_pending_handshakes = 64;  // connections not yet past hello; the oldest goes first
  std::chrono::milliseconds hello_timeout{5000};  // a connection silent this long is closed
  uint32_t max_message_bytes = 1u << 20;
  uint32_t max_keys_per_request = 4096;
  // Slots one client process may hold reserved or pinned at once, over all its connections;
  // 0 = half the pool.
  uint32_t max_slots_per_client = 0;
  // No client maps the pool: each gets a private window of max_slots_per_client slots, and the
  // server copies chunks in at commit and out at load (docs/protocol.md, "Isolated clients").
  // Costs one copy per chunk each way; keeps tenants from reading or writing each other's bytes.
  // With it every connection also belongs to a tenant, which the server determines and the
  // client cannot choose: its keys are derived from the tenant as well as from the namespace it
  // declares (so two tenants declaring the same namespace share nothing, in memory or in the
  // file tier), and its stats list only its own tenant's clients (docs/security.md).
  bool isolate_clients = false;
  // The windows' memory, all connections together: a window gets what is left of it, a
  // connection that would get none is refused (kUnavailable). 0 = four times the pool.
  uint64_t max_window_bytes = 0;
  // Who a connection's tenant is under isolate_clients. Empty: its peer uid (SO_PEERCRED), so
  // every process of one user is one tenant. Else a client must present one of these tokens at
  // hello and belongs to the tenant named with it (a tenant may have several tokens, e.g. while
  // one is rotated); any other token is refused. REQUIRES isolate_clients; excludes `token`.
  struct TenantToken {
    std::string tenant;  // a name: letters, digits and ._@- (at most 128 bytes)
    std::string token;   // at most 4096 bytes; unique across the list
  };
  std::vector<TenantToken> tenant_tokens;
  // KV-cache events in vLLM's format (docs/kv-events.md): descriptors (`describe`) are filed and
  // the tiers' changes announced on kv_events_options' endpoints. Off: `describe` is accepted
  // and ignored. Needs a build with libzmq and msgpack-cxx; an endpoint is refused with
  // isolate_clients (one stream would carry every tenant's prefixes).
  bool kv_events = false;
  events::PublisherOptions kv_events_options;
  int http_threads = 8;  // HTTP workers (each slow HTTP client ties one up for a while)
  std::chrono::milliseconds send_timeout{10000};  // a client not reading replies is dropped
  uint64_t max_output_bytes = 4u << 20;           // ... or once this much is queued for it
};

class Server {
 public:
  // Opens the engine, binds the socket (refusing a path where a server already answers; a stale
  // socket file is replaced), binds HTTP, and starts serving. Errors: kInvalidArgument for bad
  // options, kUnavailable when the socket or port is in use, kIOError/kPermissionDenied from the
  // OS, or the engine's error.
  static Result<std::unique_ptr<Server>> Start(const ServerOptions& options);
  ~Server();  // Stop(), then wait

  // Drains: stops accepting, refuses new handshakes, closes every connection (releasing what it
  // held), finishes the engine's queued writes, stops HTTP, removes the socket file. Idempotent.
  void Stop();
  // Blocks until Stop() has completed.
  void Wait();

  int http_port() const;  // the bound port, or -1 without HTTP
  const std::string& socket_path() const;
  // The statistics document with every client listed: the operator's view. With isolate_clients
  // HTTP /stats lists no client (counts only) and a client's `stats` only its tenant's clients.
  std::string StatsJson() const;
  std::string MetricsText() const;
  Engine& engine();

  class Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The namespace the server's engine (and its file tier directory) uses, derived from the pool's
// chunk size so that a restarted server with the same chunk size finds its files again.
KeyNamespace ServerNamespace(uint64_t chunk_bytes);

// The root a tenant's keys are derived from under isolate_clients (protocol.md, "Tenants"):
// SHA-256(str("kvtier/tenant/v1") || str(tenant) || ns.Root()), with str() as in
// docs/chunk-key.md. `tenant` is "uid:<uid>" or "tenant:<name>".
ChunkKey TenantRoot(const KeyNamespace& ns, std::string_view tenant);

// Derives stored keys from a client's keys (protocol.md, "Namespaces"). Not thread-safe: one per
// connection.
class KeyDeriver {
 public:
  // From ns.Root() (a shared pool), or from a root of the caller's (a tenant's, TenantRoot).
  explicit KeyDeriver(const KeyNamespace& ns);
  explicit KeyDeriver(const ChunkKey& root);
  ~KeyDeriver();
  KeyDeriver(const KeyDeriver&) = delete;
  KeyDeriver& operator=(const KeyDeriver&) = delete;
  ChunkKey Derive(const ChunkKey& client_key);

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace kvtier::server

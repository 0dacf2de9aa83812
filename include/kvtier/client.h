// Client of a `kvtier serve` daemon: a ChunkStore (kvtier/store.h), so that an integration switches
// between an in-process Engine and a shared server with one setting (kvtier/chunk_store.h opens
// either).
//
//   ClientOptions o;
//   o.ns = ns;  o.chunk_bytes = layout.bytes_per_chunk(256);
//   auto client = Client::Connect(o);
//   LookupResult hit = client.value()->Lookup(keys);
//   auto op = client.value()->Load(keys, destinations);  // asynchronous, like Engine::Load
//   OpResult r = op->Wait();                              // r.chunks leading chunks loaded
//
// The client library (kvtier_client) needs only the protocol codec and the common types: it
// links without the engine, the tiers, io_uring, prometheus-cpp or cpp-httplib.
//
// In server mode the chunks live in the server's L1 pool, a shared-memory arena that the client
// maps in full (MAP_SHARED, page-aligned: pool_base() can be registered with cudaHostRegister).
// Data never crosses the socket: Store and Load copy between caller memory and pool slots in
// this process; the zero-copy calls (ReserveSlots/CommitSlots, PrepareLoad/Unpin) let a caller
// (e.g. a GPU copy engine) read and write slots itself. docs/protocol.md defines the protocol.
//
// Failure model: a cache never stalls its caller. If the server dies or stops answering within
// rpc_timeout, the connection is marked broken and closed (the server then releases everything
// this client held); from then on Lookup reports zero hits and every other call fails fast with
// kUnavailable. Reconnect by creating a new Client (slot numbers of the old one mean nothing).
//
// Thread-safety: every method of ChunkStore, Client and AsyncOp is thread-safe. Requests from
// several threads are pipelined over the one connection.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvtier/chunk_key.h"
#include "kvtier/socket_path.h"
#include "kvtier/store.h"
#include "kvtier/status.h"

namespace kvtier {

struct ClientOptions {
  std::string socket_path;   // empty = DefaultSocketPath()
  KeyNamespace ns;           // REQUIRED: scopes every key this client sends
  uint64_t chunk_bytes = 0;  // REQUIRED: must equal the server's pool chunk size (0 = adopt it)
  std::string token;         // the server's shared secret, or this client's tenant token
  std::string client_name;   // shown in server logs; printable UTF-8, at most 256 bytes
  // The uid the server must run as (checked with SO_PEERCRED before the token is sent). -1:
  // $KVTIER_SERVER_UID if set, else this process's uid or root.
  int64_t server_uid = -1;
  std::chrono::milliseconds connect_timeout{5000};
  std::chrono::milliseconds rpc_timeout{10000};  // a server silent this long is declared dead
  int copy_threads = 1;           // threads copying for Store/Load (not used by zero-copy calls)
  size_t max_queued_copies = 64;  // Store/Load batches queued before kRejected
  bool populate_mapping = true;   // MAP_POPULATE the pool mapping so first copies run full speed
};

// A connection to a `kvtier serve` daemon. See the file comment.
class Client final : public ChunkStore {
 public:
  // Connects, checks the server's identity (server_uid), performs the handshake (version,
  // namespace, chunk size, token) and maps the pool.
  // Fails with kUnavailable if no server listens at the socket, kPermissionDenied for a wrong
  // token, socket permissions or a server running as an unexpected user, kInvalidArgument for a
  // namespace or chunk size the server refuses (the message says why), kTimeout if the server does
  // not answer in time.
  static Result<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  ~Client() override;  // waits for queued Store/Load copies, then closes the connection
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  uint64_t chunk_bytes() const override;
  LookupResult Lookup(std::span<const ChunkKey> keys) override;
  // Like Lookup, but a broken connection is an error rather than zero hits.
  Result<LookupResult> TryLookup(std::span<const ChunkKey> keys);
  Result<AsyncOp> Store(std::span<const ChunkKey> keys,
                        std::span<const std::span<const uint8_t>> src) override;
  Result<AsyncOp> Load(std::span<const ChunkKey> keys,
                       std::span<const std::span<uint8_t>> dst) override;
  // REQUIRES for the zero-copy calls: keys.size() <= max_keys_per_request().
  Result<std::vector<SlotId>> ReserveSlots(std::span<const ChunkKey> keys) override;
  Status CommitSlots(std::span<const ChunkKey> keys, std::span<const SlotId> slots) override;
  Status AbortSlots(std::span<const SlotId> slots) override;
  Result<AsyncOp> PrepareLoad(std::span<const ChunkKey> keys) override;
  Status Unpin(std::span<const SlotId> slots) override;
  std::span<uint8_t> SlotData(SlotId slot) const override;
  uint8_t* pool_base() const override;
  uint64_t pool_bytes() const override;

  // An empty round trip (for health checks and latency measurements).
  Status Ping();
  // Tells the server the vLLM block hashes of chunks, for its KV-cache events
  // (docs/kv-events.md): descriptors[i] is the msgpack descriptor of the chunk keys[i] names (a
  // client key, as in Store). A server without --kv-events accepts and ignores them. Batches of
  // any length are split to the server's limits. kInvalidArgument if the spans differ in length
  // or a descriptor is empty or over 16 KiB (nothing is sent then).
  Status Describe(std::span<const ChunkKey> keys,
                  std::span<const std::span<const uint8_t>> descriptors);
  // The server's statistics as JSON (protocol.md, `stats`; isolated: its tenant's clients only).
  Result<std::string> StatsJson();
  // False once the connection broke; the reason is in broken_status().
  bool connected() const;
  Status broken_status() const;
  uint64_t session_id() const;
  uint32_t num_slots() const;
  uint64_t slot_bytes() const;
  uint32_t max_keys_per_request() const;

  class Impl;

 private:
  explicit Client(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;  // shared with pending operations
};

}  // namespace kvtier

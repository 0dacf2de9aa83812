// Publisher: kvtier's KV-cache events on vLLM's transport (docs/kv-events.md).
//
// The tiers tell it of every change to their indexes (TierListener, one small record pushed into
// a bounded lock-free queue, dropped and counted when full: a store or load never waits). The
// server tells it which client chunk each stored key is (Bind, at reserve and load) and what the
// client said of the chunk (Describe: vLLM's block hashes). One thread owns all state: it joins
// the three, announces a chunk in a medium once every rank's shard is in that tier and its
// parent chunk is announced somewhere, reference-counts hashes per topic and medium, batches the
// events, publishes them on a ZMQ PUB socket as [topic, seq, KVEventBatch], keeps the last
// batches in a ring and answers replay requests on a ROUTER socket (the ring, or a snapshot of
// what is announced now when the ring no longer reaches back far enough). It also gives the
// file tier each chunk's descriptor for the file's header, and reads the headers of files it
// finds but did not describe (another host's, or found at start) on a thread of its own.
//
// Thread-safety: every method is thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "kvtier/chunk_key.h"
#include "kvtier/status.h"
#include "kvtier/tier_listener.h"

namespace kvtier::events {

struct PublisherOptions {
  // ZMQ endpoints, vLLM's rule: one containing '*' or "::", or ipc:// or inproc://, is bound;
  // any other is connected to (the subscriber binds). Empty: no PUB socket (state only).
  std::string endpoint;
  std::string replay_endpoint;  // always bound; empty: no replay
  std::string bind_host;        // replaces '*' in both endpoints (one interface)
  // {host}: pod (or the host name), {model}: the namespace's model id, {ns}: its group id.
  std::string topic = "kv@{host}@{model}";
  std::string pod;  // empty: the host name
  std::string medium_cpu = "CPU";
  std::string medium_storage = "STORAGE";
  bool token_ids = true;  // false: location-only events (no token ids, block_size 0)
  bool clear_on_start = false;
  std::chrono::milliseconds batch_interval{10};
  size_t max_batch_events = 256;
  size_t max_batch_bytes = 1 << 20;
  size_t buffer_steps = 10000;             // batches kept for replay
  uint64_t buffer_bytes = 64ull << 20;     // and at most these bytes of them
  int hwm = 100000;                        // ZMQ send high-water mark (messages)
  size_t max_queue_size = 65536;           // records between the tiers and the publisher
  size_t replay_max_chunks = 65536;        // chunks per snapshot
  size_t max_pending_descriptors = 65536;  // descriptors of chunks in no tier
  std::chrono::seconds descriptor_ttl{600};
  // Headers of chunk files this host did not describe (another host's, or found at start) read
  // for their descriptors, at most this many a second; 0: none are read.
  double describe_reads_per_s = 200;
};

// Checks endpoints and sizes without opening anything (for start-up errors).
Status ValidatePublisherOptions(const PublisherOptions& o);

struct PublisherStats {
  uint64_t stored_events[2] = {};   // BlockStored per medium (0: CPU, 1: STORAGE)
  uint64_t removed_events[2] = {};  // BlockRemoved per medium
  uint64_t cleared_events = 0;
  uint64_t batches = 0;
  uint64_t dropped_queue_full = 0;    // records the tiers could not push
  uint64_t dropped_descriptors = 0;   // invalid, over the bound, or expired before any commit
  uint64_t descriptor_conflicts = 0;  // a different descriptor for a chunk already described
  uint64_t replays_ring = 0, replays_snapshot = 0;
  uint64_t undescribed_chunks = 0;  // chunks in a tier with no descriptor (a gauge)
  uint64_t announced_chunks = 0;    // (chunk, medium) pairs announced now (a gauge)
  // Descriptors in chunk files (docs/file-format.md): written into headers, left out of them
  // (even location-only it would not fit), read from headers of files this host found,
  // and headers whose descriptor could not be read or taken (I/O error, corrupt, invalid).
  uint64_t file_descriptors_written = 0;
  uint64_t file_descriptors_too_large = 0;
  uint64_t file_descriptors_read = 0;
  uint64_t file_descriptor_errors = 0;
};

// What the publisher knows of a group (a namespace without its rank: the ranks of one TP group
// share a descriptor and are announced once).
struct GroupInfo {
  std::string model_id;
  std::string ns_id;  // for {ns}
  uint32_t chunk_tokens = 0;
  uint32_t world_size = 1;
};

class Publisher final : public TierListener {
 public:
  // Opens the sockets (a bad endpoint fails here, with a message) and starts the thread.
  static Result<std::shared_ptr<Publisher>> Start(const PublisherOptions& options);
  ~Publisher() override;  // Stop()
  // Publishes what is batched, closes the sockets, ends the thread. Idempotent.
  void Stop();

  // The endpoints as bound (tcp://*:0 resolved to its port); empty where none.
  std::string endpoint() const;
  std::string replay_endpoint() const;

  // Idempotent; needed before the group's chunks can be announced.
  void RegisterGroup(uint64_t group, const GroupInfo& info);
  // `stored` is rank `rank`'s shard of the group's chunk `client_key`. Never blocks.
  void Bind(uint64_t group, const ChunkKey& client_key, uint32_t rank, const ChunkKey& stored);
  // Checks a descriptor and files it (kept while the chunk is in a tier, or pending for
  // descriptor_ttl, at most max_pending_descriptors). An invalid one is counted and its error
  // returned.
  Status Describe(uint64_t group, const ChunkKey& client_key, std::span<const uint8_t> descriptor);

  void OnTierChange(TierId tier, const ChunkKey& key, bool stored) noexcept override;
  // The descriptor for the header of `key`'s chunk file (EncodeFileDescriptor): the group, rank
  // and client key Bind gave, the descriptor Describe gave, both remembered for the most recent
  // max_queue_size bindings and max_pending_descriptors descriptors. Empty if either is
  // missing: a chunk described after its file was written has no descriptor in the file.
  std::string ChunkDescriptor(const ChunkKey& key) noexcept override;

  // How to read the descriptor in a chunk file's header (Engine::ReadChunkDescriptor). Files
  // found in the file tier whose key this process never bound (another host's, or found at
  // start) are queued until then, and read at most describe_reads_per_s a second on a thread
  // of the publisher's; a descriptor found is bound and filed as if its client had described
  // it. Set once, before or after Start's tiers open; the reader must stay valid until Stop.
  using DescriptorReader = std::function<Result<std::string>(const ChunkKey& stored)>;
  void SetDescriptorReader(DescriptorReader reader);

  PublisherStats Stats() const;
  // Waits until every record pushed so far has been applied and its batch published (tests).
  bool Flush(std::chrono::milliseconds timeout);

  class Impl;

 private:
  explicit Publisher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvtier::events

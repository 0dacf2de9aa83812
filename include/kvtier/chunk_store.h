// Opens the KV store an inference integration talks to: an Engine in this process, or a
// `kvtier serve` shared by every process on the node, behind one interface (ChunkStore,
// kvtier/client.h), chosen by one setting.
//
//   ChunkStoreOptions o;
//   o.mode = ChunkStoreMode::kServer;                 // or kInProcess
//   o.client.ns = ns;  o.client.chunk_bytes = layout.bytes_per_chunk(256);
//   o.engine.ns = ns;  o.engine.chunk_bytes = ...;   // used by kInProcess
//   auto store = OpenChunkStore(o);
//
// Thread-safety: the functions are thread-safe; so is every ChunkStore they return.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "kvtier/client.h"
#include "kvtier/engine.h"
#include "kvtier/status.h"

namespace kvtier {

enum class ChunkStoreMode : uint8_t { kInProcess, kServer };
// "in_process"/"in-process"/"local" or "server".
Result<ChunkStoreMode> ParseChunkStoreMode(std::string_view name);

struct ChunkStoreOptions {
  ChunkStoreMode mode = ChunkStoreMode::kInProcess;
  EngineOptions engine;  // kInProcess: the engine to open in this process
  ClientOptions client;  // kServer: the server to connect to
};

// Opens an in-process Engine or connects to a server, per options.mode.
Result<std::unique_ptr<ChunkStore>> OpenChunkStore(const ChunkStoreOptions& options);
// Wraps an already open engine (not owned; it must outlive the store).
std::unique_ptr<ChunkStore> WrapEngine(Engine* engine);

}  // namespace kvtier

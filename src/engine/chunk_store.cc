// The in-process ChunkStore: an Engine behind the interface a server's Client also has, and the
// factory that opens one or the other (include/kvtier/chunk_store.h). Beside the engine, so that
// the client library links without it.
#include "kvtier/chunk_store.h"

#include <fmt/format.h>

#include <atomic>
#include <memory>

namespace kvtier {

Result<ChunkStoreMode> ParseChunkStoreMode(std::string_view name) {
  if (name == "in_process" || name == "in-process" || name == "local") {
    return ChunkStoreMode::kInProcess;
  }
  if (name == "server") return ChunkStoreMode::kServer;
  return Status::InvalidArgument(
      fmt::format("unknown chunk store mode \"{}\" (expected in_process or server)", name));
}

namespace {

class EngineOp final : public AsyncOp::Impl {
 public:
  EngineOp(OpHandle h, Engine* engine, bool owns_pins)
      : h_(std::move(h)), engine_(engine), owns_pins_(owns_pins) {}
  ~EngineOp() override {
    // Pins nobody took are given back when the load ends, without waiting for it here.
    if (owns_pins_ && !taken_) {
      h_.OnDone([engine = engine_](const OpResult& r) { engine->Unpin(r.slots); });
    }
  }
  bool Done() override { return h_.Done(); }
  std::optional<OpResult> WaitFor(std::optional<std::chrono::nanoseconds> timeout) override {
    std::optional<OpResult> r = timeout ? h_.WaitFor(*timeout) : std::optional(h_.Wait());
    if (r) taken_ = true;
    return r;
  }

 private:
  OpHandle h_;
  Engine* engine_;
  bool owns_pins_;
  std::atomic<bool> taken_{false};
};

class EngineStore final : public ChunkStore {
 public:
  EngineStore(Engine* engine, std::unique_ptr<Engine> owned)
      : engine_(engine), owned_(std::move(owned)) {}
  uint64_t chunk_bytes() const override { return engine_->options().chunk_bytes; }
  LookupResult Lookup(std::span<const ChunkKey> keys) override { return engine_->Lookup(keys); }
  Result<AsyncOp> Store(std::span<const ChunkKey> keys,
                        std::span<const std::span<const uint8_t>> src) override {
    KVTIER_ASSIGN_OR_RETURN(auto h, engine_->Store(keys, src));
    return AsyncOp(std::make_shared<EngineOp>(std::move(h), engine_, false));
  }
  Result<AsyncOp> Load(std::span<const ChunkKey> keys,
                       std::span<const std::span<uint8_t>> dst) override {
    KVTIER_ASSIGN_OR_RETURN(auto h, engine_->Load(keys, dst));
    return AsyncOp(std::make_shared<EngineOp>(std::move(h), engine_, false));
  }
  Result<std::vector<SlotId>> ReserveSlots(std::span<const ChunkKey> keys) override {
    return engine_->ReserveSlots(keys);
  }
  Status CommitSlots(std::span<const ChunkKey> keys, std::span<const SlotId> slots) override {
    engine_->CommitSlots(keys, slots);
    return Status::Ok();
  }
  Status AbortSlots(std::span<const SlotId> slots) override {
    engine_->AbortSlots(slots);
    return Status::Ok();
  }
  Result<AsyncOp> PrepareLoad(std::span<const ChunkKey> keys) override {
    KVTIER_ASSIGN_OR_RETURN(auto h, engine_->PrepareLoad(keys));
    return AsyncOp(std::make_shared<EngineOp>(std::move(h), engine_, true));
  }
  Status Unpin(std::span<const SlotId> slots) override {
    engine_->Unpin(slots);
    return Status::Ok();
  }
  std::span<uint8_t> SlotData(SlotId slot) const override { return engine_->SlotData(slot); }
  uint8_t* pool_base() const override { return engine_->pool().base; }
  uint64_t pool_bytes() const override { return engine_->pool().bytes; }

 private:
  Engine* engine_;
  std::unique_ptr<Engine> owned_;
};

}  // namespace

std::unique_ptr<ChunkStore> WrapEngine(Engine* engine) {
  return std::make_unique<EngineStore>(engine, nullptr);
}

Result<std::unique_ptr<ChunkStore>> OpenChunkStore(const ChunkStoreOptions& options) {
  if (options.mode == ChunkStoreMode::kServer) {
    KVTIER_ASSIGN_OR_RETURN(auto client, Client::Connect(options.client));
    return std::unique_ptr<ChunkStore>(std::move(client));
  }
  KVTIER_ASSIGN_OR_RETURN(auto engine, Engine::Open(options.engine));
  Engine* raw = engine.get();
  return std::unique_ptr<ChunkStore>(std::make_unique<EngineStore>(raw, std::move(engine)));
}

}  // namespace kvtier

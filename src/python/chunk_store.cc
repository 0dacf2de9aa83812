// ChunkStore: an in-process engine (open_engine) or a `kvtier serve` connection (connect) behind
// one Python class, with its async ops (AsyncOp, OpResult) and zero-copy slot views.
#include "kvtier/chunk_store.h"

#include <Python.h>  // first, as Python's headers require
#include <fmt/format.h>
#include <nanobind/nanobind.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kvtier/chunk_key.h"
#include "kvtier/client.h"
#include "kvtier/engine.h"
#include "kvtier/status.h"
#include "python/binding.h"
#include "python/stats.h"
#include "server/config.h"

namespace kvtier::python {
namespace {

// Slots this Python store reserved (with their keys) and pins it holds, so that commit, abort and
// unpin only ever pass the core slots that are the caller's to give back: the memory tier trusts
// its callers, and a wrong slot would corrupt it.
class SlotLedger {
 public:
  void AddReserved(std::span<const ChunkKey> keys, std::span<const SlotId> slots) {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < slots.size(); ++i) {
      if (slots[i] != kNoSlot) reserved_[slots[i]] = keys[i];
    }
  }
  // Checks every slot first, then forgets them all. `keys` (null for aborts) must match.
  Status TakeReserved(const std::vector<ChunkKey>* keys, std::span<const SlotId> slots) {
    std::lock_guard lock(mu_);
    std::unordered_set<SlotId> seen;
    for (size_t i = 0; i < slots.size(); ++i) {
      const SlotId s = slots[i];
      if (s == kNoSlot) continue;
      auto it = reserved_.find(s);
      if (it == reserved_.end()) {
        return Status::InvalidArgument(fmt::format("slot {} is not reserved by this store", s));
      }
      if (keys != nullptr && (*keys)[i] != it->second) {
        return Status::InvalidArgument(
            fmt::format("slot {} was reserved for another key than keys[{}]", s, i));
      }
      if (!seen.insert(s).second) {
        return Status::InvalidArgument(fmt::format("slot {} is given twice", s));
      }
    }
    for (SlotId s : slots) reserved_.erase(s);
    return Status::Ok();
  }
  void AddPins(std::span<const SlotId> slots) {
    std::lock_guard lock(mu_);
    for (SlotId s : slots) ++pins_[s];
  }
  Status TakePins(std::span<const SlotId> slots) {
    std::lock_guard lock(mu_);
    std::unordered_map<SlotId, uint32_t> want;
    for (SlotId s : slots) ++want[s];
    for (const auto& [s, n] : want) {
      auto it = pins_.find(s);
      if (it == pins_.end() || it->second < n) {
        return Status::InvalidArgument(
            fmt::format("slot {} is not pinned by this store (or not that often)", s));
      }
    }
    for (const auto& [s, n] : want) {
      auto it = pins_.find(s);
      if ((it->second -= n) == 0) pins_.erase(it);
    }
    return Status::Ok();
  }

 private:
  std::mutex mu_;
  std::unordered_map<SlotId, ChunkKey> reserved_;
  std::unordered_map<SlotId, uint32_t> pins_;
};

// What a Python ChunkStore shares with everything it hands out (ops, slot views): they keep it
// alive, so none of them can outlive the engine or the pool mapping they point into.
struct StoreCore {
  ~StoreCore() {
    store.reset();  // the adapter before the engine it points to
    if (engine) FlushEngine();
    engine.reset();
  }
  // Shutdown of an in-process engine, as `kvtier serve` drains: with write-back, L1's chunks go
  // to L2 now (they would be lost with the process); then queued operations and writes finish.
  // A cache cannot fail its caller here, so errors are logged.
  void FlushEngine() {
    Status s = engine->FlushDirty();
    if (!s.ok()) spdlog::error("kvtier: writing back L1 chunks at close: {}", s.ToString());
  }
  std::unique_ptr<Engine> engine;     // in-process mode
  std::unique_ptr<ChunkStore> store;  // WrapEngine(engine) or the Client
  Client* client = nullptr;           // server mode: `store`, as a Client
  uint32_t num_slots = 0;
  SlotLedger ledger;
};

struct PyOpResult {
  bool ok = true;
  std::string code = "ok";
  std::string message;
  uint64_t chunks = 0;
  std::vector<int64_t> slots;

  static PyOpResult From(const OpResult& r) {
    PyOpResult p;
    p.ok = r.status.ok();
    p.code = CodeName(r.status.code());
    p.message = r.status.ok() ? "" : r.status.message();
    p.chunks = r.chunks;
    p.slots.assign(r.slots.begin(), r.slots.end());
    return p;
  }
  std::string Repr() const {
    return fmt::format("OpResult(ok={}, code='{}', chunks={}, slots={}{})", ok ? "True" : "False",
                       code, chunks, slots.size(), message.empty() ? "" : ", message=" + message);
  }
};

class PyAsyncOp {
 public:
  PyAsyncOp(std::shared_ptr<StoreCore> core, AsyncOp op, std::vector<HeldBuffer> buffers,
            bool pins_to_caller)
      : core_(std::move(core)),
        op_(std::move(op)),
        buffers_(std::move(buffers)),
        pins_to_caller_(pins_to_caller) {}
  PyAsyncOp(const PyAsyncOp&) = delete;
  PyAsyncOp& operator=(const PyAsyncOp&) = delete;

  ~PyAsyncOp() {
    if (result_) {
      // Done and taken: the buffers are back and any pins are the caller's. What is left may
      // still block: a remote op's destructor takes the connection's lock, and the core may be
      // the store's last reference.
      Reaper::Reap([op = std::move(op_), core = std::move(core_)]() mutable {
        op.reset();
        core.reset();
      });
      return;
    }
    // Maybe still running: the reaper waits for it before the caller's buffers go back. A
    // PrepareLoad op is not waited on: its destructor releases the pins it would have handed out.
    auto held = std::make_shared<std::vector<HeldBuffer>>(std::move(buffers_));
    Reaper::Reap([op = std::move(op_), core = std::move(core_), held]() mutable {
      if (!held->empty()) (void)op->Wait();
      op.reset();
      for (HeldBuffer& b : *held) b.Release();  // takes the GIL
      core.reset();
    });
  }

  bool Done() {
    if (result_) return true;
    AsyncOp op = *op_;
    nb::gil_scoped_release release;
    return op.Done();
  }

  std::optional<PyOpResult> Wait(std::optional<double> timeout) {
    const double seconds = timeout ? CheckedTimeout(*timeout) : 0;
    if (result_) return result_;
    // Beyond ~30 years a deadline is "forever" (and would overflow the clock).
    const bool forever = !timeout || seconds > 1e9;
    const auto deadline = forever ? Clock::time_point::max()
                                  : Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                       std::chrono::duration<double>(seconds));
    AsyncOp op = *op_;
    std::optional<OpResult> r;
    for (;;) {
      // Waits in slices so Ctrl-C (handled by the main thread, with the GIL) can interrupt.
      const auto now = Clock::now();
      const auto slice = std::min<Clock::duration>(std::chrono::milliseconds(100),
                                                   deadline - std::min(now, deadline));
      {
        nb::gil_scoped_release release;
        r = op.WaitFor(slice);
      }
      if (r || Clock::now() >= deadline) break;
      if (PyErr_CheckSignals() != 0) throw nb::python_error();
    }
    if (!r) return std::nullopt;
    if (!result_) Finish(*r);  // another thread may have finished it meanwhile
    return result_;
  }

 private:
  // REQUIRES: the GIL is held (it serializes Finish).
  void Finish(const OpResult& r) {
    result_ = PyOpResult::From(r);
    if (pins_to_caller_) core_->ledger.AddPins(r.slots);
    for (HeldBuffer& b : buffers_) b.Release();
    buffers_.clear();
  }

  std::shared_ptr<StoreCore> core_;
  std::optional<AsyncOp> op_;
  std::vector<HeldBuffer> buffers_;
  std::optional<PyOpResult> result_;
  const bool pins_to_caller_;
};

// Exports a slot's bytes (buffer protocol) while keeping the store alive: a memoryview of it can
// never point into an unmapped pool.
struct SlotBuffer {
  SlotBuffer(std::shared_ptr<StoreCore> c, uint8_t* d, size_t n)
      : core(std::move(c)), data(d), size(n) {}
  ~SlotBuffer() { ReapShared(std::move(core)); }
  std::shared_ptr<StoreCore> core;
  uint8_t* data;
  size_t size;
};

int SlotBufferGet(PyObject* self, Py_buffer* view, int flags) {
  SlotBuffer* b = nb::inst_ptr<SlotBuffer>(self);
  return PyBuffer_FillInfo(view, self, b->data, static_cast<Py_ssize_t>(b->size),
                           /*readonly=*/0, flags);
}

PyType_Slot kSlotBufferSlots[] = {
    {Py_bf_getbuffer, reinterpret_cast<void*>(SlotBufferGet)},
    {0, nullptr},
};

class PyChunkStore {
 public:
  PyChunkStore(std::shared_ptr<StoreCore> core, std::string mode)
      : core_(std::move(core)), mode_(std::move(mode)) {
    chunk_bytes_ = core_->store->chunk_bytes();
  }
  PyChunkStore(const PyChunkStore&) = delete;
  PyChunkStore& operator=(const PyChunkStore&) = delete;
  virtual ~PyChunkStore() { ReapShared(std::move(core_)); }

  uint64_t chunk_bytes() const { return chunk_bytes_; }
  const std::string& mode() const { return mode_; }
  bool closed() const { return core_ == nullptr; }
  uint64_t pool_base() const { return reinterpret_cast<uintptr_t>(Core()->store->pool_base()); }
  uint64_t pool_bytes() const { return Core()->store->pool_bytes(); }
  uint32_t num_slots() const { return Core()->num_slots; }

  nb::tuple Lookup(nb::handle keys_obj) {
    std::vector<ChunkKey> keys = ParseKeys(keys_obj);
    LookupResult r = Run([&](StoreCore& c) { return c.store->Lookup(keys); });
    return nb::make_tuple(r.total, r.memory);
  }

  PyAsyncOp* Store(nb::handle keys_obj, nb::handle buffers_obj) {
    std::vector<ChunkKey> keys = ParseKeys(keys_obj);
    std::vector<HeldBuffer> held = ParseChunkBuffers(buffers_obj, HeldBuffer::Access::kRead);
    std::vector<std::span<const uint8_t>> src;
    src.reserve(held.size());
    for (const HeldBuffer& b : held) src.emplace_back(b.data(), b.size());
    std::shared_ptr<StoreCore> core = Core();
    AsyncOp op = Unwrap(Run([&](StoreCore& c) { return c.store->Store(keys, src); }));
    return new PyAsyncOp(std::move(core), std::move(op), std::move(held), false);
  }

  PyAsyncOp* Load(nb::handle keys_obj, nb::handle buffers_obj) {
    std::vector<ChunkKey> keys = ParseKeys(keys_obj);
    std::vector<HeldBuffer> held = ParseChunkBuffers(buffers_obj, HeldBuffer::Access::kWrite);
    std::vector<std::span<uint8_t>> dst;
    dst.reserve(held.size());
    for (const HeldBuffer& b : held) dst.emplace_back(b.data(), b.size());
    std::shared_ptr<StoreCore> core = Core();
    AsyncOp op = Unwrap(Run([&](StoreCore& c) { return c.store->Load(keys, dst); }));
    return new PyAsyncOp(std::move(core), std::move(op), std::move(held), false);
  }

  std::vector<int64_t> ReserveSlots(nb::handle keys_obj) {
    std::vector<ChunkKey> keys = ParseKeys(keys_obj);
    std::vector<SlotId> slots = Unwrap(Run([&](StoreCore& c) {
      Result<std::vector<SlotId>> r = c.store->ReserveSlots(keys);
      if (r.ok()) c.ledger.AddReserved(keys, *r);
      return r;
    }));
    return ToPython(slots);
  }

  void CommitSlots(nb::handle keys_obj, nb::handle slots_obj) {
    std::vector<ChunkKey> keys = ParseKeys(keys_obj);
    std::vector<SlotId> slots = ParseSlots(slots_obj, /*allow_no_slot=*/true);
    if (slots.size() > keys.size()) {
      ThrowInvalid(
          fmt::format("commit_slots: {} slots but only {} keys", slots.size(), keys.size()));
    }
    keys.resize(slots.size());
    Check(Run([&](StoreCore& c) {
      KVTIER_RETURN_IF_ERROR(c.ledger.TakeReserved(&keys, slots));
      return slots.empty() ? Status::Ok() : c.store->CommitSlots(keys, slots);
    }));
  }

  void AbortSlots(nb::handle slots_obj) {
    std::vector<SlotId> slots = DropNoSlot(ParseSlots(slots_obj, /*allow_no_slot=*/true));
    Check(Run([&](StoreCore& c) {
      KVTIER_RETURN_IF_ERROR(c.ledger.TakeReserved(nullptr, slots));
      return slots.empty() ? Status::Ok() : c.store->AbortSlots(slots);
    }));
  }

  PyAsyncOp* PrepareLoad(nb::handle keys_obj) {
    std::vector<ChunkKey> keys = ParseKeys(keys_obj);
    std::shared_ptr<StoreCore> core = Core();
    AsyncOp op = Unwrap(Run([&](StoreCore& c) { return c.store->PrepareLoad(keys); }));
    return new PyAsyncOp(std::move(core), std::move(op), {}, /*pins_to_caller=*/true);
  }

  void Unpin(nb::handle slots_obj) {
    std::vector<SlotId> slots = ParseSlots(slots_obj, /*allow_no_slot=*/false);
    Check(Run([&](StoreCore& c) {
      KVTIER_RETURN_IF_ERROR(c.ledger.TakePins(slots));
      return slots.empty() ? Status::Ok() : c.store->Unpin(slots);
    }));
  }

  uint64_t SlotAddress(int64_t slot) { return reinterpret_cast<uintptr_t>(SlotSpan(slot).data()); }

  nb::object SlotView(int64_t slot) {
    std::span<uint8_t> s = SlotSpan(slot);
    nb::object exporter =
        nb::cast(new SlotBuffer(Core(), s.data(), s.size()), nb::rv_policy::take_ownership);
    return nb::steal(PyMemoryView_FromObject(exporter.ptr()));
  }

  nb::dict Stats() {
    std::shared_ptr<StoreCore> core = Core();
    if (core->client != nullptr) {
      std::string text = Unwrap(Run([](StoreCore& c) { return c.client->StatsJson(); }));
      return nb::cast<nb::dict>(nb::module_::import_("json").attr("loads")(text));
    }
    EngineStats s = Run([](StoreCore& c) { return c.engine->Stats(); });
    return EngineStatsDict(s);
  }

  // Blocking: an engine writes L1's dirty chunks to L2 (write-back) and finishes queued
  // operations and writes; a client waits for its copies and disconnects. Ops and slot views still
  // alive keep the C++ store until they go.
  void Close() {
    if (!core_) return;
    std::shared_ptr<StoreCore> core = std::move(core_);
    nb::gil_scoped_release release;
    if (core->engine) core->FlushEngine();  // done now, even if an op keeps the engine alive
    core.reset();
  }

 protected:
  std::shared_ptr<StoreCore> Core() const {
    if (!core_) throw StatusError("closed", "the store is closed");
    return core_;
  }

  // Runs f(core) with the GIL released. The core reference is dropped before the GIL is taken
  // back: if close() ran meanwhile, the last reference (and the blocking destructor) is ours.
  template <typename F>
  auto Run(F&& f) const -> decltype(f(std::declval<StoreCore&>())) {
    std::shared_ptr<StoreCore> core = Core();
    nb::gil_scoped_release release;
    struct Drop {
      std::shared_ptr<StoreCore>& c;
      ~Drop() { c.reset(); }
    } drop{core};
    return f(*core);
  }

 private:
  std::vector<SlotId> ParseSlots(nb::handle obj, bool allow_no_slot) const {
    const uint32_t n = Core()->num_slots;
    std::vector<int64_t> ids = ParseIntegers(obj, "slots");
    std::vector<SlotId> slots(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] == -1 && allow_no_slot) {
        slots[i] = kNoSlot;
      } else if (ids[i] < 0 || ids[i] >= int64_t{n}) {
        ThrowInvalid(fmt::format("slots[{}] = {} is out of range [0, {})", i, ids[i], n));
      } else {
        slots[i] = static_cast<SlotId>(ids[i]);
      }
    }
    return slots;
  }

  static std::vector<SlotId> DropNoSlot(std::vector<SlotId> slots) {
    std::erase(slots, kNoSlot);
    return slots;
  }

  static std::vector<int64_t> ToPython(const std::vector<SlotId>& slots) {
    std::vector<int64_t> out(slots.size());
    for (size_t i = 0; i < slots.size(); ++i) {
      out[i] = slots[i] == kNoSlot ? -1 : int64_t{slots[i]};
    }
    return out;
  }

  std::span<uint8_t> SlotSpan(int64_t slot) const {
    std::shared_ptr<StoreCore> core = Core();
    if (slot < 0 || slot >= int64_t{core->num_slots}) {
      ThrowInvalid(fmt::format("slot {} is out of range [0, {})", slot, core->num_slots));
    }
    std::span<uint8_t> s = core->store->SlotData(static_cast<SlotId>(slot));
    if (s.data() == nullptr) ThrowInvalid(fmt::format("slot {} has no memory", slot));
    return s;
  }

  std::shared_ptr<StoreCore> core_;  // null once closed; touched with the GIL held only
  std::string mode_;
  uint64_t chunk_bytes_ = 0;
};

class PyServerClient : public PyChunkStore {
 public:
  using PyChunkStore::PyChunkStore;

  void Ping() {
    Check(Run([](StoreCore& c) { return c.client->Ping(); }));
  }
  void Describe(nb::handle keys_obj, nb::handle descriptors_obj) {
    std::vector<ChunkKey> keys = ParseKeys(keys_obj);
    // Copied while the GIL is held: the call then runs without it.
    std::vector<std::string> owned;
    if (!nb::isinstance<nb::list>(descriptors_obj) && !nb::isinstance<nb::tuple>(descriptors_obj)) {
      ThrowInvalid("describe: descriptors must be a list of bytes");
    }
    for (nb::handle d : descriptors_obj) {
      if (!nb::isinstance<nb::bytes>(d)) ThrowInvalid("describe: each descriptor must be bytes");
      nb::bytes b = nb::borrow<nb::bytes>(d);
      owned.emplace_back(b.c_str(), b.size());
    }
    std::vector<std::span<const uint8_t>> views;
    views.reserve(owned.size());
    for (const std::string& o : owned) {
      views.emplace_back(reinterpret_cast<const uint8_t*>(o.data()), o.size());
    }
    Check(Run([&](StoreCore& c) { return c.client->Describe(keys, views); }));
  }
  // A property that health checks poll: a closed client is simply not connected.
  bool connected() const { return !closed() && Core()->client->connected(); }
  uint64_t session_id() const { return Core()->client->session_id(); }
};

std::chrono::milliseconds Milliseconds(int64_t ms, const char* name, bool allow_zero) {
  if (ms < 0 || (!allow_zero && ms == 0)) {
    ThrowInvalid(fmt::format("{} must be {} milliseconds, got {}", name,
                             allow_zero ? "a non-negative number of" : "a positive number of", ms));
  }
  return std::chrono::milliseconds(ms);
}

PyChunkStore* OpenEngine(const KeyNamespace& ns, uint64_t chunk_bytes, double l1_size_gb,
                         nb::handle l2, const std::string& write_policy,
                         const std::string& eviction_policy, int64_t load_deadline_ms,
                         int worker_threads, bool huge_pages) {
  if (chunk_bytes == 0) ThrowInvalid("open_engine: chunk_bytes must be positive");
  // The same settings, parsing and checks as `kvtier serve`: an in-process engine is configured
  // like the server's.
  server::ServeConfig config;
  config.l1_size_gb = l1_size_gb;
  config.eviction_policy = eviction_policy;
  config.write_policy = write_policy;
  config.chunk_size = ns.chunk_tokens;
  config.chunk_bytes = chunk_bytes;
  config.worker_threads = worker_threads;
  config.huge_pages = huge_pages;
  config.http_port = -1;
  if (l2.is_none()) {
    config.no_l2 = true;
  } else {
    const std::string text = JsonTextOf(l2, "l2 must be None, a JSON string or a dict");
    config.l2.push_back(Unwrap(server::ParseL2Spec(text)));
  }
  auto options = server::BuildServerOptions(config);
  if (!options.ok()) Throw(options.status().WithContext("open_engine"));
  EngineOptions eo = options->engine;
  eo.ns = ns;
  eo.load_deadline = Milliseconds(load_deadline_ms, "load_deadline_ms", /*allow_zero=*/true);
  auto core = std::make_shared<StoreCore>();
  {
    nb::gil_scoped_release release;
    core->engine = Unwrap(Engine::Open(eo));
  }
  core->store = WrapEngine(core->engine.get());
  core->num_slots = core->engine->pool().num_slots;
  return new PyChunkStore(std::move(core), "in_process");
}

PyServerClient* Connect(const KeyNamespace& ns, uint64_t chunk_bytes,
                        const std::string& socket_path, const std::string& token,
                        const std::string& client_name, int64_t connect_timeout_ms,
                        int64_t rpc_timeout_ms) {
  ClientOptions o;
  o.ns = ns;
  o.chunk_bytes = chunk_bytes;
  o.socket_path = socket_path;
  o.token = token;
  o.client_name = client_name;
  o.connect_timeout = Milliseconds(connect_timeout_ms, "connect_timeout_ms", false);
  o.rpc_timeout = Milliseconds(rpc_timeout_ms, "rpc_timeout_ms", false);
  auto core = std::make_shared<StoreCore>();
  {
    nb::gil_scoped_release release;
    std::unique_ptr<Client> client = Unwrap(Client::Connect(o));
    core->client = client.get();
    core->num_slots = client->num_slots();
    core->store = std::move(client);
  }
  return new PyServerClient(std::move(core), "server");
}

}  // namespace

void RegisterChunkStore(nb::module_& m) {
  nb::class_<PyOpResult>(m, "OpResult",
                         "The outcome of an AsyncOp. A failed operation is a result, not an "
                         "exception: check ``ok``.")
      .def_ro("ok", &PyOpResult::ok, "True if every chunk was done.")
      .def_ro("code", &PyOpResult::code, "\"ok\" or the snake_case status code.")
      .def_ro("message", &PyOpResult::message, "The status message (empty when ok).")
      .def_ro("chunks", &PyOpResult::chunks,
              "load/prepare_load: leading chunks delivered; store: chunks now stored.")
      .def_ro("slots", &PyOpResult::slots,
              "prepare_load only: the pinned slot of each leading chunk. The caller owns these "
              "pins and must give each back with ChunkStore.unpin().")
      .def("__repr__", &PyOpResult::Repr);

  nb::class_<PyAsyncOp>(m, "AsyncOp",
                        "A handle to an asynchronous store, load or prepare_load. Holds the "
                        "caller's buffers until the operation is done; dropping it does not cancel "
                        "the operation and never blocks.")
      .def("done", &PyAsyncOp::Done, "True once the operation has finished. Never blocks long.")
      .def("wait", &PyAsyncOp::Wait, nb::arg("timeout") = nb::none(),
           "Waits (GIL released) for the result: an OpResult, or None if ``timeout`` seconds "
           "passed first (the operation goes on). ``timeout=None`` waits until done.");

  nb::class_<SlotBuffer>(m, "_SlotBuffer", nb::type_slots(kSlotBufferSlots),
                         "Buffer exporter behind ChunkStore.slot_view (keeps the store alive).");

  nb::class_<PyChunkStore>(
      m, "ChunkStore",
      "A KV chunk store: an in-process engine (open_engine) or a `kvtier serve` connection "
      "(connect). Every method is thread-safe and releases the GIL while it works. "
      "Use as a context manager, or call close().")
      .def_prop_ro("chunk_bytes", &PyChunkStore::chunk_bytes,
                   "Bytes of one chunk: every buffer given to store/load has exactly this size.")
      .def_prop_ro("mode", &PyChunkStore::mode, "\"in_process\" or \"server\".")
      .def_prop_ro("closed", &PyChunkStore::closed, "True after close().")
      .def_prop_ro("pool_base", &PyChunkStore::pool_base,
                   "Address of the L1 pool (page-aligned; e.g. for cudaHostRegister).")
      .def_prop_ro("pool_bytes", &PyChunkStore::pool_bytes, "Bytes of the L1 pool.")
      .def_prop_ro("num_slots", &PyChunkStore::num_slots, "Slots (chunks) in the L1 pool.")
      .def("lookup", &PyChunkStore::Lookup, nb::arg("keys"),
           (std::string("(total, in_l1): how many leading chunks of ``keys`` a load would find "
                        "now, and how many of those are in L1. A broken server connection reports "
                        "(0, 0). ") +
            kKeysDoc)
               .c_str())
      .def("store", &PyChunkStore::Store, nb::arg("keys"), nb::arg("buffers"),
           nb::rv_policy::take_ownership,
           (std::string("Stores buffers[i] under keys[i], asynchronously (keys already stored "
                        "are skipped). ``buffers``: buffer-protocol objects or CPU tensors, each "
                        "chunk_bytes long, held by the returned AsyncOp until it is done. Raises "
                        "for bad arguments, a full queue (code \"rejected\") or a dead server. ") +
            kKeysDoc)
               .c_str())
      .def("load", &PyChunkStore::Load, nb::arg("keys"), nb::arg("buffers"),
           nb::rv_policy::take_ownership,
           (std::string("Copies the longest available prefix of ``keys`` into ``buffers`` "
                        "(writable, each chunk_bytes long), asynchronously; the result's chunks "
                        "says how many. ") +
            kKeysDoc)
               .c_str())
      .def("reserve_slots", &PyChunkStore::ReserveSlots, nb::arg("keys"),
           (std::string("Zero-copy store: reserves an L1 slot per key; -1 where the key is "
                        "already stored. May be shorter than ``keys`` when the pool is full of "
                        "pinned chunks. Fill each slot (slot_view/slot_address), then "
                        "commit_slots or abort_slots. ") +
            kKeysDoc)
               .c_str())
      .def("commit_slots", &PyChunkStore::CommitSlots, nb::arg("keys"), nb::arg("slots"),
           "Publishes filled slots: ``keys`` and ``slots`` as given to and returned by "
           "reserve_slots (-1 entries are skipped). Slots not reserved by this store raise "
           "InvalidArgumentError.")
      .def("abort_slots", &PyChunkStore::AbortSlots, nb::arg("slots"),
           "Gives reserved, unfilled slots back (-1 entries are skipped).")
      .def("prepare_load", &PyChunkStore::PrepareLoad, nb::arg("keys"),
           nb::rv_policy::take_ownership,
           (std::string("Zero-copy load: pins the longest available prefix of ``keys`` in L1 "
                        "(promoting from L2), asynchronously. Once wait() returns, result.slots "
                        "are the caller's pins: read them, then unpin(). An op dropped before its "
                        "result was taken releases its pins itself. ") +
            kKeysDoc)
               .c_str())
      .def("unpin", &PyChunkStore::Unpin, nb::arg("slots"),
           "Releases pins taken through prepare_load.")
      .def("slot_address", &PyChunkStore::SlotAddress, nb::arg("slot"),
           "Address of a slot's chunk_bytes in the pool (writable while reserved, readable while "
           "pinned). Valid while the store is open.")
      .def("slot_view", &PyChunkStore::SlotView, nb::arg("slot"),
           "A writable, zero-copy memoryview of a slot's chunk_bytes. It keeps the pool mapped "
           "for as long as it lives.")
      .def("stats", &PyChunkStore::Stats,
           "Statistics: an engine's EngineStats as a nested dict, or the server's /stats "
           "document.")
      .def("close", &PyChunkStore::Close,
           "Closes the store; idempotent. Blocks: an engine finishes queued operations and L2 "
           "writes, a client waits for its copies and disconnects (ops and slot views still "
           "alive keep the C++ store until they go). Later calls raise KvtierError with code "
           "\"closed\".")
      .def("__enter__", [](nb::object self) { return self; })
      .def("__exit__", [](PyChunkStore& s, nb::args) {
        s.Close();
        return false;
      });

  nb::class_<PyServerClient, PyChunkStore>(
      m, "ServerClient",
      "A connection to a `kvtier serve` daemon. If the server dies or stops answering within "
      "rpc_timeout_ms, the connection breaks: lookup reports (0, 0) and every other call fails "
      "fast with code \"unavailable\". Reconnect with connect().")
      .def("ping", &PyServerClient::Ping, "An empty round trip; raises if the server is gone.")
      .def("describe", &PyServerClient::Describe, nb::arg("keys"), nb::arg("descriptors"),
           "Tells the server the vLLM block hashes of chunks, for its KV-cache events "
           "(docs/kv-events.md): descriptors[i] (bytes, a msgpack map of at most 16 KiB) "
           "describes the chunk keys[i] names. A server without --kv-events accepts and "
           "ignores them; a server with it checks them and drops bad ones (counted). Returns "
           "None; raises InvalidArgumentError for mismatched lengths or a descriptor that is "
           "not bytes, empty or too large, and the usual errors if the server is gone.")
      .def_prop_ro("connected", &PyServerClient::connected,
                   "False once the connection broke or the client was closed.")
      .def_prop_ro("session_id", &PyServerClient::session_id, "The server's id for this session.");

  m.def("open_engine", &OpenEngine, nb::arg("ns"), nb::arg("chunk_bytes"), nb::kw_only(),
        nb::arg("l1_size_gb") = 1.0, nb::arg("l2").none() = nb::none(),
        nb::arg("write_policy") = "write_back", nb::arg("eviction_policy") = "prefix-aware",
        nb::arg("load_deadline_ms") = 2000, nb::arg("worker_threads") = 2,
        nb::arg("huge_pages") = false, nb::rv_policy::take_ownership,
        "Opens an engine in this process: an L1 pool of ``l1_size_gb`` GiB of ``chunk_bytes`` "
        "chunks and, if ``l2`` is given, a file tier. ``l2`` is the JSON object `kvtier serve "
        "--l2` takes, as a string or dict: {\"type\": \"fs\", \"path\": ..., \"max_size_gb\": ..., "
        "\"read_threads\": ..., \"write_threads\": ...} (unknown keys are refused). "
        "write_policy: write_back, write_through or none; eviction_policy: prefix-aware or lru. "
        "A load still waiting on L2 after load_deadline_ms reports the rest as misses.");

  m.def("connect", &Connect, nb::arg("ns"), nb::arg("chunk_bytes") = 0, nb::kw_only(),
        nb::arg("socket_path") = "", nb::arg("token") = "", nb::arg("client_name") = "",
        nb::arg("connect_timeout_ms") = 5000, nb::arg("rpc_timeout_ms") = 10000,
        nb::rv_policy::take_ownership,
        "Connects to a `kvtier serve` daemon (default socket: default_socket_path()) and maps "
        "its L1 pool. chunk_bytes 0 adopts the server's. Raises KvtierError: \"unavailable\" "
        "when no server listens, \"permission_denied\" for a wrong token, \"invalid_argument\" "
        "for a namespace or chunk size the server refuses, \"timeout\".");
}

}  // namespace kvtier::python

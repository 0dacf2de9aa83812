// KvCopier: gathers a paged KV cache's blocks into chunks and scatters them back (host memcpy or
// CUDA), with KvPageTensor describing the cache and CopyHandle a started copy.
#include <Python.h>  // first, as Python's headers require
#include <fmt/format.h>
#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kvtier/paged_kv.h"
#include "kvtier/status.h"
#include "python/binding.h"

namespace kvtier::python {
namespace {

struct PyKvPageTensor {
  uint64_t base = 0;
  uint64_t num_blocks = 0;
  uint64_t block_stride_bytes = 0;
  uint64_t token_bytes = 0;
  uint32_t num_layers = 1;
  uint64_t layer_stride_bytes = 0;
  uint32_t num_components = 1;
  uint64_t component_stride_bytes = 0;

  static PyKvPageTensor From(const KvPageTensor& t) {
    return {reinterpret_cast<uintptr_t>(t.base),
            t.num_blocks,
            t.block_stride_bytes,
            t.token_bytes,
            t.num_layers,
            t.layer_stride_bytes,
            t.num_components,
            t.component_stride_bytes};
  }
  KvPageTensor ToC() const {
    KvPageTensor t;
    t.base = reinterpret_cast<void*>(static_cast<uintptr_t>(base));
    t.num_blocks = num_blocks;
    t.block_stride_bytes = block_stride_bytes;
    t.token_bytes = token_bytes;
    t.num_layers = num_layers;
    t.layer_stride_bytes = layer_stride_bytes;
    t.num_components = num_components;
    t.component_stride_bytes = component_stride_bytes;
    return t;
  }
  std::string Repr() const {
    return fmt::format(
        "KvPageTensor(base={:#x}, num_blocks={}, block_stride_bytes={}, token_bytes={}, "
        "num_layers={}, layer_stride_bytes={}, num_components={}, component_stride_bytes={})",
        base, num_blocks, block_stride_bytes, token_bytes, num_layers, layer_stride_bytes,
        num_components, component_stride_bytes);
  }
};

// CopyHandle is single-owner in C++; Python threads may share one, so calls are serialized.
struct CopyHandleState {
  std::mutex mu;
  CopyHandle handle;
};

class PyCopyHandle {
 public:
  PyCopyHandle(std::shared_ptr<KvCopier> copier, CopyHandle h)
      : copier_(std::move(copier)), state_(std::make_shared<CopyHandleState>()) {
    mechanism_ = CopyMechanismName(h.mechanism());
    state_->handle = std::move(h);
  }
  ~PyCopyHandle() {
    Reaper::Reap([copier = std::move(copier_), state = std::move(state_)]() mutable {
      state.reset();
      copier.reset();
    });
  }
  bool IsDone() {
    nb::gil_scoped_release release;
    std::lock_guard lock(state_->mu);
    return state_->handle.IsDone();
  }
  void Wait() {
    Status s;
    {
      nb::gil_scoped_release release;
      std::lock_guard lock(state_->mu);
      s = state_->handle.Wait();
    }
    Check(s);
  }
  uint64_t event() {
    nb::gil_scoped_release release;
    std::lock_guard lock(state_->mu);
    return reinterpret_cast<uintptr_t>(state_->handle.event());
  }
  const std::string& mechanism() const { return mechanism_; }

 private:
  std::shared_ptr<KvCopier> copier_;
  std::shared_ptr<CopyHandleState> state_;
  std::string mechanism_;
};

class PyKvCopier {
 public:
  PyKvCopier(const std::vector<PyKvPageTensor>& tensors, uint32_t tokens_per_block, int device,
             const std::string& mechanism) {
    mechanism_ = Unwrap(ParseCopyMechanism(mechanism));
    PagedKvCacheDesc desc;
    desc.memory = device < 0 ? MemorySpace::kHost : MemorySpace::kCuda;
    desc.device = device < 0 ? 0 : device;
    desc.tokens_per_block = tokens_per_block;
    for (const PyKvPageTensor& t : tensors) desc.tensors.push_back(t.ToC());
    PagedKvCache cache = Unwrap(PagedKvCache::Create(std::move(desc)));
    nb::gil_scoped_release release;  // CUDA initialization takes a while
    copier_ =
        Unwrap(device < 0 ? NewHostKvCopier(std::move(cache)) : NewCudaKvCopier(std::move(cache)));
  }
  PyKvCopier(const PyKvCopier&) = delete;
  PyKvCopier& operator=(const PyKvCopier&) = delete;
  ~PyKvCopier() { ReapShared(std::move(copier_)); }

  const PagedKvCache& cache() const { return copier_->cache(); }

  PyCopyHandle* Gather(nb::handle block_ids_obj, uint64_t num_tokens, uint64_t dst,
                       uint64_t capacity, uint64_t stream, uint64_t wait_event) {
    std::vector<int64_t> ids = ParseIntegers(block_ids_obj, "block_ids");
    CopyOptions o = Options(stream, wait_event);
    Result<CopyHandle> h = [&] {
      nb::gil_scoped_release release;
      return copier_->Gather(ids, num_tokens, reinterpret_cast<void*>(static_cast<uintptr_t>(dst)),
                             capacity, o);
    }();
    return new PyCopyHandle(copier_, Unwrap(std::move(h)));
  }

  PyCopyHandle* Scatter(nb::handle block_ids_obj, uint64_t num_tokens, uint64_t src,
                        uint64_t nbytes, uint64_t stream, uint64_t wait_event) {
    std::vector<int64_t> ids = ParseIntegers(block_ids_obj, "block_ids");
    CopyOptions o = Options(stream, wait_event);
    Result<CopyHandle> h = [&] {
      nb::gil_scoped_release release;
      return copier_->Scatter(
          ids, num_tokens, reinterpret_cast<const void*>(static_cast<uintptr_t>(src)), nbytes, o);
    }();
    return new PyCopyHandle(copier_, Unwrap(std::move(h)));
  }

  // Batched form: chunk i is block_ids[i] <-> address addrs[i] of `nbytes` bytes.
  PyCopyHandle* CopyChunks(nb::handle block_ids_obj, uint64_t num_tokens, nb::handle addrs_obj,
                           uint64_t nbytes, uint64_t stream, uint64_t wait_event, bool gather) {
    std::vector<int64_t> addrs = ParseIntegers(addrs_obj, "addrs");
    if (!nb::isinstance<nb::sequence>(block_ids_obj) || nb::len(block_ids_obj) != addrs.size()) {
      throw nb::type_error("block_ids must be a sequence of one block-id sequence per address");
    }
    std::vector<std::vector<int64_t>> ids;
    ids.reserve(addrs.size());
    for (nb::handle h : block_ids_obj) ids.push_back(ParseIntegers(h, "block_ids"));
    std::vector<ChunkCopy> chunks(addrs.size());
    for (size_t i = 0; i < chunks.size(); ++i) {
      chunks[i] = {ids[i], reinterpret_cast<void*>(static_cast<uintptr_t>(addrs[i])), nbytes};
    }
    CopyOptions o = Options(stream, wait_event);
    Result<CopyHandle> h = [&] {
      nb::gil_scoped_release release;
      return gather ? copier_->GatherChunks(chunks, num_tokens, o)
                    : copier_->ScatterChunks(chunks, num_tokens, o);
    }();
    return new PyCopyHandle(copier_, Unwrap(std::move(h)));
  }

  std::string auto_mechanism() const {
    return std::string(CopyMechanismName(copier_->AutoMechanism()));
  }

 private:
  CopyOptions Options(uint64_t stream, uint64_t wait_event) const {
    CopyOptions o;
    o.stream = reinterpret_cast<void*>(static_cast<uintptr_t>(stream));
    o.wait_event = reinterpret_cast<void*>(static_cast<uintptr_t>(wait_event));
    o.mechanism = mechanism_;
    return o;
  }

  std::shared_ptr<KvCopier> copier_;
  CopyMechanism mechanism_ = CopyMechanism::kAuto;
};

}  // namespace

void RegisterCopier(nb::module_& m) {
  nb::class_<PyKvPageTensor>(
      m, "KvPageTensor",
      "One tensor of a paged KV cache as raw pages (sizes in bytes). Page (block b, layer l, "
      "component c) starts at base + b * block_stride_bytes + l * layer_stride_bytes + c * "
      "component_stride_bytes and holds tokens_per_block * token_bytes contiguous bytes. "
      "``base`` is an address (e.g. tensor.data_ptr()); the memory must outlive every copier "
      "using it.")
      .def(
          "__init__",
          [](PyKvPageTensor* self, uint64_t base, uint64_t num_blocks, uint64_t block_stride_bytes,
             uint64_t token_bytes, uint32_t num_layers, uint64_t layer_stride_bytes,
             uint32_t num_components, uint64_t component_stride_bytes) {
            new (self) PyKvPageTensor{
                base,       num_blocks,         block_stride_bytes, token_bytes,
                num_layers, layer_stride_bytes, num_components,     component_stride_bytes};
          },
          nb::arg("base"), nb::arg("num_blocks"), nb::arg("block_stride_bytes"),
          nb::arg("token_bytes"), nb::arg("num_layers") = 1, nb::arg("layer_stride_bytes") = 0,
          nb::arg("num_components") = 1, nb::arg("component_stride_bytes") = 0)
      .def_ro("base", &PyKvPageTensor::base, "Address of page (block 0, layer 0, component 0).")
      .def_ro("num_blocks", &PyKvPageTensor::num_blocks, "Valid block ids are [0, num_blocks).")
      .def_ro("block_stride_bytes", &PyKvPageTensor::block_stride_bytes,
              "Bytes from block b to b + 1.")
      .def_ro("token_bytes", &PyKvPageTensor::token_bytes, "One token's bytes in one page.")
      .def_ro("num_layers", &PyKvPageTensor::num_layers, "Layers in every block.")
      .def_ro("layer_stride_bytes", &PyKvPageTensor::layer_stride_bytes,
              "Bytes from layer l to l + 1 inside a block.")
      .def_ro("num_components", &PyKvPageTensor::num_components,
              "2 for separate K and V pages, 1 for MLA or mixed K/V.")
      .def_ro("component_stride_bytes", &PyKvPageTensor::component_stride_bytes,
              "Bytes from component c to c + 1.")
      .def_static(
          "split_kv",
          [](uint64_t base, uint64_t num_blocks, uint32_t tokens_per_block, uint64_t token_bytes) {
            return PyKvPageTensor::From(
                KvPageTensor::SplitKv(reinterpret_cast<void*>(static_cast<uintptr_t>(base)),
                                      num_blocks, tokens_per_block, token_bytes));
          },
          nb::arg("base"), nb::arg("num_blocks"), nb::arg("tokens_per_block"),
          nb::arg("token_bytes"),
          "[2, num_blocks, tokens_per_block, ...] (vLLM FlashAttention, one tensor per layer).")
      .def_static(
          "packed_kv",
          [](uint64_t base, uint64_t num_blocks, uint32_t tokens_per_block, uint64_t token_bytes) {
            return PyKvPageTensor::From(
                KvPageTensor::PackedKv(reinterpret_cast<void*>(static_cast<uintptr_t>(base)),
                                       num_blocks, tokens_per_block, token_bytes));
          },
          nb::arg("base"), nb::arg("num_blocks"), nb::arg("tokens_per_block"),
          nb::arg("token_bytes"), "[num_blocks, 2, tokens_per_block, ...] (K and V side by side).")
      .def_static(
          "single_page",
          [](uint64_t base, uint64_t num_blocks, uint32_t tokens_per_block, uint64_t token_bytes) {
            return PyKvPageTensor::From(
                KvPageTensor::SinglePage(reinterpret_cast<void*>(static_cast<uintptr_t>(base)),
                                         num_blocks, tokens_per_block, token_bytes));
          },
          nb::arg("base"), nb::arg("num_blocks"), nb::arg("tokens_per_block"),
          nb::arg("token_bytes"), "[num_blocks, tokens_per_block, ...]: one page per block (MLA).")
      .def_static(
          "cross_layer",
          [](uint64_t base, uint64_t num_blocks, uint32_t num_layers, uint32_t tokens_per_block,
             uint64_t token_bytes) {
            return PyKvPageTensor::From(
                KvPageTensor::CrossLayer(reinterpret_cast<void*>(static_cast<uintptr_t>(base)),
                                         num_blocks, num_layers, tokens_per_block, token_bytes));
          },
          nb::arg("base"), nb::arg("num_blocks"), nb::arg("num_layers"),
          nb::arg("tokens_per_block"), nb::arg("token_bytes"),
          "[num_blocks, num_layers, 2, tokens_per_block, ...]: every layer's K and V per block.")
      .def("__repr__", &PyKvPageTensor::Repr);

  nb::class_<PyCopyHandle>(m, "CopyHandle",
                           "A started copy. Dropping it neither cancels nor waits for the copy; "
                           "the chunk and the blocks must stay valid until it completes.")
      .def("is_done", &PyCopyHandle::IsDone, "True once the copy completed (or failed).")
      .def("wait", &PyCopyHandle::Wait,
           "Blocks (GIL released) until the copy completes; raises KvtierError if the device "
           "reported an error.")
      .def_prop_ro("event", &PyCopyHandle::event,
                   "The cudaEvent_t completing with the copy, as an int (0 for host copies, "
                   "which are complete on return). Valid while this handle lives.")
      .def_prop_ro("mechanism", &PyCopyHandle::mechanism, "The mechanism that carried it out.");

  nb::class_<PyKvCopier>(
      m, "KvCopier",
      "Gathers a paged KV cache's blocks into a chunk in the canonical layout "
      "(docs/gpu-data-path.md) and scatters chunks back. device -1: a cache in host memory "
      "(memcpy); device >= 0: a cache on that CUDA device (raises KvtierError \"unimplemented\" "
      "when kvtier was built without CUDA, \"unavailable\" without a device). mechanism: auto, "
      "memcpy, dma, kernel or staged. Thread-safe.")
      .def(nb::init<const std::vector<PyKvPageTensor>&, uint32_t, int, const std::string&>(),
           nb::arg("tensors"), nb::arg("tokens_per_block"), nb::arg("device") = -1,
           nb::arg("mechanism") = "auto")
      .def_prop_ro(
          "bytes_per_token", [](const PyKvCopier& c) { return c.cache().bytes_per_token(); },
          "Bytes of one token across every tensor, layer and component.")
      .def_prop_ro(
          "num_blocks", [](const PyKvCopier& c) { return c.cache().num_blocks(); },
          "Valid block ids are [0, num_blocks).")
      .def_prop_ro(
          "tokens_per_block", [](const PyKvCopier& c) { return c.cache().tokens_per_block(); },
          "Tokens in every block.")
      .def_prop_ro("auto_mechanism", &PyKvCopier::auto_mechanism,
                   "The mechanism \"auto\" resolves to for this cache.")
      .def(
          "chunk_bytes",
          [](const PyKvCopier& c, uint64_t num_tokens) {
            return c.cache().chunk_bytes(num_tokens);
          },
          nb::arg("num_tokens"), "Bytes of a chunk of num_tokens tokens.")
      .def(
          "describe", [](const PyKvCopier& c) { return c.cache().ToString(); },
          "A one-line description of the cache.")
      .def("gather", &PyKvCopier::Gather, nb::arg("block_ids"), nb::arg("num_tokens"),
           nb::arg("dst"), nb::arg("capacity"), nb::arg("stream") = 0, nb::arg("wait_event") = 0,
           nb::rv_policy::take_ownership,
           "Gathers blocks ``block_ids`` (in token order; a list of ints or an int64 buffer) into "
           "the chunk at address ``dst`` of ``capacity`` bytes (pinned host memory for GPU "
           "caches, e.g. store.slot_address(slot)). ``num_tokens`` must be a multiple of "
           "tokens_per_block. ``stream``/``wait_event``: cudaStream_t/cudaEvent_t as ints, 0 for "
           "none. Host copies are done on return.")
      .def("scatter", &PyKvCopier::Scatter, nb::arg("block_ids"), nb::arg("num_tokens"),
           nb::arg("src"), nb::arg("nbytes"), nb::arg("stream") = 0, nb::arg("wait_event") = 0,
           nb::rv_policy::take_ownership,
           "Scatters the chunk at address ``src`` (exactly chunk_bytes(num_tokens) bytes) into "
           "blocks ``block_ids`` (no duplicates). Same rules as gather.")
      .def(
          "gather_chunks",
          [](PyKvCopier& c, nb::handle block_ids, uint64_t num_tokens, nb::handle dsts,
             uint64_t capacity, uint64_t stream, uint64_t wait_event) {
            return c.CopyChunks(block_ids, num_tokens, dsts, capacity, stream, wait_event, true);
          },
          nb::arg("block_ids"), nb::arg("num_tokens"), nb::arg("dsts"), nb::arg("capacity"),
          nb::arg("stream") = 0, nb::arg("wait_event") = 0, nb::rv_policy::take_ownership,
          "Many gathers in one call: chunk i's blocks ``block_ids[i]`` into address ``dsts[i]`` "
          "(``capacity`` bytes each). Every chunk is checked before anything is queued; the "
          "handle completes with the last copy. On the copy engines all chunks go in one batch.")
      .def(
          "scatter_chunks",
          [](PyKvCopier& c, nb::handle block_ids, uint64_t num_tokens, nb::handle srcs,
             uint64_t nbytes, uint64_t stream, uint64_t wait_event) {
            return c.CopyChunks(block_ids, num_tokens, srcs, nbytes, stream, wait_event, false);
          },
          nb::arg("block_ids"), nb::arg("num_tokens"), nb::arg("srcs"), nb::arg("nbytes"),
          nb::arg("stream") = 0, nb::arg("wait_event") = 0, nb::rv_policy::take_ownership,
          "Many scatters in one call: the chunk at ``srcs[i]`` (``nbytes`` each) into blocks "
          "``block_ids[i]``. Same rules as gather_chunks.");

  m.def("cuda_built", &CudaDataPathBuilt, "True when this build contains the CUDA copier.");
}

}  // namespace kvtier::python

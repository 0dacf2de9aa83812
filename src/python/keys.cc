// Chunk keys: keys as arguments and results, token ids, and the module's KeyNamespace,
// chain_chunk_key and chunk_keys.
#include <Python.h>  // first, as Python's headers require
#include <fmt/format.h>
#include <nanobind/nanobind.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvtier/chunk_key.h"
#include "python/binding.h"

namespace kvtier::python {
namespace {

// Token ids as uint32, borrowing the caller's memory when it already holds native uint32.
struct Tokens {
  HeldBuffer held;
  std::vector<uint32_t> owned;
  std::span<const uint32_t> view;
};

Tokens ParseTokens(nb::handle obj) {
  Tokens t;
  if (!PyList_Check(obj.ptr()) && !PyTuple_Check(obj.ptr()) && HeldBuffer::Supported(obj)) {
    t.held = HeldBuffer::Acquire(obj, HeldBuffer::Access::kRead, "tokens");
    const char f = t.held.format();
    if (t.held.itemsize() == 4 && (f == 'I' || f == 'L' || f == 'N') &&
        reinterpret_cast<uintptr_t>(t.held.data()) % alignof(uint32_t) == 0) {
      t.view = {reinterpret_cast<const uint32_t*>(t.held.data()), t.held.size() / 4};
      return t;
    }
  }
  std::vector<int64_t> ids = ParseIntegers(obj, "tokens");
  t.owned.resize(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] > int64_t{UINT32_MAX}) {
      ThrowInvalid(fmt::format("tokens[{}] = {} is not a uint32 token id", i, ids[i]));
    }
    t.owned[i] = static_cast<uint32_t>(ids[i]);
  }
  t.held.Release();
  t.view = t.owned;
  return t;
}

ChunkKey KeyFromBytes(const uint8_t* p) {
  std::array<uint8_t, ChunkKey::kSize> a;
  std::memcpy(a.data(), p, a.size());
  return ChunkKey(a);
}

}  // namespace

ChunkKey ParseKey(nb::handle obj, const std::string& what) {
  if (PyBytes_Check(obj.ptr())) {
    if (PyBytes_GET_SIZE(obj.ptr()) != ChunkKey::kSize) {
      ThrowInvalid(fmt::format("{} must be {} bytes, got {}", what, ChunkKey::kSize,
                               PyBytes_GET_SIZE(obj.ptr())));
    }
    return KeyFromBytes(reinterpret_cast<const uint8_t*>(PyBytes_AS_STRING(obj.ptr())));
  }
  HeldBuffer b = HeldBuffer::Acquire(obj, HeldBuffer::Access::kRead, what);
  if (b.size() != ChunkKey::kSize) {
    ThrowInvalid(fmt::format("{} must be {} bytes, got {}", what, ChunkKey::kSize, b.size()));
  }
  return KeyFromBytes(b.data());
}

std::vector<ChunkKey> ParseKeys(nb::handle obj) {
  std::vector<ChunkKey> keys;
  if (!PyList_Check(obj.ptr()) && !PyTuple_Check(obj.ptr()) && HeldBuffer::Supported(obj)) {
    HeldBuffer b = HeldBuffer::Acquire(obj, HeldBuffer::Access::kRead, "keys");
    if (b.size() % ChunkKey::kSize != 0) {
      ThrowInvalid(fmt::format("keys: a buffer of keys must hold a multiple of {} bytes, got {}",
                               ChunkKey::kSize, b.size()));
    }
    keys.reserve(b.size() / ChunkKey::kSize);
    for (size_t at = 0; at < b.size(); at += ChunkKey::kSize) {
      keys.push_back(KeyFromBytes(b.data() + at));
    }
    return keys;
  }
  nb::object seq = nb::steal(PySequence_Fast(obj.ptr(), ""));
  if (!seq.is_valid()) {
    PyErr_Clear();
    throw nb::type_error(
        fmt::format("keys must be a list of 32-byte keys or one buffer of n * 32 bytes, not {}",
                    TypeName(obj))
            .c_str());
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  keys.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    keys.push_back(ParseKey(items[i], fmt::format("keys[{}]", i)));
  }
  return keys;
}

nb::bytes KeyBytes(const ChunkKey& k) {
  return nb::bytes(reinterpret_cast<const char*>(k.data()), ChunkKey::kSize);
}

void RegisterKeys(nb::module_& m) {
  nb::class_<KeyNamespace>(
      m, "KeyNamespace",
      "What chunk keys are scoped to: two stores share chunks only if every field matches. "
      "Validated on construction (InvalidArgumentError); the fields are read-only.")
      .def(
          "__init__",
          [](KeyNamespace* self, std::string model_id, uint64_t layout_fingerprint,
             uint32_t chunk_tokens, uint32_t rank, uint32_t world_size, std::string tenant_salt) {
            KeyNamespace ns;
            ns.model_id = std::move(model_id);
            ns.layout_fingerprint = layout_fingerprint;
            ns.chunk_tokens = chunk_tokens;
            ns.rank = rank;
            ns.world_size = world_size;
            ns.tenant_salt = std::move(tenant_salt);
            Check(ns.Validate());
            new (self) KeyNamespace(std::move(ns));
          },
          nb::arg("model_id"), nb::arg("layout_fingerprint") = 0, nb::arg("chunk_tokens") = 256,
          nb::arg("rank") = 0, nb::arg("world_size") = 1, nb::arg("tenant_salt") = "",
          "model_id: e.g. \"Qwen/Qwen3-8B\" (non-empty, at most 1 KiB); layout_fingerprint: the "
          "KV layout's 64-bit fingerprint; chunk_tokens: tokens per chunk (1 .. 2**20); rank and "
          "world_size: the tensor-parallel shard (rank < world_size); tenant_salt: optional, "
          "separates tenants sharing one store.")
      .def_ro("model_id", &KeyNamespace::model_id, "The model id.")
      .def_ro("layout_fingerprint", &KeyNamespace::layout_fingerprint, "The KV layout fingerprint.")
      .def_ro("chunk_tokens", &KeyNamespace::chunk_tokens, "Tokens per chunk.")
      .def_ro("rank", &KeyNamespace::rank, "Tensor-parallel rank.")
      .def_ro("world_size", &KeyNamespace::world_size, "Tensor-parallel world size.")
      .def_ro("tenant_salt", &KeyNamespace::tenant_salt, "Tenant salt (may be empty).")
      .def(
          "root", [](const KeyNamespace& ns) { return KeyBytes(ns.Root()); },
          "The 32-byte root key: the hash of every field, the predecessor of the first chunk.")
      .def(
          "id", [](const KeyNamespace& ns) { return ns.Id(); },
          "16 hex digits derived from root(): this namespace's folder name on shared storage.")
      .def("__eq__",
           [](const KeyNamespace& a, nb::handle b) {
             return nb::isinstance<KeyNamespace>(b) &&
                    a.Root() == nb::cast<const KeyNamespace&>(b).Root();
           })
      .def("__hash__",
           [](const KeyNamespace& ns) { return static_cast<int64_t>(ns.Root().Hash64()); })
      .def("__repr__",
           [](const KeyNamespace& ns) {
             return fmt::format(
                 "KeyNamespace(model_id={}, layout_fingerprint={:#x}, chunk_tokens={}, rank={}, "
                 "world_size={}, tenant_salt={})",
                 nb::cast<std::string>(nb::repr(nb::str(ns.model_id.c_str()))),
                 ns.layout_fingerprint, ns.chunk_tokens, ns.rank, ns.world_size,
                 nb::cast<std::string>(nb::repr(nb::str(ns.tenant_salt.c_str()))));
           })
      // Picklable, so a namespace can be handed to worker processes.
      .def("__getstate__",
           [](const KeyNamespace& ns) {
             return nb::make_tuple(ns.model_id, ns.layout_fingerprint, ns.chunk_tokens, ns.rank,
                                   ns.world_size, ns.tenant_salt);
           })
      .def("__setstate__", [](KeyNamespace* self, nb::tuple t) {
        KeyNamespace ns;
        if (t.size() != 6) ThrowInvalid("KeyNamespace state must have 6 fields");
        ns.model_id = nb::cast<std::string>(t[0]);
        ns.layout_fingerprint = nb::cast<uint64_t>(t[1]);
        ns.chunk_tokens = nb::cast<uint32_t>(t[2]);
        ns.rank = nb::cast<uint32_t>(t[3]);
        ns.world_size = nb::cast<uint32_t>(t[4]);
        ns.tenant_salt = nb::cast<std::string>(t[5]);
        Check(ns.Validate());
        new (self) KeyNamespace(std::move(ns));
      });

  m.def(
      "chain_chunk_key",
      [](nb::handle prev, nb::handle tokens_obj) {
        ChunkKey p = ParseKey(prev, "prev");
        Tokens tokens = ParseTokens(tokens_obj);
        if (tokens.view.empty()) ThrowInvalid("chain_chunk_key: tokens must not be empty");
        ChunkKey k;
        {
          nb::gil_scoped_release release;
          k = ChainChunkKey(p, tokens.view);
        }
        return KeyBytes(k);
      },
      nb::arg("prev"), nb::arg("tokens"),
      "SHA-256(prev || tokens as little-endian uint32): the key of the chunk of ``tokens`` that "
      "follows the chunk keyed ``prev`` (``ns.root()`` for the first chunk). ``tokens``: a "
      "non-empty sequence of ints or an integer buffer (array('I'/'i'/'q'), numpy, CPU tensor).");

  m.def(
      "chunk_keys",
      [](const KeyNamespace& ns, nb::handle tokens_obj) {
        Tokens tokens = ParseTokens(tokens_obj);
        Result<std::vector<ChunkKey>> keys = [&] {
          nb::gil_scoped_release release;
          return ComputeChunkKeys(ns, tokens.view);
        }();
        nb::list out;
        for (const ChunkKey& k : Unwrap(std::move(keys))) out.append(KeyBytes(k));
        return out;
      },
      nb::arg("ns"), nb::arg("tokens"),
      "The keys (32-byte bytes) of every full chunk of ``tokens`` in namespace ``ns``; a "
      "trailing partial chunk gets no key.");
}

}  // namespace kvtier::python

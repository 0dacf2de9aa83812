// What the files of kvtier._native share: the Register* function of each (module.cc calls them
// in order), the error bridge, the reaper, memory borrowed from Python objects and the arguments
// parsed from it. Private to src/python.
//
// Whatever touches a Python object requires the GIL; a StatusError may be thrown without it.
#pragma once

#include <Python.h>  // first, as Python's headers require
#include <nanobind/nanobind.h>
// The same type casters in every file: a file without one would bind the type as a class.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvtier/chunk_key.h"
#include "kvtier/status.h"

namespace kvtier::python {

namespace nb = nanobind;

using Clock = std::chrono::steady_clock;

// Each adds its part of the module; module.cc calls them in this order.
void RegisterErrors(nb::module_& m);      // errors.cc: KvtierError, InvalidArgumentError
void RegisterKeys(nb::module_& m);        // keys.cc: KeyNamespace, chunk keys
void RegisterChunkStore(nb::module_& m);  // chunk_store.cc: ChunkStore, open_engine, connect
void RegisterServer(nb::module_& m);      // server.cc: Server, start_server
void RegisterCopier(nb::module_& m);      // kv_copier.cc: KvCopier, KvPageTensor
void RegisterFileTier(nb::module_& m);    // file_tier.cc: FileTier, open_file_tier
void RegisterReaper(nb::module_& m);      // reaper.cc: drained at exit, fresh after fork

// ---------------------------------------------------------------------------------------------
// Errors (errors.cc)

// The snake_case name of a status code, as Python sees it ("not_found", ...).
std::string CodeName(StatusCode code);

// Thrown anywhere in the bindings (also with the GIL released: the release guard reacquires it
// while unwinding); the translator registered at import turns it into a kvtier exception.
class StatusError : public std::exception {
 public:
  explicit StatusError(const Status& s)
      : code_(CodeName(s.code())),
        message_(s.message()),
        retryable_(s.retryable()),
        invalid_argument_(s.code() == StatusCode::kInvalidArgument) {}
  StatusError(std::string code, std::string message)
      : code_(std::move(code)), message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }

  // Sets the Python error indicator to the matching kvtier exception.
  void Raise() const;

 private:
  std::string code_;
  std::string message_;
  bool retryable_ = false;
  bool invalid_argument_ = false;
};

[[noreturn]] inline void Throw(const Status& s) { throw StatusError(s); }
[[noreturn]] inline void ThrowInvalid(std::string message) {
  throw StatusError(Status::InvalidArgument(std::move(message)));
}
inline void Check(const Status& s) {
  if (!s.ok()) Throw(s);
}
template <typename T>
T Unwrap(Result<T> r) {
  if (!r.ok()) Throw(r.status());
  return std::move(r).value();
}

// The text of the pending Python error, which is cleared (for folding it into our own message).
std::string TakePythonErrorText();

std::string TypeName(nb::handle obj);

// The JSON text of a configuration argument given as a JSON string or a dict (which is dumped);
// anything else is a TypeError "<expected>, not <type>".
std::string JsonTextOf(nb::handle obj, std::string_view expected);

// str(obj). (nb::str(o) of an object that is no str yet would not convert it.)
std::string StrOf(nb::handle obj);

// A timeout argument in seconds, checked to be non-negative (InvalidArgumentError otherwise).
double CheckedTimeout(double seconds);

// ---------------------------------------------------------------------------------------------
// The reaper: destroys objects whose destructors may block, off the caller's thread.

class Reaper {
 public:
  using Work = std::function<void()>;

  // Runs `work` on the reaper thread (started on first use), or inline once the reaper has shut
  // down (interpreter exit). `work` must not throw and must take the GIL itself if it needs it.
  // REQUIRES: the GIL is held (every caller is a destructor run by Python, or the bindings).
  static void Reap(Work work);

  // Finishes everything queued and joins the thread. Called from atexit, before finalization, so
  // work that takes the GIL still can. REQUIRES: the GIL is held.
  static void Shutdown();

  // In a child process after fork() the thread does not exist: forget (leak) its state, so the
  // child starts a reaper of its own when it needs one and never joins a thread it lacks.
  static void AfterForkInChild();

 private:
  struct State;

  static void Loop(State* s);

  // Both are read and written with the GIL held only.
  static State* state_;
  static bool shut_down_;
};

// Hands the last reference of `p` to the reaper (a no-op for null).
template <typename T>
void ReapShared(std::shared_ptr<T> p) {
  if (p) Reaper::Reap([p = std::move(p)]() mutable { p.reset(); });
}

// ---------------------------------------------------------------------------------------------
// Memory borrowed from Python objects, and the arguments made of it (buffers.cc)

// The bytes of a Python object: a buffer-protocol export (kept, which also locks a bytearray or
// numpy array against resizing) or, for a CPU tensor (no buffer protocol), a reference to the
// tensor and its data_ptr. Released with the GIL, which Release() takes itself.
class HeldBuffer {
 public:
  enum class Access { kRead, kWrite };

  HeldBuffer() = default;
  HeldBuffer(const HeldBuffer&) = delete;
  HeldBuffer& operator=(const HeldBuffer&) = delete;
  HeldBuffer(HeldBuffer&& o) noexcept { *this = std::move(o); }
  HeldBuffer& operator=(HeldBuffer&& o) noexcept {
    if (this != &o) {
      Release();
      view_ = o.view_;
      has_view_ = std::exchange(o.has_view_, false);
      owner_ = std::exchange(o.owner_, nullptr);
      data_ = o.data_;
      size_ = o.size_;
      format_ = o.format_;
      itemsize_ = o.itemsize_;
    }
    return *this;
  }
  ~HeldBuffer() { Release(); }

  // Whether Acquire may work on `obj` (a buffer exporter or something tensor-like).
  static bool Supported(nb::handle obj);

  // Borrows the memory of `obj`, which must be contiguous (and writable for kWrite). `what` names
  // the argument in error messages. REQUIRES: the GIL is held.
  static HeldBuffer Acquire(nb::handle obj, Access access, const std::string& what);

  // Gives the memory back. Safe to call more than once and from any thread before the
  // interpreter finalizes.
  void Release();

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  // The element type as a struct-module code ('B', 'i', 'q', ...), 0 for non-integers.
  char format() const { return format_; }
  size_t itemsize() const { return itemsize_; }

 private:
  static bool IsTensorLike(nb::handle obj);

  // Native-order integer formats only ("i", "=I", "<q"); anything else is 0.
  static char ParseFormat(const char* f);

  static char TensorFormat(const std::string& dtype);

  Py_buffer view_{};
  bool has_view_ = false;
  PyObject* owner_ = nullptr;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  char format_ = 0;
  size_t itemsize_ = 0;
};

// Integers from a list/tuple/iterable or an integer buffer (array, numpy, CPU tensor).
std::vector<int64_t> ParseIntegers(nb::handle obj, const std::string& what);

// Chunk buffers of a Store (read) or Load (write): a sequence of buffer-like objects.
std::vector<HeldBuffer> ParseChunkBuffers(nb::handle obj, HeldBuffer::Access access);

// ---------------------------------------------------------------------------------------------
// Chunk keys as arguments and results (keys.cc)

// A 32-byte key: bytes or any bytes-like object. `what` names the argument in error messages.
ChunkKey ParseKey(nb::handle obj, const std::string& what);

// Keys: a list of 32-byte bytes-like objects, or one bytes-like object of n * 32 bytes.
std::vector<ChunkKey> ParseKeys(nb::handle obj);

// A key as 32 bytes of Python bytes.
nb::bytes KeyBytes(const ChunkKey& k);

// The docstring part every method taking keys shares.
inline constexpr const char* kKeysDoc =
    "``keys``: a list of 32-byte ``bytes`` keys, or one bytes-like object of n * 32 bytes.";

}  // namespace kvtier::python

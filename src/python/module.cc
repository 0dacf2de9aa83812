// kvtier._native: the Python bindings of the kvtier core (nanobind). python/kvtier re-exports it.
//
// Rules every binding here follows:
//  * Zero-copy: chunk data moves between the caller's buffers (buffer protocol, or a CPU tensor's
//    data_ptr) and the store in C++; it never becomes a Python bytes object. A Store/Load op
//    holds the caller's buffers (a buffer export, which also stops a bytearray or numpy array
//    from being resized) until the operation is done.
//  * The GIL is released around every call that may block or take long: lookups, submissions,
//    zero-copy RPCs, waits, copies, opening and connecting.
//  * Errors are Python exceptions carrying the C++ Status message: kvtier.KvtierError with a
//    snake_case .code, kvtier.InvalidArgumentError (also a ValueError) for invalid arguments.
//    Every argument is checked before it reaches C++, including slot numbers: each store keeps a
//    ledger of the slots it reserved and the pins it holds, so a wrong slot is an error and not
//    a corrupted pool.
//  * Dropping a Python object never blocks its caller. C++ objects whose destructors may block
//    (an Engine finishes queued writes, a Client waits for copies, a remote PrepareLoad releases
//    its pins with an RPC, a CUDA copier synchronizes its streams) are destroyed by one reaper
//    thread. It is drained and joined by an atexit hook, before the interpreter finalizes, so it
//    never touches Python during finalization; later drops are destroyed inline.
#include <Python.h>  // first, as Python's headers require
#include <fmt/format.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <pthread.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/logging.h"
#include "kvtier/chunk_key.h"
#include "kvtier/chunk_store.h"
#include "kvtier/client.h"
#include "kvtier/engine.h"
#include "kvtier/file_tier.h"
#include "kvtier/paged_kv.h"
#include "kvtier/status.h"
#include "server/config.h"
#include "server/server.h"

namespace nb = nanobind;

namespace kvtier::python {
namespace {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------------------------
// Errors

PyObject* g_kvtier_error = nullptr;            // kvtier.KvtierError
PyObject* g_invalid_argument_error = nullptr;  // kvtier.InvalidArgumentError

std::string CodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "ok";
    case StatusCode::kNotFound:
      return "not_found";
    case StatusCode::kInvalidArgument:
      return "invalid_argument";
    case StatusCode::kRejected:
      return "rejected";
    case StatusCode::kNoSpace:
      return "no_space";
    case StatusCode::kIOError:
      return "io_error";
    case StatusCode::kCorruption:
      return "corruption";
    case StatusCode::kTimeout:
      return "timeout";
    case StatusCode::kUnavailable:
      return "unavailable";
    case StatusCode::kPermissionDenied:
      return "permission_denied";
    case StatusCode::kInternal:
      return "internal";
    case StatusCode::kUnimplemented:
      return "unimplemented";
    case StatusCode::kAborted:
      return "aborted";
  }
  return "unknown";
}

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
  void Raise() const {
    PyObject* type = invalid_argument_ ? g_invalid_argument_error : g_kvtier_error;
    // Messages carry paths and peer text: never let a stray byte turn into a UnicodeError.
    nb::object message = nb::steal(
        PyUnicode_DecodeUTF8(message_.data(), static_cast<Py_ssize_t>(message_.size()), "replace"));
    if (!message.is_valid()) return;
    nb::object exc = nb::steal(PyObject_CallOneArg(type, message.ptr()));
    if (!exc.is_valid()) return;
    if (PyObject_SetAttrString(exc.ptr(), "code", nb::str(code_.c_str()).ptr()) != 0 ||
        PyObject_SetAttrString(exc.ptr(), "message", message.ptr()) != 0 ||
        PyObject_SetAttrString(exc.ptr(), "retryable", retryable_ ? Py_True : Py_False) != 0) {
      return;
    }
    PyErr_SetObject(type, exc.ptr());
  }

 private:
  std::string code_;
  std::string message_;
  bool retryable_ = false;
  bool invalid_argument_ = false;
};

[[noreturn]] void Throw(const Status& s) { throw StatusError(s); }
[[noreturn]] void ThrowInvalid(std::string message) {
  throw StatusError(Status::InvalidArgument(std::move(message)));
}
void Check(const Status& s) {
  if (!s.ok()) Throw(s);
}
template <typename T>
T Unwrap(Result<T> r) {
  if (!r.ok()) Throw(r.status());
  return std::move(r).value();
}

// The text of the pending Python error, which is cleared (for folding it into our own message).
std::string TakePythonErrorText() {
  PyObject *type = nullptr, *value = nullptr, *trace = nullptr;
  PyErr_Fetch(&type, &value, &trace);
  std::string text = "unknown error";
  if (value != nullptr) {
    if (PyObject* s = PyObject_Str(value)) {
      if (const char* c = PyUnicode_AsUTF8(s)) text = c;
      Py_DECREF(s);
    }
  }
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(trace);
  PyErr_Clear();
  return text;
}

std::string TypeName(nb::handle obj) { return Py_TYPE(obj.ptr())->tp_name; }

// str(obj). (nb::str(o) of an object that is no str yet would not convert it.)
std::string StrOf(nb::handle obj) {
  nb::object s = nb::steal(PyObject_Str(obj.ptr()));
  if (!s.is_valid()) throw nb::python_error();
  return nb::cast<std::string>(s);
}

// ---------------------------------------------------------------------------------------------
// The reaper: destroys objects whose destructors may block, off the caller's thread.

class Reaper {
 public:
  using Work = std::function<void()>;

  // Runs `work` on the reaper thread (started on first use), or inline once the reaper has shut
  // down (interpreter exit). `work` must not throw and must take the GIL itself if it needs it.
  // REQUIRES: the GIL is held (every caller is a destructor run by Python, or the bindings).
  static void Reap(Work work) {
    if (shut_down_) {
      work();
      return;
    }
    if (state_ == nullptr) {
      state_ = new State;
      State* s = state_;
      s->thread = std::thread([s] { Loop(s); });
    }
    {
      std::lock_guard lock(state_->mu);
      state_->queue.push_back(std::move(work));
    }
    state_->cv.notify_one();
  }

  // Finishes everything queued and joins the thread. Called from atexit, before finalization, so
  // work that takes the GIL still can. REQUIRES: the GIL is held.
  static void Shutdown() {
    shut_down_ = true;
    State* s = state_;
    if (s == nullptr) return;
    state_ = nullptr;
    {
      std::lock_guard lock(s->mu);
      s->stop = true;
    }
    s->cv.notify_one();
    {
      nb::gil_scoped_release release;
      s->thread.join();
    }
    delete s;
  }

  // In a child process after fork() the thread does not exist: forget (leak) its state, so the
  // child starts a reaper of its own when it needs one and never joins a thread it lacks.
  static void AfterForkInChild() { state_ = nullptr; }

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Work> queue;
    bool stop = false;
    std::thread thread;
  };

  static void Loop(State* s) {
    for (;;) {
      Work work;
      {
        std::unique_lock lock(s->mu);
        s->cv.wait(lock, [s] { return s->stop || !s->queue.empty(); });
        if (s->queue.empty()) return;  // stop requested and everything done
        work = std::move(s->queue.front());
        s->queue.pop_front();
      }
      work();
      work = nullptr;  // captured objects die here, off the caller's thread
    }
  }

  // Both are read and written with the GIL held only.
  static inline State* state_ = nullptr;
  static inline bool shut_down_ = false;
};

// Hands the last reference of `p` to the reaper (a no-op for null).
template <typename T>
void ReapShared(std::shared_ptr<T> p) {
  if (p) Reaper::Reap([p = std::move(p)]() mutable { p.reset(); });
}

// ---------------------------------------------------------------------------------------------
// Memory borrowed from Python objects

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
  static bool Supported(nb::handle obj) {
    return PyObject_CheckBuffer(obj.ptr()) || IsTensorLike(obj);
  }

  // Borrows the memory of `obj`, which must be contiguous (and writable for kWrite). `what` names
  // the argument in error messages. REQUIRES: the GIL is held.
  static HeldBuffer Acquire(nb::handle obj, Access access, const std::string& what) {
    HeldBuffer b;
    if (PyObject_CheckBuffer(obj.ptr())) {
      int flags = PyBUF_FORMAT | PyBUF_C_CONTIGUOUS;
      if (access == Access::kWrite) flags |= PyBUF_WRITABLE;
      if (PyObject_GetBuffer(obj.ptr(), &b.view_, flags) != 0) {
        ThrowInvalid(fmt::format("{} must be a {}C-contiguous buffer: {}", what,
                                 access == Access::kWrite ? "writable, " : "",
                                 TakePythonErrorText()));
      }
      b.has_view_ = true;
      b.data_ = static_cast<uint8_t*>(b.view_.buf);
      b.size_ = static_cast<size_t>(b.view_.len);
      b.itemsize_ = static_cast<size_t>(b.view_.itemsize);
      b.format_ = ParseFormat(b.view_.format ? b.view_.format : "B");
      return b;
    }
    if (!IsTensorLike(obj)) {
      throw nb::type_error(
          fmt::format("{} must be a buffer (bytes, bytearray, memoryview, array, numpy array) or "
                      "a CPU tensor, not {}",
                      what, TypeName(obj))
              .c_str());
    }
    // A torch tensor: no buffer protocol, but data_ptr() and friends say where its bytes are.
    std::string device = StrOf(obj.attr("device").attr("type"));
    if (device != "cpu") {
      ThrowInvalid(fmt::format("{} is a tensor on {}, not in host memory", what, device));
    }
    if (!nb::cast<bool>(obj.attr("is_contiguous")())) {
      ThrowInvalid(fmt::format("{} is a non-contiguous tensor", what));
    }
    b.data_ = reinterpret_cast<uint8_t*>(nb::cast<uintptr_t>(obj.attr("data_ptr")()));
    b.itemsize_ = nb::cast<size_t>(obj.attr("element_size")());
    b.size_ = nb::cast<size_t>(obj.attr("numel")()) * b.itemsize_;
    b.format_ = TensorFormat(StrOf(obj.attr("dtype")));
    b.owner_ = obj.ptr();
    Py_INCREF(b.owner_);
    return b;
  }

  // Gives the memory back. Safe to call more than once and from any thread before the
  // interpreter finalizes.
  void Release() {
    if (!has_view_ && owner_ == nullptr) return;
    PyGILState_STATE gil = PyGILState_Ensure();
    if (has_view_) PyBuffer_Release(&view_);
    Py_XDECREF(owner_);
    PyGILState_Release(gil);
    has_view_ = false;
    owner_ = nullptr;
  }

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  // The element type as a struct-module code ('B', 'i', 'q', ...), 0 for non-integers.
  char format() const { return format_; }
  size_t itemsize() const { return itemsize_; }

 private:
  static bool IsTensorLike(nb::handle obj) {
    return nb::hasattr(obj, "data_ptr") && nb::hasattr(obj, "device") &&
           nb::hasattr(obj, "element_size") && nb::hasattr(obj, "is_contiguous");
  }

  // Native-order integer formats only ("i", "=I", "<q"); anything else is 0.
  static char ParseFormat(const char* f) {
    if (*f == '@' || *f == '=' || *f == '<') ++f;  // little-endian hosts only
    if (f[0] == '\0' || f[1] != '\0') return 0;
    return std::strchr("bBhHiIlLqQnN", f[0]) ? f[0] : 0;
  }

  static char TensorFormat(const std::string& dtype) {
    static const std::pair<const char*, char> kTypes[] = {
        {"torch.int8", 'b'},  {"torch.uint8", 'B'},  {"torch.int16", 'h'}, {"torch.uint16", 'H'},
        {"torch.int32", 'i'}, {"torch.uint32", 'I'}, {"torch.int64", 'q'}, {"torch.uint64", 'Q'},
    };
    for (const auto& [name, code] : kTypes) {
      if (dtype == name) return code;
    }
    return 0;
  }

  Py_buffer view_{};
  bool has_view_ = false;
  PyObject* owner_ = nullptr;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  char format_ = 0;
  size_t itemsize_ = 0;
};

// Reads element i of an integer buffer as int64; false if it does not fit.
bool ReadInteger(const HeldBuffer& b, size_t i, int64_t* out) {
  const uint8_t* p = b.data() + i * b.itemsize();
  const bool is_signed = std::strchr("bhilqn", b.format()) != nullptr;
  switch (b.itemsize()) {
    case 1:
      *out = is_signed ? int64_t{*reinterpret_cast<const int8_t*>(p)} : int64_t{*p};
      return true;
    case 2: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      *out = is_signed ? int64_t{static_cast<int16_t>(v)} : int64_t{v};
      return true;
    }
    case 4: {
      uint32_t v;
      std::memcpy(&v, p, 4);
      *out = is_signed ? int64_t{static_cast<int32_t>(v)} : int64_t{v};
      return true;
    }
    case 8: {
      uint64_t v;
      std::memcpy(&v, p, 8);
      if (!is_signed && v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return false;
      }
      *out = static_cast<int64_t>(v);
      return true;
    }
  }
  return false;
}

// A sequence's items as int64 (Python ints, or anything with __index__).
std::vector<int64_t> SequenceIntegers(nb::handle obj, const std::string& what) {
  nb::object seq = nb::steal(PySequence_Fast(obj.ptr(), ""));
  if (!seq.is_valid()) {
    PyErr_Clear();
    throw nb::type_error(fmt::format("{} must be a sequence of ints or an integer buffer, not {}",
                                     what, TypeName(obj))
                             .c_str());
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    nb::object index = nb::steal(PyNumber_Index(items[i]));
    if (!index.is_valid()) {
      PyErr_Clear();
      throw nb::type_error(
          fmt::format("{}[{}] must be an int, not {}", what, i, TypeName(items[i])).c_str());
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
    if (overflow != 0) ThrowInvalid(fmt::format("{}[{}] is out of range", what, i));
    out[static_cast<size_t>(i)] = v;
  }
  return out;
}

// Integers from a list/tuple/iterable or an integer buffer (array, numpy, CPU tensor).
std::vector<int64_t> ParseIntegers(nb::handle obj, const std::string& what) {
  if (!PyList_Check(obj.ptr()) && !PyTuple_Check(obj.ptr()) && HeldBuffer::Supported(obj)) {
    HeldBuffer b = HeldBuffer::Acquire(obj, HeldBuffer::Access::kRead, what);
    if (b.format() == 0) {
      ThrowInvalid(fmt::format("{} must hold integers in native byte order", what));
    }
    std::vector<int64_t> out(b.size() / b.itemsize());
    for (size_t i = 0; i < out.size(); ++i) {
      if (!ReadInteger(b, i, &out[i])) ThrowInvalid(fmt::format("{}[{}] is out of range", what, i));
    }
    return out;
  }
  return SequenceIntegers(obj, what);
}

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

// Keys: a list of 32-byte bytes-like objects, or one bytes-like object of n * 32 bytes.
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

// Chunk buffers of a Store (read) or Load (write): a sequence of buffer-like objects.
std::vector<HeldBuffer> ParseChunkBuffers(nb::handle obj, HeldBuffer::Access access) {
  if (PyBytes_Check(obj.ptr()) || PyByteArray_Check(obj.ptr()) || PyMemoryView_Check(obj.ptr())) {
    throw nb::type_error("buffers must be a list of chunk buffers, one per key");
  }
  nb::object seq = nb::steal(PySequence_Fast(obj.ptr(), ""));
  if (!seq.is_valid()) {
    PyErr_Clear();
    throw nb::type_error(
        fmt::format("buffers must be a list of chunk buffers, not {}", TypeName(obj)).c_str());
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  std::vector<HeldBuffer> out;
  out.reserve(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    out.push_back(HeldBuffer::Acquire(items[i], access, fmt::format("buffers[{}]", i)));
  }
  return out;
}

nb::bytes KeyBytes(const ChunkKey& k) {
  return nb::bytes(reinterpret_cast<const char*>(k.data()), ChunkKey::kSize);
}

// ---------------------------------------------------------------------------------------------
// Stores

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

double CheckedTimeout(double seconds) {
  if (!(seconds >= 0)) ThrowInvalid("timeout must be None or a non-negative number of seconds");
  return seconds;
}

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

nb::dict CountersDict(const TierCounters& c) {
  nb::dict d;
  d["lookups"] = c.lookups;
  d["hits"] = c.hits;
  d["misses"] = c.misses;
  d["served"] = c.served;
  d["bytes_in"] = c.bytes_in;
  d["bytes_out"] = c.bytes_out;
  d["evictions"] = c.evictions;
  d["rejections"] = c.rejections;
  d["errors"] = c.errors;
  return d;
}

nb::dict FileTierStatsDict(const FileTierStats& f) {
  nb::dict file;
  file["chunks"] = f.chunks;
  file["bytes"] = f.bytes;
  file["capacity_bytes"] = f.capacity_bytes;
  file["reads"] = f.reads;
  file["writes"] = f.writes;
  file["hits"] = f.hits;
  file["misses"] = f.misses;
  file["bytes_read"] = f.bytes_read;
  file["bytes_written"] = f.bytes_written;
  file["evictions"] = f.evictions;
  file["rejections"] = f.rejections;
  file["errors"] = f.errors;
  file["corrupt"] = f.corrupt;
  file["foreign"] = f.foreign;
  file["disk_rechecks"] = f.disk_rechecks;
  file["found_on_disk"] = f.found_on_disk;
  file["stale_temps_removed"] = f.stale_temps_removed;
  file["bounce_copies"] = f.bounce_copies;
  file["queued_reads"] = f.queued_reads;
  file["queued_writes"] = f.queued_writes;
  file["o_direct"] = f.o_direct;
  file["io_engine"] = f.io_engine;
  return file;
}

nb::dict EngineStatsDict(const EngineStats& s) {
  nb::dict mem;
  const MemoryTierStats& m = s.memory_detail;
  mem["capacity_bytes"] = m.capacity_bytes;
  mem["slot_bytes"] = m.slot_bytes;
  mem["num_slots"] = m.num_slots;
  mem["resident"] = m.resident;
  mem["pinned"] = m.pinned;
  mem["huge_pages"] = m.huge_pages;
  mem["lookups"] = m.lookups;
  mem["hits"] = m.hits;
  mem["misses"] = m.misses;
  mem["bytes_in"] = m.bytes_in;
  mem["bytes_out"] = m.bytes_out;
  mem["evictions"] = m.evictions;
  mem["dirty"] = m.dirty;
  mem["dirty_evictions"] = m.dirty_evictions;
  mem["dirty_refusals"] = m.dirty_refusals;
  mem["rejections"] = m.rejections;
  mem["errors"] = m.errors;
  nb::dict d;
  d["memory"] = CountersDict(s.memory);
  d["memory_detail"] = mem;
  d["has_file"] = s.has_file;
  if (s.has_file) {
    d["file"] = CountersDict(s.file);
    d["file_detail"] = FileTierStatsDict(s.file_detail);
  }
  d["promotions"] = s.promotions;
  d["shared_reads"] = s.shared_reads;
  d["deadline_misses"] = s.deadline_misses;
  d["write_backs"] = s.write_backs;
  d["write_back_failures"] = s.write_back_failures;
  d["dirty_evictions"] = s.dirty_evictions;
  d["stores"] = s.stores;
  d["loads"] = s.loads;
  d["rejected_ops"] = s.rejected_ops;
  return d;
}

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
    std::string text;
    if (PyUnicode_Check(l2.ptr())) {
      text = nb::cast<std::string>(l2);
    } else if (PyDict_Check(l2.ptr())) {
      text = nb::cast<std::string>(nb::module_::import_("json").attr("dumps")(l2));
    } else {
      throw nb::type_error(
          fmt::format("l2 must be None, a JSON string or a dict, not {}", TypeName(l2)).c_str());
    }
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

// ---------------------------------------------------------------------------------------------
// The file tier on its own: kvtier's L2 reading into and writing from a buffer the caller owns,
// for an integration that already has a host-memory tier of its own (vLLM's native offloading,
// whose CPU tier is the primary). Chunks go straight between that buffer and the chunk files,
// O_DIRECT in place where the buffer's chunks are 4 KiB-aligned, on the tier's read and write
// pools; Python only submits and collects. Each job carries an id of the caller's choosing and
// lands in one completion queue when its last chunk is done, so a poll costs nothing while no
// job finished.

struct FileJob {
  int64_t id = 0;
  bool read = false;
  Clock::time_point start;
  double seconds = 0;             // submission to last chunk done
  HeldBuffer buffer;              // released on a Python thread (collect or close)
  std::vector<uint8_t> chunk_ok;  // entry i is written by the one pool thread that did chunk i
  std::atomic<size_t> remaining{0};
  std::mutex mu;
  Status first_error;  // guarded by mu
};

struct FileTierCore {
  // The tier first: its destructor waits for queued and running I/O, whose callbacks use the
  // queue below.
  ~FileTierCore() { tier.reset(); }

  void ChunkDone(const std::shared_ptr<FileJob>& job, size_t i, Status s) {
    if (s.ok()) {
      if (i < job->chunk_ok.size()) job->chunk_ok[i] = 1;
    } else {
      std::lock_guard lock(job->mu);
      if (job->first_error.ok()) job->first_error = std::move(s);
    }
    if (job->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) Finish(job);
  }

  void Finish(const std::shared_ptr<FileJob>& job) {
    job->seconds = std::chrono::duration<double>(Clock::now() - job->start).count();
    std::lock_guard lock(mu);
    finished.push_back(job);
    --in_flight;
    if (in_flight == 0) idle.notify_all();
  }

  std::shared_ptr<FileTier> tier;  // guarded by mu; null once closed
  uint64_t chunk_bytes = 0;
  std::mutex mu;
  std::condition_variable idle;
  size_t in_flight = 0;                           // guarded by mu
  std::deque<std::shared_ptr<FileJob>> finished;  // guarded by mu; not yet collected
};

class PyFileTier {
 public:
  explicit PyFileTier(std::shared_ptr<FileTierCore> core) : core_(std::move(core)) {}
  PyFileTier(const PyFileTier&) = delete;
  PyFileTier& operator=(const PyFileTier&) = delete;
  ~PyFileTier() { ReapShared(std::move(core_)); }  // may wait for I/O: never on the caller
  // core_ is never null while Python can call: nanobind destroys the object only after.

  uint64_t chunk_bytes() const { return core_->chunk_bytes; }
  bool closed() const {
    std::lock_guard lock(core_->mu);
    return !core_->tier;
  }
  std::string namespace_dir() const { return Tier()->namespace_dir(); }
  std::string ChunkPath(nb::handle key) const { return Tier()->ChunkPath(ParseKey(key, "key")); }

  std::vector<bool> Contains(nb::handle keys_obj) {
    std::vector<ChunkKey> keys = ParseKeys(keys_obj);
    std::shared_ptr<FileTier> tier = Tier();
    std::vector<bool> out(keys.size());
    nb::gil_scoped_release release;
    for (size_t i = 0; i < keys.size(); ++i) out[i] = tier->Contains(keys[i]);
    return out;
  }

  void Submit(bool read, int64_t job_id, nb::handle keys_obj, nb::handle buffer_obj,
              nb::handle offsets_obj) {
    const char* what = read ? "submit_read" : "submit_write";
    std::vector<ChunkKey> keys = ParseKeys(keys_obj);
    std::vector<int64_t> offsets = ParseIntegers(offsets_obj, "offsets");
    if (offsets.size() != keys.size()) {
      ThrowInvalid(fmt::format("{}: {} keys but {} offsets", what, keys.size(), offsets.size()));
    }
    auto job = std::make_shared<FileJob>();
    job->buffer = HeldBuffer::Acquire(
        buffer_obj, read ? HeldBuffer::Access::kWrite : HeldBuffer::Access::kRead, "buffer");
    const uint64_t n = core_->chunk_bytes;
    for (size_t i = 0; i < offsets.size(); ++i) {
      if (offsets[i] < 0 || static_cast<uint64_t>(offsets[i]) + n > job->buffer.size()) {
        ThrowInvalid(
            fmt::format("{}: offsets[{}] = {} puts a {}-byte chunk outside the {}-byte "
                        "buffer",
                        what, i, offsets[i], n, job->buffer.size()));
      }
    }
    std::shared_ptr<FileTier> tier = Tier();
    job->id = job_id;
    job->read = read;
    job->chunk_ok.assign(keys.size(), 0);
    job->remaining.store(keys.size() + 1);  // +1: submission itself, so no chunk finishes it early
    job->start = Clock::now();
    FileTierCore* core = core_.get();
    {
      std::lock_guard lock(core->mu);
      ++core->in_flight;
    }
    nb::gil_scoped_release release;
    for (size_t i = 0; i < keys.size(); ++i) {
      uint8_t* at = job->buffer.data() + offsets[i];
      // The callbacks run on the tier's pool threads; the core outlives them (its destructor
      // destroys the tier first, which waits for them).
      auto done = [core, job, i](Status s) { core->ChunkDone(job, i, std::move(s)); };
      Status s = read ? tier->ReadAsync(keys[i], std::span<uint8_t>(at, n), done)
                      : tier->WriteAsync(keys[i], std::span<const uint8_t>(at, n), done);
      if (!s.ok()) core->ChunkDone(job, i, std::move(s));  // refused (queue full): a failed chunk
    }
    core->ChunkDone(job, keys.size(), Status::Ok());  // index past the chunks: no entry written
  }

  // Finished jobs since the last call: (job, ok, chunks, error, seconds).
  nb::list Finished() {
    std::deque<std::shared_ptr<FileJob>> done;
    {
      std::lock_guard lock(core_->mu);
      done.swap(core_->finished);
    }
    nb::list out;
    for (const std::shared_ptr<FileJob>& job : done) {
      job->buffer.Release();
      size_t chunks = 0;
      if (job->read) {
        while (chunks < job->chunk_ok.size() && job->chunk_ok[chunks]) ++chunks;
      } else {
        for (uint8_t ok : job->chunk_ok) chunks += ok;
      }
      std::string error;
      {
        std::lock_guard lock(job->mu);
        if (!job->first_error.ok()) error = job->first_error.ToString();
      }
      out.append(nb::make_tuple(job->id, error.empty(), chunks, error, job->seconds));
    }
    return out;
  }

  size_t in_flight() const {
    std::lock_guard lock(core_->mu);
    return core_->in_flight;
  }

  bool WaitIdle(std::optional<double> timeout) {
    std::shared_ptr<FileTierCore> core = core_;
    const auto deadline =
        timeout ? Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(CheckedTimeout(*timeout)))
                : Clock::time_point::max();
    for (;;) {
      bool idle;
      {
        nb::gil_scoped_release release;
        std::unique_lock lock(core->mu);
        // Slices of 100 ms let Ctrl-C through.
        const auto until = std::min(deadline, Clock::now() + std::chrono::milliseconds(100));
        idle = core->idle.wait_until(lock, until, [&] { return core->in_flight == 0; });
      }
      if (idle) return true;
      if (Clock::now() >= deadline) return false;
      if (PyErr_CheckSignals() != 0) throw nb::python_error();
    }
  }

  nb::dict Stats() const { return FileTierStatsDict(Tier()->Stats()); }

  // Waits for every submitted job, then closes the tier. Results stay collectable; the buffers
  // of jobs not collected yet are given back now, so the caller can release its memory.
  void Close() {
    std::shared_ptr<FileTier> tier;
    {
      std::lock_guard lock(core_->mu);
      tier = std::move(core_->tier);
    }
    if (tier) {
      nb::gil_scoped_release release;
      (void)tier->Drain();  // jobs submitted before; a Submit racing close holds its own ref
      tier.reset();
    }
    std::lock_guard lock(core_->mu);
    for (const std::shared_ptr<FileJob>& job : core_->finished) job->buffer.Release();
  }

 private:
  std::shared_ptr<FileTier> Tier() const {
    std::lock_guard lock(core_->mu);
    if (!core_->tier) throw StatusError("closed", "the file tier is closed");
    return core_->tier;
  }

  std::shared_ptr<FileTierCore> core_;
};

PyFileTier* OpenFileTier(const KeyNamespace& ns, uint64_t chunk_bytes, nb::handle l2,
                         int64_t max_queued_chunks, std::optional<bool> sync_data) {
  if (chunk_bytes == 0) ThrowInvalid("open_file_tier: chunk_bytes must be positive");
  if (max_queued_chunks < 1) ThrowInvalid("open_file_tier: max_queued_chunks must be positive");
  std::string text;
  if (PyUnicode_Check(l2.ptr())) {
    text = nb::cast<std::string>(l2);
  } else if (PyDict_Check(l2.ptr())) {
    text = nb::cast<std::string>(nb::module_::import_("json").attr("dumps")(l2));
  } else {
    throw nb::type_error(
        fmt::format("l2 must be a JSON string or a dict, not {}", TypeName(l2)).c_str());
  }
  // The same JSON, parsing and mapping as `kvtier serve --l2`.
  server::ServeConfig config;
  config.chunk_size = ns.chunk_tokens;
  config.chunk_bytes = chunk_bytes;
  config.http_port = -1;
  config.l2.push_back(Unwrap(server::ParseL2Spec(text)));
  auto options = server::BuildServerOptions(config);
  if (!options.ok()) Throw(options.status().WithContext("open_file_tier"));
  FileTierOptions fo = *options->engine.file;
  fo.ns = ns;
  fo.chunk_bytes = chunk_bytes;
  fo.max_queued_reads = fo.max_queued_writes = static_cast<size_t>(max_queued_chunks);
  if (sync_data) fo.sync_data = *sync_data;  // else the l2 JSON's (true unless it says false)
  auto core = std::make_shared<FileTierCore>();
  core->chunk_bytes = chunk_bytes;
  {
    nb::gil_scoped_release release;
    core->tier = Unwrap(FileTier::Open(fo));
  }
  return new PyFileTier(std::move(core));
}

// `kvtier serve` inside this process: the engine, its L1 pool and its file tier live here, and
// other processes (or this one, through connect()) reach it on its socket.
class PyServer {
 public:
  explicit PyServer(std::unique_ptr<server::Server> s)
      : server_(std::move(s)),
        socket_path_(server_->socket_path()),
        http_port_(server_->http_port()) {}
  PyServer(const PyServer&) = delete;
  PyServer& operator=(const PyServer&) = delete;
  ~PyServer() { ReapShared(std::move(server_)); }  // ~Server drains: never on the caller

  const std::string& socket_path() const { return socket_path_; }
  int http_port() const { return http_port_; }
  bool stopped() const { return server_ == nullptr; }

  nb::dict Stats() const {
    std::string text = Running().StatsJson();
    return nb::cast<nb::dict>(nb::module_::import_("json").attr("loads")(text));
  }
  std::string Metrics() const { return Running().MetricsText(); }

  void Stop() {
    if (!server_) return;
    std::shared_ptr<server::Server> s = std::move(server_);
    nb::gil_scoped_release release;
    s->Stop();
    s.reset();
  }

 private:
  server::Server& Running() const {
    if (!server_) throw StatusError("closed", "the server is stopped");
    return *server_;
  }

  std::shared_ptr<server::Server> server_;  // null once stopped
  std::string socket_path_;
  int http_port_;
};

PyServer* StartServer(nb::handle config_obj) {
  std::string text;
  if (PyUnicode_Check(config_obj.ptr())) {
    text = nb::cast<std::string>(config_obj);
  } else if (PyDict_Check(config_obj.ptr())) {
    text = nb::cast<std::string>(nb::module_::import_("json").attr("dumps")(config_obj));
  } else {
    throw nb::type_error(
        fmt::format("config must be a JSON string or a dict, not {}", TypeName(config_obj))
            .c_str());
  }
  // The same settings and checks as `kvtier serve --config`.
  server::ServeConfig config;
  Check(server::ApplyConfigJson(text, &config));
  server::ServerOptions options = Unwrap(server::BuildServerOptions(config));
  Result<std::unique_ptr<server::Server>> s = [&] {
    nb::gil_scoped_release release;
    return server::Server::Start(options);
  }();
  return new PyServer(Unwrap(std::move(s)));
}

// ---------------------------------------------------------------------------------------------
// Copier

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

// ---------------------------------------------------------------------------------------------
// Module

constexpr const char* kKvtierErrorDoc =
    "An error from kvtier. ``code`` is the snake_case status code (\"invalid_argument\", "
    "\"not_found\", \"rejected\", \"no_space\", \"io_error\", \"corruption\", \"timeout\", "
    "\"unavailable\", \"permission_denied\", \"internal\", \"unimplemented\", \"aborted\", or "
    "\"closed\" for a store used after close()); ``message`` is the C++ status message; "
    "``retryable`` says whether trying again may help.";

constexpr const char* kKeysDoc =
    "``keys``: a list of 32-byte ``bytes`` keys, or one bytes-like object of n * 32 bytes.";

void DefineErrors(nb::module_& m) {
  nb::dict attrs;
  attrs["code"] = "unknown";
  attrs["message"] = "";
  attrs["retryable"] = false;
  g_kvtier_error = PyErr_NewExceptionWithDoc("kvtier.KvtierError", kKvtierErrorDoc, PyExc_Exception,
                                             attrs.ptr());
  if (g_kvtier_error == nullptr) throw nb::python_error();
  nb::object bases = nb::steal(PyTuple_Pack(2, g_kvtier_error, PyExc_ValueError));
  nb::dict invalid_attrs;
  invalid_attrs["code"] = "invalid_argument";
  g_invalid_argument_error = PyErr_NewExceptionWithDoc(
      "kvtier.InvalidArgumentError",
      "An invalid argument (code \"invalid_argument\"): both a KvtierError and a ValueError.",
      bases.ptr(), invalid_attrs.ptr());
  if (g_invalid_argument_error == nullptr) throw nb::python_error();
  // The globals keep their references for the life of the process (extension modules are never
  // unloaded), so the translator can always raise them.
  m.attr("KvtierError") = nb::borrow(g_kvtier_error);
  m.attr("InvalidArgumentError") = nb::borrow(g_invalid_argument_error);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      e.Raise();
    }
  });
}

void DefineKeys(nb::module_& m) {
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

void DefineStores(nb::module_& m) {
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

  nb::class_<PyServer>(
      m, "Server",
      "A `kvtier serve` running inside this process (start_server). Stop it with stop() or a "
      "with block; dropping it stops it in the background.")
      .def_prop_ro("socket_path", &PyServer::socket_path, "The Unix socket it listens on.")
      .def_prop_ro("http_port", &PyServer::http_port,
                   "The HTTP port of /metrics, /healthz and /stats, or -1 without HTTP.")
      .def_prop_ro("stopped", &PyServer::stopped, "True after stop().")
      .def("stats", &PyServer::Stats,
           "The statistics document as a dict, every client listed: the operator's view (under "
           "isolate_clients, HTTP /stats lists no client and a client's stats() only its "
           "tenant's).")
      .def("metrics", &PyServer::Metrics, "The /metrics text (Prometheus).")
      .def("stop", &PyServer::Stop,
           "Drains and stops; idempotent. Blocks: closes every connection (releasing what it "
           "held), writes L1's dirty chunks to L2 (write-back), finishes queued writes and "
           "removes the socket.")
      .def("__enter__", [](nb::object self) { return self; })
      .def("__exit__", [](PyServer& s, nb::args) {
        s.Stop();
        return false;
      });

  m.def("start_server", &StartServer, nb::arg("config") = "{}", nb::rv_policy::take_ownership,
        "Starts `kvtier serve` inside this process. ``config``: the settings `kvtier serve "
        "--config` reads, as a JSON string or dict (keys as the flags: l1_size_gb, chunk_bytes, "
        "chunk_size, model, l2 (a list of tier objects), no_l2, write_policy, eviction_policy, "
        "socket, token, http_port, worker_threads, ...); the defaults are the command's. "
        "InvalidArgumentError for bad settings; KvtierError \"unavailable\" when the socket is "
        "in use.");

  m.def("default_socket_path", &DefaultSocketPath,
        "Where `kvtier serve` listens by default: $XDG_RUNTIME_DIR/kvtier.sock, else "
        "/tmp/kvtier-<uid>.sock.");
}

void DefineCopier(nb::module_& m) {
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

void DefineFileTier(nb::module_& m) {
  nb::class_<PyFileTier>(
      m, "FileTier",
      "kvtier's file tier (L2) on its own, moving chunks between the files and a buffer the "
      "caller owns (e.g. another system's host-memory cache), O_DIRECT in place where the "
      "buffer's chunks are 4 KiB-aligned. Jobs run on the tier's read and write pools with the "
      "GIL released; finished() collects them. Thread-safe.")
      .def_prop_ro("chunk_bytes", &PyFileTier::chunk_bytes, "Bytes of one chunk.")
      .def_prop_ro("closed", &PyFileTier::closed, "True after close().")
      .def_prop_ro("namespace_dir", &PyFileTier::namespace_dir,
                   "The folder of this namespace's chunk files.")
      .def_prop_ro("in_flight", &PyFileTier::in_flight, "Jobs submitted and not yet finished.")
      .def("chunk_path", &PyFileTier::ChunkPath, nb::arg("key"),
           "Where the chunk of ``key`` lives, whether or not it exists.")
      .def("contains", &PyFileTier::Contains, nb::arg("keys"),
           (std::string("Whether each key has a chunk: kvtier's index, and for a key not in it "
                        "at most one stat of its file per half second (chunks other processes or "
                        "hosts wrote). ") +
            kKeysDoc)
               .c_str())
      .def(
          "submit_read",
          [](PyFileTier& t, int64_t job, nb::handle keys, nb::handle buffer, nb::handle offsets) {
            t.Submit(true, job, keys, buffer, offsets);
          },
          nb::arg("job"), nb::arg("keys"), nb::arg("buffer"), nb::arg("offsets"),
          "Reads the chunk of keys[i] into ``buffer`` (writable, C-contiguous) at byte "
          "offsets[i], asynchronously; ``job`` is the caller's id for finished(). The buffer is "
          "held until the job is collected (or the tier closed). A missing, corrupt or foreign "
          "chunk fails its read and is never written into the buffer as data the result calls "
          "good.")
      .def(
          "submit_write",
          [](PyFileTier& t, int64_t job, nb::handle keys, nb::handle buffer, nb::handle offsets) {
            t.Submit(false, job, keys, buffer, offsets);
          },
          nb::arg("job"), nb::arg("keys"), nb::arg("buffer"), nb::arg("offsets"),
          "Writes chunk_bytes of ``buffer`` at offsets[i] as the chunk of keys[i], "
          "asynchronously (checksummed, published by rename, capacity enforced; keys already "
          "stored are skipped). ``job`` is the caller's id for finished().")
      .def("finished", &PyFileTier::Finished,
           "Jobs finished since the last call, as tuples (job, ok, chunks, error, seconds): "
           "``chunks`` is the leading chunks read for a read and the chunks stored for a write, "
           "``error`` the first failure (\"\" when ok), ``seconds`` from submission to the last "
           "chunk. Never blocks.")
      .def("wait_idle", &PyFileTier::WaitIdle, nb::arg("timeout") = nb::none(),
           "Waits (GIL released) until no job is in flight; False if ``timeout`` seconds passed "
           "first.")
      .def("stats", &PyFileTier::Stats, "The file tier's statistics as a dict.")
      .def("close", &PyFileTier::Close,
           "Waits for every submitted job, then closes the tier; idempotent. Results stay "
           "collectable through finished(); buffers are given back now.")
      .def("__enter__", [](nb::object self) { return self; })
      .def("__exit__", [](PyFileTier& t, nb::args) {
        t.Close();
        return false;
      });

  m.def("open_file_tier", &OpenFileTier, nb::arg("ns"), nb::arg("chunk_bytes"), nb::arg("l2"),
        nb::kw_only(), nb::arg("max_queued_chunks") = 65536, nb::arg("sync_data") = nb::none(),
        nb::rv_policy::take_ownership,
        "Opens kvtier's file tier for ``ns`` and ``chunk_bytes``-byte chunks. ``l2`` is the JSON "
        "object `kvtier serve --l2` takes, as a string or dict: {\"type\": \"fs\", \"path\": ..., "
        "\"max_size_gb\": ..., \"read_threads\": ..., \"write_threads\": ...}. The index is "
        "rebuilt from the directory. ``max_queued_chunks`` bounds the chunks waiting for a "
        "read or write thread; a chunk beyond it fails its job (code \"rejected\"). ``sync_data`` "
        "False skips the fdatasync before each chunk's publication (docs/file-format.md: a "
        "power loss may then leave chunks that fail their checksum, which read as misses); "
        "given, it overrides the l2 object's \"sync_data\" (default true).");
}

void InitModule(nb::module_& m) {
  m.doc() = "kvtier's C++ core: chunk keys, the tiered engine, the server client, KV copiers.";
  m.attr("__version__") = KVTIER_VERSION;
  InitLogging();  // log lines to stderr: a benchmark's JSON on stdout stays parseable
  DefineErrors(m);
  DefineKeys(m);
  DefineStores(m);
  DefineCopier(m);
  DefineFileTier(m);
  // Drain the reaper before the interpreter finalizes (its work may need the GIL), and give a
  // forked child a fresh one.
  nb::module_::import_("atexit").attr("register")(
      nb::cpp_function([] { Reaper::Shutdown(); }, nb::name("_shutdown_reaper")));
  pthread_atfork(nullptr, nullptr, [] { Reaper::AfterForkInChild(); });
}

}  // namespace
}  // namespace kvtier::python

NB_MODULE(_native, m) { kvtier::python::InitModule(m); }

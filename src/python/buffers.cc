// Memory borrowed from Python objects (HeldBuffer: the buffer protocol, or a CPU tensor's
// data_ptr) and the arguments read from it: integers and chunk buffers.
#include <Python.h>  // first, as Python's headers require
#include <fmt/format.h>
#include <nanobind/nanobind.h>

#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "python/binding.h"

namespace kvtier::python {
namespace {

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

}  // namespace

bool HeldBuffer::Supported(nb::handle obj) {
  return PyObject_CheckBuffer(obj.ptr()) || IsTensorLike(obj);
}

HeldBuffer HeldBuffer::Acquire(nb::handle obj, Access access, const std::string& what) {
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

void HeldBuffer::Release() {
  if (!has_view_ && owner_ == nullptr) return;
  PyGILState_STATE gil = PyGILState_Ensure();
  if (has_view_) PyBuffer_Release(&view_);
  Py_XDECREF(owner_);
  PyGILState_Release(gil);
  has_view_ = false;
  owner_ = nullptr;
}

bool HeldBuffer::IsTensorLike(nb::handle obj) {
  return nb::hasattr(obj, "data_ptr") && nb::hasattr(obj, "device") &&
         nb::hasattr(obj, "element_size") && nb::hasattr(obj, "is_contiguous");
}

char HeldBuffer::ParseFormat(const char* f) {
  if (*f == '@' || *f == '=' || *f == '<') ++f;  // little-endian hosts only
  if (f[0] == '\0' || f[1] != '\0') return 0;
  return std::strchr("bBhHiIlLqQnN", f[0]) ? f[0] : 0;
}

char HeldBuffer::TensorFormat(const std::string& dtype) {
  static const std::pair<const char*, char> kTypes[] = {
      {"torch.int8", 'b'},  {"torch.uint8", 'B'},  {"torch.int16", 'h'}, {"torch.uint16", 'H'},
      {"torch.int32", 'i'}, {"torch.uint32", 'I'}, {"torch.int64", 'q'}, {"torch.uint64", 'Q'},
  };
  for (const auto& [name, code] : kTypes) {
    if (dtype == name) return code;
  }
  return 0;
}

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

}  // namespace kvtier::python

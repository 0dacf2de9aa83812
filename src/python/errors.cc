// Errors: the kvtier exception types, the translator that raises them for a StatusError, and the
// small helpers that name Python objects in error messages.
#include <Python.h>  // first, as Python's headers require
#include <fmt/format.h>
#include <nanobind/nanobind.h>

#include <exception>
#include <string>

#include "kvtier/status.h"
#include "python/binding.h"

namespace kvtier::python {
namespace {

PyObject* g_kvtier_error = nullptr;            // kvtier.KvtierError
PyObject* g_invalid_argument_error = nullptr;  // kvtier.InvalidArgumentError

constexpr const char* kKvtierErrorDoc =
    "An error from kvtier. ``code`` is the snake_case status code (\"invalid_argument\", "
    "\"not_found\", \"rejected\", \"no_space\", \"io_error\", \"corruption\", \"timeout\", "
    "\"unavailable\", \"permission_denied\", \"internal\", \"unimplemented\", \"aborted\", or "
    "\"closed\" for a store used after close()); ``message`` is the C++ status message; "
    "``retryable`` says whether trying again may help.";

}  // namespace

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

void StatusError::Raise() const {
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

std::string JsonTextOf(nb::handle obj, std::string_view expected) {
  if (PyUnicode_Check(obj.ptr())) return nb::cast<std::string>(obj);
  if (PyDict_Check(obj.ptr())) {
    return nb::cast<std::string>(nb::module_::import_("json").attr("dumps")(obj));
  }
  throw nb::type_error(fmt::format("{}, not {}", expected, TypeName(obj)).c_str());
}

std::string StrOf(nb::handle obj) {
  nb::object s = nb::steal(PyObject_Str(obj.ptr()));
  if (!s.is_valid()) throw nb::python_error();
  return nb::cast<std::string>(s);
}

double CheckedTimeout(double seconds) {
  if (!(seconds >= 0)) ThrowInvalid("timeout must be None or a non-negative number of seconds");
  return seconds;
}

void RegisterErrors(nb::module_& m) {
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

}  // namespace kvtier::python

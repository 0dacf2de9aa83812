// Status and Result<T>: errors as values.
//
// No exception crosses the library or the daemon protocol. A Status is one pointer-sized word
// on success; on failure it carries a code, a message and whether a retry may help. "Rejected"
// (queue full, no space) and "not found" (a miss) are normal outcomes that callers handle, not
// crashes.
//
// Thread-safety: Status and Result are values; distinct objects may be used from distinct threads.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace kvtier {

enum class StatusCode : int {
  kOk = 0,
  kNotFound = 1,          // a miss: the chunk is not (or no longer) there
  kInvalidArgument = 2,   // caller error: bad option, bad input
  kRejected = 3,          // a bounded queue or pool is full: retry later or recompute
  kNoSpace = 4,           // a tier has no room (ENOSPC, capacity)
  kIOError = 5,           // the OS reported an error
  kCorruption = 6,        // data failed a checksum or a header check
  kTimeout = 7,           // a deadline passed
  kUnavailable = 8,       // a peer or a service is not reachable
  kPermissionDenied = 9,  // token or namespace refused
  kInternal = 10,         // a bug: an invariant did not hold
  kUnimplemented = 11,
  kAborted = 12,  // cancelled, e.g. during shutdown
};

std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message, bool retryable = false);

  static Status Ok() { return Status(); }
  static Status NotFound(std::string msg) { return {StatusCode::kNotFound, std::move(msg)}; }
  static Status InvalidArgument(std::string msg) {
    return {StatusCode::kInvalidArgument, std::move(msg)};
  }
  static Status Rejected(std::string msg) { return {StatusCode::kRejected, std::move(msg), true}; }
  static Status NoSpace(std::string msg) { return {StatusCode::kNoSpace, std::move(msg), true}; }
  static Status IOError(std::string msg, bool retryable = false) {
    return {StatusCode::kIOError, std::move(msg), retryable};
  }
  static Status Corruption(std::string msg) { return {StatusCode::kCorruption, std::move(msg)}; }
  static Status Timeout(std::string msg) { return {StatusCode::kTimeout, std::move(msg), true}; }
  static Status Unavailable(std::string msg) {
    return {StatusCode::kUnavailable, std::move(msg), true};
  }
  static Status PermissionDenied(std::string msg) {
    return {StatusCode::kPermissionDenied, std::move(msg)};
  }
  static Status Internal(std::string msg) { return {StatusCode::kInternal, std::move(msg)}; }
  static Status Unimplemented(std::string msg) {
    return {StatusCode::kUnimplemented, std::move(msg)};
  }
  static Status Aborted(std::string msg) { return {StatusCode::kAborted, std::move(msg)}; }
  // From an errno value: ENOSPC/EDQUOT map to kNoSpace, ENOENT to kNotFound, EACCES/EPERM to
  // kPermissionDenied, EAGAIN/EINTR are retryable, anything else is kIOError.
  static Status FromErrno(int err, std::string_view context);

  bool ok() const { return rep_ == nullptr; }
  StatusCode code() const { return rep_ ? rep_->code : StatusCode::kOk; }
  const std::string& message() const;
  bool retryable() const { return rep_ && rep_->retryable; }
  bool IsNotFound() const { return code() == StatusCode::kNotFound; }
  bool IsRejected() const { return code() == StatusCode::kRejected; }

  // "OK" or "<CodeName>: <message>".
  std::string ToString() const;

  // Adds context in front of the message ("opening x: <message>"); OK stays OK.
  Status WithContext(std::string_view context) const;

 private:
  struct Rep {
    StatusCode code;
    bool retryable;
    std::string message;
  };
  std::shared_ptr<const Rep> rep_;  // null means OK; shared so copies are cheap
};

// Ends the process with `status` on stderr: value() of a Result that holds an error is a bug of
// its caller, reported as what the error was rather than as a bad_variant_access.
[[noreturn]] void DieOfValueOnError(const Status& status);

// Result<T> holds either a T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    if (std::get<Status>(v_).ok()) {
      v_ = Status::Internal("Result constructed from an OK status without a value");
    }
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  // REQUIRES: ok() for value(); on an error it ends the process, saying which.
  T& value() & {
    CheckValue();
    return *std::get_if<T>(&v_);
  }
  const T& value() const& {
    CheckValue();
    return *std::get_if<T>(&v_);
  }
  T&& value() && {
    CheckValue();
    return std::move(*std::get_if<T>(&v_));
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

  Status status() const { return ok() ? Status::Ok() : std::get<Status>(v_); }

 private:
  void CheckValue() const {
    if (!ok()) [[unlikely]]
      DieOfValueOnError(std::get<Status>(v_));
  }

  std::variant<T, Status> v_;
};

}  // namespace kvtier

// Returns early from the enclosing function when `expr` (a Status) is not OK.
#define KVTIER_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::kvtier::Status kvtier_status_ = (expr);        \
    if (!kvtier_status_.ok()) return kvtier_status_; \
  } while (0)

#define KVTIER_CONCAT_INNER(a, b) a##b
#define KVTIER_CONCAT(a, b) KVTIER_CONCAT_INNER(a, b)
// KVTIER_ASSIGN_OR_RETURN(auto x, MakeX()): assigns the value or returns the error.
#define KVTIER_ASSIGN_OR_RETURN(lhs, expr)                   \
  auto KVTIER_CONCAT(kvtier_result_, __LINE__) = (expr);     \
  if (!KVTIER_CONCAT(kvtier_result_, __LINE__).ok())         \
    return KVTIER_CONCAT(kvtier_result_, __LINE__).status(); \
  lhs = std::move(KVTIER_CONCAT(kvtier_result_, __LINE__)).value()

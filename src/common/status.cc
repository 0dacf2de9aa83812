#include "kvtier/status.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace kvtier {

std::string_view StatusCodeName(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "OK";
    case StatusCode::kNotFound:
      return "NotFound";
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kRejected:
      return "Rejected";
    case StatusCode::kNoSpace:
      return "NoSpace";
    case StatusCode::kIOError:
      return "IOError";
    case StatusCode::kCorruption:
      return "Corruption";
    case StatusCode::kTimeout:
      return "Timeout";
    case StatusCode::kUnavailable:
      return "Unavailable";
    case StatusCode::kPermissionDenied:
      return "PermissionDenied";
    case StatusCode::kInternal:
      return "Internal";
    case StatusCode::kUnimplemented:
      return "Unimplemented";
    case StatusCode::kAborted:
      return "Aborted";
  }
  return "Unknown";
}

Status::Status(StatusCode code, std::string message, bool retryable) {
  if (code != StatusCode::kOk) {
    rep_ = std::make_shared<const Rep>(Rep{code, retryable, std::move(message)});
  }
}

const std::string& Status::message() const {
  static const std::string kEmpty;
  return rep_ ? rep_->message : kEmpty;
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return fmt::format("{}: {}", StatusCodeName(code()), message());
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  return Status(code(), fmt::format("{}: {}", context, message()), retryable());
}

Status Status::FromErrno(int err, std::string_view context) {
  std::string msg = fmt::format("{}: {}", context, std::strerror(err));
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      return NoSpace(std::move(msg));
    case ENOENT:
    case ESTALE:
      return NotFound(std::move(msg));  // a network filesystem's file removed elsewhere
    case EACCES:
    case EPERM:
      return PermissionDenied(std::move(msg));
    case EAGAIN:
    case EINTR:
      return IOError(std::move(msg), /*retryable=*/true);
    default:
      return IOError(std::move(msg));
  }
}

}  // namespace kvtier

namespace kvtier {

void DieOfValueOnError(const Status& status) {
  std::fprintf(stderr, "kvtier: value() of a Result that holds an error: %s\n",
               status.ToString().c_str());
  std::abort();
}

}  // namespace kvtier

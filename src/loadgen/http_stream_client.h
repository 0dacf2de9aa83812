// A streaming HTTP client for OpenAI-compatible chat completions, built on libcurl's multi
// interface: one thread drives any number of concurrent streams (hundreds), so the time stamps it
// takes (launch, first content, finish) are not distorted by thread scheduling.
//
// Usage: Submit() requests, then call Poll() in a loop; each request's callback runs inside Poll()
// once the request has finished or failed.
//
// Thread-safety: a client must be used from one thread at a time. HttpGet is thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_set>

#include "kvtier/status.h"

namespace kvtier::loadgen {

using SteadyClock = std::chrono::steady_clock;

enum class FailureKind {
  kNone,
  kConnect,      // could not connect or resolve
  kHttpStatus,   // the server answered with an HTTP error status that a retry may cure (5xx,
                 // 408, 429)
  kRejected,     // the server refused the request itself (HTTP 4xx other than 408 and 429): the
                 // same request would be refused again
  kEarlyClose,   // the stream ended before [DONE] / a finish reason
  kTimeout,      // no complete answer within the request timeout
  kStreamError,  // the stream carried an error object or unparseable data
  kEmpty,        // the stream completed without any generated text
  kOther,
  kUnfinished,   // still unanswered when the caller gave up on it (CancelAll)
};
const char* FailureKindName(FailureKind kind);

struct ChatResult {
  FailureKind failure = FailureKind::kNone;
  std::string error;  // for people; empty on success
  int http_status = 0;
  SteadyClock::time_point launch;         // just before the request was handed to the transport
  SteadyClock::time_point first_content;  // first non-empty content delta (if any)
  SteadyClock::time_point finish;         // end of the stream
  bool got_content = false;
  bool usage_reported = false;
  int64_t prompt_tokens = 0;      // from the usage block
  int64_t completion_tokens = 0;  // from the usage block, else the number of content chunks
  std::string content;            // the generated text
  bool ok() const { return failure == FailureKind::kNone; }
};

class HttpStreamClient {
 public:
  struct Options {
    std::string base_url;               // e.g. "http://localhost:8000/v1"
    std::string api_key;                // sent as a bearer token when not empty
    double request_timeout_s = 600;     // whole request, 0 = none
    double connect_timeout_s = 10;
  };
  using DoneCallback = std::function<void(ChatResult&& result)>;

  static Result<std::unique_ptr<HttpStreamClient>> Create(Options options);
  ~HttpStreamClient();
  HttpStreamClient(const HttpStreamClient&) = delete;
  HttpStreamClient& operator=(const HttpStreamClient&) = delete;

  // POSTs `json_body` to <base_url>/chat/completions (with header x-user-id when `user_id` is not
  // empty) and streams the answer. The request starts moving at the next Poll(). `done` runs
  // exactly once, inside a later Poll(), unless AbortAll() drops the request first.
  void Submit(std::string json_body, std::string user_id, DoneCallback done);

  // Moves every transfer forward, waiting up to `timeout_ms` for network activity, and runs the
  // callbacks of finished requests. Fails only if libcurl itself fails.
  Status Poll(int timeout_ms);

  size_t in_flight() const;
  // Drops every unfinished request without running its callback; returns how many there were.
  size_t AbortAll();
  // Ends every unfinished request now and runs its callback with failure kUnfinished, `finish`
  // set to now, and `first_content`/`got_content` as far as the stream had come; returns how
  // many there were. Must not be called from inside a callback.
  size_t CancelAll();

 private:
  struct Transfer;
  explicit HttpStreamClient(Options options);
  void Complete(Transfer* t, int curl_code);
  Options options_;
  void* multi_ = nullptr;  // CURLM*
  std::string chat_url_;
  std::unordered_set<Transfer*> transfers_;  // owned; those not yet completed
};

struct HttpResponse {
  long status = 0;
  std::string body;
};

// Blocking GET, e.g. of <base_url>/models. Fails with Unavailable when the server cannot be
// reached within `timeout_s`; an HTTP error status is returned as a response, not an error.
Result<HttpResponse> HttpGet(const std::string& url, const std::string& api_key, double timeout_s);

}  // namespace kvtier::loadgen

// S3Client: the HTTP side of the S3 env (internal to kvtier_io).
//
// libcurl multi handles, each driven by an event-loop thread of its own, run the client's
// requests: many in flight at once, each connection kept open and reused (each multi handle's
// connection cache; `max_connections` to the endpoint in all). Requests are signed by libcurl's
// built-in AWS Signature Version 4 (CURLOPT_AWS_SIGV4), the payload declared UNSIGNED-PAYLOAD: the
// chunk's own checksum, not the signature, protects the bytes (docs/s3.md).
//
// A request that S3 throttles (503 SlowDown), that fails with a 500/502/504, or whose connection
// breaks before an answer, is retried after a backoff (exponential with jitter), as long as the
// request's deadline (`request_timeout` from its first attempt) allows. A request that runs past
// its deadline fails with ETIMEDOUT: a slow GET is a miss, never a stall.
//
// Thread-safety: Execute may be called from any number of threads at once.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvtier/io.h"
#include "kvtier/status.h"

namespace kvtier::io {

struct S3ClientConfig {
  std::string endpoint;  // scheme://host[:port], no trailing slash
  std::string region;
  std::string bucket;
  bool path_style = true;  // endpoint/bucket/key; else bucket.host/key (virtual-hosted)
  std::string access_key_id, secret_access_key, session_token;
  int max_connections = 16;
  // Event-loop threads, each with its own share of the connections: one thread receiving and
  // copying every transfer's bytes becomes the limit at a few GB/s.
  int event_threads = 4;
  std::chrono::milliseconds connect_timeout{2000};
  std::chrono::milliseconds request_timeout{10000};  // per request, retries included
  int max_retries = 4;
  std::chrono::milliseconds retry_base_delay{50};  // doubles per retry, with jitter
};

// One request. The caller owns it and the buffers it points at until Execute returns.
struct S3Request {
  std::string method = "GET";  // GET, PUT, HEAD, DELETE, POST
  std::string key;             // object key (no leading slash); empty: the bucket itself
  std::map<std::string, std::string> query;  // encoded and sorted by the client
  std::vector<std::string> headers;          // extra "Name: value" lines
  // The body of a PUT (gathered from these buffers in order) or of a POST (one buffer at most).
  std::vector<std::span<const uint8_t>> upload;
  // GET: the body is scattered over these buffers in order (at most their total size; the
  // rest is discarded) if there are any, else it goes into S3Response::body.
  std::vector<std::span<uint8_t>> download;
  bool has_range = false;  // GET of bytes [range_offset, range_offset + download_bytes())
  uint64_t range_offset = 0;

  uint64_t upload_bytes() const {
    uint64_t n = 0;
    for (const auto& u : upload) n += u.size();
    return n;
  }
  uint64_t download_bytes() const {
    uint64_t n = 0;
    for (const auto& d : download) n += d.size();
    return n;
  }
};

struct S3Response {
  long http_status = 0;  // 0: no HTTP answer (see curl_error)
  int curl_code = 0;     // CURLE_OK when an answer came
  std::string curl_error;
  std::string body;       // for requests without a download span, and for every error answer
  uint64_t received = 0;  // bytes written into S3Request::download's buffers
  int64_t content_length = -1;
  int64_t object_size = -1;  // from Content-Range ("bytes a-b/SIZE"), or a 200's Content-Length
  int64_t last_modified_ns = 0;
  std::string etag;
  std::string error_code, error_message;  // S3's <Code> and <Message> of an error answer
  int attempts = 0;
  bool timed_out = false;

  bool ok() const { return http_status >= 200 && http_status < 300; }
  // errno-style reading of a failure: ENOENT (404), EACCES (403), ETIMEDOUT, ECONNREFUSED,
  // EAGAIN (still throttled after every retry), EIO otherwise; 0 for success.
  int Errno() const;
  // "GET s3://bucket/key: 403 SignatureDoesNotMatch: ... (hint)", for logs and Status messages.
  std::string Describe(const S3Request& request, const std::string& bucket) const;
  // The Status of a failed answer (kNotFound, kPermissionDenied, kUnavailable, kIOError, ...).
  Status ToStatus(const S3Request& request, const std::string& bucket) const;
};

class S3Client {
 public:
  static Result<std::unique_ptr<S3Client>> Create(const S3ClientConfig& config);
  ~S3Client();
  S3Client(const S3Client&) = delete;
  S3Client& operator=(const S3Client&) = delete;

  // Called on Execute's thread with a request's index and the bytes its download holds: now and
  // then while it streams in (finished false: the leading `bytes` are in place, though a retry
  // may still rewrite them), and once when it is over (finished true; its response is final).
  using Progress = std::function<void(size_t index, uint64_t bytes, bool finished)>;
  // Runs every request concurrently and blocks until all have an answer (after retries) or
  // failed, calling `progress` (if set) as they go.
  void Execute(std::span<S3Request> requests, std::span<S3Response> responses,
               const Progress& progress = {});
  S3Response Execute(S3Request& request);

  const S3ClientConfig& config() const { return config_; }
  // The URL of a request (for tests and messages).
  std::string Url(const S3Request& request) const;

  class Loop;

 private:
  explicit S3Client(const S3ClientConfig& config);
  S3ClientConfig config_;
  std::vector<std::unique_ptr<Loop>> loops_;
  std::atomic<uint64_t> next_loop_{0};
};

// The client configuration of an S3 env (bucket from the URL; endpoint, region, addressing and
// credentials from the options, else from the standard AWS_* environment variables).
Result<S3ClientConfig> ResolveS3Config(const S3EnvOptions& options);
// The URL of an object ("" for the bucket), path-style or virtual-hosted, without a query.
std::string ObjectUrl(const S3ClientConfig& config, std::string_view key);

// RFC 3986 percent-encoding of everything but unreserved characters (and '/' if keep_slash), as
// SigV4's canonical request wants it.
std::string UriEncode(std::string_view s, bool keep_slash);
// An S3 error body's <Code> and <Message> (empty if the body is not an S3 error document).
void ParseS3Error(std::string_view body, std::string* code, std::string* message);
// RFC 7231 HTTP-date ("Tue, 01 Dec 2026 07:08:49 GMT") or ISO 8601 ("2026-12-01T07:08:42.000Z")
// as nanoseconds since the epoch; 0 if unparsable.
int64_t ParseHttpTime(std::string_view text);

}  // namespace kvtier::io

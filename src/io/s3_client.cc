// S3Client: libcurl's multi interface on one event-loop thread (see s3_client.h).
#include "io/s3_client.h"

#include <curl/curl.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <deque>
#include <mutex>
#include <random>
#include <thread>

#include "common/strings.h"
#include "kvtier/io.h"
#include "pugixml.hpp"

namespace kvtier::io {
namespace {

using Clock = std::chrono::steady_clock;

// curl_global_init once per process, before any thread uses libcurl.
void GlobalInit() {
  static const bool done = [] {
    curl_global_init(CURL_GLOBAL_DEFAULT);
    return true;
  }();
  (void)done;
}

std::string GetEnv(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::string(v) : std::string();
}

bool Retryable(const S3Response& r) {
  if (r.http_status == 0) {
    switch (r.curl_code) {
      case CURLE_COULDNT_CONNECT:
      case CURLE_SEND_ERROR:
      case CURLE_RECV_ERROR:
      case CURLE_GOT_NOTHING:
      case CURLE_PARTIAL_FILE:
        return true;
      default:
        return false;  // a timeout is final: the deadline has passed
    }
  }
  return r.http_status == 500 || r.http_status == 502 || r.http_status == 503 ||
         r.http_status == 504;
}

std::string_view Hint(std::string_view code) {
  if (code == "InvalidAccessKeyId") {
    return " (the server does not know this access key: check AWS_ACCESS_KEY_ID)";
  }
  if (code == "SignatureDoesNotMatch") {
    return " (check AWS_SECRET_ACCESS_KEY and AWS_REGION)";
  }
  if (code == "RequestTimeTooSkewed") {
    return " (this machine's clock is too far from the server's: synchronize it, e.g. with NTP)";
  }
  if (code == "ExpiredToken" || code == "InvalidToken" || code == "TokenRefreshRequired") {
    return " (the session credentials are expired or wrong: renew AWS_SESSION_TOKEN)";
  }
  if (code == "NoSuchBucket") return " (create the bucket, or check the URL and AWS_ENDPOINT_URL)";
  if (code == "AccessDenied") return " (the credentials lack permission for this bucket or key)";
  if (code == "SlowDown") return " (the server kept throttling after every retry)";
  return {};
}

// Refusals of the credentials, whatever their HTTP status (a bad token is a 400).
bool CredentialsRefused(const S3Response& r) {
  static constexpr std::string_view kCodes[] = {
      "AccessDenied",         "InvalidAccessKeyId", "SignatureDoesNotMatch",
      "RequestTimeTooSkewed", "ExpiredToken",       "InvalidToken",
      "TokenRefreshRequired", "InvalidSecurity",    "AuthorizationHeaderMalformed"};
  return r.http_status == 403 ||
         std::find(std::begin(kCodes), std::end(kCodes), r.error_code) != std::end(kCodes);
}

}  // namespace

std::string UriEncode(std::string_view s, bool keep_slash) {
  std::string out;
  out.reserve(s.size());
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' ||
        (keep_slash && c == '/')) {
      out.push_back(static_cast<char>(c));
    } else {
      out += fmt::format("%{:02X}", c);
    }
  }
  return out;
}

void ParseS3Error(std::string_view body, std::string* code, std::string* message) {
  code->clear();
  message->clear();
  pugi::xml_document doc;
  if (!doc.load_buffer(body.data(), body.size())) return;
  pugi::xml_node e = doc.child("Error");
  if (!e) return;
  *code = e.child_value("Code");
  *message = e.child_value("Message");
}

int64_t ParseHttpTime(std::string_view text) {
  std::string s(text);
  int y, mo, d, h, mi;
  double sec;
  if (std::sscanf(s.c_str(), "%4d-%2d-%2dT%2d:%2d:%lfZ", &y, &mo, &d, &h, &mi, &sec) == 6) {
    std::tm tm{};
    tm.tm_year = y - 1900, tm.tm_mon = mo - 1, tm.tm_mday = d;
    tm.tm_hour = h, tm.tm_min = mi, tm.tm_sec = 0;
    return static_cast<int64_t>(timegm(&tm)) * 1000000000 + static_cast<int64_t>(sec * 1e9);
  }
  time_t t = curl_getdate(s.c_str(), nullptr);
  return t < 0 ? 0 : static_cast<int64_t>(t) * 1000000000;
}

int S3Response::Errno() const {
  if (ok()) return 0;
  if (timed_out) return ETIMEDOUT;
  if (http_status == 0) return curl_code == CURLE_COULDNT_CONNECT ? ECONNREFUSED : EIO;
  if (http_status == 404) return ENOENT;
  if (CredentialsRefused(*this)) return EACCES;
  if (http_status == 503) return EAGAIN;
  return EIO;
}

std::string S3Response::Describe(const S3Request& request, const std::string& bucket) const {
  std::string what = fmt::format("{} s3://{}/{}", request.method, bucket, request.key);
  if (http_status == 0) {
    return fmt::format(
        "{}: {}{}", what, timed_out ? "no answer before the deadline: " : "",
        curl_error.empty() ? curl_easy_strerror(static_cast<CURLcode>(curl_code)) : curl_error);
  }
  std::string s = fmt::format("{}: HTTP {}", what, http_status);
  if (!error_code.empty()) s += fmt::format(" {}", error_code);
  if (!error_message.empty()) s += fmt::format(": {}", error_message);
  s += Hint(error_code);
  if (attempts > 1) s += fmt::format(" [{} attempts]", attempts);
  return s;
}

Status S3Response::ToStatus(const S3Request& request, const std::string& bucket) const {
  std::string msg = Describe(request, bucket);
  if (timed_out) return Status::Timeout(std::move(msg));
  if (http_status == 0) return Status::Unavailable(std::move(msg));
  if (http_status == 404) return Status::NotFound(std::move(msg));
  if (CredentialsRefused(*this)) return Status::PermissionDenied(std::move(msg));
  if (http_status == 503) return Status::Unavailable(std::move(msg));
  return Status::IOError(std::move(msg));
}

// The event loop. Transfers are handed to it through `incoming_`; it alone touches the multi
// handle and the easy handles.
class S3Client::Loop {
 public:
  // What Execute waits on.
  struct Batch {
    std::mutex mu;
    std::condition_variable cv;
    // In order: (request, true) when it is over, (request, false) when its download moved on by
    // kProgressStep.
    std::deque<std::pair<size_t, bool>> events;
    size_t remaining = 0;
    bool wants_progress = false;
  };
  static constexpr uint64_t kProgressStep = 1u << 20;
  // One request from its first attempt to its answer.
  struct Transfer {
    const S3Request* req = nullptr;
    S3Response* resp = nullptr;
    Batch* batch = nullptr;
    size_t index = 0;
    std::string url;
    Clock::time_point deadline;
    Clock::time_point not_before;  // of a retry
    // Per attempt:
    CURL* easy = nullptr;
    curl_slist* headers = nullptr;
    size_t upload_segment = 0, upload_offset = 0;  // where the next byte comes from
    uint64_t skip = 0;  // bytes of a 200 answer to a ranged GET before the range
    uint64_t download_bytes = 0;
    size_t segment = 0, segment_offset = 0;  // where the next downloaded byte goes
    std::atomic<uint64_t> streamed{0};       // bytes downloaded by this attempt, for Execute
    uint64_t announced = 0;                  // `streamed` when Execute was last told
    char errbuf[CURL_ERROR_SIZE] = {};
  };

  Loop(const S3ClientConfig& config, long connections) : config_(config) {
    multi_ = curl_multi_init();
    curl_multi_setopt(multi_, CURLMOPT_MAX_HOST_CONNECTIONS, connections);
    curl_multi_setopt(multi_, CURLMOPT_MAX_TOTAL_CONNECTIONS, connections);
    curl_multi_setopt(multi_, CURLMOPT_MAXCONNECTS, connections);
    thread_ = std::thread([this] { Run(); });
  }
  ~Loop() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    curl_multi_wakeup(multi_);
    thread_.join();
    for (CURL* e : idle_) curl_easy_cleanup(e);
    curl_multi_cleanup(multi_);
  }

  void Submit(Transfer* t) {
    {
      std::lock_guard lock(mu_);
      incoming_.push_back(t);
    }
    curl_multi_wakeup(multi_);
  }

 private:
  void Run() {
    std::vector<Transfer*> starting;
    for (;;) {
      bool stopping;
      {
        std::lock_guard lock(mu_);
        starting.swap(incoming_);
        stopping = stop_;
      }
      if (stopping) {
        for (Transfer* t : starting) Cancel(t);
        for (Transfer* t : retrying_) Cancel(t);
        for (Transfer* t : active_) {
          curl_multi_remove_handle(multi_, t->easy);
          Release(t);
          Cancel(t);
        }
        return;
      }
      for (Transfer* t : starting) Start(t);
      starting.clear();
      const auto now = Clock::now();
      auto next_retry = Clock::time_point::max();
      for (auto it = retrying_.begin(); it != retrying_.end();) {
        if ((*it)->not_before <= now) {
          Start(*it);
          it = retrying_.erase(it);
        } else {
          next_retry = std::min(next_retry, (*it)->not_before);
          ++it;
        }
      }
      int running = 0;
      curl_multi_perform(multi_, &running);
      int left = 0;
      while (CURLMsg* m = curl_multi_info_read(multi_, &left)) {
        if (m->msg != CURLMSG_DONE) continue;
        Transfer* t = nullptr;
        curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, &t);
        Done(t, m->data.result);
      }
      int wait_ms = 100;
      if (next_retry != Clock::time_point::max()) {
        auto d = std::chrono::duration_cast<std::chrono::milliseconds>(next_retry - now).count();
        wait_ms = static_cast<int>(std::clamp<int64_t>(d, 0, wait_ms));
      }
      curl_multi_poll(multi_, nullptr, 0, wait_ms, nullptr);
    }
  }

  void Start(Transfer* t) {
    S3Response& r = *t->resp;
    ++r.attempts;
    const auto now = Clock::now();
    if (r.attempts == 1) t->deadline = now + config_.request_timeout;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(t->deadline - now);
    r.http_status = 0, r.curl_code = 0, r.received = 0, r.content_length = -1;
    r.object_size = -1, r.last_modified_ns = 0;
    r.body.clear(), r.curl_error.clear(), r.etag.clear();
    t->skip = 0, t->errbuf[0] = 0;
    t->upload_segment = 0, t->upload_offset = 0;
    t->segment = 0, t->segment_offset = 0, t->announced = 0;
    t->streamed.store(0, std::memory_order_relaxed);
    t->download_bytes = t->req->download_bytes();

    CURL* e;
    if (!idle_.empty()) {
      e = idle_.back();
      idle_.pop_back();
      curl_easy_reset(e);
    } else {
      e = curl_easy_init();
    }
    t->easy = e;
    const S3Request& q = *t->req;
    curl_easy_setopt(e, CURLOPT_URL, t->url.c_str());
    curl_easy_setopt(e, CURLOPT_PRIVATE, t);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    if (getenv("KVS3V")) curl_easy_setopt(e, CURLOPT_VERBOSE, 1L);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, t->errbuf);
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, long(config_.connect_timeout.count()));
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, long(std::max<int64_t>(1, left.count())));
    curl_easy_setopt(e, CURLOPT_BUFFERSIZE, 512L << 10);
    curl_easy_setopt(e, CURLOPT_UPLOAD_BUFFERSIZE, 2L << 20);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, &Loop::OnBody);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, t);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, &Loop::OnHeader);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, t);
    const std::string sigv4 = fmt::format("aws:amz:{}:s3", config_.region);
    curl_easy_setopt(e, CURLOPT_AWS_SIGV4, sigv4.c_str());
    curl_easy_setopt(e, CURLOPT_USERNAME, config_.access_key_id.c_str());
    curl_easy_setopt(e, CURLOPT_PASSWORD, config_.secret_access_key.c_str());

    curl_slist* h = nullptr;
    h = curl_slist_append(h, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
    if (!config_.session_token.empty()) {
      h = curl_slist_append(h,
                            fmt::format("x-amz-security-token: {}", config_.session_token).c_str());
    }
    if (q.has_range) {
      const uint64_t last = q.range_offset + std::max<uint64_t>(t->download_bytes, 1) - 1;
      h = curl_slist_append(h, fmt::format("Range: bytes={}-{}", q.range_offset, last).c_str());
    }
    for (const std::string& line : q.headers) h = curl_slist_append(h, line.c_str());
    t->headers = h;
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, h);

    if (q.method == "HEAD") {
      curl_easy_setopt(e, CURLOPT_NOBODY, 1L);
    } else if (q.method == "PUT") {
      curl_easy_setopt(e, CURLOPT_UPLOAD, 1L);
      curl_easy_setopt(e, CURLOPT_INFILESIZE_LARGE, curl_off_t(q.upload_bytes()));
      curl_easy_setopt(e, CURLOPT_READFUNCTION, &Loop::OnUpload);
      curl_easy_setopt(e, CURLOPT_READDATA, t);
      // Send the body at once rather than wait for a 100 Continue that some servers never send.
      // (Removing the Expect header instead would break the signature: curl 7.88 signs it.)
      curl_easy_setopt(e, CURLOPT_EXPECT_100_TIMEOUT_MS, 0L);
    } else if (q.method == "POST") {
      curl_easy_setopt(e, CURLOPT_POST, 1L);
      const std::span<const uint8_t> body =
          q.upload.empty() ? std::span<const uint8_t>() : q.upload[0];
      curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, curl_off_t(body.size()));
      curl_easy_setopt(e, CURLOPT_POSTFIELDS,
                       body.empty() ? "" : reinterpret_cast<const char*>(body.data()));
    } else if (q.method != "GET") {
      curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, q.method.c_str());
    }
    curl_multi_add_handle(multi_, e);
    active_.push_back(t);
  }

  // Frees the attempt's handle (kept for reuse) and header list.
  void Release(Transfer* t) {
    curl_slist_free_all(t->headers);
    t->headers = nullptr;
    idle_.push_back(t->easy);
    t->easy = nullptr;
    std::erase(active_, t);
  }

  void Done(Transfer* t, CURLcode code) {
    S3Response& r = *t->resp;
    long status = 0;
    curl_easy_getinfo(t->easy, CURLINFO_RESPONSE_CODE, &status);
    curl_multi_remove_handle(multi_, t->easy);
    Release(t);
    r.curl_code = code;
    r.http_status = code == CURLE_OK ? status : 0;
    if (code != CURLE_OK) {
      r.curl_error = t->errbuf[0] != 0 ? t->errbuf : curl_easy_strerror(code);
      r.timed_out = code == CURLE_OPERATION_TIMEDOUT;
    }
    if (r.http_status >= 300) ParseS3Error(r.body, &r.error_code, &r.error_message);
    if (!r.ok() && Retryable(r) && r.attempts <= config_.max_retries) {
      // Exponential backoff with jitter, within the deadline.
      std::uniform_real_distribution<double> jitter(0.5, 1.5);
      const auto delay = std::chrono::duration_cast<Clock::duration>(
          config_.retry_base_delay * (1 << std::min(r.attempts - 1, 10)) * jitter(rng_));
      t->not_before = Clock::now() + delay;
      if (t->not_before < t->deadline) {
        retrying_.push_back(t);
        return;
      }
    }
    Finish(t);
  }

  static void Finish(Transfer* t) {
    Batch& b = *t->batch;
    std::lock_guard lock(b.mu);
    b.events.push_back({t->index, true});
    --b.remaining;
    b.cv.notify_all();
  }

  void Cancel(Transfer* t) {
    t->resp->http_status = 0;
    t->resp->curl_code = CURLE_ABORTED_BY_CALLBACK;
    t->resp->curl_error = "the S3 client is shutting down";
    Finish(t);
  }

  static size_t OnBody(char* data, size_t size, size_t n, void* user) {
    auto* t = static_cast<Transfer*>(user);
    S3Response& r = *t->resp;
    const size_t len = size * n;
    long status = 0;
    curl_easy_getinfo(t->easy, CURLINFO_RESPONSE_CODE, &status);
    const S3Request& q = *t->req;
    if (status >= 300 || q.download.empty()) {
      if (r.body.size() < (16u << 20)) r.body.append(data, len);
      return len;
    }
    size_t off = 0;
    if (status == 200 && q.has_range && t->skip < q.range_offset) {  // range ignored
      off = static_cast<size_t>(std::min<uint64_t>(len, q.range_offset - t->skip));
      t->skip += off;
    }
    while (off < len && t->segment < q.download.size()) {
      std::span<uint8_t> seg = q.download[t->segment];
      const size_t take = std::min(len - off, seg.size() - t->segment_offset);
      if (take > 0) std::memcpy(seg.data() + t->segment_offset, data + off, take);
      off += take;
      r.received += take;
      t->segment_offset += take;
      if (t->segment_offset == seg.size()) ++t->segment, t->segment_offset = 0;
    }
    t->streamed.store(r.received, std::memory_order_release);
    if (t->batch->wants_progress && r.received - t->announced >= kProgressStep) {
      t->announced = r.received;
      Batch& b = *t->batch;
      std::lock_guard lock(b.mu);
      b.events.push_back({t->index, false});
      b.cv.notify_all();
    }
    return len;
  }

  static size_t OnUpload(char* buf, size_t size, size_t n, void* user) {
    auto* t = static_cast<Transfer*>(user);
    const auto& src = t->req->upload;
    size_t filled = 0;
    while (filled < size * n && t->upload_segment < src.size()) {
      std::span<const uint8_t> seg = src[t->upload_segment];
      const size_t take = std::min(size * n - filled, seg.size() - t->upload_offset);
      if (take > 0) std::memcpy(buf + filled, seg.data() + t->upload_offset, take);
      filled += take;
      t->upload_offset += take;
      if (t->upload_offset == seg.size()) ++t->upload_segment, t->upload_offset = 0;
    }
    return filled;
  }

  static size_t OnHeader(char* data, size_t size, size_t n, void* user) {
    auto* t = static_cast<Transfer*>(user);
    S3Response& r = *t->resp;
    std::string_view line(data, size * n);
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.remove_suffix(1);
    if (line.starts_with("HTTP/")) {  // a new answer (after a 100 Continue, say)
      r.content_length = -1, r.object_size = -1, r.last_modified_ns = 0;
      return size * n;
    }
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos) return size * n;
    const std::string name = Lower(line.substr(0, colon));
    std::string_view value = line.substr(colon + 1);
    while (!value.empty() && value.front() == ' ') value.remove_prefix(1);
    long status = 0;
    curl_easy_getinfo(t->easy, CURLINFO_RESPONSE_CODE, &status);
    if (name == "content-length") {
      r.content_length = std::strtoll(std::string(value).c_str(), nullptr, 10);
      if (status == 200) r.object_size = r.content_length;
    } else if (name == "content-range") {
      const size_t slash = value.rfind('/');
      if (slash != std::string_view::npos && value.substr(slash + 1) != "*") {
        r.object_size = std::strtoll(std::string(value.substr(slash + 1)).c_str(), nullptr, 10);
      }
    } else if (name == "last-modified") {
      r.last_modified_ns = ParseHttpTime(value);
    } else if (name == "etag") {
      r.etag = std::string(value);
    }
    return size * n;
  }

  const S3ClientConfig& config_;
  CURLM* multi_ = nullptr;
  std::thread thread_;
  std::mutex mu_;
  std::vector<Transfer*> incoming_;
  bool stop_ = false;
  // Loop thread only:
  std::vector<Transfer*> active_, retrying_;
  std::vector<CURL*> idle_;
  std::mt19937_64 rng_{std::random_device{}()};
};

Result<S3ClientConfig> ResolveS3Config(const S3EnvOptions& options) {
  GlobalInit();
  const auto bad = [&](std::string_view why) {
    return Status::InvalidArgument(fmt::format(
        "'{}' is not a valid S3 URL ({}); expected s3://BUCKET[/PREFIX]", options.url, why));
  };
  if (!IsS3Url(options.url)) return bad("it does not start with s3://");
  std::string_view rest = std::string_view(options.url).substr(5);
  if (rest.find_first_of("?#") != std::string_view::npos) return bad("options in the URL");
  const std::string bucket(rest.substr(0, rest.find('/')));
  if (bucket.size() < 3 || bucket.size() > 63 ||
      bucket.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789.-") != std::string::npos) {
    return bad("a bucket name is 3-63 lowercase letters, digits, '.' and '-'");
  }
  if (options.connections < 1 || options.connections > 1024) {
    return Status::InvalidArgument(
        fmt::format("S3 connections {} out of range [1, 1024]", options.connections));
  }
  if (options.list_page_keys < 1 || options.list_page_keys > 1000) {
    return Status::InvalidArgument("S3 listing page size must be in [1, 1000]");
  }
  if (options.part_bytes < (5u << 20) || options.part_bytes > (1u << 30)) {
    return Status::InvalidArgument("S3 part size must be between 5 MiB (S3's minimum) and 1 GiB");
  }

  S3ClientConfig c;
  c.bucket = bucket;
  c.region = !options.region.empty() ? options.region : GetEnv("AWS_REGION");
  if (c.region.empty()) c.region = GetEnv("AWS_DEFAULT_REGION");
  if (c.region.empty()) c.region = "us-east-1";
  std::string endpoint =
      !options.endpoint.empty() ? options.endpoint : GetEnv("AWS_ENDPOINT_URL_S3");
  if (endpoint.empty()) endpoint = GetEnv("AWS_ENDPOINT_URL");
  const bool user_endpoint = !endpoint.empty();
  if (!user_endpoint) endpoint = fmt::format("https://s3.{}.amazonaws.com", c.region);
  while (endpoint.ends_with('/')) endpoint.pop_back();
  if (!endpoint.starts_with("http://") && !endpoint.starts_with("https://")) {
    return Status::InvalidArgument(
        fmt::format("S3 endpoint '{}' must start with http:// or https://", endpoint));
  }
  c.endpoint = endpoint;
  if (options.addressing == "path") {
    c.path_style = true;
  } else if (options.addressing == "virtual") {
    c.path_style = false;
  } else if (options.addressing == "auto" || options.addressing.empty()) {
    c.path_style = user_endpoint;
  } else {
    return Status::InvalidArgument(fmt::format(
        "S3 addressing '{}': expected \"path\", \"virtual\" or \"auto\"", options.addressing));
  }
  c.access_key_id =
      !options.access_key_id.empty() ? options.access_key_id : GetEnv("AWS_ACCESS_KEY_ID");
  c.secret_access_key = !options.secret_access_key.empty() ? options.secret_access_key
                                                           : GetEnv("AWS_SECRET_ACCESS_KEY");
  c.session_token =
      !options.session_token.empty() ? options.session_token : GetEnv("AWS_SESSION_TOKEN");
  if (c.access_key_id.empty() || c.secret_access_key.empty()) {
    return Status::InvalidArgument(fmt::format(
        "{}: no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY", options.url));
  }
  c.max_connections = options.connections;
  c.request_timeout = options.request_timeout;
  c.connect_timeout = options.connect_timeout;
  c.max_retries = options.max_retries;
  return c;
}

S3Client::S3Client(const S3ClientConfig& config) : config_(config) {}

S3Client::~S3Client() = default;

Result<std::unique_ptr<S3Client>> S3Client::Create(const S3ClientConfig& config) {
  if (config.endpoint.empty() || config.bucket.empty() || config.region.empty()) {
    return Status::InvalidArgument("S3 client: endpoint, bucket and region are required");
  }
  if (config.max_connections < 1 || config.max_connections > 1024) {
    return Status::InvalidArgument(
        fmt::format("S3 connections {} out of range [1, 1024]", config.max_connections));
  }
  GlobalInit();
  std::unique_ptr<S3Client> c(new S3Client(config));
  // The connections are shared out among the loops, as evenly as they go.
  const int loops = std::clamp(config.event_threads, 1, config.max_connections);
  for (int i = 0; i < loops; ++i) {
    const long share = config.max_connections / loops + (i < config.max_connections % loops);
    c->loops_.push_back(std::make_unique<Loop>(c->config_, share));
  }
  return c;
}

std::string ObjectUrl(const S3ClientConfig& config, std::string_view object_key) {
  // The bucket itself is "/bucket" path-style (no trailing slash, as SDKs sign it), "/" else.
  const std::string key = object_key.empty() ? "" : "/" + UriEncode(object_key, true);
  if (config.path_style) return fmt::format("{}/{}{}", config.endpoint, config.bucket, key);
  const size_t scheme = config.endpoint.find("://");
  return fmt::format("{}://{}.{}{}", config.endpoint.substr(0, scheme), config.bucket,
                     config.endpoint.substr(scheme + 3), key.empty() ? "/" : key);
}

std::string S3Client::Url(const S3Request& request) const {
  std::string url = ObjectUrl(config_, request.key);
  // SigV4 signs the query as given: sorted by name (std::map), names and values encoded.
  char sep = '?';
  for (const auto& [name, value] : request.query) {
    url += fmt::format("{}{}={}", sep, UriEncode(name, false), UriEncode(value, false));
    sep = '&';
  }
  return url;
}

void S3Client::Execute(std::span<S3Request> requests, std::span<S3Response> responses,
                       const Progress& progress) {
  Loop::Batch batch;
  batch.remaining = requests.size();
  batch.wants_progress = static_cast<bool>(progress);
  std::vector<Loop::Transfer> transfers(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    responses[i] = S3Response{};
    Loop::Transfer& t = transfers[i];
    t.req = &requests[i], t.resp = &responses[i], t.batch = &batch, t.index = i;
    t.url = Url(requests[i]);
  }
  // Round robin over the loops, request by request: a batch's transfers (the parts of one
  // read, say) are received and copied on several threads at once.
  for (Loop::Transfer& t : transfers) {
    loops_[next_loop_.fetch_add(1, std::memory_order_relaxed) % loops_.size()]->Submit(&t);
  }
  std::unique_lock lock(batch.mu);
  for (;;) {
    batch.cv.wait(lock, [&] { return !batch.events.empty() || batch.remaining == 0; });
    std::deque<std::pair<size_t, bool>> events;
    events.swap(batch.events);
    const bool last = batch.remaining == 0;
    if (progress) {
      lock.unlock();
      // A request's "moved on" events all come before its end.
      for (auto [i, finished] : events) {
        progress(i,
                 finished ? responses[i].received
                          : transfers[i].streamed.load(std::memory_order_acquire),
                 finished);
      }
      lock.lock();
    }
    if (last && batch.events.empty()) break;
  }
}

S3Response S3Client::Execute(S3Request& request) {
  S3Response r;
  Execute(std::span<S3Request>(&request, 1), std::span<S3Response>(&r, 1));
  return r;
}

}  // namespace kvtier::io

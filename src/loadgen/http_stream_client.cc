#include "loadgen/http_stream_client.h"

#include <curl/curl.h>

#include <mutex>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "loadgen/chat_stream.h"

namespace kvtier::loadgen {
namespace {

void GlobalInit() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

constexpr size_t kMaxErrorBody = 4096;

// The "message" of an OpenAI-style error body, else the body itself (shortened).
std::string ErrorMessage(const std::string& body) {
  auto j = nlohmann::json::parse(body, nullptr, false);
  if (!j.is_discarded() && j.is_object()) {
    if (auto e = j.find("error"); e != j.end()) {
      if (e->is_object() && e->contains("message") && (*e)["message"].is_string()) {
        return (*e)["message"].get<std::string>();
      }
      if (e->is_string()) return e->get<std::string>();
    }
    if (auto m = j.find("message"); m != j.end() && m->is_string()) return m->get<std::string>();
    if (auto d = j.find("detail"); d != j.end()) return d->is_string() ? d->get<std::string>() : d->dump();
  }
  return body.substr(0, 300);
}

}  // namespace

const char* FailureKindName(FailureKind kind) {
  switch (kind) {
    case FailureKind::kNone: return "ok";
    case FailureKind::kConnect: return "connect";
    case FailureKind::kHttpStatus: return "http_status";
    case FailureKind::kRejected: return "rejected";
    case FailureKind::kEarlyClose: return "early_close";
    case FailureKind::kTimeout: return "timeout";
    case FailureKind::kStreamError: return "stream_error";
    case FailureKind::kEmpty: return "empty_answer";
    case FailureKind::kOther: return "other";
    case FailureKind::kUnfinished: return "unfinished";
  }
  return "other";
}

struct HttpStreamClient::Transfer {
  explicit Transfer(DoneCallback cb)
      : done(std::move(cb)), decoder([this](std::string_view) {
          if (!result.got_content) {
            result.got_content = true;
            result.first_content = SteadyClock::now();
          }
        }) {}
  ~Transfer() {
    if (headers != nullptr) curl_slist_free_all(headers);
    if (easy != nullptr) curl_easy_cleanup(easy);
  }
  CURL* easy = nullptr;
  curl_slist* headers = nullptr;
  std::string body;
  DoneCallback done;
  ChatResult result;
  ChatStreamDecoder decoder;
  long status = 0;
  bool any_bytes = false;
  std::string error_body;
  char curl_error[CURL_ERROR_SIZE] = {0};

  static size_t OnData(char* ptr, size_t size, size_t n, void* user) {
    auto* t = static_cast<Transfer*>(user);
    const size_t bytes = size * n;
    if (t->status == 0) curl_easy_getinfo(t->easy, CURLINFO_RESPONSE_CODE, &t->status);
    t->any_bytes = true;
    if (t->status >= 400) {
      if (t->error_body.size() < kMaxErrorBody) t->error_body.append(ptr, std::min(bytes, kMaxErrorBody));
    } else {
      t->decoder.Feed(std::string_view(ptr, bytes));
    }
    return bytes;
  }
};

HttpStreamClient::HttpStreamClient(Options options) : options_(std::move(options)) {}

Result<std::unique_ptr<HttpStreamClient>> HttpStreamClient::Create(Options options) {
  GlobalInit();
  if (options.base_url.empty()) return Status::InvalidArgument("empty base URL");
  std::unique_ptr<HttpStreamClient> client(new HttpStreamClient(std::move(options)));
  CURLM* multi = curl_multi_init();
  if (multi == nullptr) return Status::Internal("curl_multi_init failed");
  // Keep a connection per stream alive between requests, as HTTP clients of inference servers do.
  curl_multi_setopt(multi, CURLMOPT_MAXCONNECTS, 4096L);
  curl_multi_setopt(multi, CURLMOPT_MAX_HOST_CONNECTIONS, 0L);
  curl_multi_setopt(multi, CURLMOPT_PIPELINING, CURLPIPE_NOTHING);
  client->multi_ = multi;
  std::string base = client->options_.base_url;
  while (!base.empty() && base.back() == '/') base.pop_back();
  client->chat_url_ = base + "/chat/completions";
  return client;
}

HttpStreamClient::~HttpStreamClient() {
  AbortAll();
  if (multi_ != nullptr) curl_multi_cleanup(static_cast<CURLM*>(multi_));
}

void HttpStreamClient::Submit(std::string json_body, std::string user_id, DoneCallback done) {
  auto* t = new Transfer(std::move(done));
  t->body = std::move(json_body);
  t->easy = curl_easy_init();
  CURL* e = t->easy;
  curl_easy_setopt(e, CURLOPT_URL, chat_url_.c_str());
  curl_easy_setopt(e, CURLOPT_POST, 1L);
  curl_easy_setopt(e, CURLOPT_POSTFIELDS, t->body.data());
  curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(t->body.size()));
  t->headers = curl_slist_append(t->headers, "Content-Type: application/json");
  t->headers = curl_slist_append(t->headers, "Accept: text/event-stream");
  t->headers = curl_slist_append(t->headers, "Expect:");  // no 100-continue round trip
  if (!options_.api_key.empty()) {
    t->headers = curl_slist_append(t->headers, ("Authorization: Bearer " + options_.api_key).c_str());
  }
  if (!user_id.empty()) t->headers = curl_slist_append(t->headers, ("x-user-id: " + user_id).c_str());
  curl_easy_setopt(e, CURLOPT_HTTPHEADER, t->headers);
  curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, &Transfer::OnData);
  curl_easy_setopt(e, CURLOPT_WRITEDATA, t);
  curl_easy_setopt(e, CURLOPT_PRIVATE, t);
  curl_easy_setopt(e, CURLOPT_ERRORBUFFER, t->curl_error);
  curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(e, CURLOPT_TCP_NODELAY, 1L);
  curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS,
                   static_cast<long>(options_.connect_timeout_s * 1000));
  if (options_.request_timeout_s > 0) {
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, static_cast<long>(options_.request_timeout_s * 1000));
  }
  t->result.launch = SteadyClock::now();
  curl_multi_add_handle(static_cast<CURLM*>(multi_), e);
  transfers_.insert(t);
}

void HttpStreamClient::Complete(Transfer* t, int curl_code) {
  ChatResult& r = t->result;
  r.finish = SteadyClock::now();
  if (t->status == 0) curl_easy_getinfo(t->easy, CURLINFO_RESPONSE_CODE, &t->status);
  r.http_status = static_cast<int>(t->status);
  const auto code = static_cast<CURLcode>(curl_code);
  auto curl_message = [&] {
    return t->curl_error[0] != '\0' ? std::string(t->curl_error) : curl_easy_strerror(code);
  };
  if (code == CURLE_OK && t->status >= 400) {
    // A 4xx names a fault in the request (too long a prompt, an unknown model, a bad field): a
    // retry sends the same request and gets the same answer. 408 and 429 are about timing.
    const bool refused = t->status < 500 && t->status != 408 && t->status != 429;
    r.failure = refused ? FailureKind::kRejected : FailureKind::kHttpStatus;
    r.error = fmt::format("HTTP {}: {}", t->status, ErrorMessage(t->error_body));
  } else if (code == CURLE_COULDNT_CONNECT || code == CURLE_COULDNT_RESOLVE_HOST ||
             code == CURLE_COULDNT_RESOLVE_PROXY) {
    r.failure = FailureKind::kConnect;
    r.error = fmt::format("cannot connect to {}: {}", chat_url_, curl_message());
  } else if (code == CURLE_OPERATION_TIMEDOUT) {
    r.failure = FailureKind::kTimeout;
    r.error = fmt::format("request timed out: {}", curl_message());
  } else if (code == CURLE_PARTIAL_FILE || code == CURLE_RECV_ERROR ||
             code == CURLE_GOT_NOTHING || code == CURLE_HTTP2_STREAM || code == CURLE_SEND_ERROR) {
    r.failure = FailureKind::kEarlyClose;
    r.error = fmt::format("the server closed the stream early: {}", curl_message());
  } else if (code != CURLE_OK) {
    r.failure = FailureKind::kOther;
    r.error = curl_message();
  } else {
    t->decoder.Finish();
    if (!t->decoder.error().empty()) {
      r.failure = FailureKind::kStreamError;
      r.error = t->decoder.error();
    } else if (!t->decoder.done() && t->decoder.finish_reason().empty()) {
      r.failure = FailureKind::kEarlyClose;
      r.error = "the stream ended without a finish reason or [DONE]";
    } else if (!r.got_content) {
      r.failure = FailureKind::kEmpty;
      r.error = fmt::format("the stream finished ({}) without any generated text",
                            t->decoder.finish_reason().empty() ? "no reason"
                                                               : t->decoder.finish_reason());
    }
  }
  r.usage_reported = t->decoder.has_usage();
  r.prompt_tokens = t->decoder.prompt_tokens();
  r.completion_tokens =
      r.usage_reported ? t->decoder.completion_tokens() : t->decoder.content_chunks();
  r.content = t->decoder.content();
}

Status HttpStreamClient::Poll(int timeout_ms) {
  auto* multi = static_cast<CURLM*>(multi_);
  auto drain = [&]() -> Status {
    int running = 0;
    CURLMcode mc = curl_multi_perform(multi, &running);
    if (mc != CURLM_OK) return Status::Internal(fmt::format("curl: {}", curl_multi_strerror(mc)));
    int left = 0;
    while (CURLMsg* msg = curl_multi_info_read(multi, &left)) {
      if (msg->msg != CURLMSG_DONE) continue;
      Transfer* t = nullptr;
      curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, reinterpret_cast<char**>(&t));
      const int code = msg->data.result;
      curl_multi_remove_handle(multi, msg->easy_handle);
      transfers_.erase(t);
      Complete(t, code);
      std::unique_ptr<Transfer> owned(t);
      if (owned->done) owned->done(std::move(owned->result));
    }
    return Status::Ok();
  };
  KVTIER_RETURN_IF_ERROR(drain());
  if (transfers_.empty()) {
    if (timeout_ms > 0) {
      // Nothing to wait on: sleep the remaining time so callers can pace without spinning.
      curl_multi_poll(multi, nullptr, 0, timeout_ms, nullptr);
    }
    return Status::Ok();
  }
  CURLMcode mc = curl_multi_poll(multi, nullptr, 0, timeout_ms, nullptr);
  if (mc != CURLM_OK) return Status::Internal(fmt::format("curl: {}", curl_multi_strerror(mc)));
  return drain();
}

size_t HttpStreamClient::in_flight() const { return transfers_.size(); }

size_t HttpStreamClient::AbortAll() {
  auto* multi = static_cast<CURLM*>(multi_);
  const size_t n = transfers_.size();
  for (Transfer* t : transfers_) {
    if (multi != nullptr) curl_multi_remove_handle(multi, t->easy);
    delete t;
  }
  transfers_.clear();
  return n;
}

size_t HttpStreamClient::CancelAll() {
  auto* multi = static_cast<CURLM*>(multi_);
  std::vector<std::unique_ptr<Transfer>> cancelled;
  for (Transfer* t : transfers_) {
    if (multi != nullptr) curl_multi_remove_handle(multi, t->easy);
    cancelled.emplace_back(t);
  }
  transfers_.clear();
  const auto now = SteadyClock::now();
  for (auto& t : cancelled) {
    ChatResult& r = t->result;
    r.finish = now;
    r.failure = FailureKind::kUnfinished;
    r.error = r.got_content ? "still streaming when the run ended"
                            : "no answer yet when the run ended";
    r.content = t->decoder.content();
    if (t->done) t->done(std::move(r));
  }
  return cancelled.size();
}

Result<HttpResponse> HttpGet(const std::string& url, const std::string& api_key, double timeout_s) {
  GlobalInit();
  CURL* e = curl_easy_init();
  if (e == nullptr) return Status::Internal("curl_easy_init failed");
  HttpResponse response;
  char error[CURL_ERROR_SIZE] = {0};
  curl_slist* headers = nullptr;
  if (!api_key.empty()) headers = curl_slist_append(headers, ("Authorization: Bearer " + api_key).c_str());
  curl_easy_setopt(e, CURLOPT_URL, url.c_str());
  curl_easy_setopt(e, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(e, CURLOPT_ERRORBUFFER, error);
  curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, static_cast<long>(timeout_s * 1000));
  curl_easy_setopt(e, CURLOPT_WRITEFUNCTION,
                   +[](char* ptr, size_t size, size_t n, void* user) -> size_t {
                     auto* body = static_cast<std::string*>(user);
                     if (body->size() < (64u << 20)) body->append(ptr, size * n);
                     return size * n;
                   });
  curl_easy_setopt(e, CURLOPT_WRITEDATA, &response.body);
  CURLcode code = curl_easy_perform(e);
  curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &response.status);
  curl_slist_free_all(headers);
  curl_easy_cleanup(e);
  if (code != CURLE_OK) {
    return Status::Unavailable(fmt::format("cannot reach {}: {}", url,
                                           error[0] != '\0' ? error : curl_easy_strerror(code)));
  }
  return response;
}

}  // namespace kvtier::loadgen

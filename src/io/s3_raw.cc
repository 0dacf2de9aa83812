// S3RawClient: one libcurl easy handle, blocking calls (see s3_raw.h).
#include "io/s3_raw.h"

#include <curl/curl.h>
#include <fmt/format.h>

#include <cstring>

#include "io/s3_client.h"
#include "kvtier/io.h"

namespace kvtier::io {

class S3RawClient::Impl {
 public:
  S3ClientConfig config;
  CURL* easy = curl_easy_init();
  ~Impl() { curl_easy_cleanup(easy); }

  // Runs one request on the kept easy handle: PUT `upload`, or GET into `download`.
  Status Perform(const std::string& url, std::span<const uint8_t> upload,
                 std::span<uint8_t> download, bool put) {
    struct Io {
      std::span<const uint8_t> up;
      std::span<uint8_t> down;
      size_t sent = 0, received = 0;
      std::string error_body;
      long status = 0;
    } io{upload, download, 0, 0, {}, 0};
    const std::string key = url.substr(fmt::format("s3://{}/", config.bucket).size());
    curl_easy_reset(easy);
    curl_easy_setopt(easy, CURLOPT_URL, ObjectUrl(config, key).c_str());
    curl_easy_setopt(easy, CURLOPT_NOSIGNAL, 1L);
    const std::string sigv4 = fmt::format("aws:amz:{}:s3", config.region);
    curl_easy_setopt(easy, CURLOPT_AWS_SIGV4, sigv4.c_str());
    curl_easy_setopt(easy, CURLOPT_USERNAME, config.access_key_id.c_str());
    curl_easy_setopt(easy, CURLOPT_PASSWORD, config.secret_access_key.c_str());
    curl_easy_setopt(easy, CURLOPT_BUFFERSIZE, 512L << 10);
    curl_easy_setopt(easy, CURLOPT_UPLOAD_BUFFERSIZE, 2L << 20);
    curl_slist* h = curl_slist_append(nullptr, "x-amz-content-sha256: UNSIGNED-PAYLOAD");
    if (!config.session_token.empty()) {
      h = curl_slist_append(h,
                            fmt::format("x-amz-security-token: {}", config.session_token).c_str());
    }
    curl_easy_setopt(easy, CURLOPT_HTTPHEADER, h);
    if (put) {
      curl_easy_setopt(easy, CURLOPT_UPLOAD, 1L);
      curl_easy_setopt(easy, CURLOPT_INFILESIZE_LARGE, curl_off_t(upload.size()));
      curl_easy_setopt(easy, CURLOPT_EXPECT_100_TIMEOUT_MS, 0L);
      curl_easy_setopt(easy, CURLOPT_READDATA, &io);
      curl_easy_setopt(
          easy, CURLOPT_READFUNCTION, +[](char* buf, size_t size, size_t n, void* user) -> size_t {
            auto* io = static_cast<Io*>(user);
            size_t take = std::min(size * n, io->up.size() - io->sent);
            if (take > 0) std::memcpy(buf, io->up.data() + io->sent, take);
            io->sent += take;
            return take;
          });
    }
    curl_easy_setopt(easy, CURLOPT_WRITEDATA, &io);
    curl_easy_setopt(
        easy, CURLOPT_WRITEFUNCTION, +[](char* data, size_t size, size_t n, void* user) -> size_t {
          auto* io = static_cast<Io*>(user);
          const size_t len = size * n;
          const size_t take = std::min(len, io->down.size() - io->received);
          if (take > 0) std::memcpy(io->down.data() + io->received, data, take);
          io->received += take;
          if (take < len) io->error_body.append(data + take, len - take);
          return len;
        });
    CURLcode code = curl_easy_perform(easy);
    curl_slist_free_all(h);
    if (code != CURLE_OK) {
      return Status::IOError(
          fmt::format("{} {}: {}", put ? "PUT" : "GET", url, curl_easy_strerror(code)));
    }
    curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &io.status);
    if (io.status < 200 || io.status >= 300) {
      return Status::IOError(fmt::format("{} {}: HTTP {}", put ? "PUT" : "GET", url, io.status));
    }
    if (!put && (io.received != download.size() || !io.error_body.empty())) {
      return Status::IOError(fmt::format("GET {}: {} bytes, expected {}", url,
                                         io.received + io.error_body.size(), download.size()));
    }
    return Status::Ok();
  }
};

Result<std::unique_ptr<S3RawClient>> S3RawClient::Connect(const std::string& url) {
  S3EnvOptions o;
  o.url = url;
  KVTIER_ASSIGN_OR_RETURN(S3ClientConfig config, ResolveS3Config(o));
  std::unique_ptr<S3RawClient> c(new S3RawClient());
  c->impl_ = std::make_unique<Impl>();
  c->impl_->config = std::move(config);
  return c;
}

S3RawClient::~S3RawClient() = default;

Status S3RawClient::WriteFile(const std::string& url, std::span<const uint8_t> data) {
  return impl_->Perform(url, data, {}, true);
}

Status S3RawClient::ReadFile(const std::string& url, std::span<uint8_t> out) {
  return impl_->Perform(url, {}, out, false);
}

}  // namespace kvtier::io

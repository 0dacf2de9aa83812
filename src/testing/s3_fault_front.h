// S3FaultFront: an HTTP front on loopback that passes requests to a real S3 server unchanged
// (same Host header, so the client's signature still verifies there) and answers some of them
// itself the way S3 does when it throttles (503 SlowDown), refuses a skewed clock (403
// RequestTimeTooSkewed) or hangs. The loopback server checks signatures but neither throttles
// nor checks clocks; this is how the client's handling of those answers is tested.
#pragma once

#include <cpp-httplib/httplib.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "kvtier/io.h"
#include "testing/s3_target.h"

namespace kvtier::testing {

class S3FaultFront {
 public:
  enum class Mode { kPass, kSlowDown, kSkewedClock, kHang };

  // `upstream`: http://HOST:PORT of the real server.
  explicit S3FaultFront(const std::string& upstream) : upstream_(upstream) {
    auto handler = [this](const httplib::Request& req, httplib::Response& res) {
      Handle(req, res);
    };
    server_.Get(".*", handler);
    server_.Put(".*", handler);
    server_.Post(".*", handler);
    server_.Delete(".*", handler);
    server_.set_payload_max_length(1ull << 32);
    port_ = server_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { server_.listen_after_bind(); });
    server_.wait_until_ready();
  }
  ~S3FaultFront() {
    Inject(Mode::kPass);  // releases hung requests
    server_.stop();
    thread_.join();
  }

  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  // The next `count` requests (all of them for -1) are answered per `mode`; then pass. A hung
  // request waits `hang`, or until the next Inject, then passes.
  void Inject(Mode mode, int count = -1, std::chrono::milliseconds hang = std::chrono::seconds(3)) {
    std::lock_guard lock(hang_mu_);
    hang_ms_ = static_cast<int>(hang.count());
    remaining_ = count;
    mode_ = mode;
    ++injections_;
    hang_cv_.notify_all();
  }
  int requests() const { return requests_.load(); }
  int injected() const { return injected_.load(); }

 private:
  void Handle(const httplib::Request& req, httplib::Response& res) {
    requests_.fetch_add(1);
    Mode mode = mode_.load();
    if (mode != Mode::kPass) {
      int left = remaining_.load();
      if (left == 0) {
        mode = Mode::kPass;
      } else if (left > 0) {
        remaining_.fetch_sub(1);
      }
    }
    if (mode == Mode::kSlowDown) {
      injected_.fetch_add(1);
      res.status = 503;
      res.set_content(
          "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code><Message>Please "
          "reduce your request rate.</Message></Error>",
          "application/xml");
      return;
    }
    if (mode == Mode::kSkewedClock) {
      injected_.fetch_add(1);
      res.status = 403;
      res.set_content(
          "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>RequestTimeTooSkewed</Code>"
          "<Message>The difference between the request time and the current time is too "
          "large.</Message></Error>",
          "application/xml");
      return;
    }
    if (mode == Mode::kHang) {
      injected_.fetch_add(1);
      std::unique_lock lock(hang_mu_);
      const uint64_t injection = injections_;
      hang_cv_.wait_for(lock, std::chrono::milliseconds(hang_ms_.load()),
                        [&] { return injections_ != injection; });
    }
    httplib::Client up(upstream_);
    up.set_read_timeout(std::chrono::seconds(30));
    up.set_path_encode(false);  // the target as the client signed it, byte for byte
    httplib::Request fwd;
    fwd.method = req.method;
    fwd.path = req.target;
    for (const auto& [name, value] : req.headers) {
      if (name == "Content-Length" || name == "Connection" || name == "Expect" ||
          name == "Transfer-Encoding" || name == "REMOTE_ADDR" || name == "REMOTE_PORT" ||
          name == "LOCAL_ADDR" || name == "LOCAL_PORT") {
        continue;
      }
      fwd.headers.emplace(name, value);
    }
    fwd.body = req.body;
    httplib::Response up_res;
    httplib::Error err;
    if (!up.send(fwd, up_res, err)) {
      res.status = 502;
      return;
    }
    res.status = up_res.status;
    std::string type = "application/octet-stream";
    std::string body = std::move(up_res.body);
    if (up_res.status == 206 && req.ranges.size() == 1) {
      // httplib cuts a request's range out of every answer it sends: hand it the object's
      // bytes at their place in a body of the object's size (from "bytes a-b/SIZE"), so that
      // its cut gives back what the upstream sent, under the right Content-Range.
      const std::string range = up_res.get_header_value("Content-Range");
      const uint64_t first = std::stoull(range.substr(range.find(' ') + 1));
      const uint64_t size = std::stoull(range.substr(range.rfind('/') + 1));
      std::string whole(size, '\0');
      whole.replace(first, body.size(), body);
      body = std::move(whole);
    }
    for (const auto& [name, value] : up_res.headers) {
      if (name == "Content-Length" || name == "Connection" || name == "Transfer-Encoding" ||
          name == "Content-Range" || name == "content-range") {
        continue;
      }
      if (name == "Content-Type" || name == "content-type") {
        type = value;
        continue;
      }
      res.set_header(name, value);
    }
    res.set_content(body, type);
  }

  const std::string upstream_;
  httplib::Server server_;
  int port_ = 0;
  std::thread thread_;
  std::atomic<Mode> mode_{Mode::kPass};
  std::atomic<int> remaining_{0}, hang_ms_{3000};
  std::atomic<int> requests_{0}, injected_{0};
  std::mutex hang_mu_;
  std::condition_variable hang_cv_;
  uint64_t injections_ = 0;  // guarded by hang_mu_
};

// A fixture with a fault front before the test server: skipped without a server, failed
// without one when one is required (KVTIER_REQUIRE_S3=1).
class S3FaultFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string upstream = EnvOr("AWS_ENDPOINT_URL");
    if (upstream.empty()) {
      if (S3Required()) FAIL() << "KVTIER_REQUIRE_S3=1 but AWS_ENDPOINT_URL is unset";
      GTEST_SKIP() << "no S3 test server";
    }
    front_ = std::make_unique<S3FaultFront>(upstream);
  }
  // An env's options for `url` through the front, each request given `timeout`.
  S3EnvOptions FrontOptions(const std::string& url, std::chrono::milliseconds timeout) const {
    S3EnvOptions o;
    o.url = url;
    o.endpoint = front_->endpoint();
    o.request_timeout = timeout;
    return o;
  }
  std::unique_ptr<S3FaultFront> front_;
};

}  // namespace kvtier::testing

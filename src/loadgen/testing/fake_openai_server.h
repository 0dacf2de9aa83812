// A small OpenAI-compatible chat-completions server for testing the load generator: it streams
// answers as server-sent events like vLLM does (a first chunk with an empty content delta, one
// chunk per token, a finish reason, a usage chunk, then [DONE]), with configurable delays, a
// bounded number of requests served at once (to give it a finite service rate), injected HTTP
// errors and streams closed early.
//
// It counts one prompt token per whitespace-separated word plus 4 per message (the chat markup).
// Answers are `max_tokens` words ("w1 w2 ...").
//
// Thread-safety: Start/Stop from one thread; the accessors may be called from any thread while it
// serves.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvtier/status.h"

namespace httplib {
class Server;
}

namespace kvtier::loadgen::testing {

struct FakeServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;                          // 0: any free port
  std::string model = "fake-model";
  int64_t max_model_len = 32768;         // enforced (HTTP 400 above it); 0 = no limit
  bool report_max_model_len = true;      // report max_model_len in /v1/models
  double first_token_delay_s = 0;        // before the first content chunk
  double prefill_s_per_token = 0;        // added to the first-token delay per prompt token
  double inter_token_delay_s = 0;        // between content chunks
  int max_concurrent = 0;                // requests served at once; others wait; 0 = unlimited
  int error_every = 0;                   // every Nth request gets HTTP `error_status`; 0 = never
  int error_status = 500;
  bool fail_all = false;                 // every chat request gets HTTP `error_status`
  int close_every = 0;                   // every Nth request's stream is cut short; 0 = never
  int close_after_tokens = 1;            // content chunks sent before the cut
  bool close_abruptly = true;            // true: drop the connection; false: end without [DONE]
  bool send_usage = true;                // honour stream_options.include_usage
  int threads = 512;                     // server threads (one per open connection)
};

struct ReceivedRequest {
  std::string user_id;        // x-user-id header
  int64_t prompt_tokens = 0;  // as counted by this server
  int messages = 0;
  std::string first_message;  // content of the first message
  std::string last_message;   // content of the last message
  std::vector<std::string> roles;
  int max_tokens = 0;
  bool include_usage = false;
  double temperature = -1;
};

class FakeOpenAiServer {
 public:
  static Result<std::unique_ptr<FakeOpenAiServer>> Start(FakeServerOptions options);
  ~FakeOpenAiServer();  // stops

  int port() const { return port_; }
  std::string base_url() const;  // "http://127.0.0.1:<port>/v1"
  int64_t chat_requests() const { return chat_requests_.load(); }
  int64_t max_active() const { return max_active_.load(); }  // most requests served at once
  std::vector<ReceivedRequest> received() const;
  void Stop();

 private:
  explicit FakeOpenAiServer(FakeServerOptions options);
  void Install();
  FakeServerOptions options_;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
  std::atomic<int64_t> chat_requests_{0};
  std::atomic<int64_t> active_{0};
  std::atomic<int64_t> max_active_{0};
  friend class ServingToken;
  std::mutex slots_mu_;
  std::condition_variable slots_cv_;
  int slots_in_use_ = 0;
  mutable std::mutex received_mu_;
  std::vector<ReceivedRequest> received_;
};

}  // namespace kvtier::loadgen::testing

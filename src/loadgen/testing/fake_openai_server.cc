#include "loadgen/testing/fake_openai_server.h"

#include <cpp-httplib/httplib.h>

#include <chrono>
#include <condition_variable>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace kvtier::loadgen::testing {
namespace {

int64_t CountWords(const std::string& text) {
  std::istringstream in(text);
  std::string word;
  int64_t n = 0;
  while (in >> word) ++n;
  return n;
}

void SleepFor(double seconds) {
  if (seconds > 0) std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
}

std::string Chunk(const nlohmann::json& delta, const nlohmann::json& finish_reason) {
  nlohmann::json j = {{"id", "chatcmpl-fake"},
                      {"object", "chat.completion.chunk"},
                      {"model", "fake"},
                      {"choices", {{{"index", 0}, {"delta", delta}, {"finish_reason", finish_reason}}}}};
  return "data: " + j.dump() + "\n\n";
}

std::string ErrorBody(const std::string& message, int status) {
  return nlohmann::json{{"object", "error"}, {"message", message}, {"type", "BadRequestError"},
                        {"code", status}}
      .dump();
}

}  // namespace

// Held while a request is served: takes one of `max_concurrent` slots (waiting for one, which is
// the server's queue) and counts the request as active.
class ServingToken {
 public:
  explicit ServingToken(FakeOpenAiServer& s) : s_(s) {
    if (s_.options_.max_concurrent > 0) {
      std::unique_lock lock(s_.slots_mu_);
      s_.slots_cv_.wait(lock, [&] { return s_.slots_in_use_ < s_.options_.max_concurrent; });
      ++s_.slots_in_use_;
    }
    const int64_t now_active = ++s_.active_;
    int64_t seen = s_.max_active_.load();
    while (now_active > seen && !s_.max_active_.compare_exchange_weak(seen, now_active)) {
    }
  }
  ~ServingToken() {
    --s_.active_;
    if (s_.options_.max_concurrent > 0) {
      {
        std::lock_guard lock(s_.slots_mu_);
        --s_.slots_in_use_;
      }
      s_.slots_cv_.notify_one();
    }
  }
  ServingToken(const ServingToken&) = delete;
  ServingToken& operator=(const ServingToken&) = delete;

 private:
  FakeOpenAiServer& s_;
};

FakeOpenAiServer::FakeOpenAiServer(FakeServerOptions options)
    : options_(std::move(options)), server_(std::make_unique<httplib::Server>()) {}

Result<std::unique_ptr<FakeOpenAiServer>> FakeOpenAiServer::Start(FakeServerOptions options) {
  std::unique_ptr<FakeOpenAiServer> s(new FakeOpenAiServer(std::move(options)));
  const int threads = s->options_.threads;
  s->server_->new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  s->server_->set_keep_alive_max_count(100000);
  s->server_->set_keep_alive_timeout(30);
  s->server_->set_tcp_nodelay(true);
  s->Install();
  if (s->options_.port == 0) {
    s->port_ = s->server_->bind_to_any_port(s->options_.host);
  } else {
    s->port_ = s->server_->bind_to_port(s->options_.host, s->options_.port) ? s->options_.port : -1;
  }
  if (s->port_ <= 0) {
    return Status::Unavailable(fmt::format("cannot listen on {}:{}", s->options_.host, s->options_.port));
  }
  s->thread_ = std::thread([srv = s->server_.get()] { srv->listen_after_bind(); });
  while (!s->server_->is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return s;
}

FakeOpenAiServer::~FakeOpenAiServer() { Stop(); }

void FakeOpenAiServer::Stop() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
}

std::string FakeOpenAiServer::base_url() const {
  return fmt::format("http://{}:{}/v1", options_.host, port_);
}

std::vector<ReceivedRequest> FakeOpenAiServer::received() const {
  std::lock_guard lock(received_mu_);
  return received_;
}

void FakeOpenAiServer::Install() {
  server_->Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    nlohmann::json model = {{"id", options_.model}, {"object", "model"}, {"owned_by", "kvtier-test"}};
    if (options_.max_model_len > 0 && options_.report_max_model_len) {
      model["max_model_len"] = options_.max_model_len;
    }
    res.set_content(nlohmann::json{{"object", "list"}, {"data", {model}}}.dump(), "application/json");
  });

  server_->Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    const int64_t n = ++chat_requests_;
    auto body = nlohmann::json::parse(req.body, nullptr, false);
    if (body.is_discarded() || !body.contains("messages") || !body["messages"].is_array() ||
        !body.value("stream", false)) {
      res.status = 400;
      res.set_content(ErrorBody("expected a streamed chat completion with messages", 400),
                      "application/json");
      return;
    }
    ReceivedRequest r;
    r.user_id = req.get_header_value("x-user-id");
    for (const auto& m : body["messages"]) {
      const std::string content = m.value("content", "");
      r.prompt_tokens += CountWords(content) + 4;
      r.roles.push_back(m.value("role", ""));
      if (r.messages == 0) r.first_message = content;
      r.last_message = content;
      ++r.messages;
    }
    r.max_tokens = body.value("max_tokens", 16);
    r.temperature = body.value("temperature", -1.0);
    r.include_usage = body.contains("stream_options") &&
                      body["stream_options"].value("include_usage", false);
    {
      std::lock_guard lock(received_mu_);
      received_.push_back(r);
    }
    if (options_.model != body.value("model", "")) {
      res.status = 404;
      res.set_content(ErrorBody(fmt::format("The model `{}` does not exist.", body.value("model", "")), 404),
                      "application/json");
      return;
    }
    if (options_.max_model_len > 0 && r.prompt_tokens + r.max_tokens > options_.max_model_len) {
      res.status = 400;
      res.set_content(ErrorBody(fmt::format("This model's maximum context length is {} tokens; "
                                            "your request has {}",
                                            options_.max_model_len, r.prompt_tokens + r.max_tokens),
                                400),
                      "application/json");
      return;
    }
    if (options_.fail_all || (options_.error_every > 0 && n % options_.error_every == 0)) {
      res.status = options_.error_status;
      res.set_content(ErrorBody("injected failure", options_.error_status), "application/json");
      return;
    }
    const bool cut = options_.close_every > 0 && n % options_.close_every == 0;
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, r, cut, step = 0, token = std::shared_ptr<ServingToken>()](
            size_t, httplib::DataSink& sink) mutable -> bool {
          if (step == 0 && !token) {
            token = std::make_shared<ServingToken>(*this);  // queue for a slot
            std::string first = Chunk({{"role", "assistant"}, {"content", ""}}, nullptr);
            if (!sink.write(first.data(), first.size())) return false;
            SleepFor(options_.first_token_delay_s +
                     options_.prefill_s_per_token * static_cast<double>(r.prompt_tokens));
          }
          if (step < r.max_tokens) {
            if (cut && step >= options_.close_after_tokens) {
              token.reset();
              if (options_.close_abruptly) return false;  // drops the connection mid-stream
              sink.done();
              return true;
            }
            if (step > 0) SleepFor(options_.inter_token_delay_s);
            std::string piece = Chunk({{"content", fmt::format("{}w{}", step == 0 ? "" : " ", step + 1)}},
                                      step + 1 == r.max_tokens ? nlohmann::json("length")
                                                               : nlohmann::json(nullptr));
            ++step;
            if (!sink.write(piece.data(), piece.size())) return false;
            return true;
          }
          if (options_.send_usage && r.include_usage) {
            nlohmann::json usage = {{"id", "chatcmpl-fake"},
                                    {"object", "chat.completion.chunk"},
                                    {"choices", nlohmann::json::array()},
                                    {"usage",
                                     {{"prompt_tokens", r.prompt_tokens},
                                      {"completion_tokens", r.max_tokens},
                                      {"total_tokens", r.prompt_tokens + r.max_tokens}}}};
            std::string u = "data: " + usage.dump() + "\n\n";
            sink.write(u.data(), u.size());
          }
          static const std::string kDone = "data: [DONE]\n\n";
          sink.write(kDone.data(), kDone.size());
          token.reset();
          sink.done();
          return true;
        });
  });
}

}  // namespace kvtier::loadgen::testing

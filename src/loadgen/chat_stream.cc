#include "loadgen/chat_stream.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace kvtier::loadgen {

void SseParser::Feed(std::string_view bytes) {
  size_t start = 0;
  while (start < bytes.size()) {
    const size_t nl = bytes.find('\n', start);
    if (nl == std::string_view::npos) {
      line_.append(bytes.substr(start));
      return;
    }
    line_.append(bytes.substr(start, nl - start));
    if (!line_.empty() && line_.back() == '\r') line_.pop_back();
    HandleLine(line_);
    line_.clear();
    start = nl + 1;
  }
}

void SseParser::Finish() {
  if (!line_.empty()) {
    HandleLine(line_);
    line_.clear();
  }
  HandleLine("");
}

void SseParser::HandleLine(std::string_view line) {
  if (line.empty()) {  // end of an event
    if (has_data_) on_event_(data_);
    data_.clear();
    has_data_ = false;
    return;
  }
  if (line.front() == ':') return;  // comment / keep-alive
  std::string_view field = line, value;
  if (size_t colon = line.find(':'); colon != std::string_view::npos) {
    field = line.substr(0, colon);
    value = line.substr(colon + 1);
    if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
  }
  if (field != "data") return;
  if (has_data_) data_.push_back('\n');
  data_.append(value);
  has_data_ = true;
}

ChatStreamDecoder::ChatStreamDecoder(ContentHandler on_content)
    : on_content_(std::move(on_content)),
      sse_([this](std::string_view data) { HandleEvent(data); }) {}

void ChatStreamDecoder::HandleEvent(std::string_view data) {
  if (data == "[DONE]") {
    done_ = true;
    return;
  }
  auto j = nlohmann::json::parse(data, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    if (error_.empty()) error_ = fmt::format("stream carried a payload that is not JSON: {:.120}", data);
    return;
  }
  if (auto err = j.find("error"); err != j.end() && !err->is_null()) {
    std::string message = err->dump();
    if (err->is_object() && err->contains("message") && (*err)["message"].is_string()) {
      message = (*err)["message"].get<std::string>();
    } else if (err->is_string()) {
      message = err->get<std::string>();
    }
    if (error_.empty()) error_ = fmt::format("server error in stream: {}", message);
    return;
  }
  if (auto choices = j.find("choices"); choices != j.end() && choices->is_array() &&
                                        !choices->empty()) {
    const auto& choice = (*choices)[0];
    if (auto delta = choice.find("delta"); delta != choice.end() && delta->is_object()) {
      if (auto c = delta->find("content"); c != delta->end() && c->is_string()) {
        const auto& piece = c->get_ref<const std::string&>();
        if (!piece.empty()) {
          ++content_chunks_;
          content_ += piece;
          if (on_content_) on_content_(piece);
        }
      }
    }
    if (auto fr = choice.find("finish_reason"); fr != choice.end() && fr->is_string()) {
      finish_reason_ = fr->get<std::string>();
    }
  }
  if (auto usage = j.find("usage"); usage != j.end() && usage->is_object()) {
    auto get = [&](const char* key) -> int64_t {
      auto it = usage->find(key);
      return it != usage->end() && it->is_number_integer() ? it->get<int64_t>() : 0;
    };
    has_usage_ = true;
    prompt_tokens_ = get("prompt_tokens");
    completion_tokens_ = get("completion_tokens");
  }
}

}  // namespace kvtier::loadgen

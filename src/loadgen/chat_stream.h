// Decoding of OpenAI chat-completions streams: server-sent events (SSE) whose `data:` payloads
// are JSON chunks, ending with `data: [DONE]`.
//
// SseParser splits a byte stream into events; ChatStreamDecoder interprets the events of one
// streamed chat completion: the content deltas, the finish reason, the usage block that servers
// send last when asked with `stream_options.include_usage`, and in-stream error objects.
//
// Thread-safety: none; each stream owns its parser and decoder.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace kvtier::loadgen {

class SseParser {
 public:
  // Called once per complete event with its data (several `data:` lines joined by '\n').
  using EventHandler = std::function<void(std::string_view data)>;
  explicit SseParser(EventHandler on_event) : on_event_(std::move(on_event)) {}

  // Accepts any split of the stream (a chunk may end mid-line). Lines end with \n or \r\n;
  // comments (":...") and fields other than "data" are ignored.
  void Feed(std::string_view bytes);
  // Delivers a final event not followed by a blank line (a stream cut short).
  void Finish();

 private:
  void HandleLine(std::string_view line);
  EventHandler on_event_;
  std::string line_;
  std::string data_;
  bool has_data_ = false;
};

class ChatStreamDecoder {
 public:
  // Called with each non-empty piece of generated text, as it arrives.
  using ContentHandler = std::function<void(std::string_view piece)>;
  explicit ChatStreamDecoder(ContentHandler on_content = nullptr);

  void Feed(std::string_view bytes) { sse_.Feed(bytes); }
  void Finish() { sse_.Finish(); }

  bool done() const { return done_; }                 // saw data: [DONE]
  bool has_usage() const { return has_usage_; }
  int64_t prompt_tokens() const { return prompt_tokens_; }
  int64_t completion_tokens() const { return completion_tokens_; }
  const std::string& content() const { return content_; }
  int64_t content_chunks() const { return content_chunks_; }  // chunks with non-empty content
  const std::string& finish_reason() const { return finish_reason_; }
  // Set when the stream carried an error object or a payload that is not valid JSON.
  const std::string& error() const { return error_; }

 private:
  void HandleEvent(std::string_view data);
  ContentHandler on_content_;
  SseParser sse_;
  bool done_ = false;
  bool has_usage_ = false;
  int64_t prompt_tokens_ = 0;
  int64_t completion_tokens_ = 0;
  int64_t content_chunks_ = 0;
  std::string content_;
  std::string finish_reason_;
  std::string error_;
};

}  // namespace kvtier::loadgen

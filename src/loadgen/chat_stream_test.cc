#include "loadgen/chat_stream.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace kvtier::loadgen {
namespace {

// A stream shaped like vLLM's: an empty first delta, content, finish reason, usage, [DONE].
const char kVllmStream[] =
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},"
    "\"finish_reason\":null}]}\n\n"
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"},\"finish_reason\":null}]}\n\n"
    ": keep-alive comment\n\n"
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"},\"finish_reason\":\"length\"}]}\r\n\r\n"
    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":22,\"completion_tokens\":2,\"total_tokens\":24}}\n\n"
    "data: [DONE]\n\n";

TEST(SseParser, SplitsEventsWhateverTheChunking) {
  const std::string stream = "data: a\n\nevent: x\ndata: b\ndata: c\n\n:comment\n\ndata:d\r\n\r\n";
  for (size_t chunk : {1u, 2u, 3u, 7u, 1000u}) {
    std::vector<std::string> events;
    SseParser parser([&](std::string_view d) { events.emplace_back(d); });
    for (size_t i = 0; i < stream.size(); i += chunk) parser.Feed(std::string_view(stream).substr(i, chunk));
    parser.Finish();
    EXPECT_EQ(events, (std::vector<std::string>{"a", "b\nc", "d"})) << "chunk " << chunk;
  }
}

TEST(SseParser, DeliversAnUnterminatedLastEventOnFinish) {
  std::vector<std::string> events;
  SseParser parser([&](std::string_view d) { events.emplace_back(d); });
  parser.Feed("data: complete\n\ndata: cut");
  EXPECT_EQ(events.size(), 1u);
  parser.Finish();
  EXPECT_EQ(events, (std::vector<std::string>{"complete", "cut"}));
}

TEST(ChatStreamDecoder, DecodesAVllmStream) {
  std::vector<std::string> pieces;
  ChatStreamDecoder d([&](std::string_view p) { pieces.emplace_back(p); });
  const std::string stream = kVllmStream;
  for (size_t i = 0; i < stream.size(); i += 5) d.Feed(std::string_view(stream).substr(i, 5));
  d.Finish();
  EXPECT_TRUE(d.done());
  EXPECT_TRUE(d.error().empty()) << d.error();
  EXPECT_EQ(d.content(), "Hello");
  EXPECT_EQ(pieces, (std::vector<std::string>{"Hel", "lo"}));  // the empty first delta is skipped
  EXPECT_EQ(d.content_chunks(), 2);
  EXPECT_EQ(d.finish_reason(), "length");
  EXPECT_TRUE(d.has_usage());
  EXPECT_EQ(d.prompt_tokens(), 22);
  EXPECT_EQ(d.completion_tokens(), 2);
}

TEST(ChatStreamDecoder, ReportsErrorsInTheStream) {
  ChatStreamDecoder d;
  d.Feed("data: {\"error\":{\"message\":\"out of KV cache\",\"code\":500}}\n\n");
  EXPECT_NE(d.error().find("out of KV cache"), std::string::npos);
  ChatStreamDecoder junk;
  junk.Feed("data: {not json\n\n");
  EXPECT_NE(junk.error().find("not JSON"), std::string::npos);
}

TEST(ChatStreamDecoder, AStreamWithoutDoneIsNotDone) {
  ChatStreamDecoder d;
  d.Feed("data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n");
  d.Finish();
  EXPECT_FALSE(d.done());
  EXPECT_TRUE(d.finish_reason().empty());
  EXPECT_FALSE(d.has_usage());
}

}  // namespace
}  // namespace kvtier::loadgen

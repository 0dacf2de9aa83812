// Request logs, read as a stream: one parsed RequestRecord per line of a JSON-lines file (OpenAI
// responses, their `usage` objects, proxy logs), a vLLM server log, or a CSV with a header
// (`kvtier bench qa`'s and LMCache's multi-round QA output, or any CSV by a column mapping).
// docs/planner.md ("Your own traffic") lists the fields each format is read from.
//
// A LineParser holds one file's state (its CSV header, the conversations it has recognized);
// use one per file, from one thread. ReadRequestLog streams a file (plain or gzip, told apart by
// its magic bytes, not its name) through a parser and never holds more than one line.
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvtier/status.h"

namespace kvtier::planner {

enum class LogFormat { kAuto, kJsonLines, kVllm, kCsv };
Result<LogFormat> ParseLogFormat(std::string_view name);
const char* LogFormatName(LogFormat f);

// Where each field is found: a CSV column name, or a dotted JSON path ("usage.prompt_tokens").
// An empty entry means the built-in list of names for that field (see docs/planner.md).
struct FieldMapping {
  std::string prompt, completion, conversation, time, round;
};
// "prompt=COL,user=COL,time=COL,completion=COL,round=COL" (user, session and conversation are
// one field). Fails on an unknown field name or an entry without '='.
Result<FieldMapping> ParseFieldMapping(std::string_view text);

struct RequestRecord {
  static constexpr double kNoTime = std::numeric_limits<double>::quiet_NaN();
  double time_s = kNoTime;  // arrival, Unix seconds (or seconds of some fixed origin)
  uint64_t prompt_tokens = 0;
  uint64_t completion_tokens = 0;
  bool has_completion = false;
  std::string conversation;  // user, session or conversation id; empty = none
  int64_t round = -1;        // 1-based number of the question in its conversation; -1 = unknown
};

class LineParser {
 public:
  enum class Outcome {
    kRecord,     // *out holds a request
    kIgnored,    // not a request (a CSV header, another line of a server log, a blank line)
    kMalformed,  // meant to be a request but unreadable; *why says how
  };
  // `format` kAuto decides on the first line that is not blank. Fails on an impossible mapping.
  static Result<LineParser> Create(LogFormat format, FieldMapping mapping);

  // REQUIRES: `line` has no line terminator. A CSV file's first line must be its header.
  Outcome Parse(std::string_view line, RequestRecord* out, std::string* why);
  LogFormat format() const { return format_; }
  // A vLLM log whose INFO request lines carry no token counts (newer vLLM logs the prompt's
  // token ids only at DEBUG): how many such lines were seen.
  uint64_t requests_without_tokens() const { return requests_without_tokens_; }
  // Set when a CSV header lacks the prompt column: every later line is refused with it.
  const std::string& fatal() const { return fatal_; }

 private:
  LineParser(LogFormat format, FieldMapping mapping);
  Outcome ParseJson(std::string_view line, RequestRecord* out, std::string* why);
  Outcome ParseCsv(std::string_view line, RequestRecord* out, std::string* why);
  Outcome ParseVllm(std::string_view line, RequestRecord* out, std::string* why);

  LogFormat format_;
  FieldMapping mapping_;
  // CSV: column index of each field, -1 when absent; set from the header.
  bool have_header_ = false;
  int col_prompt_ = -1, col_completion_ = -1, col_conversation_ = -1, col_time_ = -1,
      col_round_ = -1;
  size_t columns_ = 0;
  std::string fatal_;
  uint64_t requests_without_tokens_ = 0;
  // vLLM logs carry no user id, but a conversation's next prompt starts with its previous one:
  // (prompt length, hash of the prompt's token ids) -> conversation number. Only each
  // conversation's latest prompt is kept, and at most kMaxTrackedPrompts of them.
  static constexpr size_t kMaxTrackedPrompts = 1 << 20;
  struct PromptKey {
    uint64_t length, hash;
    bool operator==(const PromptKey&) const = default;
  };
  struct PromptKeyHash {
    size_t operator()(const PromptKey& k) const { return k.hash ^ (k.length * 0x9E3779B97F4A7C15ull); }
  };
  std::unordered_map<PromptKey, uint64_t, PromptKeyHash> last_prompt_;
  uint64_t next_conversation_ = 1;
  int year_ = 0;  // vLLM stamps lines without a year (see ParseVllm)
  int last_month_ = 0;
};

struct LogReadProgress {
  std::string file;
  uint64_t lines = 0;
  uint64_t bytes_read = 0;  // of the file as stored (compressed bytes for gzip)
  uint64_t file_bytes = 0;  // 0 when unknown
};

struct LogFileCounts {
  uint64_t lines = 0, records = 0, ignored = 0, malformed = 0;
  uint64_t requests_without_tokens = 0;
  bool truncated = false;   // a gzip stream that ended early, or a last line with no newline
  bool gzip = false;
  LogFormat format = LogFormat::kAuto;
  std::vector<std::string> malformed_examples;  // "file:line: why", the first few
};

// Reads `path` line by line, calling `on_record` for each request. Lines longer than 16 MiB are
// malformed. Fails only when the file cannot be opened or read (a missing file, a directory, an
// I/O error), or when a CSV has no prompt column; a gzip stream cut short is `truncated`, not an
// error. `progress` is called about once a second.
Result<LogFileCounts> ReadRequestLog(const std::string& path, LogFormat format,
                                     const FieldMapping& mapping,
                                     const std::function<void(const RequestRecord&)>& on_record,
                                     const std::function<void(const LogReadProgress&)>& progress =
                                         {});

// Parses a time stamp: a number (Unix seconds; milliseconds or microseconds when too large to be
// seconds) or ISO 8601 ("2025-03-01T12:00:00.5Z", a space for the T, an offset +hh:mm). NaN when
// it is neither.
double ParseTimestamp(std::string_view text);

}  // namespace kvtier::planner

#include "planner/request_log.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <nlohmann/json.hpp>

namespace kvtier::planner {
namespace {

using json = nlohmann::json;

// The names each field goes by in the formats read without a mapping, in order of preference.
// JSON paths are dotted; CSV columns match any of the last components, case-insensitively.
const std::vector<std::string> kPromptPaths = {
    "usage.prompt_tokens",      "prompt_tokens",
    "usage.input_tokens",       "input_tokens",
    "response.usage.prompt_tokens", "response.body.usage.prompt_tokens",
    "response.usage.input_tokens",  "num_prompt_tokens"};
const std::vector<std::string> kCompletionPaths = {
    "usage.completion_tokens",      "completion_tokens",
    "usage.output_tokens",          "output_tokens",
    "generation_tokens",            "response.usage.completion_tokens",
    "response.body.usage.completion_tokens", "response.usage.output_tokens"};
const std::vector<std::string> kConversationPaths = {
    "user",          "user_id",          "session_id",          "conversation_id",
    "metadata.user_id", "metadata.session_id", "metadata.conversation_id", "metadata.user",
    "request.user",  "body.user",        "response.body.user"};
const std::vector<std::string> kTimePaths = {"launch_time", "created",   "created_at", "timestamp",
                                             "time",        "start_time", "startTime", "request_time",
                                             "response.body.created"};
const std::vector<std::string> kRoundPaths = {"question_id", "round", "turn"};

std::string_view Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool ParseDouble(std::string_view text, double* out) {
  text = Trim(text);
  if (text.empty()) return false;
  std::string copy(text);  // strtod needs a terminator; from_chars for double is not everywhere
  char* end = nullptr;
  const double v = std::strtod(copy.c_str(), &end);
  if (end != copy.c_str() + copy.size() || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

// A token count: a non-negative integer (a float with no fraction is accepted: some loggers
// write every number as one).
bool ParseCount(std::string_view text, uint64_t* out) {
  double v = 0;
  if (!ParseDouble(text, &v) || v < 0 || v != std::floor(v) || v > 1e15) return false;
  *out = static_cast<uint64_t>(v);
  return true;
}

const json* FindPath(const json& j, std::string_view path) {
  const json* node = &j;
  while (!path.empty()) {
    const size_t dot = path.find('.');
    const std::string key(path.substr(0, dot));
    if (!node->is_object()) return nullptr;
    auto it = node->find(key);
    if (it == node->end()) return nullptr;
    node = &*it;
    path = dot == std::string_view::npos ? std::string_view() : path.substr(dot + 1);
  }
  return node->is_null() ? nullptr : node;
}

const json* FindField(const json& j, const std::string& mapped,
                      const std::vector<std::string>& defaults) {
  if (!mapped.empty()) return FindPath(j, mapped);
  for (const std::string& p : defaults) {
    if (const json* v = FindPath(j, p)) return v;
  }
  return nullptr;
}

bool JsonCount(const json& v, uint64_t* out) {
  if (v.is_number_unsigned()) {
    *out = v.get<uint64_t>();
    return true;
  }
  if (v.is_number()) {
    const double d = v.get<double>();
    if (d < 0 || d != std::floor(d)) return false;
    *out = static_cast<uint64_t>(d);
    return true;
  }
  if (v.is_string()) return ParseCount(v.get<std::string>(), out);
  return false;
}

std::string JsonText(const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

double JsonTime(const json& v) {
  if (v.is_number()) return ParseTimestamp(fmt::format("{}", v.get<double>()));
  if (v.is_string()) return ParseTimestamp(v.get<std::string>());
  return RequestRecord::kNoTime;
}

// Splits one CSV line (RFC 4180 quoting, no line breaks inside a field).
bool SplitCsv(std::string_view line, std::vector<std::string>* fields) {
  fields->clear();
  std::string cur;
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"') {
        if (i + 1 < line.size() && line[i + 1] == '"') {
          cur += '"';
          ++i;
        } else {
          quoted = false;
        }
      } else {
        cur += c;
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      fields->push_back(std::move(cur));
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (quoted) return false;  // an unterminated quote: a line cut short
  fields->push_back(std::move(cur));
  return true;
}

int FindColumn(const std::vector<std::string>& header, const std::string& mapped,
               const std::vector<std::string>& defaults) {
  auto find = [&](const std::string& name) -> int {
    const std::string want = Lower(name);
    for (size_t i = 0; i < header.size(); ++i) {
      if (Lower(Trim(header[i])) == want) return static_cast<int>(i);
    }
    return -1;
  };
  if (!mapped.empty()) return find(mapped);
  for (const std::string& d : defaults) {
    std::string_view name = d;
    if (size_t dot = name.rfind('.'); dot != std::string_view::npos) name = name.substr(dot + 1);
    if (int c = find(std::string(name)); c >= 0) return c;
  }
  return -1;
}

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// vLLM stamps each line "LEVEL MM-DD HH:MM:SS[.mmm] [file.py:N]": finds that stamp.
bool FindVllmStamp(std::string_view line, int* month, int* day, double* seconds_of_day) {
  for (size_t i = 0; i + 14 <= line.size(); ++i) {
    const char* p = line.data() + i;
    if (IsDigit(p[0]) && IsDigit(p[1]) && p[2] == '-' && IsDigit(p[3]) && IsDigit(p[4]) &&
        p[5] == ' ' && IsDigit(p[6]) && IsDigit(p[7]) && p[8] == ':' && IsDigit(p[9]) &&
        IsDigit(p[10]) && p[11] == ':' && IsDigit(p[12]) && IsDigit(p[13])) {
      *month = (p[0] - '0') * 10 + (p[1] - '0');
      *day = (p[3] - '0') * 10 + (p[4] - '0');
      double s = ((p[6] - '0') * 10 + (p[7] - '0')) * 3600.0 +
                 ((p[9] - '0') * 10 + (p[10] - '0')) * 60.0 + (p[12] - '0') * 10 + (p[13] - '0');
      size_t j = i + 14;
      if (j < line.size() && (line[j] == '.' || line[j] == ',')) {
        double scale = 0.1;
        for (++j; j < line.size() && IsDigit(line[j]); ++j, scale /= 10) s += (line[j] - '0') * scale;
      }
      if (*month < 1 || *month > 12 || *day < 1 || *day > 31) return false;
      *seconds_of_day = s;
      return true;
    }
  }
  return false;
}

}  // namespace

Result<LogFormat> ParseLogFormat(std::string_view name) {
  if (name == "auto") return LogFormat::kAuto;
  if (name == "jsonl" || name == "json") return LogFormat::kJsonLines;
  if (name == "vllm") return LogFormat::kVllm;
  if (name == "csv") return LogFormat::kCsv;
  return Status::InvalidArgument(
      fmt::format("--log-format: unknown format '{}' (auto, jsonl, vllm or csv)", name));
}

const char* LogFormatName(LogFormat f) {
  switch (f) {
    case LogFormat::kAuto: return "auto";
    case LogFormat::kJsonLines: return "JSON lines";
    case LogFormat::kVllm: return "vLLM log";
    case LogFormat::kCsv: return "CSV";
  }
  return "?";
}

Result<FieldMapping> ParseFieldMapping(std::string_view text) {
  FieldMapping m;
  while (!text.empty()) {
    const size_t comma = text.find(',');
    std::string_view entry = Trim(text.substr(0, comma));
    text = comma == std::string_view::npos ? std::string_view() : text.substr(comma + 1);
    if (entry.empty()) continue;
    const size_t eq = entry.find('=');
    if (eq == std::string_view::npos || eq == 0 || eq + 1 == entry.size()) {
      return Status::InvalidArgument(
          fmt::format("--log-fields: '{}' is not FIELD=NAME (e.g. prompt=usage.prompt_tokens)",
                      entry));
    }
    const std::string field = Lower(Trim(entry.substr(0, eq)));
    std::string name(Trim(entry.substr(eq + 1)));
    if (field == "prompt") {
      m.prompt = name;
    } else if (field == "completion" || field == "answer") {
      m.completion = name;
    } else if (field == "user" || field == "session" || field == "conversation") {
      m.conversation = name;
    } else if (field == "time") {
      m.time = name;
    } else if (field == "round" || field == "turn") {
      m.round = name;
    } else {
      return Status::InvalidArgument(fmt::format(
          "--log-fields: unknown field '{}' (prompt, completion, user, time, round)", field));
    }
  }
  return m;
}

double ParseTimestamp(std::string_view text) {
  text = Trim(text);
  if (text.size() >= 2 && text.front() == '"' && text.back() == '"') {
    text = text.substr(1, text.size() - 2);
  }
  double v = 0;
  if (ParseDouble(text, &v)) {
    if (v > 1e14) return v / 1e6;  // microseconds since 1970
    if (v > 1e11) return v / 1e3;  // milliseconds
    return v;
  }
  // ISO 8601: YYYY-MM-DD[T ]HH:MM:SS[.frac][Z|+hh:mm|-hh:mm|+hhmm]
  int y, mo, d, h, mi, s, n = 0;
  std::string copy(text);
  if (std::sscanf(copy.c_str(), "%4d-%2d-%2d%*1[T ]%2d:%2d:%2d%n", &y, &mo, &d, &h, &mi, &s, &n) <
          6 ||
      n == 0) {
    return RequestRecord::kNoTime;
  }
  if (mo < 1 || mo > 12 || d < 1 || d > 31 || h > 23 || mi > 59 || s > 60) {
    return RequestRecord::kNoTime;
  }
  std::tm tm{};
  tm.tm_year = y - 1900;
  tm.tm_mon = mo - 1;
  tm.tm_mday = d;
  tm.tm_hour = h;
  tm.tm_min = mi;
  tm.tm_sec = s;
  double t = static_cast<double>(timegm(&tm));
  std::string_view rest = std::string_view(copy).substr(static_cast<size_t>(n));
  if (!rest.empty() && (rest[0] == '.' || rest[0] == ',')) {
    double scale = 0.1;
    size_t i = 1;
    for (; i < rest.size() && IsDigit(rest[i]); ++i, scale /= 10) t += (rest[i] - '0') * scale;
    rest.remove_prefix(i);
  }
  if (rest.empty() || rest == "Z" || rest == "z") return t;
  if (rest[0] == '+' || rest[0] == '-') {
    const int sign = rest[0] == '+' ? 1 : -1;
    int oh = 0, om = 0;
    std::string off(rest.substr(1));
    if (std::sscanf(off.c_str(), "%2d:%2d", &oh, &om) == 2 ||
        std::sscanf(off.c_str(), "%2d%2d", &oh, &om) >= 1) {
      return t - sign * (oh * 3600.0 + om * 60.0);
    }
  }
  return RequestRecord::kNoTime;
}

LineParser::LineParser(LogFormat format, FieldMapping mapping)
    : format_(format), mapping_(std::move(mapping)) {}

Result<LineParser> LineParser::Create(LogFormat format, FieldMapping mapping) {
  return LineParser(format, std::move(mapping));
}

LineParser::Outcome LineParser::Parse(std::string_view line, RequestRecord* out, std::string* why) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  if (Trim(line).empty()) return Outcome::kIgnored;
  if (format_ == LogFormat::kAuto) {
    const std::string_view t = Trim(line);
    std::vector<std::string> fields;
    if (t.front() == '{') {
      format_ = LogFormat::kJsonLines;
    } else if (SplitCsv(t, &fields) && fields.size() > 1 &&
               FindColumn(fields, mapping_.prompt, kPromptPaths) >= 0) {
      format_ = LogFormat::kCsv;  // a header naming the prompt column
    } else {
      // Anything else is taken for a server log (its first lines are banners and warnings);
      // a CSV whose header names no prompt column needs --log-format csv and --log-fields.
      format_ = LogFormat::kVllm;
    }
  }
  *out = RequestRecord{};
  switch (format_) {
    case LogFormat::kJsonLines: return ParseJson(line, out, why);
    case LogFormat::kCsv: return ParseCsv(line, out, why);
    default: return ParseVllm(line, out, why);
  }
}

LineParser::Outcome LineParser::ParseJson(std::string_view line, RequestRecord* out,
                                          std::string* why) {
  json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    *why = "not JSON (or cut short)";
    return Outcome::kMalformed;
  }
  if (!j.is_object()) {
    *why = "not a JSON object";
    return Outcome::kMalformed;
  }
  const json* prompt = FindField(j, mapping_.prompt, kPromptPaths);
  if (prompt == nullptr) {
    *why = mapping_.prompt.empty() ? "no prompt_tokens (nor usage.prompt_tokens, input_tokens)"
                                   : fmt::format("no field '{}'", mapping_.prompt);
    return Outcome::kMalformed;
  }
  if (!JsonCount(*prompt, &out->prompt_tokens)) {
    *why = fmt::format("prompt tokens '{}' is not a count", JsonText(*prompt));
    return Outcome::kMalformed;
  }
  if (const json* c = FindField(j, mapping_.completion, kCompletionPaths)) {
    out->has_completion = JsonCount(*c, &out->completion_tokens);
  }
  if (const json* c = FindField(j, mapping_.conversation, kConversationPaths)) {
    out->conversation = JsonText(*c);
  }
  if (const json* t = FindField(j, mapping_.time, kTimePaths)) out->time_s = JsonTime(*t);
  if (const json* r = FindField(j, mapping_.round, kRoundPaths)) {
    uint64_t round = 0;
    if (JsonCount(*r, &round) && round >= 1) out->round = static_cast<int64_t>(round);
  }
  return Outcome::kRecord;
}

LineParser::Outcome LineParser::ParseCsv(std::string_view line, RequestRecord* out,
                                         std::string* why) {
  std::vector<std::string> fields;
  if (!fatal_.empty()) {
    *why = fatal_;
    return Outcome::kMalformed;
  }
  if (!SplitCsv(line, &fields)) {
    *why = "unterminated quote (a line cut short)";
    return Outcome::kMalformed;
  }
  if (!have_header_) {
    have_header_ = true;
    columns_ = fields.size();
    col_prompt_ = FindColumn(fields, mapping_.prompt, kPromptPaths);
    col_completion_ = FindColumn(fields, mapping_.completion, kCompletionPaths);
    col_conversation_ = FindColumn(fields, mapping_.conversation, kConversationPaths);
    col_time_ = FindColumn(fields, mapping_.time, kTimePaths);
    col_round_ = FindColumn(fields, mapping_.round, kRoundPaths);
    if (col_prompt_ < 0) {
      fatal_ = fmt::format(
          "the CSV header '{}' has no {} column; name it with --log-fields prompt=COLUMN",
          std::string(line.substr(0, 200)),
          mapping_.prompt.empty() ? "prompt_tokens" : "'" + mapping_.prompt + "'");
    }
    return Outcome::kIgnored;
  }
  if (fields.size() != columns_) {
    *why = fmt::format("{} fields where the header has {}", fields.size(), columns_);
    return Outcome::kMalformed;
  }
  if (!ParseCount(fields[col_prompt_], &out->prompt_tokens)) {
    *why = fmt::format("prompt tokens '{}' is not a count", fields[col_prompt_]);
    return Outcome::kMalformed;
  }
  if (col_completion_ >= 0) {
    out->has_completion = ParseCount(fields[col_completion_], &out->completion_tokens);
  }
  if (col_conversation_ >= 0) out->conversation = std::string(Trim(fields[col_conversation_]));
  if (col_time_ >= 0) out->time_s = ParseTimestamp(fields[col_time_]);
  if (col_round_ >= 0) {
    uint64_t round = 0;
    if (ParseCount(fields[col_round_], &round) && round >= 1) {
      out->round = static_cast<int64_t>(round);
    }
  }
  return Outcome::kRecord;
}

LineParser::Outcome LineParser::ParseVllm(std::string_view line, RequestRecord* out,
                                          std::string* why) {
  // vLLM's RequestLogger (vllm/entrypoints/logger.py), with --enable-log-requests:
  //   up to 0.10: INFO  "Received request ID: prompt: '...', params: ..., prompt_token_ids: [..],
  //               ..." (prompt_token_ids cut to --max-log-len when that is set);
  //   since then: INFO  "Received request ID: params: ..., lora_request: ..." (no tokens) and,
  //               at DEBUG, "Request ID details: prompt: ..., prompt_token_ids: [...], ..." or
  //               "Request ID details: prompt_len: N, prompt_token_ids_len: M, ...".
  const bool received = line.find("Received request ") != std::string_view::npos;
  const bool details = !received && line.find("Request ") != std::string_view::npos &&
                       line.find(" details: ") != std::string_view::npos;
  if (!received && !details) return Outcome::kIgnored;
  int month = 0, day = 0;
  double seconds = 0;
  if (FindVllmStamp(line, &month, &day, &seconds)) {
    // vLLM writes no year. A log is taken to end no later than now: its first stamp is in this
    // year unless that would be in the future, and a month smaller than the last one means the
    // year turned.
    if (last_month_ == 0) {
      const std::time_t now = std::time(nullptr);
      std::tm today{};
      gmtime_r(&now, &today);
      year_ = today.tm_year + 1900;
      if (month > today.tm_mon + 1 || (month == today.tm_mon + 1 && day > today.tm_mday)) --year_;
    } else if (month < last_month_) {
      ++year_;
    }
    last_month_ = month;
    std::tm tm{};
    tm.tm_year = year_ - 1900;
    tm.tm_mon = month - 1;
    tm.tm_mday = day;
    out->time_s = static_cast<double>(timegm(&tm)) + seconds;
  }
  if (size_t p = line.find("prompt_token_ids_len: "); p != std::string_view::npos) {
    std::string_view rest = line.substr(p + 22);
    const size_t end = rest.find_first_of(",. ");
    if (!ParseCount(rest.substr(0, end), &out->prompt_tokens)) {
      if (rest.starts_with("None")) {
        ++requests_without_tokens_;
        return Outcome::kIgnored;
      }
      *why = "prompt_token_ids_len is not a count";
      return Outcome::kMalformed;
    }
    return Outcome::kRecord;
  }
  // The prompt text comes first and may hold anything, so the last occurrence is the field.
  const size_t p = line.rfind("prompt_token_ids: ");
  if (p == std::string_view::npos) {
    ++requests_without_tokens_;
    return Outcome::kIgnored;
  }
  std::string_view rest = line.substr(p + 18);
  if (rest.starts_with("None")) {
    ++requests_without_tokens_;
    return Outcome::kIgnored;
  }
  if (!rest.starts_with("[")) {
    *why = "prompt_token_ids is not a list";
    return Outcome::kMalformed;
  }
  const size_t close = rest.find(']');
  if (close == std::string_view::npos) {
    *why = "prompt_token_ids cut short (no closing ']')";
    return Outcome::kMalformed;
  }
  std::string_view ids = rest.substr(1, close - 1);
  // The ids, hashed prefix by prefix: the longest prefix that was some conversation's latest
  // prompt makes this request that conversation's next round.
  uint64_t hash = 1469598103934665603ull, count = 0;
  uint64_t best_conversation = 0, best_round = 0;
  PromptKey best_key{0, 0};
  while (!ids.empty()) {
    ids = Trim(ids);
    if (ids.empty()) break;
    uint64_t id = 0;
    auto [ptr, ec] = std::from_chars(ids.data(), ids.data() + ids.size(), id);
    if (ec != std::errc()) {
      *why = "prompt_token_ids holds something other than token ids";
      return Outcome::kMalformed;
    }
    ids.remove_prefix(static_cast<size_t>(ptr - ids.data()));
    ids = Trim(ids);
    if (!ids.empty()) {
      if (ids.front() != ',') {
        *why = "prompt_token_ids holds something other than token ids";
        return Outcome::kMalformed;
      }
      ids.remove_prefix(1);
    }
    hash = (hash ^ (id + 1)) * 1099511628211ull;
    ++count;
    if (auto it = last_prompt_.find(PromptKey{count, hash}); it != last_prompt_.end()) {
      best_key = it->first;
      best_conversation = it->second >> 20;
      best_round = it->second & ((1u << 20) - 1);
    }
  }
  out->prompt_tokens = count;
  if (count == 0) return Outcome::kRecord;
  if (best_conversation == 0) {
    best_conversation = next_conversation_++;
    best_round = 0;
  } else if (best_key.length == count) {
    // The same prompt again (a retry or a regenerated answer): the same round, kept as it was.
    out->conversation = fmt::format("prompt-chain-{}", best_conversation);
    out->round = static_cast<int64_t>(best_round);
    return Outcome::kRecord;
  } else {
    last_prompt_.erase(best_key);
  }
  if (last_prompt_.size() >= kMaxTrackedPrompts) last_prompt_.clear();  // bounded memory
  const uint64_t round = std::min<uint64_t>(best_round + 1, (1u << 20) - 1);
  last_prompt_[PromptKey{count, hash}] = (best_conversation << 20) | round;
  out->conversation = fmt::format("prompt-chain-{}", best_conversation);
  out->round = static_cast<int64_t>(round);
  return Outcome::kRecord;
}

Result<LogFileCounts> ReadRequestLog(const std::string& path, LogFormat format,
                                     const FieldMapping& mapping,
                                     const std::function<void(const RequestRecord&)>& on_record,
                                     const std::function<void(const LogReadProgress&)>& progress) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return Status::FromErrno(errno, fmt::format("cannot open '{}'", path));
  }
  if (S_ISDIR(st.st_mode)) {
    return Status::InvalidArgument(fmt::format("'{}' is a directory, not a log file", path));
  }
  // zlib reads a plain file as is (gzdirect), so one path serves both.
  gzFile gz = gzopen(path.c_str(), "rb");
  if (gz == nullptr) return Status::FromErrno(errno, fmt::format("cannot open '{}'", path));
  gzbuffer(gz, 1 << 18);
  struct Closer {
    gzFile f;
    ~Closer() { gzclose(f); }
  } closer{gz};

  KVTIER_ASSIGN_OR_RETURN(LineParser parser, LineParser::Create(format, mapping));
  LogFileCounts counts;
  constexpr size_t kMaxLine = 16u << 20;
  constexpr size_t kMaxExamples = 5;
  std::vector<char> buf(1 << 16);  // small: a read that hits a cut stream loses what it held
  std::string pending;  // a line that spans two reads
  bool skipping = false;  // inside a line longer than kMaxLine
  bool first_read = true;
  RequestRecord record;
  std::string why;
  LogReadProgress prog{path, 0, 0, static_cast<uint64_t>(st.st_size)};
  auto last_progress = std::chrono::steady_clock::now();

  auto handle = [&](std::string_view line) -> Status {
    ++counts.lines;
    why.clear();
    switch (parser.Parse(line, &record, &why)) {
      case LineParser::Outcome::kRecord:
        ++counts.records;
        on_record(record);
        break;
      case LineParser::Outcome::kIgnored: ++counts.ignored; break;
      case LineParser::Outcome::kMalformed:
        if (!parser.fatal().empty()) {
          return Status::InvalidArgument(fmt::format("'{}': {}", path, parser.fatal()));
        }
        ++counts.malformed;
        if (counts.malformed_examples.size() < kMaxExamples) {
          counts.malformed_examples.push_back(fmt::format("{}:{}: {}", path, counts.lines, why));
        }
        break;
    }
    if (!parser.fatal().empty()) {
      return Status::InvalidArgument(fmt::format("'{}': {}", path, parser.fatal()));
    }
    if (progress && (counts.lines & 0xFFFF) == 0) {
      auto now = std::chrono::steady_clock::now();
      if (now - last_progress >= std::chrono::seconds(1)) {
        last_progress = now;
        prog.lines = counts.lines;
        prog.bytes_read = static_cast<uint64_t>(std::max<z_off_t>(0, gzoffset(gz)));
        progress(prog);
      }
    }
    return Status::Ok();
  };
  auto too_long = [&] {
    ++counts.lines;
    ++counts.malformed;
    if (counts.malformed_examples.size() < kMaxExamples) {
      counts.malformed_examples.push_back(
          fmt::format("{}:{}: a line longer than 16 MiB", path, counts.lines));
    }
  };

  for (;;) {
    const int n = gzread(gz, buf.data(), static_cast<unsigned>(buf.size()));
    if (first_read) {
      counts.gzip = gzdirect(gz) == 0;
      first_read = false;
    }
    if (n < 0) {
      int code = 0;
      const char* msg = gzerror(gz, &code);
      if (code == Z_BUF_ERROR || code == Z_DATA_ERROR) {
        counts.truncated = true;  // a cut or damaged stream: keep what was read
        break;
      }
      return Status::IOError(fmt::format("reading '{}': {}", path, msg ? msg : "error"));
    }
    if (n == 0) {
      int code = 0;
      gzerror(gz, &code);
      if (code == Z_BUF_ERROR) counts.truncated = true;
      break;
    }
    std::string_view chunk(buf.data(), static_cast<size_t>(n));
    while (!chunk.empty()) {
      const size_t nl = chunk.find('\n');
      std::string_view piece = chunk.substr(0, nl);
      if (skipping) {
        if (nl != std::string_view::npos) skipping = false;
      } else if (nl == std::string_view::npos) {
        pending.append(piece);
        if (pending.size() > kMaxLine) {
          too_long();
          pending.clear();
          skipping = true;
        }
      } else if (pending.empty()) {
        KVTIER_RETURN_IF_ERROR(handle(piece));
      } else {
        pending.append(piece);
        if (pending.size() > kMaxLine) {
          too_long();
        } else {
          KVTIER_RETURN_IF_ERROR(handle(pending));
        }
        pending.clear();
      }
      if (nl == std::string_view::npos) break;
      chunk.remove_prefix(nl + 1);
    }
  }
  if (!pending.empty()) {
    // A last line with no newline: a log still being written, or cut short. Read it anyway; a
    // cut JSON object or CSV row is malformed like any other.
    counts.truncated = true;
    KVTIER_RETURN_IF_ERROR(handle(pending));
  }
  counts.format = parser.format();
  counts.requests_without_tokens = parser.requests_without_tokens();
  if (progress) {
    prog.lines = counts.lines;
    prog.bytes_read = prog.file_bytes;
    progress(prog);
  }
  return counts;
}

}  // namespace kvtier::planner

#include "loadgen/guards.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include <fmt/format.h>

namespace kvtier::loadgen {

namespace fs = std::filesystem;

Result<CacheDirContents> InspectCacheDir(const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) {
    return Status::InvalidArgument(fmt::format(
        "cache directory {} does not exist (create it empty, or leave out --cache-dir)", dir));
  }
  if (!fs::is_directory(dir, ec)) {
    return Status::InvalidArgument(fmt::format("cache directory {} is not a directory", dir));
  }
  CacheDirContents contents;
  fs::recursive_directory_iterator it(dir, fs::directory_options::skip_permission_denied, ec);
  if (ec) return Status::IOError(fmt::format("listing {}: {}", dir, ec.message()));
  for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (ec) return Status::IOError(fmt::format("listing {}: {}", dir, ec.message()));
    std::error_code e2;
    if (!it->is_regular_file(e2)) continue;
    const std::string name = it->path().filename().string();
    if (name == "kvtier-cache.json" || name == "namespace.json") continue;
    ++contents.files;
    contents.bytes += it->file_size(e2);
    if (contents.example.empty()) contents.example = it->path().string();
  }
  return contents;
}

Status CheckCacheDirIsCold(const std::string& dir, bool allow_warm,
                           std::vector<std::string>* warnings) {
  KVTIER_ASSIGN_OR_RETURN(CacheDirContents contents, InspectCacheDir(dir));
  if (contents.files == 0) return Status::Ok();
  const std::string what = fmt::format(
      "cache directory {} already holds {} files ({:.1f} MB, e.g. {}): chunks from an earlier run "
      "inflate hit rates",
      dir, contents.files, static_cast<double>(contents.bytes) / 1e6, contents.example);
  if (!allow_warm) {
    return Status::InvalidArgument(
        what + "; empty it first, or pass --allow-warm-cache to measure a warm cache on purpose");
  }
  if (warnings) warnings->push_back(what + " (allowed by --allow-warm-cache)");
  return Status::Ok();
}

Status CheckContextWindow(const WorkloadConfig& c, int64_t max_model_len, double token_scale) {
  if (max_model_len <= 0) return Status::Ok();
  const double scale = std::max(1.0, token_scale);
  const auto peak =
      static_cast<int64_t>(static_cast<double>(EstimatePeakPromptTokens(c)) * scale * 1.05);
  const int64_t needed = peak + c.answer_len;
  if (needed <= max_model_len) return Status::Ok();
  return Status::InvalidArgument(fmt::format(
      "the last round's prompt would be about {} tokens (shared system {} + user {} + {} earlier "
      "answers of {} + {} questions and chat markup{}, with a 5 % margin), plus {} to generate = "
      "{}, over the "
      "server's context window of {} tokens: late rounds would fail. Lower --num-rounds, "
      "--answer-len, --user-history-prompt or --shared-system-prompt, or serve a longer context",
      peak, c.system_prompt_len, c.user_history_len, c.num_rounds - 1, c.answer_len, c.num_rounds,
      scale > 1.0 ? fmt::format(", scaled by {:.2f} as the server counts more tokens per word", scale)
                  : "",
      c.answer_len, needed, max_model_len));
}

std::string SaturationWarning(const Summary& s, const WorkloadConfig& config, double min_ratio) {
  const double expected = config.expected_qps();
  const double gap_s = config.gap_between_requests();
  // A window in which the pacing sends only a few requests cannot tell a slow server from the
  // rounding of a handful of sends: judge it only with about ten sends behind it.
  const bool enough = s.sent >= kMinSendsToJudgePacing ||
                      expected * s.seconds >= static_cast<double>(kMinSendsToJudgePacing);
  const bool slow = enough && expected > 0 && s.actual_qps < min_ratio * expected;
  const bool held = enough && s.sent > 0 && s.held_back * 10 > s.sent;
  if (!slow && !held) return "";
  std::string why;
  if (slow) {
    why = fmt::format(
        "the server is saturated: actual QPS {:.3f} against {:.3f} that --qps {:.3f} should send, "
        "so TTFT measures its queue, not its cache",
        s.actual_qps, expected, config.qps);
  } else {
    why = fmt::format(
        "the pacing did not hold: answers take {:.3f} s (median), longer than a user's gap of "
        "{:.3f} s between questions, so users wait for answers and more of them pile up",
        s.median_latency, gap_s);
  }
  return fmt::format(
      "{} ({} of {} sends held back behind an unanswered request). Lower --qps to about 65 % of "
      "the service rate (--find-capacity measures it){}",
      why, s.held_back, s.sent, held && !slow ? ", or shorten --answer-len / raise --num-users" : "");
}

std::string ShortRunNote(const Summary& s, const WorkloadConfig& config) {
  const double expected = config.expected_qps();
  if (s.sent >= kMinSendsToJudgePacing ||
      expected * s.seconds >= static_cast<double>(kMinSendsToJudgePacing)) {
    return "";
  }
  return fmt::format(
      "the run lasted {:.1f} s and sent {} requests, too few to check the pacing (a user asks "
      "every {:.1f} s); the saturation check needs about {} sends: --time {:.0f} or more",
      s.seconds, s.sent, config.gap_between_requests(), kMinSendsToJudgePacing,
      std::ceil(kMinSendsToJudgePacing / expected));
}

}  // namespace kvtier::loadgen

// kvtier fsck DIR: checks every file of a file-tier cache directory (header, size, checksum) and
// names each bad one; --repair removes corrupt and stale temporary files.
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <nlohmann/json.hpp>

#include "kvtier/cache_dir.h"
#include "tools/command.h"

namespace kvtier::tools {
namespace {

struct FsckArgs {
  std::string dir;
  bool repair = false;
  bool json = false;
  int64_t temp_grace_s = 600;
  int threads = 2;
};

int RunFsck(const FsckArgs& a) {
  if (a.temp_grace_s < 0) {
    fmt::print(stderr, "kvtier fsck: --temp-grace must not be negative\n");
    return 2;
  }
  FsckOptions o;
  o.repair = a.repair;
  o.temp_grace = std::chrono::seconds(a.temp_grace_s);
  o.threads = std::max(1, a.threads);
  const bool tty = ::isatty(STDERR_FILENO);
  auto last = std::chrono::steady_clock::now();
  o.progress = [&](uint64_t done, uint64_t total) {
    auto now = std::chrono::steady_clock::now();
    if (done != total && now - last < std::chrono::seconds(1)) return;
    last = now;
    if (total >= 100 || done != total) {
      fmt::print(stderr, "{}fsck: {}/{} files checked{}", tty ? "\r" : "", done, total,
                 tty && done != total ? "" : "\n");
    }
  };
  auto report = FsckCacheDir(a.dir, o);
  if (!report.ok()) {
    fmt::print(stderr, "kvtier fsck: {}\n", report.status().message());
    return 2;
  }
  const FsckReport& r = *report;
  if (a.json) {
    nlohmann::json findings = nlohmann::json::array();
    for (const auto& f : r.findings) {
      findings.push_back({{"kind", FsckFindingKindName(f.kind)},
                          {"path", f.path},
                          {"reason", f.reason},
                          {"removed", f.removed}});
    }
    nlohmann::json j = {{"dir", a.dir},
                        {"namespaces", r.namespaces},
                        {"files", r.files},
                        {"good", r.good},
                        {"good_bytes", r.good_bytes},
                        {"corrupt", r.corrupt},
                        {"foreign", r.foreign},
                        {"stale_temps", r.stale_temps},
                        {"fresh_temps", r.fresh_temps},
                        {"unknown", r.unknown},
                        {"removed", r.removed},
                        {"remove_failures", r.remove_failures},
                        {"repair", a.repair},
                        {"clean", r.clean()},
                        {"findings", findings}};
    fmt::print("{}\n", j.dump(2));
  } else {
    for (const auto& f : r.findings) {
      fmt::print("{:<10} {}: {}{}\n", FsckFindingKindName(f.kind), f.path, f.reason,
                 f.removed ? " [removed]" : "");
    }
    fmt::print(
        "{}: {} namespaces, {} files: {} good ({:.2f} GB), {} corrupt, {} foreign, {} stale "
        "temporary, {} in-flight temporary, {} unknown{}\n",
        a.dir, r.namespaces, r.files, r.good, r.good_bytes / 1e9, r.corrupt, r.foreign,
        r.stale_temps, r.fresh_temps, r.unknown,
        a.repair ? fmt::format("; removed {}", r.removed) : "");
    if (!r.clean()) {
      fmt::print("{}\n", a.repair ? "some bad files could not be removed"
                                  : "run with --repair to remove corrupt and stale files");
    }
  }
  return r.clean() ? 0 : 1;
}

void AddFsck(CLI::App& parent, CommandContext& ctx) {
  auto args = std::make_shared<FsckArgs>();
  auto* cmd = parent.add_subcommand(
      "fsck",
      "Check every file of a kvtier cache directory (header, size, checksum) and name the bad "
      "ones. Exit status: 0 clean, 1 corrupt or stale files remain, 2 the directory cannot be "
      "checked");
  cmd->add_option("DIR", args->dir,
                  "Cache directory (the file tier's root): a path, or nfs://HOST/EXPORT/PATH")
      ->required();
  cmd->add_flag("--repair", args->repair,
                "Remove corrupt files and stale temporary files (foreign and unknown files are "
                "only reported)");
  cmd->add_option("--temp-grace", args->temp_grace_s,
                  "Seconds after which a temporary file counts as left by a dead writer")
      ->capture_default_str();
  cmd->add_option("--threads", args->threads, "Files checked in parallel")->capture_default_str();
  cmd->add_flag("--json", args->json, "Print the report as JSON on stdout");
  cmd->callback([args, &ctx] { ctx.exit_code = RunFsck(*args); });
}

const bool kRegistered = RegisterCommand("", &AddFsck);

}  // namespace
}  // namespace kvtier::tools

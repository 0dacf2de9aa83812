// kvtier stats DIR and kvtier purge DIR: summarize and empty a file-tier cache directory.
#include <fmt/format.h>
#include <unistd.h>

#include <ctime>
#include <nlohmann/json.hpp>

#include "kvtier/cache_dir.h"
#include "tools/command.h"

namespace kvtier::tools {
namespace {

std::string Time(int64_t ns) {
  if (ns == 0) return "-";
  std::time_t t = static_cast<std::time_t>(ns / 1000000000);
  std::tm tm;
  ::localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

std::string Iso(int64_t ns) {
  if (ns == 0) return "";
  std::time_t t = static_cast<std::time_t>(ns / 1000000000);
  std::tm tm;
  ::gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

struct StatsArgs {
  std::string dir;
  bool json = false;
};

int RunStats(const StatsArgs& a) {
  auto sum = SummarizeCacheDir(a.dir);
  if (!sum.ok()) {
    fmt::print(stderr, "kvtier stats: {}\n", sum.status().message());
    return 2;
  }
  if (a.json) {
    nlohmann::json nss = nlohmann::json::array();
    for (const auto& ns : sum->namespaces) {
      nss.push_back({{"id", ns.id},
                     {"model_id", ns.model_id},
                     {"chunk_bytes", ns.chunk_bytes},
                     {"chunks", ns.chunks},
                     {"bytes", ns.bytes},
                     {"temporary_files", ns.temps},
                     {"temporary_bytes", ns.temp_bytes},
                     {"oldest", Iso(ns.oldest_mtime_ns)},
                     {"newest", Iso(ns.newest_mtime_ns)}});
    }
    nlohmann::json j = {{"dir", a.dir},
                        {"chunks", sum->chunks},
                        {"bytes", sum->bytes},
                        {"temporary_files", sum->temps},
                        {"temporary_bytes", sum->temp_bytes},
                        {"oldest", Iso(sum->oldest_mtime_ns)},
                        {"newest", Iso(sum->newest_mtime_ns)},
                        {"namespaces", nss}};
    fmt::print("{}\n", j.dump(2));
    return 0;
  }
  fmt::print("{}: {} chunks, {:.3f} GB in {} namespaces; oldest {}, newest {}\n", a.dir,
             sum->chunks, sum->bytes / 1e9, sum->namespaces.size(), Time(sum->oldest_mtime_ns),
             Time(sum->newest_mtime_ns));
  if (sum->temps > 0) {
    fmt::print(
        "{} temporary files ({:.3f} GB): writes in flight or left by a crash (see "
        "kvtier fsck)\n",
        sum->temps, sum->temp_bytes / 1e9);
  }
  if (!sum->namespaces.empty()) {
    fmt::print("{:<16}  {:>9}  {:>10}  {:>11}  {:<19}  {:<19}  {}\n", "namespace", "chunks", "GB",
               "chunk bytes", "oldest", "newest", "model");
    for (const auto& ns : sum->namespaces) {
      fmt::print("{:<16}  {:>9}  {:>10.3f}  {:>11}  {:<19}  {:<19}  {}\n", ns.id, ns.chunks,
                 ns.bytes / 1e9, ns.chunk_bytes, Time(ns.oldest_mtime_ns), Time(ns.newest_mtime_ns),
                 ns.model_id.empty() ? "?" : ns.model_id);
    }
  }
  return 0;
}

struct PurgeArgs {
  std::string dir;
  std::string ns;
  bool yes = false;
};

int RunPurge(const PurgeArgs& a) {
  auto sum = SummarizeCacheDir(a.dir);  // also refuses what is not a kvtier cache
  if (!sum.ok()) {
    fmt::print(stderr, "kvtier purge: {}\n", sum.status().message());
    return 2;
  }
  uint64_t chunks = 0, bytes = 0;
  bool found = a.ns.empty();
  for (const auto& ns : sum->namespaces) {
    if (!a.ns.empty() && ns.id != a.ns) continue;
    found = true;
    chunks += ns.chunks;
    bytes += ns.bytes + ns.temp_bytes;
  }
  if (!found) {
    fmt::print(stderr, "kvtier purge: no namespace {} in {}\n", a.ns, a.dir);
    return 2;
  }
  std::string what = a.ns.empty() ? "every namespace" : fmt::format("namespace {}", a.ns);
  if (!a.yes) {
    fmt::print(stderr,
               "kvtier purge would remove {} of {}: {} chunks, {:.3f} GB. Nothing was removed; "
               "run again with --yes to do it.\n",
               what, a.dir, chunks, bytes / 1e9);
    return 1;
  }
  auto purged = PurgeCacheDir(a.dir, a.ns);
  if (!purged.ok()) {
    fmt::print(stderr, "kvtier purge: {}\n", purged.status().message());
    return 2;
  }
  fmt::print("removed {} files ({:.3f} GB) and {} directories from {}\n", purged->files,
             purged->bytes / 1e9, purged->directories, a.dir);
  return 0;
}

void AddStats(CLI::App& parent, CommandContext& ctx) {
  auto args = std::make_shared<StatsArgs>();
  auto* cmd = parent.add_subcommand(
      "stats", "Summarize a kvtier cache directory: chunks, bytes, namespaces, oldest and newest");
  cmd->add_option("DIR", args->dir,
                  "Cache directory (the file tier's root): a path, or nfs://HOST/EXPORT/PATH")
      ->required();
  cmd->add_flag("--json", args->json, "Print the summary as JSON on stdout");
  cmd->callback([args, &ctx] { ctx.exit_code = RunStats(*args); });
}

void AddPurge(CLI::App& parent, CommandContext& ctx) {
  auto args = std::make_shared<PurgeArgs>();
  auto* cmd = parent.add_subcommand(
      "purge",
      "Remove every chunk (or one namespace's) from a kvtier cache directory. Refuses a directory "
      "that is not a kvtier cache; without --yes only says what it would remove. Stop the tiers "
      "using the directory first");
  cmd->add_option("DIR", args->dir,
                  "Cache directory (the file tier's root): a path, or nfs://HOST/EXPORT/PATH")
      ->required();
  cmd->add_option("--namespace", args->ns, "Only this namespace (16 hex digits, see kvtier stats)");
  cmd->add_flag("--yes", args->yes, "Really remove");
  cmd->callback([args, &ctx] { ctx.exit_code = RunPurge(*args); });
}

const bool kStats = RegisterCommand("", &AddStats);
const bool kPurge = RegisterCommand("", &AddPurge);

}  // namespace
}  // namespace kvtier::tools

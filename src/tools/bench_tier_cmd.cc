// kvtier bench tier: writes then reads chunks through the file tier, and in the same run does
// plain O_DIRECT writes and reads of files of the same size with the same concurrency (the
// physical limit this tier is held to).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "benchmarks/tier_bench.h"
#include "tools/command.h"

namespace kvtier::tools {
namespace {

using benchmarks::TierBenchOptions;
using benchmarks::TierBenchResult;

void PrintTierBench(const TierBenchOptions& a, const TierBenchResult& r) {
  fmt::print("tier write   {:6.2f} GB/s   {} write {:6.2f} GB/s   ratio {:.2f}\n",
             r.tier_write.GBps(), r.reference, r.raw_write.GBps(), r.write_ratio());
  fmt::print("tier read    {:6.2f} GB/s   {} read  {:6.2f} GB/s   ratio {:.2f}\n",
             r.tier_read.GBps(), r.reference, r.raw_read.GBps(), r.read_ratio());
  if (r.remote()) {
    fmt::print(
        "{}: {} connections for the tier, one per thread for the reference; this client "
        "caches nothing, the server may serve reads from its memory\n",
        r.nfs ? "NFS" : "S3", r.connections);
  } else {
    fmt::print("o_direct {}, io engine {}, page cache holding {} bytes of the files afterwards\n",
               r.o_direct(), r.io_engine, r.page_cache_resident_bytes());
  }
  if (a.keep) {
    fmt::print("kept the chunk files in {} (namespaces {})\n", a.dir,
               fmt::join(r.kept_namespaces, ", "));
  }
}

struct BenchTierArgs {
  TierBenchOptions options;
  bool json = false;
};

int RunBenchTier(TierBenchOptions a, bool json) {
  a.log = [](const std::string& line) { fmt::print(stderr, "{}\n", line); };
  auto result = benchmarks::RunTierBench(a);
  if (!result.ok()) {
    fmt::print(stderr, "kvtier bench tier: {}\n", result.status().message());
    return 1;
  }
  if (json) {
    fmt::print("{}\n", benchmarks::TierBenchResultToJson(a, *result).dump(2));
  } else {
    PrintTierBench(a, *result);
  }
  if (!result->warning.empty()) {
    // Loud and fatal: a figure that looks like storage but is the page cache must not pass.
    fmt::print(stderr, "kvtier bench tier: WARNING: {} (exit status 1)\n", result->warning);
    return 1;
  }
  return 0;
}

void AddBenchTier(CLI::App& parent, CommandContext& ctx) {
  auto args = std::make_shared<BenchTierArgs>();
  auto* cmd = parent.add_subcommand(
      "tier",
      "Write then read chunks through the file tier, and compare with plain O_DIRECT writes and "
      "reads of same-size files at the same concurrency, measured in the same run");
  cmd->add_option("--dir", args->options.dir,
                  "Directory to benchmark (a kvtier cache or a new one): a path, "
                  "nfs://HOST/EXPORT/PATH to speak NFS without a mount, or s3://BUCKET/PREFIX "
                  "(endpoint and credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)")
      ->required();
  cmd->add_option("--connections,--nfs-connections", args->options.connections,
                  "nfs:// and s3:// only: the tier's connections to the server (default: max of "
                  "--readers and --writers, the reference's connection count, for NFS; four "
                  "times that for S3, whose reads are ranged GETs of several parts at once)");
  cmd->add_option("--s3-part-mib", args->options.s3_part_mib,
                  "s3:// only: the tier's ranged-GET and upload part size in MiB (5-1024; "
                  "default 64, one GET per chunk)");
  cmd->add_option("--chunk-mib", args->options.chunk_mib, "Chunk payload size in MiB")
      ->capture_default_str();
  cmd->add_option("--chunks", args->options.chunks, "Chunks written and read per repeat")
      ->capture_default_str();
  cmd->add_option("--readers", args->options.readers,
                  "Concurrent reads (tier read threads, raw readers)")
      ->capture_default_str();
  cmd->add_option("--writers", args->options.writers,
                  "Concurrent writes (tier write threads, raw writers)")
      ->capture_default_str();
  cmd->add_option("--repeats", args->options.repeats,
                  "Rounds; raw and tier alternate going first, figures are totals over all")
      ->capture_default_str();
  cmd->add_option("--io-engine", args->options.io_engine, "auto, io_uring or threads")
      ->capture_default_str();
  cmd->add_option("--io-depth", args->options.io_depth, "Tier requests in flight per chunk")
      ->capture_default_str();
  cmd->add_option("--request-kib", args->options.request_kib, "Tier read request size in KiB")
      ->capture_default_str();
  cmd->add_option("--write-request-kib", args->options.write_request_kib,
                  "Tier write request size in KiB")
      ->capture_default_str();
  cmd->add_flag("--keep", args->options.keep, "Leave the tier's chunk files in --dir");
  cmd->add_flag("--json", args->json, "Print the result as JSON on stdout");
  cmd->callback([args, &ctx] { ctx.exit_code = RunBenchTier(args->options, args->json); });
}

const bool kRegistered = RegisterCommand("bench", &AddBenchTier);

}  // namespace
}  // namespace kvtier::tools

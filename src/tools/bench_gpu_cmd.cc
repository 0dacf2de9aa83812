// `kvtier bench gpu`: the GPU data path (paged KV cache <-> pinned host chunks) against the
// pinned cudaMemcpy peaks measured in the same run.
#include <fmt/format.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "gpu/gpu_bench.h"
#include "tools/command.h"

namespace {

struct BenchGpuArgs {
  bool json = false;
  int device = 0;
  std::vector<uint32_t> block_tokens = {16, 32, 64};
  uint32_t chunks = 32;
  int reps = 5;
  double cache_gib = 8;
  uint32_t layers = 36;
};

// Targets from the data path's specification: fractions of the same-run cudaMemcpy peaks.
constexpr double kGatherTarget = 0.9, kScatterTarget = 0.9, kBidirTarget = 0.85;

int RunBenchGpu(const BenchGpuArgs& args) {
  kvtier::gpu::GpuBenchOptions o;
  o.device = args.device;
  o.block_tokens = args.block_tokens;
  o.chunks = args.chunks;
  o.reps = args.reps;
  o.layers = args.layers;
  o.cache_bytes = static_cast<uint64_t>(args.cache_gib * 1073741824.0);
  o.progress = [](const std::string& line) {
    fmt::print(stderr, "{}\n", line);
    std::fflush(stderr);
  };
  auto r = kvtier::gpu::RunGpuBench(o);
  if (!r.ok()) {
    fmt::print(stderr, "kvtier bench gpu: {}\n", r.status().ToString());
    return r.status().code() == kvtier::StatusCode::kUnimplemented ? 2 : 1;
  }
  const auto& rep = *r;
  const double g = rep.gather / rep.peak_d2h, s = rep.scatter / rep.peak_h2d,
               b = rep.bidir / rep.peak_bidir;
  const double cg = rep.cross_gather / rep.peak_d2h, cs = rep.cross_scatter / rep.peak_h2d,
               cb = rep.cross_bidir / rep.peak_bidir;
  const bool met = g >= kGatherTarget && s >= kScatterTarget && b >= kBidirTarget;
  if (args.json) {
    nlohmann::json j;
    j["device"] = rep.device;
    j["layout"] = fmt::format(
        "Qwen3-8B-like: {} layers, 8 KV heads x 128 dims, bf16, K and V pages, 256-token chunks",
        args.layers);
    j["chunk_bytes"] = rep.chunk_bytes;
    j["batch_bytes"] = rep.batch_bytes;
    j["block_tokens"] = args.block_tokens.front();
    j["peak_d2h_GBps"] = rep.peak_d2h;
    j["peak_h2d_GBps"] = rep.peak_h2d;
    j["peak_bidir_GBps"] = rep.peak_bidir;
    j["peaks_measured"] = {
        {"start",
         {{"d2h", rep.peaks_start.d2h},
          {"h2d", rep.peaks_start.h2d},
          {"bidir", rep.peaks_start.bidir}}},
        {"end",
         {{"d2h", rep.peaks_end.d2h}, {"h2d", rep.peaks_end.h2d}, {"bidir", rep.peaks_end.bidir}}}};
    j["mechanism"] = rep.auto_mechanism;
    j["gather_GBps"] = rep.gather;
    j["scatter_GBps"] = rep.scatter;
    j["bidir_GBps"] = rep.bidir;
    j["gather_vs_peak_d2h"] = g;
    j["scatter_vs_peak_h2d"] = s;
    j["bidir_vs_peak_bidir"] = b;
    j["cross_layer"] = {{"mechanism", rep.cross_auto_mechanism},
                        {"gather_GBps", rep.cross_gather},
                        {"scatter_GBps", rep.cross_scatter},
                        {"bidir_GBps", rep.cross_bidir},
                        {"gather_vs_peak_d2h", cg},
                        {"scatter_vs_peak_h2d", cs},
                        {"bidir_vs_peak_bidir", cb}};
    j["targets"] = {{"gather_vs_peak_d2h", kGatherTarget},
                    {"scatter_vs_peak_h2d", kScatterTarget},
                    {"bidir_vs_peak_bidir", kBidirTarget}};
    j["targets_met"] = met;
    auto& rows = j["rows"] = nlohmann::json::array();
    for (const auto& row : rep.rows) {
      rows.push_back({{"layout", row.layout},
                      {"block_tokens", row.block_tokens},
                      {"page_bytes", row.page_bytes},
                      {"variant", row.variant},
                      {"op", row.op},
                      {"GBps", row.gbps},
                      {"peak_GBps", row.peak_gbps},
                      {"ratio", row.ratio},
                      {"verified", row.verified}});
    }
    fmt::print("{}\n", j.dump(2));
    return 0;
  }
  fmt::print("{}\n", rep.device);
  fmt::print("chunk {:.1f} MiB, {:.2f} GiB per direction per timed batch, random block ids\n",
             rep.chunk_bytes / 1048576.0, rep.batch_bytes / 1073741824.0);
  fmt::print(
      "peak pinned cudaMemcpy (larger of start and end): d2h {:.1f} GB/s, h2d {:.1f} GB/s, "
      "bidir {:.1f} GB/s\n",
      rep.peak_d2h, rep.peak_h2d, rep.peak_bidir);
  fmt::print("{:<12} {:<9} {:>9} {:>9} {:>8} {:>8}\n", "layout", "op", "GB/s", "peak", "ratio",
             "target");
  auto line = [](const char* layout, const char* op, double v, double peak, double target) {
    fmt::print("{:<12} {:<9} {:>9.1f} {:>9.1f} {:>8.3f} {:>8}\n", layout, op, v, peak, v / peak,
               fmt::format("{:.2f} {}", target, v / peak >= target ? "ok" : "MISS"));
  };
  fmt::print("per-layer ({} tokens/block, mechanism {}):\n", args.block_tokens.front(),
             rep.auto_mechanism);
  line("per-layer", "gather", rep.gather, rep.peak_d2h, kGatherTarget);
  line("per-layer", "scatter", rep.scatter, rep.peak_h2d, kScatterTarget);
  line("per-layer", "bidir", rep.bidir, rep.peak_bidir, kBidirTarget);
  fmt::print("cross-layer (mechanism {}):\n", rep.cross_auto_mechanism);
  line("cross-layer", "gather", rep.cross_gather, rep.peak_d2h, kGatherTarget);
  line("cross-layer", "scatter", rep.cross_scatter, rep.peak_h2d, kScatterTarget);
  line("cross-layer", "bidir", rep.cross_bidir, rep.peak_bidir, kBidirTarget);
  fmt::print("targets {}\n", met ? "met" : "NOT met");
  return 0;
}

void AddBenchGpu(CLI::App& parent, kvtier::tools::CommandContext& ctx) {
  auto args = std::make_shared<BenchGpuArgs>();
  auto* cmd = parent.add_subcommand(
      "gpu",
      "Measure gather (GPU blocks -> pinned host chunk), scatter and both at once for a "
      "Qwen3-8B-like paged KV cache (per-layer and cross-layer layouts, random block ids), "
      "against the pinned cudaMemcpy peaks of the same run. Needs a CUDA build and a GPU.");
  cmd->add_flag("--json", args->json, "Print the results as JSON on stdout");
  cmd->add_option("--device", args->device, "CUDA device ordinal")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--block-tokens", args->block_tokens,
                  "Tokens per block to run; the first is the headline figure (each must divide "
                  "the 256-token chunk)")
      ->capture_default_str()
      ->delimiter(',')
      ->check(CLI::Range(1u, 256u));
  cmd->add_option("--chunks", args->chunks, "Chunks per timed batch and direction")
      ->capture_default_str()
      ->check(CLI::Range(1u, 4096u));
  cmd->add_option("--reps", args->reps, "Timed batches per figure (the median is reported)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--cache-gib", args->cache_gib, "GPU memory for the paged cache, GiB")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 1024.0));
  cmd->add_option("--layers", args->layers, "Model layers (8 KV heads x 128 dims, bf16 each)")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1024u));
  cmd->callback([args, &ctx] { ctx.exit_code = RunBenchGpu(*args); });
}

const bool kRegistered = kvtier::tools::RegisterCommand("bench", &AddBenchGpu);

}  // namespace

#include "planner/plan.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "testing/temp_dir.h"

namespace kvtier::planner {
namespace {

constexpr uint64_t kQwenBytes = 147456;

PlanInputs Inputs(std::vector<TierSpec> tiers) {
  PlanInputs in;
  in.model = *LoadModel("qwen3-8b", 1);
  in.gpu_description = "h200";
  EngineModel& e = in.engine;
  e.gpu_kv_bytes = 19e9;
  e.kv_bytes_per_token = kQwenBytes;
  e.prefill = *PrefillCost::FromTable(
      {{4096, 0.135}, {8192, 0.280}, {16384, 0.652}, {24576, 1.049}, {32768, 1.530}});
  e.decode_weights_s = 16.4e9 / 4.8e12;
  e.decode_s_per_kv_token = kQwenBytes / 4.8e12;
  in.workload.duration_s = 300;
  in.contexts = {4096, 16384, 32768};
  in.tiers = std::move(tiers);
  return in;
}

std::vector<TierSpec> CpuNfs(double cpu_bytes) {
  return {{"cpu", cpu_bytes, 20e9, 20e9}, {"nfs", 200.0 * (1ull << 30), 3.55e9, 3.55e9}};
}

TEST(PlanTest, SweepReproducesTheThreeRegimes) {
  PlanInputs in = Inputs(CpuNfs(64.0 * (1ull << 30)));
  in.sensitivity = false;
  auto r = RunPlan(in);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->points.size(), 3u);
  const PointReport& fits = r->points[0];
  const PointReport& evicts = r->points[1];
  const PointReport& storage = r->points[2];
  EXPECT_EQ(fits.regime, 1);
  EXPECT_EQ(evicts.regime, 2);
  EXPECT_EQ(storage.regime, 3);
  // Regime 1: offload is never read and only costs.
  EXPECT_GE(fits.offload.mean_ttft_s, fits.baseline.mean_ttft_s);
  // Regime 2: the GPU evicts; the CPU tier carries the gain.
  EXPECT_LT(evicts.baseline.hit_rate[0], fits.baseline.hit_rate[0]);
  EXPECT_GT(evicts.offload.bytes_read[0], 0);
  EXPECT_LT(evicts.offload.mean_ttft_s, evicts.baseline.mean_ttft_s);
  // Regime 3: offload wins by a wide margin.
  EXPECT_LT(storage.offload.mean_ttft_s, 0.7 * storage.baseline.mean_ttft_s);
  EXPECT_GT(storage.offload.service_rate_rps, storage.baseline.service_rate_rps);
  EXPECT_EQ(r->eviction_onset_tokens, EvictionOnsetContext(19e9, kQwenBytes, in.workload));
}

TEST(PlanTest, FastModeUsesClosedForms) {
  PlanInputs in = Inputs(CpuNfs(8.0 * (1ull << 30)));
  in.fast = true;
  auto r = RunPlan(in);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->points[0].regime, 1);
  EXPECT_EQ(r->points[1].regime, 2);
  EXPECT_EQ(r->points[2].regime, 3);
  EXPECT_GT(r->points[2].baseline.mean_ttft_s, r->points[0].baseline.mean_ttft_s);
}

TEST(PlanTest, JsonHasExactlyTheIssueFields) {
  PlanInputs in = Inputs(CpuNfs(8.0 * (1ull << 30)));
  in.fast = true;
  auto r = RunPlan(in);
  ASSERT_TRUE(r.ok());
  nlohmann::json j = ReportToJson(*r);
  std::vector<std::string> keys;
  for (auto& [k, v] : j.items()) keys.push_back(k);
  EXPECT_EQ(keys, (std::vector<std::string>{"kv_bytes_per_token", "points", "single_request",
                                            "thresholds"}));
  EXPECT_EQ(j["single_request"]["suffix_tokens"], 256);
  ASSERT_EQ(j["single_request"]["rows"].size(), 3u);
  const auto& hit = j["single_request"]["rows"][2];
  EXPECT_EQ(hit["prefix_tokens"], 32768 - 256);
  EXPECT_LT(hit["hit_ttft_s"]["cpu"], hit["hit_ttft_s"]["nfs"]);
  EXPECT_LT(hit["hit_ttft_s"]["cpu"], hit["recompute_s"]);
  EXPECT_EQ(j["kv_bytes_per_token"], kQwenBytes);
  EXPECT_TRUE(j["thresholds"]["eviction_onset_tokens"].is_number());
  EXPECT_TRUE(j["thresholds"]["payoff_tokens"]["nfs"].is_number());
  ASSERT_EQ(j["points"].size(), 3u);
  const auto& p = j["points"][1];
  EXPECT_EQ(p.size(), 4u);
  EXPECT_EQ(p["context_tokens"], 16384);
  for (const char* arm : {"baseline", "offload"}) {
    const auto& a = p[arm];
    EXPECT_EQ(a.size(), 9u);
    for (const char* f : {"qps", "service_rate_rps", "mean_ttft_s", "median_ttft_s", "p90_ttft_s"})
      EXPECT_TRUE(a[f].is_number());
    double shares = 0;
    for (const auto& [name, share] : a["token_share"].items()) shares += share.get<double>();
    EXPECT_NEAR(shares, 1.0, 1e-9);       // every prompt token has one source
    EXPECT_EQ(a["hit_rate"].size(), 4u);  // gpu, cpu, nfs, recompute
    EXPECT_TRUE(a["hit_rate"].contains("recompute"));
    EXPECT_TRUE(a["bytes_written"].contains("cpu"));
    EXPECT_TRUE(a["bytes_read"].contains("nfs"));
  }
}

TEST(PlanTest, CalibrationRecoversTheStepOverhead) {
  PlanInputs in = Inputs(CpuNfs(8.0 * (1ull << 30)));
  in.contexts = {16384};
  in.sensitivity = false;
  in.service_rate = false;
  in.qps = 0.5;
  in.workload.qps = 0.5;
  in.engine.step_overhead_s = 0.030;
  auto truth = RunPlan(in);
  ASSERT_TRUE(truth.ok());
  in.engine.step_overhead_s = 0.004;
  in.calibrate = std::make_pair(uint64_t{16384}, truth->points[0].baseline.mean_ttft_s);
  auto fitted = RunPlan(in);
  ASSERT_TRUE(fitted.ok()) << fitted.status().ToString();
  EXPECT_TRUE(fitted->calibrated);
  EXPECT_NEAR(fitted->step_overhead_s, 0.030, 0.003);
  in.calibrate = std::make_pair(uint64_t{16384}, 0.001);  // faster than the prefill allows
  EXPECT_FALSE(RunPlan(in).ok());
}

TEST(PlanTest, SensitivityFlagsTheThreshold) {
  PlanInputs in = Inputs(CpuNfs(8.0 * (1ull << 30)));
  in.contexts = {16384};
  in.workload.users = 5;  // questions not in bursts (see EvictionIsTailFirst...)
  in.engine.gpu_kv_bytes = 13.5e9;
  in.service_rate = false;
  auto r = RunPlan(in);
  ASSERT_TRUE(r.ok());
  const PointReport& p = r->points[0];
  EXPECT_TRUE(p.has_sensitivity);
  EXPECT_TRUE(p.near_threshold);
  EXPECT_LT(p.baseline_gpu_hit_low, p.baseline_gpu_hit_high);
  EXPECT_NE(FormatReport(*r).find("near the eviction threshold"), std::string::npos);
}

TEST(PlanTest, PlotScriptAndGnuplot) {
  PlanInputs in = Inputs(CpuNfs(8.0 * (1ull << 30)));
  in.fast = true;
  auto r = RunPlan(in);
  ASSERT_TRUE(r.ok());
  std::string script = PlotScript(*r, "out.svg");
  EXPECT_NE(script.find("set terminal svg"), std::string::npos);
  EXPECT_NE(script.find("GPU evicts from"), std::string::npos);
  EXPECT_NE(script.find("16384 "), std::string::npos);
  EXPECT_NE(PlotScript(*r, "out.png").find("pngcairo"), std::string::npos);
  EXPECT_FALSE(WritePlot(*r, "out.pdf").ok());
  if (std::system("command -v gnuplot > /dev/null 2>&1") != 0) GTEST_SKIP() << "no gnuplot";
  kvtier::testing::TempDir dir;
  const std::string path = dir.Sub("plan.svg");
  Status s = WritePlot(*r, path);
  ASSERT_TRUE(s.ok()) << s.ToString();
  std::ifstream in_file(path);
  std::stringstream text;
  text << in_file.rdbuf();
  EXPECT_NE(text.str().find("<svg"), std::string::npos);
}

}  // namespace
}  // namespace kvtier::planner

#include "planner/options.h"

#include <gtest/gtest.h>

#include <fstream>

#include "planner/plan.h"
#include "testing/temp_dir.h"

namespace kvtier::planner {
namespace {

struct Parsed {
  CLI::App app{"test"};
  PlannerFlags flags;
  Parsed() { AddPlannerFlags(&app, &flags); }
  Result<PlanInputs> Build(std::vector<std::string> args, bool fast = false) {
    std::vector<const char*> argv = {"plan"};
    for (const auto& a : args) argv.push_back(a.c_str());
    try {
      app.parse(static_cast<int>(argv.size()), const_cast<char**>(argv.data()));
    } catch (const CLI::ParseError& e) {
      return Status::InvalidArgument(e.what());
    }
    KVTIER_RETURN_IF_ERROR(MergeConfigFile(app, &flags));
    return BuildPlanInputs(app, flags, fast);
  }
};

std::string ErrorOf(std::vector<std::string> args) {
  Parsed p;
  auto r = p.Build(std::move(args));
  return r.ok() ? "" : r.status().message();
}

TEST(OptionsTest, DefaultsAreQwenOnH200WithTheMeasuredTable) {
  Parsed p;
  auto in = p.Build({});
  ASSERT_TRUE(in.ok()) << in.status().ToString();
  EXPECT_EQ(in->engine.kv_bytes_per_token, 147456u);
  EXPECT_NE(in->engine.prefill.description().find("table"), std::string::npos);
  EXPECT_NEAR(in->engine.prefill.Full(24576), 1.049, 1e-9);
  // 143771 MiB x 0.9 - 16.4 GB of weights - 3 GB reserve.
  EXPECT_NEAR(in->engine.gpu_kv_bytes / 1e9, 116.3, 1.0);
  EXPECT_EQ(in->tiers.size(), 1u);
  EXPECT_EQ(in->contexts.size(), 5u);
}

TEST(OptionsTest, FlagsAreParsed) {
  Parsed p;
  auto in =
      p.Build({"--model", "llama-3.1-70b",       "--tp",       "4",          "--gpu",
               "h100",    "--gpu-kv-gb",         "19",         "--tier",     "cpu:8GiB:20GB/s",
               "--tier",  "nfs:200GiB:3.55GB/s", "--context",  "8k,16k",     "--qps",
               "0.5",     "--write-policy",      "write_back", "--duration", "10m"});
  ASSERT_TRUE(in.ok()) << in.status().ToString();
  EXPECT_DOUBLE_EQ(in->engine.gpu_kv_bytes, 4 * 19e9);
  EXPECT_EQ(in->tiers.size(), 2u);
  EXPECT_EQ(in->contexts, (std::vector<uint64_t>{8192, 16384}));
  EXPECT_DOUBLE_EQ(in->qps, 0.5);
  EXPECT_EQ(in->write_policy, WritePolicy::kWriteBack);
  EXPECT_DOUBLE_EQ(in->workload.duration_s, 600);
  EXPECT_NE(in->engine.prefill.description().find("FLOPs"), std::string::npos);
  EXPECT_FALSE(in->prefetch);
  Parsed q;
  auto pre = q.Build({"--prefetch", "--prefetch-fraction", "0.75", "--no-cost-aware"});
  ASSERT_TRUE(pre.ok()) << pre.status().ToString();
  EXPECT_TRUE(pre->prefetch);
  EXPECT_DOUBLE_EQ(pre->prefetch_fraction, 0.75);
  EXPECT_FALSE(pre->cost_aware);
  // `kvtier simulate` takes the connector's settings from the same inputs as `kvtier plan`.
  SimOptions o = SimOptionsFor(*pre, /*offload=*/true);
  EXPECT_TRUE(o.prefetch && !o.cost_aware);
  EXPECT_DOUBLE_EQ(o.prefetch_fraction, 0.75);
  EXPECT_EQ(o.tiers.size(), 1u);
  EXPECT_TRUE(SimOptionsFor(*pre, /*offload=*/false).tiers.empty());
}

TEST(OptionsTest, BadInputIsRefusedClearly) {
  EXPECT_NE(ErrorOf({"--model", "gpt-17"}).find("unknown model"), std::string::npos);
  EXPECT_NE(ErrorOf({"--tier", "nfs:200GiB:-3GB/s"}).find("negative"), std::string::npos);
  EXPECT_NE(ErrorOf({"--tier", "cpu:8:20GB/s"}).find("no unit"), std::string::npos);
  EXPECT_NE(ErrorOf({"--gpu", "voodoo2"}).find("unknown GPU"), std::string::npos);
  EXPECT_NE(ErrorOf({"--users", "0"}).find("--users"), std::string::npos);
  EXPECT_NE(ErrorOf({"--qps", "-1"}).find("negative"), std::string::npos);
  EXPECT_NE(ErrorOf({"--prefill-table", "4096:0.3,8192:0.1"}).find("monotone"), std::string::npos);
  EXPECT_NE(ErrorOf({"--write-policy", "maybe"}).find("write policy"), std::string::npos);
  EXPECT_NE(ErrorOf({"--model", "llama-3.1-70b", "--gpu", "l40s"}).find("does not fit"),
            std::string::npos);
  EXPECT_NE(ErrorOf({"--calibrate", "16384"}).find("TOKENS:SECONDS"), std::string::npos);
  EXPECT_FALSE(ErrorOf({"--qps", "1", "--load", "0.5"}).empty());
  EXPECT_NE(ErrorOf({"--prefetch", "--prefetch-fraction", "1.5"}).find("(0, 1]"),
            std::string::npos);
  EXPECT_NE(ErrorOf({"--prefetch-fraction", "half"}).find("--prefetch-fraction"),
            std::string::npos);
}

TEST(OptionsTest, LoadBlockingIsAFraction) {
  Parsed defaults;
  auto in = defaults.Build({});
  ASSERT_TRUE(in.ok()) << in.status().ToString();
  EXPECT_EQ(in->engine.load_blocking, 0);  // kvtier's asynchronous loads
  Parsed sync;
  in = sync.Build({"--load-blocking", "1"});
  ASSERT_TRUE(in.ok()) << in.status().ToString();
  EXPECT_EQ(in->engine.load_blocking, 1);
  EXPECT_EQ(SimOptionsFor(*in, /*offload=*/true).engine.load_blocking, 1);
  EXPECT_NE(ErrorOf({"--load-blocking", "1.5"}).find("--load-blocking must be in [0, 1]"),
            std::string::npos);
  EXPECT_NE(ErrorOf({"--load-blocking", "-0.5"}).find("negative"), std::string::npos);
  EXPECT_NE(ErrorOf({"--load-blocking", "half"}).find("--load-blocking"), std::string::npos);
  EXPECT_NE(ErrorOf({"--load-blocking", "0.5s"}).find("not a plain number"), std::string::npos);
}

TEST(OptionsTest, DecodeStepIsOneFigureOrALineOverTheKvRead) {
  Parsed one;
  auto in = one.Build({"--decode-step-ms", "8", "--step-overhead-ms", "1"});
  ASSERT_TRUE(in.ok()) << in.status().ToString();
  EXPECT_NEAR(in->engine.decode_weights_s, 0.007, 1e-12);
  EXPECT_EQ(in->engine.decode_s_per_kv_token, 0);
  // 6 ms at 0 tokens growing 1 ms per 1000: the points lie on the line, in any order.
  Parsed table;
  in = table.Build(
      {"--decode-step-ms", "4096:10.096,128:6.128,1k:7.024", "--step-overhead-ms", "0"});
  ASSERT_TRUE(in.ok()) << in.status().ToString();
  EXPECT_NEAR(in->engine.decode_weights_s, 0.006, 1e-9);
  EXPECT_NEAR(in->engine.decode_s_per_kv_token, 1e-6, 1e-12);
  // Noise that makes longer prompts decode faster is no negative cost: flat at the mean.
  auto flat = FitDecodeSteps("128:9,4096:7");
  ASSERT_TRUE(flat.ok());
  EXPECT_NEAR(flat->base_s, 0.008, 1e-12);
  EXPECT_EQ(flat->per_kv_token_s, 0);
  EXPECT_NE(ErrorOf({"--decode-step-ms", "0"}).find("must be > 0"), std::string::npos);
  EXPECT_NE(ErrorOf({"--decode-step-ms", "128:7,abc"}).find("TOKENS:MS"), std::string::npos);
  EXPECT_NE(ErrorOf({"--decode-step-ms", "128:7,128:8"}).find("two prompt lengths"),
            std::string::npos);
  EXPECT_NE(ErrorOf({"--decode-step-ms", "128:-7,256:8"}).find("negative"), std::string::npos);
}

TEST(OptionsTest, ConfigFileFillsWhatFlagsLeaveOut) {
  kvtier::testing::TempDir dir;
  const std::string path = dir.Sub("plan.json");
  std::ofstream(path) << R"({"users": 4, "context": [8192, 16384], "gpu_kv_gb": 19,
                            "tier": ["cpu:8GiB:20GB/s", "nfs:200GiB:3.55GB/s"], "rounds": 3})";
  Parsed p;
  auto in = p.Build({"--config", path, "--rounds", "7"});
  ASSERT_TRUE(in.ok()) << in.status().ToString();
  EXPECT_EQ(in->workload.users, 4u);
  EXPECT_EQ(in->workload.rounds, 7u);  // the command line wins
  EXPECT_EQ(in->contexts, (std::vector<uint64_t>{8192, 16384}));
  EXPECT_EQ(in->tiers.size(), 2u);
  std::ofstream(path) << R"({"userz": 4})";
  Parsed q;
  auto bad = q.Build({"--config", path});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("unknown key"), std::string::npos);
}

}  // namespace
}  // namespace kvtier::planner

#include "planner/simulator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "loadgen/workload.h"
#include "planner/plan.h"

namespace kvtier::planner {
namespace {

constexpr uint64_t kQwenBytes = 147456;

EngineModel Qwen(double gpu_kv_bytes) {
  EngineModel e;
  e.gpu_kv_bytes = gpu_kv_bytes;
  e.kv_bytes_per_token = kQwenBytes;
  e.prefill = *PrefillCost::FromTable(
      {{4096, 0.135}, {8192, 0.280}, {16384, 0.652}, {24576, 1.049}, {32768, 1.530}});
  e.step_overhead_s = 0.004;
  e.decode_weights_s = 16.4e9 / 4.8e12;
  e.decode_s_per_kv_token = kQwenBytes / 4.8e12;
  return e;
}

SimOptions Options(uint64_t context, double qps, std::vector<TierSpec> tiers,
                   WritePolicy policy = WritePolicy::kWriteThrough, double gpu = 19e9) {
  SimOptions o;
  o.engine = Qwen(gpu);
  o.workload.context_tokens = context;
  o.workload.qps = qps;
  o.workload.duration_s = 400;
  o.tiers = std::move(tiers);
  o.write_policy = policy;
  o.keep_requests = true;
  return o;
}

std::vector<TierSpec> CpuNfs(double cpu_bytes = 8.0 * (1ull << 30), double nfs_read = 3.55e9,
                             double nfs_write = 3.55e9) {
  return {{"cpu", cpu_bytes, 20e9, 20e9}, {"nfs", 200.0 * (1ull << 30), nfs_read, nfs_write}};
}

void CheckInvariants(const SimOptions& o, const SimResult& r) {
  ASSERT_GT(r.requests, 0u);
  uint64_t sum = 0;
  for (uint64_t n : r.requests_by_source) sum += n;
  EXPECT_EQ(sum, r.requests) << "hits plus misses must equal requests";
  for (size_t t = 0; t < o.tiers.size(); ++t) {
    EXPECT_LE(r.tier_peak_bytes[t], o.tiers[t].capacity_bytes) << o.tiers[t].name;
  }
  EXPECT_LE(r.peak_gpu_used_tokens, r.gpu_capacity_tokens);
  EXPECT_GE(r.min_ttft_minus_transfer_s, 0) << "TTFT below the pure transfer time";
  for (const RequestLog& log : r.request_log) {
    uint64_t tokens = log.gpu_tokens + log.recomputed_tokens;
    for (uint64_t t : log.tier_tokens) tokens += t;
    EXPECT_EQ(tokens, log.prompt_tokens);
    EXPECT_GE(log.ttft_s, log.transfer_s);
    EXPECT_GT(log.ttft_s, 0);
  }
}

TEST(SimulatorTest, InvariantsAcrossRegimesAndPolicies) {
  for (uint64_t context : {4096u, 16384u, 32768u}) {
    for (WritePolicy policy :
         {WritePolicy::kWriteThrough, WritePolicy::kWriteBack, WritePolicy::kNone}) {
      SimOptions o = Options(context, 0.4, CpuNfs(), policy);
      auto r = Simulate(o);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      SCOPED_TRACE(testing::Message() << context << " " << WritePolicyName(policy));
      CheckInvariants(o, *r);
    }
  }
}

TEST(SimulatorTest, SmallTiersStayWithinCapacity) {
  // Tiers far smaller than the working set evict all the time.
  SimOptions o = Options(16384, 0.6, {{"cpu", 3e9, 20e9, 20e9}, {"nfs", 10e9, 2e9, 1e9}},
                         WritePolicy::kWriteBack);
  auto r = Simulate(o);
  ASSERT_TRUE(r.ok());
  CheckInvariants(o, *r);
  EXPECT_GT(r->bytes_written[1], 0);  // write-back reached the second tier
}

TEST(SimulatorTest, NoWritePolicyEqualsTheBaseline) {
  auto base = Simulate(Options(24576, 0.4, {}));
  auto none = Simulate(Options(24576, 0.4, CpuNfs(), WritePolicy::kNone));
  ASSERT_TRUE(base.ok() && none.ok());
  EXPECT_DOUBLE_EQ(base->mean_ttft_s, none->mean_ttft_s);
  EXPECT_EQ(none->bytes_read[0] + none->bytes_read[1], 0);
}

TEST(SimulatorTest, MonotoneInBandwidth) {
  double previous = 1e9;
  for (double bw : {1e9, 2e9, 3.55e9, 7e9, 14e9, 28e9, 56e9}) {
    auto r = Simulate(Options(24576, 0.35, CpuNfs(8.0 * (1ull << 30), bw, bw)));
    ASSERT_TRUE(r.ok());
    EXPECT_LE(r->mean_ttft_s, previous * 1.01) << bw;
    previous = r->mean_ttft_s;
  }
}

TEST(SimulatorTest, CostAwareLookupsLoadOnlyWhatPays) {
  // 16k contexts, 8 users against an 8 GiB first tier: most returning prefixes are on the
  // second tier only. At 0.3 GB/s reading one (2.3 GB, 8 s) is far slower than recomputing it
  // (0.65 s): loading every hit makes the offload arm slower than none; the connector's
  // cost-aware lookups decline those reads and recompute, so the arm is no slower than none.
  SimOptions slow = Options(16384, 0.3, CpuNfs(8.0 * (1ull << 30), 0.3e9, 1e9));
  SimOptions everything = slow;
  everything.cost_aware = false;
  auto base = Simulate(Options(16384, 0.3, {}));
  auto aware = Simulate(slow);
  auto all = Simulate(everything);
  ASSERT_TRUE(base.ok() && aware.ok() && all.ok());
  EXPECT_GT(all->bytes_read[1], 0);
  EXPECT_GT(all->mean_ttft_s, base->mean_ttft_s * 1.5);
  EXPECT_EQ(aware->bytes_read[1], 0);
  EXPECT_LE(aware->mean_ttft_s, base->mean_ttft_s * 1.02);
  CheckInvariants(slow, *aware);
  // A second tier faster than recompute is loaded either way.
  SimOptions fast = Options(16384, 0.3, CpuNfs(8.0 * (1ull << 30), 20e9, 20e9));
  SimOptions fast_all = fast;
  fast_all.cost_aware = false;
  auto f1 = Simulate(fast);
  auto f2 = Simulate(fast_all);
  ASSERT_TRUE(f1.ok() && f2.ok());
  EXPECT_GT(f1->bytes_read[1], 0);
  EXPECT_EQ(f1->bytes_read[1], f2->bytes_read[1]);
  EXPECT_DOUBLE_EQ(f1->mean_ttft_s, f2->mean_ttft_s);
}

// 20-round conversations at `context` tokens and `qps`, with the second tier reading at
// `tier_read` bytes/s, simulated with the connector's prefetch off and on.
struct PrefetchPair {
  SimOptions on;
  SimResult without, with;
};
PrefetchPair WithoutAndWithPrefetch(uint64_t context, double qps, double tier_read) {
  SimOptions off = Options(context, qps, CpuNfs(8.0 * (1ull << 30), tier_read, 1e9));
  off.workload.rounds = 20;
  off.workload.duration_s = 600;
  SimOptions on = off;
  on.prefetch = true;
  auto without = Simulate(off);
  auto with = Simulate(on);
  EXPECT_TRUE(without.ok() && with.ok());
  return {on, without.ok() ? *without : SimResult{}, with.ok() ? *with : SimResult{}};
}

TEST(SimulatorTest, PrefetchTurnsReturnsFromASlowTierIntoMemoryHits) {
  // The same shape as above with a second tier slower than recomputing (0.8 GB/s): without
  // prefetch every return is recomputed (the L1 always evicts the user asked next); with it the
  // users expected back soonest are read into the L1 between their turns and hit there.
  auto slow = WithoutAndWithPrefetch(16384, 0.3, 0.8e9);
  EXPECT_LT(slow.without.tokens_by_source[1], 0.01 * slow.without.prompt_tokens);
  EXPECT_GT(slow.with.tokens_by_source[1], 0.3 * slow.with.prompt_tokens);
  EXPECT_GT(slow.with.bytes_read[1], 0);
  EXPECT_LT(slow.with.mean_ttft_s, 0.8 * slow.without.mean_ttft_s);
  CheckInvariants(slow.on, slow.with);
  // A bigger share of the L1 keeps more users.
  slow.on.prefetch_fraction = 0.75;
  auto more = Simulate(slow.on);
  ASSERT_TRUE(more.ok());
  EXPECT_GT(more->tokens_by_source[1], slow.with.tokens_by_source[1]);
  // A second tier faster than recomputing is read at every return anyway: a prefetch would only
  // add its reads to the loads', so nothing is prefetched and nothing changes.
  auto fast = WithoutAndWithPrefetch(16384, 0.3, 20e9);
  EXPECT_GT(fast.without.bytes_read[1], 0);
  EXPECT_DOUBLE_EQ(fast.with.bytes_read[1], fast.without.bytes_read[1]);
  EXPECT_DOUBLE_EQ(fast.with.mean_ttft_s, fast.without.mean_ttft_s);
  // Below the eviction onset nothing is evicted, so nothing is read: prefetch changes nothing.
  auto fits = WithoutAndWithPrefetch(4096, 1.0, 0.8e9);
  EXPECT_EQ(fits.with.bytes_read[1], 0);
  EXPECT_DOUBLE_EQ(fits.without.mean_ttft_s, fits.with.mean_ttft_s);
}

TEST(SimulatorTest, WriteTrafficCompetesWithReads) {
  auto fast_writes = Simulate(Options(24576, 0.35, CpuNfs(8.0 * (1ull << 30), 3.55e9, 50e9)));
  auto slow_writes = Simulate(Options(24576, 0.35, CpuNfs(8.0 * (1ull << 30), 3.55e9, 0.5e9)));
  ASSERT_TRUE(fast_writes.ok() && slow_writes.ok());
  EXPECT_GT(slow_writes->mean_ttft_s, fast_writes->mean_ttft_s * 1.05);
}

TEST(SimulatorTest, SavingKvThatIsNeverReadCostsTtft) {
  // Regime 1: everything fits, offload only adds the device-to-host copies.
  auto base = Simulate(Options(4096, 1.0, {}));
  auto off = Simulate(Options(4096, 1.0, CpuNfs()));
  ASSERT_TRUE(base.ok() && off.ok());
  EXPECT_EQ(off->bytes_read[0] + off->bytes_read[1], 0);
  EXPECT_GT(off->bytes_written[0], 0);
  EXPECT_GT(off->mean_ttft_s, base->mean_ttft_s);
  EXPECT_EQ(base->evicted_recompute_tokens, 0u);
}

// Mean TTFT of the requests that read nothing from a tier.
double MeanTtftOfRequestsWithoutLoads(const SimResult& r) {
  double sum = 0;
  int n = 0;
  for (const RequestLog& log : r.request_log) {
    uint64_t tier = 0;
    for (uint64_t t : log.tier_tokens) tier += t;
    if (tier > 0) continue;
    sum += log.ttft_s;
    ++n;
  }
  return n > 0 ? sum / n : 0;
}

TEST(SimulatorTest, BlockingLoadsStallEveryRequestOfTheStep) {
  // 16k contexts over an 8 GiB first tier: most returns read 2.4 GB or more from a
  // 2 GB/s second tier.
  // Asynchronous loads (kvtier's) cost only the loading request; synchronous ones (LMCache's
  // default retrieval) stall the step that runs it, and so every request in that step: those
  // that loaded nothing wait longer.
  SimOptions o = Options(16384, 0.2, CpuNfs(8.0 * (1ull << 30), 2e9, 2e9));
  o.cost_aware = false;
  auto today = Simulate(o);  // the default: asynchronous
  o.engine.load_blocking = 0;
  auto async = Simulate(o);
  o.engine.load_blocking = 0.5;
  auto half = Simulate(o);
  o.engine.load_blocking = 1;
  auto sync = Simulate(o);
  ASSERT_TRUE(today.ok() && async.ok() && half.ok() && sync.ok());
  EXPECT_GT(sync->bytes_read[1], 0);
  EXPECT_EQ(async->load_wait_s, 0);
  EXPECT_DOUBLE_EQ(async->mean_ttft_s, today->mean_ttft_s);
  EXPECT_EQ(async->steps, today->steps);
  EXPECT_GT(half->load_wait_s, 0);
  EXPECT_GT(sync->load_wait_s, 0);
  const double others_async = MeanTtftOfRequestsWithoutLoads(*async);
  const double others_sync = MeanTtftOfRequestsWithoutLoads(*sync);
  EXPECT_GT(others_sync, others_async * 1.2) << others_async << " s against " << others_sync;
  EXPECT_GT(sync->mean_ttft_s, async->mean_ttft_s);
  CheckInvariants(o, *sync);
  o.engine.load_blocking = 1.5;
  EXPECT_FALSE(Simulate(o).ok());
}

TEST(SimulatorTest, ABlockingLoadIsWaitedForOnceByItsOwnRequest) {
  // Two users taking turns far apart on a GPU that holds one conversation: every return reads
  // its prefix from the second tier while nothing else runs. Whether the request waits for the
  // read before its step or inside it, its first token comes out at the same time.
  SimOptions o = Options(16384, 0.05, CpuNfs(1e9, 1e9, 1e9), WritePolicy::kWriteThrough, 4e9);
  o.workload.users = 2;
  o.cost_aware = false;
  auto async = Simulate(o);
  o.engine.load_blocking = 1;
  auto sync = Simulate(o);
  ASSERT_TRUE(async.ok() && sync.ok());
  ASSERT_EQ(async->request_log.size(), sync->request_log.size());
  int loaded = 0;
  for (size_t i = 0; i < async->request_log.size(); ++i) {
    const RequestLog& a = async->request_log[i];
    const RequestLog& s = sync->request_log[i];
    ASSERT_EQ(a.tier_tokens, s.tier_tokens);
    if (a.tier_tokens[1] > 0) ++loaded;
    EXPECT_NEAR(a.ttft_s, s.ttft_s, 1e-9) << "request " << i;
  }
  EXPECT_GT(loaded, 0);
  EXPECT_GT(sync->load_wait_s, 0);
}

TEST(SimulatorTest, EvictionIsTailFirstSoPrefixesSurvivePartially) {
  // Just above the threshold some conversations lose only their tails: a later round finds a
  // GPU prefix longer than the shared system prompt but shorter than what it had computed.
  // Five users: their questions do not all fall on the same instants (with 8 users and 5 rounds
  // the pacing sends them in bursts, and a burst evicts whole conversations).
  SimOptions o = Options(16384, 0.8, {}, WritePolicy::kWriteThrough, 15e9);
  o.workload.users = 5;
  auto r = Simulate(o);
  ASSERT_TRUE(r.ok());
  int partial = 0;
  for (const RequestLog& log : r->request_log) {
    uint64_t previous = log.prompt_tokens - o.workload.question_tokens;
    if (log.round > 0 && log.gpu_tokens > 1024 && log.gpu_tokens + 256 < previous) ++partial;
  }
  EXPECT_GT(partial, 0);
}

// The validation setup of docs/planner.md: vLLM's CPU build with the tiny model (4 KiB of KV per
// token, 96 blocks of 128 tokens, 2,048-token steps), 8 users of 4 rounds with 42-token
// questions and 32-token answers for 90 s, its idle prefill table and decode step as given.
SimOptions ValidationSetup(std::vector<std::pair<uint64_t, double>> prefill_table,
                           double decode_step_s, double qps, uint64_t system_prompt_tokens,
                           uint64_t context_tokens) {
  SimOptions o;
  o.engine.gpu_kv_bytes = 96 * 128 * 4096.0;
  o.engine.kv_bytes_per_token = 4096;
  o.engine.prefill = *PrefillCost::FromTable(std::move(prefill_table));
  o.engine.step_overhead_s = 0;
  o.engine.decode_weights_s = decode_step_s;
  o.engine.max_batched_tokens = 2048;
  o.engine.block_tokens = 128;
  o.engine.save_blocking = 0;
  o.workload = {.users = 8,
                .rounds = 4,
                .qps = qps,
                .system_prompt_tokens = system_prompt_tokens,
                .context_tokens = context_tokens,
                .question_tokens = 42,
                .answer_tokens = 32,
                .duration_s = 90};
  return o;
}

// kvtier's L1 loses a dirty chunk only when nothing clean is evictable: a load's chunks stay
// pinned until its copy is done and the flusher's chunks until their writes end, so a tier whose
// working set of loads and saves outgrows it loses some (the validation setup of docs/planner.md
// at 3,000 words: kvtier serve's 64-chunk L1 lost 4-5 chunks per 90 s run, at 1,500 words
// none), more when the tier below writes slowly, none in a tier four times the size.
TEST(SimulatorTest, FirstTierLosesDirtyChunksOnlyWhenLoadsAndWritesHoldTheRest) {
  SimOptions o =
      ValidationSetup({{1024, 0.108}, {2048, 0.308}, {4096, 0.831}}, 0.008, 1.354, 520, 3008);
  o.write_policy = WritePolicy::kWriteBack;
  auto lost = [&](double l1_mib, double disk_write) {
    o.tiers = {{"cpu", l1_mib * (1 << 20), 10e9, 10e9},
               {"disk", 64.0 * (1ull << 30), 1e9, disk_write}};
    auto r = Simulate(o);
    EXPECT_TRUE(r.ok());
    return r.ok() ? r->dirty_evictions : 0;
  };
  const uint64_t small = lost(64, 2.3e9), slow = lost(64, 0.05e9), large = lost(256, 2.3e9);
  EXPECT_GT(small, 0u);
  EXPECT_GT(slow, small);
  EXPECT_EQ(large, 0u);
}

// The first tier evicts as kvtier's L1 does. Users taking turns over a working set a little
// larger than the tier (the validation setup of docs/planner.md: 8 users of about 2,300 tokens,
// a 64-chunk L1, write-back): under write-back the chains of recent saves stay dirty, and so
// protected, until the flusher reaches them, while promoted chunks (clean) go first; so each
// user finds much of its history in L1 (kvtier's own engine, replayed the same requests, served
// 28 % of the tokens from L1). Written through, every chunk is clean and the tier is an LRU that
// always evicts the user asked next.
TEST(SimulatorTest, FirstTierEvictsAsKvtiersL1) {
  SimOptions o =
      ValidationSetup({{1024, 0.125}, {2048, 0.328}, {4096, 0.871}}, 0.011, 2.275, 500, 1528);
  o.tiers = {{"cpu", 64.0 * (1 << 20), 9e9, 9e9}, {"disk", 64.0 * (1ull << 30), 0.8e9, 1e9}};
  auto share = [&](WritePolicy write, EvictionPolicyKind eviction) {
    o.write_policy = write;
    o.l1_eviction = eviction;
    auto r = Simulate(o);
    EXPECT_TRUE(r.ok());
    if (!r.ok()) return 0.0;
    // Saves of 6 chunks a second: the flusher keeps up but for the odd burst of loads and saves
    // that holds every clean chunk (of some 550 written).
    EXPECT_LT(r->dirty_evictions, 10u) << WritePolicyName(write);
    double all = 0;
    for (double t : r->tokens_by_source) all += t;
    return r->tokens_by_source[1] / all;  // "cpu"
  };
  const double back = share(WritePolicy::kWriteBack, EvictionPolicyKind::kPrefixAware);
  const double through = share(WritePolicy::kWriteThrough, EvictionPolicyKind::kPrefixAware);
  const double lru_back = share(WritePolicy::kWriteBack, EvictionPolicyKind::kLru);
  EXPECT_GT(back, 0.15);
  EXPECT_LT(through, 0.05);
  // kvtier's LRU policy walks every chunk, so its flusher cleans each chain's cold end and the
  // protection is lost (the engine replayed: 6 % from L1).
  EXPECT_LT(lru_back, 0.08);
}

// The simulated users send when, and what, `kvtier bench qa` sends: its own session manager,
// answered at once, against an engine too fast to hold anyone back.
TEST(SimulatorTest, SendsWhenAndWhatBenchQaSends) {
  for (auto [users, rounds, qps] : {std::tuple{8, 5, 0.4}, std::tuple{5, 3, 1.3}, {3, 7, 0.2}}) {
    const double duration = 200;
    struct Instant : loadgen::Launcher {
      std::vector<std::pair<double, int>> sends;  // time, round within its own history
      double now = 0;
      void Launch(loadgen::UserSession& s, int) override {
        sends.emplace_back(now, static_cast<int>(s.history().size() - 1) / 2);
        s.OnAnswer("a");
      }
    } launcher;
    loadgen::WorkloadConfig config;
    config.num_users = users;
    config.num_rounds = rounds;
    config.qps = qps;
    loadgen::SessionManager manager(config);
    // (NextEventTime can be a rounding short of the send it announces: step past it.)
    for (double t = 0; t < duration; t = std::max(manager.NextEventTime(t), t + 1e-7)) {
      launcher.now = t;
      manager.Step(t, launcher);
    }

    SimOptions o = Options(4096, qps, {});
    o.workload.users = users;
    o.workload.rounds = rounds;
    o.workload.answer_tokens = 1;
    o.workload.duration_s = duration;
    o.engine.prefill = *PrefillCost::FromTable({{100000, 1e-6}});
    o.engine.step_overhead_s = o.engine.decode_weights_s = o.engine.decode_s_per_kv_token = 0;
    auto r = Simulate(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    std::vector<std::pair<double, int>> simulated;
    for (const RequestLog& l : r->request_log) simulated.emplace_back(l.sent_s, l.round);
    // Sends of one instant in a canonical order (bench qa's joins drift by its loop's latency, here
    // the 1e-7 s steps).
    auto canonical = [](std::vector<std::pair<double, int>>& v) {
      for (auto& [t, round] : v) t = std::round(t * 1e2) / 1e2;
      std::sort(v.begin(), v.end());
    };
    canonical(simulated);
    canonical(launcher.sends);
    ASSERT_EQ(simulated.size(), launcher.sends.size()) << users << " users, " << rounds;
    for (size_t i = 0; i < simulated.size(); ++i) {
      EXPECT_NEAR(simulated[i].first, launcher.sends[i].first, 1e-3) << i;
      EXPECT_EQ(simulated[i].second, launcher.sends[i].second) << i;
    }
  }
}

TEST(SimulatorTest, QueueingRaisesTtftWithLoad) {
  auto light = Simulate(Options(8192, 0.5, {}));
  auto heavy = Simulate(Options(8192, 5.0, {}));
  ASSERT_TRUE(light.ok() && heavy.ok());
  EXPECT_GT(heavy->mean_ttft_s, light->mean_ttft_s);
  // Even a full GPU hit pays at least one engine step.
  EXPECT_GE(light->ttft_sorted_s.front(), 0.004);
}

TEST(SimulatorTest, DeterministicAndFast) {
  // A 20-minute, 8-user run.
  SimOptions o = Options(24576, 0.4, CpuNfs());
  o.workload.duration_s = 1200;
  auto a = Simulate(o);
  auto b = Simulate(o);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->ttft_sorted_s, b->ttft_sorted_s);
  EXPECT_GT(a->requests, 300u);
  EXPECT_LT(a->wall_s, 5.0);  // well under a second in a Release build; sanitizers are slower
}

TEST(SimulatorTest, RefusesWhatCannotRun) {
  EXPECT_FALSE(Simulate(Options(32768, 0.4, {}, WritePolicy::kNone, 2e9)).ok());  // too small
  SimOptions o = Options(4096, 0.4, {});
  o.workload.users = 0;
  EXPECT_FALSE(Simulate(o).ok());
  o = Options(4096, 0, {});
  EXPECT_FALSE(Simulate(o).ok());
  o = Options(4096, 0.4, {{"cpu", 1e9, -1, 1e9}});
  EXPECT_FALSE(Simulate(o).ok());
}

TEST(SimulatorTest, ParsesTiersAndPolicies) {
  auto t = ParseTierSpec("nfs:200GiB:3.55GB/s:1.5GB/s");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->name, "nfs");
  EXPECT_DOUBLE_EQ(t->capacity_bytes, 200.0 * (1ull << 30));
  EXPECT_DOUBLE_EQ(t->read_bytes_per_s, 3.55e9);
  EXPECT_DOUBLE_EQ(t->write_bytes_per_s, 1.5e9);
  EXPECT_DOUBLE_EQ(ParseTierSpec("cpu:8GiB:20GB/s")->write_bytes_per_s, 20e9);
  EXPECT_FALSE(ParseTierSpec("cpu:8:20GB/s").ok());      // capacity without unit
  EXPECT_FALSE(ParseTierSpec("cpu:8GiB:-20GB/s").ok());  // negative bandwidth
  EXPECT_FALSE(ParseTierSpec("cpu:8GiB").ok());
  EXPECT_FALSE(ParseTierSpec("gpu:8GiB:20GB/s").ok());  // reserved name
  EXPECT_EQ(*ParseWritePolicy("write_back"), WritePolicy::kWriteBack);
  EXPECT_FALSE(ParseWritePolicy("sometimes").ok());
}

}  // namespace
}  // namespace kvtier::planner

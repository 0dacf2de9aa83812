// The engine's counters reach /stats and /metrics as their schema (EngineCounterFields,
// TierCounterFields) says: every row, under its name, with its value.
#include "server/metrics.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "kvtier/engine.h"
#include "server/server.h"
#include "testing/temp_dir.h"

namespace kvtier::server {
namespace {

// Every counter a value of its own, so a row that reads the wrong field is caught.
EngineStats NumberedStats() {
  EngineStats st;
  st.has_file = true;
  uint64_t v = 1000;
  for (const TierCounterField& f : TierCounterFields()) {
    st.memory.*f.field = ++v;
    st.file.*f.field = v + 500;
  }
  for (const EngineCounterField& f : EngineCounterFields()) st.*f.field = ++v;
  return st;
}

TEST(StatsSchemaTest, NamesAreUniqueAndHelpIsGiven) {
  std::set<std::string> tier, engine, ops;
  for (const TierCounterField& f : TierCounterFields()) {
    EXPECT_TRUE(tier.insert(std::string(f.name)).second) << f.name;
    EXPECT_FALSE(f.help.empty()) << f.name;
  }
  for (const EngineCounterField& f : EngineCounterFields()) {
    EXPECT_TRUE(engine.insert(std::string(f.name)).second) << f.name;
    EXPECT_TRUE(ops.insert(std::string(f.op)).second) << f.op;
    EXPECT_FALSE(f.help.empty()) << f.name;
  }
}

TEST(StatsSchemaTest, MetricsTextHasEveryCounterWithItsValue) {
  Metrics metrics;
  const EngineStats st = NumberedStats();
  const std::string text = MetricsText(metrics, st);
  for (const TierCounterField& f : TierCounterFields()) {
    for (auto [tier, counters] : {std::pair{"memory", &st.memory}, std::pair{"file", &st.file}}) {
      const std::string line =
          fmt::format("kvtier_{}_total{{tier=\"{}\"}} {}\n", f.name, tier, counters->*f.field);
      EXPECT_NE(text.find(line), std::string::npos) << line;
    }
    EXPECT_NE(text.find(fmt::format("# HELP kvtier_{}_total {}\n", f.name, f.help)),
              std::string::npos)
        << f.name;
  }
  for (const EngineCounterField& f : EngineCounterFields()) {
    const std::string line =
        fmt::format("kvtier_engine_ops_total{{op=\"{}\"}} {}\n", f.op, st.*f.field);
    EXPECT_NE(text.find(line), std::string::npos) << line;
  }
}

// Through a real server's /stats document: every engine counter, and every tier counter of
// each tier, under its schema name.
TEST(StatsSchemaTest, StatsJsonHasEveryCounter) {
  testing::TempDir dir("kvtier-metrics-test");
  ServerOptions o;
  o.socket_path = dir.Sub("s.sock");
  o.http_port = -1;
  o.engine.chunk_bytes = 4096;
  o.engine.memory.capacity_bytes = 16 * 4096;
  FileTierOptions f;
  f.root = dir.Sub("l2");
  o.engine.file = f;
  auto srv = Server::Start(o);
  ASSERT_TRUE(srv.ok()) << srv.status().ToString();
  const nlohmann::json j = nlohmann::json::parse((*srv)->StatsJson());
  for (const EngineCounterField& e : EngineCounterFields()) {
    EXPECT_TRUE(j["engine"].contains(std::string(e.name))) << e.name;
  }
  for (const char* tier : {"memory", "file"}) {
    for (const TierCounterField& t : TierCounterFields()) {
      EXPECT_TRUE(j["tiers"][tier].contains(std::string(t.name))) << tier << " " << t.name;
    }
  }
}

}  // namespace
}  // namespace kvtier::server

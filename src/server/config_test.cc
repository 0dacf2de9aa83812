#include "server/config.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>

#include "testing/temp_dir.h"

namespace kvtier::server {
namespace {

TEST(ServeConfigTest, DefaultsBuildAWorkingServer) {
  ServeConfig c;
  auto o = BuildServerOptions(c);
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  // Qwen3-8B: 36 layers x 8 heads x 128 x 2 (K,V) x 2 bytes x 256 tokens.
  EXPECT_EQ(o->engine.chunk_bytes, 36ull * 8 * 128 * 2 * 2 * 256);
  EXPECT_EQ(o->engine.memory.capacity_bytes, 1ull << 30);
  ASSERT_TRUE(o->engine.file.has_value());
  EXPECT_EQ(o->engine.file->root, DefaultCacheDir());
  EXPECT_EQ(o->engine.write_policy, WritePolicy::kWriteBack);
  EXPECT_FALSE(o->socket_path.empty());
}

TEST(ServeConfigTest, JsonConfigAppliesEveryKeyAndRefusesUnknownOnes) {
  ServeConfig c;
  ASSERT_TRUE(ApplyConfigJson(R"({"l1-size-gb": 2, "eviction_policy": "lru", "chunk_size": 128,
      "l2": [{"type": "fs", "path": "/mnt/kv", "max_size_gb": 50, "read_threads": 8,
              "write_threads": 3}],
      "write_policy": "write_through", "http_port": 9100, "token": "t", "tensor_parallel_size": 2})",
                              &c)
                  .ok());
  auto o = BuildServerOptions(c);
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->engine.memory.capacity_bytes, 2ull << 30);
  EXPECT_EQ(o->engine.memory.eviction, EvictionPolicyKind::kLru);
  EXPECT_EQ(o->engine.chunk_bytes, 36ull * 4 * 128 * 2 * 2 * 128);  // tp 2 halves the heads
  EXPECT_EQ(o->engine.file->root, "/mnt/kv");
  EXPECT_EQ(o->engine.file->capacity_bytes, 50ull << 30);
  EXPECT_EQ(o->engine.file->read_threads, 8);
  EXPECT_EQ(o->engine.write_policy, WritePolicy::kWriteThrough);
  EXPECT_EQ(o->http_port, 9100);
  EXPECT_EQ(o->token, "t");
  EXPECT_EQ(o->engine.load_deadline, std::chrono::milliseconds(2000));  // the default
  ASSERT_TRUE(ApplyConfigJson(R"({"load-deadline-ms": 0})", &c).ok());
  EXPECT_EQ(BuildServerOptions(c)->engine.load_deadline.count(), 0);  // no deadline
  ASSERT_TRUE(ApplyConfigJson(R"({"load_deadline_ms": 9000})", &c).ok());
  EXPECT_EQ(BuildServerOptions(c)->engine.load_deadline, std::chrono::milliseconds(9000));

  Status unknown = ApplyConfigJson(R"({"l1_size": 2})", &c);
  EXPECT_NE(unknown.message().find("l1_size"), std::string::npos);
  EXPECT_FALSE(ApplyConfigJson("[1]", &c).ok());
  EXPECT_FALSE(ApplyConfigJson("{", &c).ok());
  EXPECT_FALSE(ApplyConfigJson(R"({"chunk_size": -1})", &c).ok());
  EXPECT_FALSE(ApplyConfigJson(R"({"chunk_size": 1.5})", &c).ok());
  EXPECT_FALSE(ApplyConfigJson(R"({"l2": {"type": "fs"}})", &c).ok());
}

TEST(ServeConfigTest, L2SpecsAreValidated) {
  auto ok = ParseL2Spec(R"({"type":"fs","path":"/x","max_size_gb":1.5})");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->max_size_gb, 1.5);
  EXPECT_FALSE(ParseL2Spec(R"({"type":"s3","path":"/x"})").ok());
  EXPECT_FALSE(ParseL2Spec(R"({"type":"fs"})").ok());
  EXPECT_FALSE(ParseL2Spec(R"({"type":"fs","path":"/x","read_threads":0})").ok());
  EXPECT_FALSE(ParseL2Spec(R"({"type":"fs","path":"/x","max_size_gb":-1})").ok());
  EXPECT_FALSE(ParseL2Spec(R"({"type":"fs","path":"/x","read_limit_gbps":-0.5})").ok());
  EXPECT_FALSE(ParseL2Spec(R"({"type":"fs","path":"/x","rescan_interval_s":-1})").ok());
  EXPECT_FALSE(ParseL2Spec(R"({"type":"fs","path":"/x","shared_capacity":1})").ok());
  EXPECT_FALSE(ParseL2Spec(R"({"type":"fs","path":"/x","colour":"red"})").ok());
  EXPECT_FALSE(ParseL2Spec("fs:/x").ok());
}

TEST(ServeConfigTest, L2ReadLimitReachesTheFileTierInBytesPerSecond) {
  auto capped = ParseL2Spec(R"({"type":"fs","path":"/x","read_limit_gbps":0.05})");
  ASSERT_TRUE(capped.ok()) << capped.status().ToString();
  ServeConfig c;
  c.l2 = {*capped};
  auto options = BuildServerOptions(c);
  ASSERT_TRUE(options.ok()) << options.status().ToString();
  EXPECT_DOUBLE_EQ(options->engine.file->read_limit_bytes_per_s, 5e7);
  auto defaults = BuildServerOptions(ServeConfig{});
  ASSERT_TRUE(defaults.ok());
  EXPECT_EQ(defaults->engine.file->read_limit_bytes_per_s, 0);
}

TEST(ServeConfigTest, L2RescanIntervalAndSharedCapacityReachTheFileTier) {
  auto spec =
      ParseL2Spec(R"({"type":"fs","path":"/x","rescan_interval_s":0.25,"shared_capacity":true})");
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  ServeConfig c;
  c.l2 = {*spec};
  auto options = BuildServerOptions(c);
  ASSERT_TRUE(options.ok()) << options.status().ToString();
  EXPECT_EQ(options->engine.file->rescan_interval, std::chrono::milliseconds(250));
  EXPECT_TRUE(options->engine.file->shared_capacity);
  auto defaults = BuildServerOptions(ServeConfig{});
  ASSERT_TRUE(defaults.ok());
  EXPECT_EQ(defaults->engine.file->rescan_interval, FileTierOptions{}.rescan_interval);
  EXPECT_FALSE(defaults->engine.file->shared_capacity);
}

TEST(ServeConfigTest, L2SyncDataIsABooleanThatReachesTheFileTier) {
  // Left out: on, as in FileTierOptions, for --l2 and for the default tier alike.
  auto plain = ParseL2Spec(R"({"type":"fs","path":"/x"})");
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_TRUE(plain->sync_data);
  auto defaults = BuildServerOptions(ServeConfig{});
  ASSERT_TRUE(defaults.ok()) << defaults.status().ToString();
  EXPECT_TRUE(defaults->engine.file->sync_data);

  auto off = ParseL2Spec(R"({"type":"fs","path":"/x","sync_data":false})");
  ASSERT_TRUE(off.ok()) << off.status().ToString();
  EXPECT_FALSE(off->sync_data);
  auto on = ParseL2Spec(R"({"type":"fs","path":"/x","sync-data":true})");
  ASSERT_TRUE(on.ok()) << on.status().ToString();
  EXPECT_TRUE(on->sync_data);
  ServeConfig c;
  c.l2 = {*off};
  auto options = BuildServerOptions(c);
  ASSERT_TRUE(options.ok()) << options.status().ToString();
  EXPECT_FALSE(options->engine.file->sync_data);

  // The --config form takes it too.
  ServeConfig from_json;
  ASSERT_TRUE(
      ApplyConfigJson(R"({"l2": [{"type": "fs", "path": "/x", "sync_data": false}]})", &from_json)
          .ok());
  ASSERT_EQ(from_json.l2.size(), 1u);
  EXPECT_FALSE(from_json.l2[0].sync_data);

  // Only a JSON boolean: not a number, a string or null.
  for (const char* bad : {"0", "1", "\"false\"", "null"}) {
    const std::string text = std::string(R"({"type":"fs","path":"/x","sync_data":)") + bad + "}";
    Status s = ParseL2Spec(text).status();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << text;
    EXPECT_NE(s.message().find("\"sync_data\" must be true or false"), std::string::npos)
        << s.ToString();
    ServeConfig bad_config;
    Status in_config = ApplyConfigJson("{\"l2\": [" + text + "]}", &bad_config);
    EXPECT_NE(in_config.message().find("sync_data"), std::string::npos) << in_config.ToString();
  }
}

TEST(ServeConfigTest, S3TiersTakeAUrlConnectionsAndAPartSize) {
  if (!S3Supported()) GTEST_SKIP() << "built without the S3 client";
  auto s3 = ParseL2Spec(R"({"type":"s3","url":"s3://bucket/kv","connections":32,"part_mib":8})");
  ASSERT_TRUE(s3.ok()) << s3.status().ToString();
  EXPECT_EQ(s3->type, "s3");
  EXPECT_EQ(s3->connections, 32);
  EXPECT_EQ(s3->part_mib, 8);
  auto fs = ParseL2Spec(R"({"type":"fs","path":"s3://bucket/kv"})");  // a URL speaks S3
  ASSERT_TRUE(fs.ok());
  EXPECT_EQ(fs->type, "s3");
  EXPECT_FALSE(ParseL2Spec(R"({"type":"s3","url":"nfs://host/export"})").ok());
  EXPECT_FALSE(ParseL2Spec(R"({"type":"s3","url":"s3://bucket/kv","part_mib":4})").ok());
  EXPECT_FALSE(ParseL2Spec(R"({"type":"fs","path":"/x","part_mib":8})").ok());
  ServeConfig c;
  c.l2 = {*s3};
  auto options = BuildServerOptions(c);
  ASSERT_TRUE(options.ok()) << options.status().ToString();
  EXPECT_EQ(options->engine.file->s3_part_bytes, 8u << 20);
  EXPECT_EQ(options->engine.file->connections, 32);
}

TEST(ServeConfigTest, BadValuesAreRefused) {
  auto refused = [](auto mutate) {
    ServeConfig c;
    mutate(c);
    return !BuildServerOptions(c).ok();
  };
  EXPECT_TRUE(refused([](ServeConfig& c) { c.l1_size_gb = 0; }));
  EXPECT_TRUE(refused([](ServeConfig& c) { c.l1_size_gb = 0.001; }));  // below one chunk
  EXPECT_TRUE(refused([](ServeConfig& c) { c.eviction_policy = "random"; }));
  EXPECT_TRUE(refused([](ServeConfig& c) { c.write_policy = "sometimes"; }));
  EXPECT_TRUE(refused([](ServeConfig& c) { c.model = "nope"; }));
  EXPECT_TRUE(refused([](ServeConfig& c) { c.chunk_size = 0; }));
  EXPECT_TRUE(refused([](ServeConfig& c) { c.http_port = 70000; }));
  EXPECT_TRUE(refused([](ServeConfig& c) { c.no_l2 = true, c.l2.push_back(DefaultL2()); }));
  EXPECT_TRUE(refused([](ServeConfig& c) { c.l2 = {DefaultL2(), DefaultL2()}; }));
  EXPECT_TRUE(refused([](ServeConfig& c) { c.token_file = "/nonexistent/token"; }));
  EXPECT_TRUE(refused([](ServeConfig& c) { c.load_deadline_ms = 600001; }));
  EXPECT_FALSE(refused([](ServeConfig& c) { c.model = "Qwen/Qwen3-8B"; }));
  EXPECT_FALSE(refused([](ServeConfig& c) { c.eviction_policy = "LRU"; }));
}

// The "kv_events" object of the configuration (and of kvtier.start_server): the flags' keys
// without their prefix, and vLLM's KVEventsConfig keys; giving the object turns events on.
TEST(ServeConfigTest, KvEventsObjectReachesThePublisherOptions) {
#ifndef KVTIER_WITH_KV_EVENTS
  GTEST_SKIP() << "built without KV-cache events (libzmq, msgpack-cxx)";
#endif
  ServeConfig c;
  c.no_l2 = true;
  ASSERT_TRUE(ApplyConfigJson(R"({"kv_events": {"endpoint": "ipc:///tmp/x", "topic": "t",
      "media": "RAM,DISK", "batch_ms": 5, "buffer_steps": 7, "buffer_mb": 2, "hwm": 9,
      "max_queue_size": 64, "replay_max_chunks": 3, "token_ids": false, "pod": "p",
      "bind_host": "127.0.0.1", "replay_endpoint": "tcp://*:0", "clear_on_start": true}})",
                              &c)
                  .ok());
  auto o = BuildServerOptions(c);
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_TRUE(o->kv_events);
  const events::PublisherOptions& e = o->kv_events_options;
  EXPECT_EQ(e.endpoint, "ipc:///tmp/x");
  EXPECT_EQ(e.replay_endpoint, "tcp://*:0");
  EXPECT_EQ(e.medium_cpu, "RAM");
  EXPECT_EQ(e.medium_storage, "DISK");
  EXPECT_EQ(e.batch_interval.count(), 5);
  EXPECT_EQ(e.buffer_steps, 7u);
  EXPECT_EQ(e.buffer_bytes, 2u << 20);
  EXPECT_EQ(e.max_queue_size, 64u);
  EXPECT_FALSE(e.token_ids);
  EXPECT_TRUE(e.clear_on_start);

  ServeConfig off;
  ASSERT_TRUE(ApplyConfigJson(R"({"kv_events": {"enable_kv_cache_events": false}})", &off).ok());
  EXPECT_FALSE(off.kv_events.enabled);
  ASSERT_TRUE(ApplyConfigJson(R"({"kv_events": true})", &off).ok());
  EXPECT_TRUE(off.kv_events.enabled);
  for (const char* bad :
       {R"({"kv_events": {"nope": 1}})", R"({"kv_events": 3})",
        R"({"kv_events": {"publisher": "kafka"}})", R"({"kv_events": {"hwm": "x"}})"}) {
    ServeConfig b;
    EXPECT_FALSE(ApplyConfigJson(bad, &b).ok()) << bad;
  }
  ServeConfig isolated = c;
  isolated.isolate_clients = true;
  auto refused = BuildServerOptions(isolated);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("--isolate-clients"), std::string::npos);
  ServeConfig media = c;
  media.kv_events.media = "A,B,C";
  EXPECT_FALSE(BuildServerOptions(media).ok());
}

TEST(ServeConfigTest, EveryModelPresetResolvesPerRank) {
  ServeConfig c;
  for (const auto& name : ModelPresetNames()) {
    c.model = name;
    c.tensor_parallel_size = 1;
    auto layout = ResolveModelLayout(c);
    ASSERT_TRUE(layout.ok()) << name << ": " << layout.status().ToString();
  }
  ASSERT_EQ(ModelPresetNames().front(), "qwen3-0.6b");
  c.model = "qwen3-32b";
  c.tensor_parallel_size = 2;
  EXPECT_EQ(ResolveModelLayout(c)->ToString(), "kv(layers=64, kv_heads=4, head_dim=128, bfloat16)");
  c.tensor_parallel_size = 16;  // more ranks than KV heads: one head each, replicated
  EXPECT_EQ(ResolveModelLayout(c)->ToString(), "kv(layers=64, kv_heads=1, head_dim=128, bfloat16)");
  c.model = "deepseek-v3";
  c.kv_dtype = "fp8";
  EXPECT_EQ(ResolveModelLayout(c)->ToString(), "latent(layers=61, latent_dim=576, float8_e4m3fn)");
}

TEST(ServeConfigTest, TenantTokenFileNeedsIsolationAndNoSharedToken) {
  testing::TempDir dir("kvtier-config-test");
  const std::string file = dir.Sub("tenants");
  std::ofstream(file) << "# name token\nalice a-1\nalice a-2\nbob b-1\n";
  ASSERT_EQ(::chmod(file.c_str(), 0600), 0);
  ServeConfig c;
  ASSERT_TRUE(
      ApplyConfigJson(R"({"isolate_clients": true, "tenant-token-file": ")" + file + R"("})", &c)
          .ok());
  auto o = BuildServerOptions(c);
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  ASSERT_EQ(o->tenant_tokens.size(), 3u);
  EXPECT_EQ(o->tenant_tokens[1].tenant, "alice");
  EXPECT_EQ(o->tenant_tokens[1].token, "a-2");
  EXPECT_EQ(o->tenant_tokens[2].tenant, "bob");
  EXPECT_TRUE(o->token.empty());

  ServeConfig shared = c;
  shared.token = "t";
  EXPECT_NE(BuildServerOptions(shared).status().message().find("excludes --token"),
            std::string::npos);
  shared = c;
  shared.token_file = file;
  EXPECT_FALSE(BuildServerOptions(shared).ok());
  ServeConfig pooled = c;
  pooled.isolate_clients = false;
  EXPECT_NE(BuildServerOptions(pooled).status().message().find("needs --isolate-clients"),
            std::string::npos);
  ASSERT_EQ(::chmod(file.c_str(), 0660), 0);
  EXPECT_EQ(BuildServerOptions(c).status().code(), StatusCode::kPermissionDenied);
}

}  // namespace
}  // namespace kvtier::server

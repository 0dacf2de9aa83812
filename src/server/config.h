// Configuration of `kvtier serve`: the settings, their JSON form (--config, --l2) and their
// translation into ServerOptions. Flag names follow LMCache's server where one exists
// (--l1-size-gb, --eviction-policy, --chunk-size, --l2 '{json}').
//
// Thread-safety: pure functions over values.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvtier/layout.h"
#include "kvtier/status.h"
#include "server/server.h"

namespace kvtier::server {

// One lower tier: --l2 '{"type":"fs","path":...,"max_size_gb":...,"read_threads":...,
// "write_threads":...,"sync_data":...}'.
struct L2Spec {
  // "fs": a local (or kernel-mounted) directory; "nfs": an nfs:// URL; "s3": an s3:// URL
  std::string type = "fs";
  std::string path;        // the directory, or for "nfs" the URL (JSON key "url" or "path")
  int connections = 0;     // "nfs", "s3": connections to the server (0: 4 for nfs, 16 for s3)
  int part_mib = 0;        // "s3": the size of a ranged GET and of an upload part (0: 64 MiB)
  double max_size_gb = 0;  // 0 = unlimited
  int read_threads = 4;
  int write_threads = 2;
  // fdatasync each chunk file before publishing it (FileTierOptions::sync_data). Off, a power
  // loss may leave published chunks that fail their checksum: misses, never wrong data
  // (docs/file-format.md, "Without step 4").
  bool sync_data = true;
  // Caps the tier's reads at this many GB/s (10^9 bytes; FileTierOptions::read_limit_bytes_per_s);
  // 0: no cap.
  double read_limit_gbps = 0;
  // How often the tier lists its directory for what other hosts published and removed
  // (FileTierOptions::rescan_interval); 0: never. Hosts sharing a directory and a capacity go
  // over it by what the others wrote in about one interval (docs/multi-node.md).
  double rescan_interval_s = 5;
  // Hosts share this directory's capacity: each write first counts what the others published
  // lately (FileTierOptions::shared_capacity, docs/multi-node.md).
  bool shared_capacity = false;
};

// KV-cache events (docs/kv-events.md, "Configuration"): --kv-events-* flags, or the "kv_events"
// object of the configuration (the same keys without the prefix; vLLM's KVEventsConfig keys
// enable_kv_cache_events and publisher are accepted too).
struct KvEventsConfig {
  bool enabled = false;
  std::string endpoint;  // PUB; empty: none
  std::string replay_endpoint;
  std::string bind_host;
  std::string topic = "kv@{host}@{model}";
  std::string pod;                    // empty: the host name
  std::string media = "CPU,STORAGE";  // L1's name, the file tier's
  bool token_ids = true;
  bool clear_on_start = false;
  uint32_t batch_ms = 10;
  uint32_t buffer_steps = 10000;
  uint32_t buffer_mb = 64;
  int hwm = 100000;
  uint32_t max_queue_size = 65536;
  uint32_t replay_max_chunks = 65536;
  double describe_reads_per_s = 200;  // headers of files others wrote (or found at start); 0: none
};
// Applies a "kv_events" JSON value: an object of the keys above (giving one turns events on
// unless it says "enabled": false), or true/false.
Status ApplyKvEventsJson(std::string_view text, KvEventsConfig* config);

struct ServeConfig {
  double l1_size_gb = 1.0;  // GiB of shared L1 pool
  std::string eviction_policy = "prefix-aware";
  uint32_t chunk_size = 256;       // tokens per chunk
  std::string model = "qwen3-8b";  // preset name or path to a Hugging Face config.json
  uint32_t tensor_parallel_size = 1;
  std::string kv_dtype;      // overrides the model's dtype (e.g. fp8)
  uint64_t chunk_bytes = 0;  // overrides model x chunk_size when set
  std::vector<L2Spec> l2;    // empty: the default file tier, unless no_l2
  bool no_l2 = false;
  std::string write_policy = "write_back";
  std::string socket;  // empty: DefaultSocketPath()
  std::string socket_group;
  std::string token;
  std::string token_file;
  std::string tenant_token_file;  // lines "TENANT_NAME TOKEN" (ReadTenantTokenFile)
  std::string http_host = "127.0.0.1";
  int http_port = 8790;  // 0: any free port; -1: no HTTP
  int worker_threads = 2;
  uint32_t max_clients = 256;
  uint32_t max_clients_per_process = 0;     // 0: a quarter of max_clients, 16 to all
  uint32_t reservation_timeout_ms = 30000;  // 0: reservations never expire
  // Slots one client process may hold reserved or pinned; 0 = half the pool.
  uint32_t max_client_slots = 0;
  bool isolate_clients = false;  // private windows, server-side copies (ServerOptions)
  uint32_t max_window_mb = 0;    // isolated clients' windows together; 0 = 4x L1
  // A load still waiting on the file tier this long after it started reports the rest as
  // missing (EngineOptions::load_deadline); 0: no deadline.
  uint32_t load_deadline_ms = 2000;
  uint32_t max_pending_handshakes = 64;
  uint32_t hello_timeout_ms = 5000;
  bool huge_pages = false;
  KvEventsConfig kv_events;
};

// Applies a JSON object of settings (keys as the flags, with '_' or '-'; "l2" is an array of
// L2 objects). Unknown keys, wrong types and bad values are errors naming the key.
Status ApplyConfigJson(std::string_view text, ServeConfig* config);
Status ApplyConfigFile(const std::string& path, ServeConfig* config);
Result<L2Spec> ParseL2Spec(std::string_view json);

// The layout of one rank of config.model (a preset name, or a config.json path).
Result<Layout> ResolveModelLayout(const ServeConfig& config);
// Names of the built-in model presets.
std::vector<std::string> ModelPresetNames();
// $XDG_CACHE_HOME/kvtier, else $HOME/.cache/kvtier, else ./kvtier-cache.
std::string DefaultCacheDir();
// The default L2: a file tier in DefaultCacheDir(), 10 GiB.
L2Spec DefaultL2();

// Reads --tenant-token-file: one "TENANT_NAME TOKEN" per line, separated by spaces or tabs;
// blank lines and lines whose first non-blank character is '#' are skipped. A name is 1 to 128
// letters, digits or ._@-; a token at most 4096 bytes without blanks; a token may appear once,
// a name on several lines (several tokens of one tenant). The file must be a regular file owned
// by this user or root that neither group nor others may read or write, since its tokens are
// credentials and whoever may write it may add a tenant. Errors name the file and the line, never
// a token.
Result<std::vector<ServerOptions::TenantToken>> ReadTenantTokenFile(const std::string& path);

// Validates everything and builds the server's options.
Result<ServerOptions> BuildServerOptions(const ServeConfig& config);

}  // namespace kvtier::server

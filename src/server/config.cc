#include "server/config.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "common/model_presets.h"
#include "common/strings.h"
#include "kvtier/io.h"
#include "kvtier/socket_path.h"

namespace kvtier::server {

namespace {

using json = nlohmann::json;

std::string NormalizeKey(std::string_view k) {
  std::string out(k);
  std::replace(out.begin(), out.end(), '-', '_');
  return out;
}

Result<json> ParseJson(std::string_view text, std::string_view what) {
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::InvalidArgument(fmt::format("{} is not valid JSON", what));
  if (!j.is_object()) return Status::InvalidArgument(fmt::format("{} must be a JSON object", what));
  return j;
}

Status GetNumber(const json& v, const std::string& key, double* out) {
  if (!v.is_number()) return Status::InvalidArgument(fmt::format("\"{}\" must be a number", key));
  *out = v.get<double>();
  return Status::Ok();
}

template <typename Int>
Status GetInt(const json& v, const std::string& key, Int* out) {
  if (!v.is_number_integer()) {
    return Status::InvalidArgument(fmt::format("\"{}\" must be an integer", key));
  }
  if constexpr (std::is_unsigned_v<Int>) {
    if (v.is_number_unsigned() || v.get<int64_t>() >= 0) {
      uint64_t x = v.get<uint64_t>();
      if (x <= std::numeric_limits<Int>::max()) {
        *out = static_cast<Int>(x);
        return Status::Ok();
      }
    }
  } else {
    int64_t x = v.get<int64_t>();
    if (x >= std::numeric_limits<Int>::min() && x <= std::numeric_limits<Int>::max()) {
      *out = static_cast<Int>(x);
      return Status::Ok();
    }
  }
  return Status::InvalidArgument(fmt::format("\"{}\" is out of range", key));
}

Status GetString(const json& v, const std::string& key, std::string* out) {
  if (!v.is_string()) return Status::InvalidArgument(fmt::format("\"{}\" must be a string", key));
  *out = v.get<std::string>();
  return Status::Ok();
}

Status GetBool(const json& v, const std::string& key, bool* out) {
  if (!v.is_boolean())
    return Status::InvalidArgument(fmt::format("\"{}\" must be true or false", key));
  *out = v.get<bool>();
  return Status::Ok();
}

Result<L2Spec> L2FromJson(const json& j) {
  if (!j.is_object()) return Status::InvalidArgument("an L2 tier must be a JSON object");
  L2Spec spec;
  bool has_path = false;
  for (auto& [k, v] : j.items()) {
    std::string key = NormalizeKey(k);
    if (key == "type") {
      KVTIER_RETURN_IF_ERROR(GetString(v, key, &spec.type));
    } else if (key == "path" || key == "url") {
      KVTIER_RETURN_IF_ERROR(GetString(v, key, &spec.path));
      has_path = true;
    } else if (key == "connections") {
      KVTIER_RETURN_IF_ERROR(GetInt(v, key, &spec.connections));
    } else if (key == "part_mib") {
      KVTIER_RETURN_IF_ERROR(GetInt(v, key, &spec.part_mib));
    } else if (key == "max_size_gb") {
      KVTIER_RETURN_IF_ERROR(GetNumber(v, key, &spec.max_size_gb));
    } else if (key == "read_threads") {
      KVTIER_RETURN_IF_ERROR(GetInt(v, key, &spec.read_threads));
    } else if (key == "write_threads") {
      KVTIER_RETURN_IF_ERROR(GetInt(v, key, &spec.write_threads));
    } else if (key == "sync_data") {
      KVTIER_RETURN_IF_ERROR(GetBool(v, key, &spec.sync_data));
    } else if (key == "read_limit_gbps") {
      KVTIER_RETURN_IF_ERROR(GetNumber(v, key, &spec.read_limit_gbps));
    } else if (key == "rescan_interval_s") {
      KVTIER_RETURN_IF_ERROR(GetNumber(v, key, &spec.rescan_interval_s));
    } else if (key == "shared_capacity") {
      KVTIER_RETURN_IF_ERROR(GetBool(v, key, &spec.shared_capacity));
    } else {
      return Status::InvalidArgument(
          fmt::format("unknown L2 key \"{}\" (expected type, path, url, connections, part_mib, "
                      "max_size_gb, read_threads, write_threads, sync_data, read_limit_gbps, "
                      "rescan_interval_s, shared_capacity)",
                      k));
    }
  }
  if (spec.type != "fs" && spec.type != "nfs" && spec.type != "s3") {
    return Status::InvalidArgument(
        fmt::format("unsupported L2 type \"{}\" (supported: \"fs\", \"nfs\", \"s3\")", spec.type));
  }
  if (!has_path || spec.path.empty()) {
    return Status::InvalidArgument(
        spec.type == "nfs"  ? "an nfs L2 tier needs a \"url\" (nfs://HOST/EXPORT/PATH)"
        : spec.type == "s3" ? "an s3 L2 tier needs a \"url\" (s3://BUCKET/PREFIX)"
                            : "an fs L2 tier needs a \"path\"");
  }
  if (spec.type == "nfs" && !IsNfsUrl(spec.path)) {
    return Status::InvalidArgument(
        fmt::format("an nfs L2 tier's url must be nfs://HOST/EXPORT[/PATH], not '{}'", spec.path));
  }
  if (spec.type == "s3" && !IsS3Url(spec.path)) {
    return Status::InvalidArgument(
        fmt::format("an s3 L2 tier's url must be s3://BUCKET[/PREFIX], not '{}'", spec.path));
  }
  // An fs tier given a URL speaks its protocol too.
  if (IsNfsUrl(spec.path)) {
    spec.type = "nfs";
    if (!NfsSupported()) {
      return Status::Unimplemented(fmt::format(
          "L2 {}: this build of kvtier has no NFS client (built without libnfs)", spec.path));
    }
  }
  if (IsS3Url(spec.path)) {
    spec.type = "s3";
    if (!S3Supported()) {
      return Status::Unimplemented(fmt::format(
          "L2 {}: this build of kvtier has no S3 client (built without libcurl or pugixml)",
          spec.path));
    }
  }
  if (spec.part_mib != 0 && spec.type != "s3") {
    return Status::InvalidArgument("L2 \"part_mib\" applies to s3 tiers only");
  }
  if (spec.part_mib != 0 && (spec.part_mib < 5 || spec.part_mib > 1024)) {
    return Status::InvalidArgument(
        "L2 \"part_mib\" must be in [5, 1024] (S3's smallest upload part is 5 MiB; 0: 64)");
  }
  if (spec.connections < 0 || spec.connections > 256) {
    return Status::InvalidArgument(
        "L2 \"connections\" must be in [0, 256] (0: 4 for nfs, 16 for s3)");
  }
  if (!(spec.max_size_gb >= 0) || spec.max_size_gb > 1e6) {
    return Status::InvalidArgument("L2 \"max_size_gb\" must be in [0, 1e6] (0 = unlimited)");
  }
  if (spec.read_threads < 1 || spec.read_threads > 256 || spec.write_threads < 1 ||
      spec.write_threads > 256) {
    return Status::InvalidArgument("L2 read_threads and write_threads must be in [1, 256]");
  }
  if (!(spec.read_limit_gbps >= 0) || spec.read_limit_gbps > 1e6) {
    return Status::InvalidArgument("L2 \"read_limit_gbps\" must be in [0, 1e6] (0 = no cap)");
  }
  if (!(spec.rescan_interval_s >= 0) || spec.rescan_interval_s > 86400) {
    return Status::InvalidArgument(
        "L2 \"rescan_interval_s\" must be in [0, 86400] seconds (0 = no rescans)");
  }
  return spec;
}

}  // namespace

std::vector<std::string> ModelPresetNames() { return kvtier::ModelPresetNames(); }

Result<L2Spec> ParseL2Spec(std::string_view text) {
  KVTIER_ASSIGN_OR_RETURN(json j, ParseJson(text, fmt::format("--l2 '{}'", text)));
  auto spec = L2FromJson(j);
  if (!spec.ok()) return spec.status().WithContext("--l2");
  return spec;
}

namespace {

Status KvEventsFromJson(const json& j, KvEventsConfig* c) {
  if (j.is_boolean()) {
    c->enabled = j.get<bool>();
    return Status::Ok();
  }
  if (!j.is_object()) {
    return Status::InvalidArgument("\"kv_events\" must be an object of settings, or true/false");
  }
  c->enabled = true;
  for (auto& [k, v] : j.items()) {
    std::string key = NormalizeKey(k);
    Status s;
    if (key == "enabled" || key == "enable_kv_cache_events") {
      s = GetBool(v, key, &c->enabled);
    } else if (key == "publisher") {  // vLLM's: "zmq" or "null"
      std::string p;
      s = GetString(v, key, &p);
      if (s.ok() && p != "zmq" && p != "null") {
        s = Status::InvalidArgument("\"publisher\" must be \"zmq\" or \"null\"");
      }
      if (s.ok() && p == "null") c->enabled = false;
    } else if (key == "endpoint") {
      s = GetString(v, key, &c->endpoint);
    } else if (key == "replay_endpoint") {
      s = GetString(v, key, &c->replay_endpoint);
    } else if (key == "bind_host") {
      s = GetString(v, key, &c->bind_host);
    } else if (key == "topic") {
      s = GetString(v, key, &c->topic);
    } else if (key == "pod") {
      s = GetString(v, key, &c->pod);
    } else if (key == "media") {
      s = GetString(v, key, &c->media);
    } else if (key == "token_ids") {
      s = GetBool(v, key, &c->token_ids);
    } else if (key == "clear_on_start") {
      s = GetBool(v, key, &c->clear_on_start);
    } else if (key == "batch_ms") {
      s = GetInt(v, key, &c->batch_ms);
    } else if (key == "buffer_steps") {
      s = GetInt(v, key, &c->buffer_steps);
    } else if (key == "buffer_mb") {
      s = GetInt(v, key, &c->buffer_mb);
    } else if (key == "hwm") {
      s = GetInt(v, key, &c->hwm);
    } else if (key == "max_queue_size") {
      s = GetInt(v, key, &c->max_queue_size);
    } else if (key == "replay_max_chunks") {
      s = GetInt(v, key, &c->replay_max_chunks);
    } else if (key == "describe_reads_per_s") {
      s = GetNumber(v, key, &c->describe_reads_per_s);
    } else {
      s = Status::InvalidArgument(fmt::format(
          "unknown key \"{}\" (expected enabled, endpoint, replay_endpoint, bind_host, topic, "
          "pod, media, token_ids, clear_on_start, batch_ms, buffer_steps, buffer_mb, hwm, "
          "max_queue_size, replay_max_chunks, describe_reads_per_s, enable_kv_cache_events, "
          "publisher)",
          k));
    }
    if (!s.ok()) return s.WithContext("\"kv_events\"");
  }
  return Status::Ok();
}

}  // namespace

Status ApplyKvEventsJson(std::string_view text, KvEventsConfig* config) {
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::InvalidArgument("\"kv_events\" is not valid JSON");
  return KvEventsFromJson(j, config);
}

namespace {

Result<events::PublisherOptions> BuildKvEvents(const KvEventsConfig& c, bool isolate_clients) {
  events::PublisherOptions o;
  o.endpoint = c.endpoint;
  o.replay_endpoint = c.replay_endpoint;
  o.bind_host = c.bind_host;
  o.topic = c.topic;
  o.pod = c.pod;
  const size_t comma = c.media.find(',');
  if (comma == std::string::npos || c.media.find(',', comma + 1) != std::string::npos) {
    return Status::InvalidArgument(fmt::format(
        "--kv-events-media must be two names, L1's and the file tier's (e.g. CPU,STORAGE), got "
        "\"{}\"",
        c.media));
  }
  o.medium_cpu = c.media.substr(0, comma);
  o.medium_storage = c.media.substr(comma + 1);
  o.token_ids = c.token_ids;
  o.clear_on_start = c.clear_on_start;
  o.batch_interval = std::chrono::milliseconds(c.batch_ms);
  o.buffer_steps = c.buffer_steps;
  o.buffer_bytes = static_cast<uint64_t>(c.buffer_mb) << 20;
  o.hwm = c.hwm;
  o.max_queue_size = c.max_queue_size;
  o.replay_max_chunks = c.replay_max_chunks;
  if (!(c.describe_reads_per_s >= 0 && c.describe_reads_per_s <= 1e6)) {
    return Status::InvalidArgument("--kv-events-describe-reads-per-s must be 0 to 1,000,000");
  }
  o.describe_reads_per_s = c.describe_reads_per_s;
  if (isolate_clients && !o.endpoint.empty()) {
    return Status::InvalidArgument(
        "--kv-events-endpoint is refused with --isolate-clients: one stream would carry every "
        "tenant's prefixes");
  }
  // (A kvtier built without libzmq refuses every option here, saying what to install.)
  KVTIER_RETURN_IF_ERROR(events::ValidatePublisherOptions(o));
  return o;
}

}  // namespace

Status ApplyConfigJson(std::string_view text, ServeConfig* c) {
  KVTIER_ASSIGN_OR_RETURN(json j, ParseJson(text, "the configuration"));
  for (auto& [k, v] : j.items()) {
    const std::string key = NormalizeKey(k);
    Status s;
    if (key == "l1_size_gb") {
      s = GetNumber(v, key, &c->l1_size_gb);
    } else if (key == "eviction_policy") {
      s = GetString(v, key, &c->eviction_policy);
    } else if (key == "chunk_size") {
      s = GetInt(v, key, &c->chunk_size);
    } else if (key == "model") {
      s = GetString(v, key, &c->model);
    } else if (key == "tensor_parallel_size") {
      s = GetInt(v, key, &c->tensor_parallel_size);
    } else if (key == "kv_dtype") {
      s = GetString(v, key, &c->kv_dtype);
    } else if (key == "chunk_bytes") {
      s = GetInt(v, key, &c->chunk_bytes);
    } else if (key == "l2") {
      if (!v.is_array()) {
        s = Status::InvalidArgument("\"l2\" must be an array of tier objects");
      } else {
        c->l2.clear();
        for (const json& t : v) {
          auto spec = L2FromJson(t);
          if (!spec.ok()) return spec.status().WithContext("configuration \"l2\"");
          c->l2.push_back(*spec);
        }
      }
    } else if (key == "no_l2") {
      s = GetBool(v, key, &c->no_l2);
    } else if (key == "write_policy") {
      s = GetString(v, key, &c->write_policy);
    } else if (key == "socket") {
      s = GetString(v, key, &c->socket);
    } else if (key == "socket_group") {
      s = GetString(v, key, &c->socket_group);
    } else if (key == "token") {
      s = GetString(v, key, &c->token);
    } else if (key == "token_file") {
      s = GetString(v, key, &c->token_file);
    } else if (key == "tenant_token_file") {
      s = GetString(v, key, &c->tenant_token_file);
    } else if (key == "http_host") {
      s = GetString(v, key, &c->http_host);
    } else if (key == "http_port") {
      s = GetInt(v, key, &c->http_port);
    } else if (key == "worker_threads") {
      s = GetInt(v, key, &c->worker_threads);
    } else if (key == "max_clients") {
      s = GetInt(v, key, &c->max_clients);
    } else if (key == "max_clients_per_process") {
      s = GetInt(v, key, &c->max_clients_per_process);
    } else if (key == "reservation_timeout_ms") {
      s = GetInt(v, key, &c->reservation_timeout_ms);
    } else if (key == "load_deadline_ms") {
      s = GetInt(v, key, &c->load_deadline_ms);
    } else if (key == "max_client_slots") {
      s = GetInt(v, key, &c->max_client_slots);
    } else if (key == "max_pending_handshakes") {
      s = GetInt(v, key, &c->max_pending_handshakes);
    } else if (key == "hello_timeout_ms") {
      s = GetInt(v, key, &c->hello_timeout_ms);
    } else if (key == "huge_pages") {
      s = GetBool(v, key, &c->huge_pages);
    } else if (key == "isolate_clients") {
      s = GetBool(v, key, &c->isolate_clients);
    } else if (key == "max_window_mb") {
      s = GetInt(v, key, &c->max_window_mb);
    } else if (key == "kv_events") {
      s = KvEventsFromJson(v, &c->kv_events);
    } else {
      s = Status::InvalidArgument(fmt::format("unknown configuration key \"{}\"", k));
    }
    if (!s.ok()) return s.WithContext("configuration");
  }
  return Status::Ok();
}

Status ApplyConfigFile(const std::string& path, ServeConfig* config) {
  std::ifstream in(path);
  if (!in) return Status::NotFound(fmt::format("cannot read configuration file \"{}\"", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ApplyConfigJson(ss.str(), config).WithContext(path);
}

Result<Layout> ResolveModelLayout(const ServeConfig& c) {
  if (c.tensor_parallel_size < 1 || c.tensor_parallel_size > 1024) {
    return Status::InvalidArgument("--tensor-parallel-size must be in [1, 1024]");
  }
  if (const ModelPreset* p = FindModelPreset(c.model)) {
    DType dtype = DType::kBFloat16;
    if (!c.kv_dtype.empty()) {
      KVTIER_ASSIGN_OR_RETURN(dtype, ParseDType(c.kv_dtype));
    }
    KVTIER_ASSIGN_OR_RETURN(Layout full, Layout::FromHfConfigJson(p->config_json, 1));
    if (full.kind() == LayoutKind::kLatent) {
      return Layout::Latent(full.num_layers(), full.head_dim(), dtype);
    }
    // Each rank holds its share of the KV heads, at least one (heads replicated beyond that).
    uint32_t heads = std::max<uint32_t>(1, full.num_kv_heads() / c.tensor_parallel_size);
    return Layout::KeyValue(full.num_layers(), heads, full.head_dim(), dtype);
  }
  if (access(c.model.c_str(), R_OK) == 0) {
    return Layout::FromHfConfigFile(c.model, c.tensor_parallel_size, c.kv_dtype);
  }
  std::string names;
  for (const auto& n : ModelPresetNames()) names += (names.empty() ? "" : ", ") + n;
  return Status::InvalidArgument(fmt::format(
      "--model \"{}\" is neither a preset ({}) nor a readable config.json", c.model, names));
}

std::string DefaultCacheDir() {
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/kvtier";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/kvtier";
  return "kvtier-cache";
}

L2Spec DefaultL2() {
  L2Spec s;
  s.path = DefaultCacheDir();
  s.max_size_gb = 10;
  return s;
}

Result<std::vector<ServerOptions::TenantToken>> ReadTenantTokenFile(const std::string& path) {
  auto fail = [&](std::string_view why) {
    return Status::InvalidArgument(fmt::format("--tenant-token-file \"{}\": {}", path, why));
  };
  // Opened once, then checked and read through the same descriptor: what is checked is what is
  // read, even if the name is replaced meanwhile.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) {
    return Status::FromErrno(errno, fmt::format("cannot read --tenant-token-file \"{}\"", path));
  }
  std::string text;
  Status checked = [&]() -> Status {
    struct stat st;
    if (::fstat(fd, &st) != 0) return Status::FromErrno(errno, "fstat");
    if (!S_ISREG(st.st_mode)) return fail("not a regular file");
    if ((st.st_mode & 077) != 0) {
      return Status::PermissionDenied(fmt::format(
          "--tenant-token-file \"{}\" has mode {:04o}: group and others must have no access "
          "(its tokens are the tenants' credentials); chmod 600 it",
          path, st.st_mode & 07777));
    }
    if (st.st_uid != ::geteuid() && st.st_uid != 0) {
      return Status::PermissionDenied(fmt::format(
          "--tenant-token-file \"{}\" is owned by uid {}: it must be owned by this user (uid {}) "
          "or root, since whoever may rewrite it may add a tenant",
          path, st.st_uid, ::geteuid()));
    }
    static constexpr size_t kMaxBytes = 1 << 20;
    char buf[4096];
    ssize_t n;
    while ((n = ::read(fd, buf, sizeof(buf))) != 0) {
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return Status::FromErrno(errno, fmt::format("reading \"{}\"", path));
      text.append(buf, static_cast<size_t>(n));
      if (text.size() > kMaxBytes) return fail("larger than 1 MiB");
    }
    return Status::Ok();
  }();
  ::close(fd);
  KVTIER_RETURN_IF_ERROR(checked);

  std::vector<ServerOptions::TenantToken> out;
  std::unordered_map<std::string, size_t> line_of;  // token -> its line, for duplicates
  std::istringstream in(text);
  std::string line;
  for (size_t no = 1; std::getline(in, line); ++no) {
    std::vector<std::string> fields;
    std::istringstream words(line);
    for (std::string w; words >> w;) fields.push_back(std::move(w));
    if (fields.empty() || fields[0][0] == '#') continue;
    // Messages name the line, never its text: it may hold a token.
    if (fields.size() != 2) {
      return fail(fmt::format("line {}: expected \"TENANT_NAME TOKEN\", found {} fields", no,
                              fields.size()));
    }
    const std::string& name = fields[0];
    const bool name_ok =
        name.size() <= 128 && std::all_of(name.begin(), name.end(), [](unsigned char ch) {
          return std::isalnum(ch) || ch == '.' || ch == '_' || ch == '@' || ch == '-';
        });
    if (!name_ok) {
      return fail(fmt::format(
          "line {}: a tenant name is 1 to 128 letters, digits or the characters ._@-", no));
    }
    if (fields[1].size() > 4096) {
      return fail(fmt::format("line {}: the token is longer than 4096 bytes", no));
    }
    if (auto [at, fresh] = line_of.emplace(fields[1], no); !fresh) {
      return fail(fmt::format("line {} repeats the token of line {}: a token must name one tenant",
                              no, at->second));
    }
    out.push_back({name, fields[1]});
  }
  if (out.empty()) return fail("no \"TENANT_NAME TOKEN\" line: no client could connect");
  return out;
}

Result<ServerOptions> BuildServerOptions(const ServeConfig& c) {
  ServerOptions o;
  if (c.chunk_size < 1 || c.chunk_size > (1u << 20)) {
    return Status::InvalidArgument("--chunk-size must be in [1, 1048576] tokens");
  }
  uint64_t chunk_bytes = c.chunk_bytes;
  if (chunk_bytes == 0) {
    KVTIER_ASSIGN_OR_RETURN(Layout layout, ResolveModelLayout(c));
    chunk_bytes = layout.bytes_per_chunk(c.chunk_size);
  }
  if (chunk_bytes > (16ull << 30))
    return Status::InvalidArgument("chunks above 16 GiB are refused");
  o.engine.chunk_bytes = chunk_bytes;
  if (!(c.l1_size_gb > 0) || c.l1_size_gb > 1 << 20) {
    return Status::InvalidArgument("--l1-size-gb must be a positive number of GiB");
  }
  o.engine.memory.capacity_bytes = static_cast<uint64_t>(c.l1_size_gb * (1ull << 30));
  const uint64_t slot = (chunk_bytes + 4095) / 4096 * 4096;
  if (o.engine.memory.capacity_bytes < slot) {
    return Status::InvalidArgument(
        fmt::format("--l1-size-gb {} holds no chunk: one chunk takes {} bytes ({:.1f} MiB)",
                    c.l1_size_gb, slot, slot / 1048576.0));
  }
  std::string policy = Lower(c.eviction_policy);
  std::replace(policy.begin(), policy.end(), '_', '-');
  KVTIER_ASSIGN_OR_RETURN(o.engine.memory.eviction, ParseEvictionPolicy(policy));
  o.engine.memory.huge_pages = c.huge_pages;
  KVTIER_ASSIGN_OR_RETURN(o.engine.write_policy, ParseWritePolicy(Lower(c.write_policy)));
  if (c.worker_threads < 1 || c.worker_threads > 256) {
    return Status::InvalidArgument("--worker-threads must be in [1, 256]");
  }
  o.engine.worker_threads = c.worker_threads;
  if (c.load_deadline_ms > 600000) {
    return Status::InvalidArgument("--load-deadline-ms must be in [0, 600000] (0: no deadline)");
  }
  o.engine.load_deadline = std::chrono::milliseconds(c.load_deadline_ms);

  std::vector<L2Spec> l2 = c.l2;
  if (c.no_l2) {
    if (!c.l2.empty()) return Status::InvalidArgument("--no-l2 and --l2 contradict each other");
  } else if (l2.empty()) {
    l2.push_back(DefaultL2());
  }
  if (l2.size() > 1) {
    return Status::InvalidArgument(
        fmt::format("{} L2 tiers given; this version supports one file tier", l2.size()));
  }
  if (!l2.empty()) {
    FileTierOptions f;
    f.root = l2[0].path;
    f.capacity_bytes = static_cast<uint64_t>(l2[0].max_size_gb * (1ull << 30));
    f.read_threads = l2[0].read_threads;
    f.write_threads = l2[0].write_threads;
    f.sync_data = l2[0].sync_data;
    f.read_limit_bytes_per_s = l2[0].read_limit_gbps * 1e9;
    f.rescan_interval = std::chrono::milliseconds(
        static_cast<int64_t>(std::llround(l2[0].rescan_interval_s * 1000)));
    f.shared_capacity = l2[0].shared_capacity;
    f.connections = l2[0].connections;
    f.s3_part_bytes = static_cast<size_t>(l2[0].part_mib) << 20;
    o.engine.file = f;
  }

  o.socket_path = c.socket.empty() ? DefaultSocketPath() : c.socket;
  o.socket_group = c.socket_group;
  o.token = c.token;
  if (o.token.empty() && !c.token_file.empty()) {
    std::ifstream in(c.token_file);
    if (!in) return Status::NotFound(fmt::format("cannot read --token-file \"{}\"", c.token_file));
    std::getline(in, o.token);
    while (!o.token.empty() && std::isspace(static_cast<unsigned char>(o.token.back()))) {
      o.token.pop_back();
    }
    if (o.token.empty()) return Status::InvalidArgument("--token-file is empty");
  }
  if (o.token.size() > 4096) return Status::InvalidArgument("--token is longer than 4096 bytes");
  if (!c.tenant_token_file.empty()) {
    if (!c.token.empty() || !c.token_file.empty()) {
      return Status::InvalidArgument(
          "--tenant-token-file excludes --token and --token-file: with it each client presents "
          "its own tenant's token, and there is no shared one");
    }
    if (!c.isolate_clients) {
      return Status::InvalidArgument(
          "--tenant-token-file needs --isolate-clients: with the shared pool every client can "
          "read and write every chunk, so there are no tenants to tell apart");
    }
    KVTIER_ASSIGN_OR_RETURN(o.tenant_tokens, ReadTenantTokenFile(c.tenant_token_file));
  }
  o.http_host = c.http_host;
  if (c.http_port < -1 || c.http_port > 65535) {
    return Status::InvalidArgument("--http-port must be in [0, 65535] (0: any free port; -1: off)");
  }
  o.http_port = c.http_port;
  if (c.max_clients < 1) return Status::InvalidArgument("--max-clients must be >= 1");
  o.max_clients = c.max_clients;
  o.max_clients_per_process = c.max_clients_per_process;
  o.reservation_timeout = std::chrono::milliseconds(c.reservation_timeout_ms);
  o.max_slots_per_client = c.max_client_slots;
  o.isolate_clients = c.isolate_clients;
  o.max_window_bytes = static_cast<uint64_t>(c.max_window_mb) << 20;
  if (c.max_pending_handshakes < 1) {
    return Status::InvalidArgument("--max-pending-handshakes must be >= 1");
  }
  o.max_pending_handshakes = c.max_pending_handshakes;
  if (c.hello_timeout_ms < 1 || c.hello_timeout_ms > 600000) {
    return Status::InvalidArgument("--hello-timeout-ms must be in [1, 600000]");
  }
  o.hello_timeout = std::chrono::milliseconds(c.hello_timeout_ms);
  if (c.kv_events.enabled) {
    o.kv_events = true;
    KVTIER_ASSIGN_OR_RETURN(o.kv_events_options, BuildKvEvents(c.kv_events, c.isolate_clients));
  } else if (!c.kv_events.endpoint.empty() || !c.kv_events.replay_endpoint.empty()) {
    return Status::InvalidArgument(
        "--kv-events-endpoint and --kv-events-replay-endpoint need --kv-events");
  }
  return o;
}

}  // namespace kvtier::server

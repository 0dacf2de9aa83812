// kvtier serve: one engine per node, shared by every inference process on it through a Unix
// socket and a shared-memory L1 pool (docs/protocol.md).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "common/task_pool.h"
#include "kvtier/client.h"
#include "kvtier/io.h"
#include "server/config.h"
#include "server/server.h"
#include "tools/command.h"

namespace kvtier::tools {
namespace {

using server::ServeConfig;

// Signals whose default action ends the process: each drains as SIGTERM does (besides the
// real-time signals). SIGXFSZ is not among them: it is ignored, so a write past the file size
// limit fails with EFBIG as an I/O error of the file tier.
constexpr int kDrainSignals[] = {SIGTERM, SIGINT, SIGHUP,  SIGQUIT, SIGALRM,  SIGVTALRM,
                                 SIGPROF, SIGIO,  SIGXCPU, SIGPWR,  SIGSTKFLT};
// Ignored: SIGPIPE (a client gone mid-reply is an error on the write), SIGUSR1 and SIGUSR2 (no
// meaning here; a stray one must not end the server), SIGXFSZ (above).
constexpr int kIgnoredSignals[] = {SIGPIPE, SIGUSR1, SIGUSR2, SIGXFSZ};

constexpr std::chrono::seconds kStartGrace{5};

std::string SignalName(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", sig);
}

struct ServeArgs {
  ServeConfig flags;            // values given on the command line
  std::vector<std::string> l2;  // raw --l2 JSON strings
  std::string config_path;
  std::string log_level = "info";
  // Copies a flag into the effective configuration when it was given on the command line.
  std::vector<std::pair<CLI::Option*, std::function<void(ServeConfig&)>>> overrides;
};

int Fail(const Status& s) {
  fmt::print(stderr, "kvtier serve: error: {}\n", s.ToString());
  return 1;
}

int RunServe(ServeArgs& args) {
  auto level = spdlog::level::from_str(args.log_level);
  if (level == spdlog::level::off && args.log_level != "off") {
    return Fail(Status::InvalidArgument(fmt::format(
        "--log-level \"{}\" (expected trace, debug, info, warn, error or off)", args.log_level)));
  }
  spdlog::set_level(level);

  ServeConfig config;
  if (!args.config_path.empty()) {
    Status s = server::ApplyConfigFile(args.config_path, &config);
    if (!s.ok()) return Fail(s);
  }
  for (auto& [opt, apply] : args.overrides) {
    if (opt->count() > 0) apply(config);
  }
  if (!args.l2.empty()) {
    config.l2.clear();
    for (const std::string& text : args.l2) {
      auto spec = server::ParseL2Spec(text);
      if (!spec.ok()) return Fail(spec.status());
      config.l2.push_back(*spec);
    }
  }
  // $KVTIER_TOKEN is the shared token's fallback: tenant tokens replace the shared token.
  if (config.token.empty() && config.token_file.empty() && config.tenant_token_file.empty()) {
    if (const char* t = std::getenv("KVTIER_TOKEN"); t && *t) config.token = t;
  }
  auto options = server::BuildServerOptions(config);
  if (!options.ok()) return Fail(options.status());

  // Signals are taken synchronously by one thread of ours: blocked before any thread starts, so
  // every thread inherits the mask and only the watcher's sigwait sees them. Every signal that
  // would end the process undrained (dirty write-back chunks lost, the socket file left) drains
  // as SIGTERM does, except the few that are ignored (docs/protocol.md, "Signals"); faults
  // (SIGSEGV, SIGBUS, SIGABRT, ...) keep their default action.
  sigset_t signals;
  sigemptyset(&signals);
  for (int sig : kDrainSignals) sigaddset(&signals, sig);
  for (int sig = SIGRTMIN; sig <= SIGRTMAX; ++sig) sigaddset(&signals, sig);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  for (int sig : kIgnoredSignals) ::signal(sig, SIG_IGN);
  // A signal while the server starts lets the start finish, then drains, as long as the start
  // completes within kStartGrace; a start that hangs past it (a file tier on a dead NFS server)
  // is ended there, with nothing dirty yet and no client served. The state outlives this
  // function: the watcher thread is detached.
  struct SignalState {
    std::mutex mu;
    std::condition_variable cv;
    int received = 0;
    bool started = false;
  };
  auto state = std::make_shared<SignalState>();
  std::thread watcher;
  try {
    watcher = std::thread([state, signals] {
      int sig = 0;
      sigwait(&signals, &sig);
      std::unique_lock lock(state->mu);
      state->received = sig;
      state->cv.notify_all();
      if (!state->cv.wait_for(lock, kStartGrace, [&] { return state->started; })) {
        spdlog::error(
            "received {} while starting, and the start has not completed within {} s: "
            "exiting",
            SignalName(sig), kStartGrace.count());
        spdlog::default_logger()->flush();
        std::_Exit(128 + sig);
      }
    });
  } catch (const std::system_error& e) {
    return Fail(Status::Unavailable(fmt::format(
        "kvtier serve cannot start a thread ({}); raise the task limit or retry", e.what())));
  }
  watcher.detach();

  // Descriptors: every client connection, its pool window and the file tier's open files take
  // one each; the common soft limit of 1024 is far below what the hard limit allows.
  if (rlimit lim{}; ::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = std::min<rlim_t>(lim.rlim_max, 1 << 20);
    (void)::setrlimit(RLIMIT_NOFILE, &lim);
  }

  const auto& eo = options->engine;
  spdlog::info("starting: L1 {:.2f} GiB of {:.2f} MiB chunks ({}), eviction {}, write policy {}",
               eo.memory.capacity_bytes / double(1ull << 30), eo.chunk_bytes / 1048576.0,
               config.chunk_bytes ? fmt::format("--chunk-bytes {}", config.chunk_bytes)
                                  : fmt::format("model {}, {} tokens, tp {}", config.model,
                                                config.chunk_size, config.tensor_parallel_size),
               EvictionPolicyName(eo.memory.eviction), WritePolicyName(eo.write_policy));
  if (eo.file) {
    spdlog::info("L2: file tier at {} ({}), {} read / {} write threads{}", eo.file->root,
                 eo.file->capacity_bytes
                     ? fmt::format("{:.1f} GiB", eo.file->capacity_bytes / double(1ull << 30))
                     : std::string("unlimited"),
                 eo.file->read_threads, eo.file->write_threads,
                 IsRemoteUrl(eo.file->root) && eo.file->connections > 0
                     ? fmt::format(", {} connections", eo.file->connections)
                     : std::string());
  } else {
    spdlog::info("L2: none");
  }
  if (options->isolate_clients) {
    // Chunk files are named by stored keys, which no tenant can compute for another, but whoever
    // may enter the file tier's directory can list and read them all, past the isolation. What
    // the server creates from now on is its user's alone; a directory already open is reported.
    ::umask(077);
    struct stat st;
    if (eo.file && !IsRemoteUrl(eo.file->root) && ::stat(eo.file->root.c_str(), &st) == 0 &&
        (st.st_mode & 011) != 0) {
      spdlog::warn(
          "--isolate-clients: the file tier's directory {} may be entered by {} (mode {:04o}), "
          "and whoever may read its files reads every tenant's chunks: chmod 700 it",
          eo.file->root, (st.st_mode & 001) ? "every user" : "its group", st.st_mode & 07777);
    }
  }
  auto srv = server::Server::Start(*options);
  if (!srv.ok()) return Fail(srv.status());
  {
    std::lock_guard lock(state->mu);
    state->started = true;  // from now on a signal drains
  }
  state->cv.notify_all();
  const Engine::Pool pool = (*srv)->engine().pool();
  spdlog::info("listening on {} ({}{}); pool {} slots, {:.2f} GiB shared", options->socket_path,
               options->socket_group.empty() ? "owner only" : "group " + options->socket_group,
               !options->tenant_tokens.empty()
                   ? fmt::format(", {} tenant tokens", options->tenant_tokens.size())
               : options->token.empty() ? ""
                                        : ", token required",
               pool.num_slots, pool.bytes / double(1ull << 30));
  if ((*srv)->http_port() >= 0) {
    spdlog::info("HTTP: http://{}:{}/metrics  /healthz  /stats", options->http_host,
                 (*srv)->http_port());
  }

  {
    std::unique_lock lock(state->mu);
    state->cv.wait(lock, [&] { return state->received != 0; });
  }
  spdlog::info("received {}, draining", SignalName(state->received));
  (*srv)->Stop();
  srv->reset();  // the engine goes: file-tier operations stuck in the kernel are abandoned
  if (size_t stuck = TaskPool::DetachedRunning(); stuck > 0) {
    // Their threads may return at any moment and reach objects that static destructors tear
    // down: leave without running those.
    spdlog::warn("exiting with {} storage operations stuck in the kernel", stuck);
    spdlog::default_logger()->flush();
    std::fflush(nullptr);
    std::quick_exit(0);
  }
  return 0;
}

void AddServe(CLI::App& parent, CommandContext& ctx) {
  auto args = std::make_shared<ServeArgs>();
  ServeConfig& f = args->flags;
  CLI::App* cmd = parent.add_subcommand(
      "serve",
      "Run the node's KV-cache server: one engine (L1 shared-memory pool + file tier) shared by "
      "every inference process through a Unix socket. SIGTERM, SIGINT, SIGHUP, SIGQUIT (and every "
      "other signal that would end it) drain and exit; SIGUSR1, SIGUSR2 and SIGPIPE are ignored.");
  cmd->footer(fmt::format(
      "Defaults work on a fresh machine: a {:.0f} GiB L1 pool of {}-token {} chunks and a 10 GiB "
      "file tier in {}.\nSettings can also come from --config FILE.json (keys as the flags, e.g. "
      "{{\"l1_size_gb\": 8, \"l2\": [{{\"type\": \"fs\", \"path\": \"/mnt/kv\"}}]}}); flags win.\n"
      "Model presets: {}.",
      f.l1_size_gb, f.chunk_size, f.model, server::DefaultCacheDir(),
      fmt::join(server::ModelPresetNames(), ", ")));
  auto add = [&](CLI::Option* opt, std::function<void(ServeConfig&)> apply) {
    args->overrides.emplace_back(opt, std::move(apply));
    return opt;
  };
  ServeArgs* a = args.get();
  add(cmd->add_option("--l1-size-gb", f.l1_size_gb,
                      "Size of the shared L1 pool in GiB (2^30 bytes; 0.5 = 512 MiB)")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.l1_size_gb = a->flags.l1_size_gb; });
  add(cmd->add_option("--eviction-policy", f.eviction_policy, "L1 eviction: lru or prefix-aware")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.eviction_policy = a->flags.eviction_policy; });
  add(cmd->add_option("--chunk-size", f.chunk_size, "Tokens per chunk")->capture_default_str(),
      [a](ServeConfig& c) { c.chunk_size = a->flags.chunk_size; });
  add(cmd->add_option("--model", f.model,
                      "Model whose per-rank KV layout sizes the pool slots: a preset name or a "
                      "Hugging Face config.json")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.model = a->flags.model; });
  add(cmd->add_option("--tensor-parallel-size", f.tensor_parallel_size,
                      "Tensor-parallel ranks sharing the model (a chunk holds one rank's KV)")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.tensor_parallel_size = a->flags.tensor_parallel_size; });
  add(cmd->add_option("--kv-dtype", f.kv_dtype, "Override the KV dtype (e.g. fp8, bfloat16)"),
      [a](ServeConfig& c) { c.kv_dtype = a->flags.kv_dtype; });
  add(cmd->add_option("--chunk-bytes", f.chunk_bytes,
                      "Bytes of one chunk, overriding --model and --chunk-size"),
      [a](ServeConfig& c) { c.chunk_bytes = a->flags.chunk_bytes; });
  cmd->add_option(
         "--l2", args->l2,
         "A lower tier as JSON, e.g. '{\"type\":\"fs\",\"path\":\"/mnt/kv\","
         "\"max_size_gb\":100,\"read_threads\":4,\"write_threads\":2}', or on NFS without "
         "a mount '{\"type\":\"nfs\",\"url\":\"nfs://filer/export/kv\",\"connections\":16}', "
         "or on S3 '{\"type\":\"s3\",\"url\":\"s3://bucket/kv\",\"max_size_gb\":1000}' "
         "(endpoint and credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
         "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION); max_size_gb is in GiB (2^30 "
         "bytes); \"sync_data\":false skips the fdatasync of each chunk file before it is "
         "published (faster writes; after a power loss some chunks fail their checksum and are "
         "misses, never wrong data; default true); \"rescan_interval_s\" is how often the "
         "tier lists its directory for chunks other hosts published or removed (default 5, 0: "
         "never); \"shared_capacity\":true for hosts sharing the directory and its "
         "max_size_gb: each write first counts what the others published lately "
         "(docs/multi-node.md) (default: a 10 GiB fs tier in the cache directory)")
      ->type_name("JSON");
  add(cmd->add_flag("--no-l2", f.no_l2, "Run with the L1 pool only"),
      [a](ServeConfig& c) { c.no_l2 = a->flags.no_l2; });
  add(cmd->add_option("--write-policy", f.write_policy,
                      "When L1 chunks reach L2: write_back (ahead of eviction and at "
                      "shutdown; a burst that outruns L2 evicts unwritten chunks), "
                      "write_through (every store; a store is refused rather than evict a chunk "
                      "L2 does not have yet) or none (L2 read-only)")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.write_policy = a->flags.write_policy; });
  add(cmd->add_option("--socket", f.socket,
                      fmt::format("Unix socket to listen on (default {})", DefaultSocketPath())),
      [a](ServeConfig& c) { c.socket = a->flags.socket; });
  add(cmd->add_option("--socket-group", f.socket_group,
                      "Let this group connect (socket mode 0660); default owner-only (0600)"),
      [a](ServeConfig& c) { c.socket_group = a->flags.socket_group; });
  add(cmd->add_option("--token", f.token,
                      "Shared secret clients must present (visible in ps: prefer --token-file "
                      "or $KVTIER_TOKEN)"),
      [a](ServeConfig& c) { c.token = a->flags.token; });
  add(cmd->add_option("--token-file", f.token_file, "File holding the shared secret"),
      [a](ServeConfig& c) { c.token_file = a->flags.token_file; });
  add(cmd->add_option(
             "--tenant-token-file", f.tenant_token_file,
             "With --isolate-clients: a file of \"TENANT_NAME TOKEN\" lines (# comments), "
             "owned by this user or root and closed to group and others (else the server "
             "refuses to start). A client must present one of its tokens and belongs to the "
             "tenant named with it, whatever its uid; any other token is refused. Replaces "
             "--token, --token-file and $KVTIER_TOKEN (giving one of the flags too is an "
             "error). Read once at start")
          ->type_name("FILE"),
      [a](ServeConfig& c) { c.tenant_token_file = a->flags.tenant_token_file; });
  add(cmd->add_option("--http-host", f.http_host, "Address of the HTTP listener")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.http_host = a->flags.http_host; });
  add(cmd->add_option("--http-port", f.http_port,
                      "Port for /metrics, /healthz and /stats (0: any free port, -1: off)")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.http_port = a->flags.http_port; });
  add(cmd->add_option("--worker-threads", f.worker_threads, "Engine copy threads")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.worker_threads = a->flags.worker_threads; });
  add(cmd->add_option("--max-clients", f.max_clients,
                      "Clients (connections past the handshake) served at once")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.max_clients = a->flags.max_clients; });
  add(cmd->add_option(
             "--max-clients-per-process", f.max_clients_per_process,
             "Of them, connections from one process (0: a quarter of --max-clients, at least 16)")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.max_clients_per_process = a->flags.max_clients_per_process; });
  add(cmd->add_option("--reservation-timeout-ms", f.reservation_timeout_ms,
                      "A store's reserved slots not committed within this are taken back (0: "
                      "never)")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.reservation_timeout_ms = a->flags.reservation_timeout_ms; });
  add(cmd->add_option("--load-deadline-ms", f.load_deadline_ms,
                      "A load still waiting on the file tier this long after it started "
                      "reports the chunks not read by then as missing, which the client "
                      "recomputes (0: no deadline). Keep it below the clients' RPC timeout "
                      "(the vLLM connector's kvtier.rpc_timeout_ms, 5000): a reply later than "
                      "that breaks the connection")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.load_deadline_ms = a->flags.load_deadline_ms; });
  add(cmd->add_option("--max-client-slots", f.max_client_slots,
                      "Pool slots one client process may hold reserved or pinned at once, over "
                      "all its connections (0: half the pool)")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.max_client_slots = a->flags.max_client_slots; });
  add(cmd->add_option("--max-pending-handshakes", f.max_pending_handshakes,
                      "Connections kept while they have not said hello (the oldest is closed "
                      "for a newcomer)")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.max_pending_handshakes = a->flags.max_pending_handshakes; });
  add(cmd->add_option("--hello-timeout-ms", f.hello_timeout_ms,
                      "A connection that has not said hello within this is closed")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.hello_timeout_ms = a->flags.hello_timeout_ms; });
  add(cmd->add_flag("--huge-pages", f.huge_pages,
                    "Ask for 2 MiB pages for the pool (transparent huge pages for shared "
                    "memory: /sys/kernel/mm/transparent_hugepage/shmem_enabled must be advise, "
                    "within_size or always; 4 KiB pages with a warning otherwise)"),
      [a](ServeConfig& c) { c.huge_pages = a->flags.huge_pages; });
  add(cmd->add_flag(
          "--isolate-clients", f.isolate_clients,
          "Separate tenants. No client maps the shared pool: each gets a private window of "
          "--max-client-slots slots and the server copies chunks in and out (one copy per chunk "
          "each way). Each connection belongs to a tenant the server determines, never the "
          "client: its uid (SO_PEERCRED), or with --tenant-token-file the tenant of its token. "
          "Keys are derived from the tenant too, so a tenant can neither read, find, nor "
          "overwrite another's chunks, in L1 or in the file tier, whatever namespace it "
          "declares; clients of one tenant share theirs. A client's stats list only its "
          "tenant's clients; HTTP /stats lists none. Files the server creates are its user's "
          "alone; an existing file-tier directory open to others is reported at start. Not "
          "separated: root, processes of one uid, the pool's and the file tier's capacity (a "
          "tenant's stores evict others' chunks), engine-wide counters (/metrics) and timing "
          "(docs/security.md). Without this flag every client can read and write every chunk: "
          "one trust domain"),
      [a](ServeConfig& c) { c.isolate_clients = a->flags.isolate_clients; });
  add(cmd->add_option("--max-window-mb", f.max_window_mb,
                      "With --isolate-clients: the memory of every client's window together; a "
                      "window gets what is left, a client that would get none is refused (0: "
                      "four times the L1 pool)")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.max_window_mb = a->flags.max_window_mb; });
  // KV-cache events (docs/kv-events.md).
  server::KvEventsConfig& ev = f.kv_events;
  add(cmd->add_flag("--kv-events", ev.enabled,
                    "Publish what the tiers hold as vLLM's KV-cache events (BlockStored/"
                    "BlockRemoved with medium CPU for L1, STORAGE for the file tier) for chunks "
                    "clients describe (the connector's kvtier.kv_events \"describe\"); "
                    "docs/kv-events.md. Without it `describe` is accepted and ignored"),
      [a](ServeConfig& c) { c.kv_events.enabled = a->flags.kv_events.enabled; });
  add(cmd->add_option("--kv-events-endpoint", ev.endpoint,
                      "ZMQ PUB endpoint, vLLM's rule: with * or ::, or ipc:// or inproc://, "
                      "bound; otherwise connected to (the subscriber binds). tcp://*:0 binds a "
                      "free port (logged). Refused with --isolate-clients. No authentication: "
                      "keep it on a private network or ipc:// (created owner-only)")
          ->type_name("ENDPOINT"),
      [a](ServeConfig& c) { c.kv_events.endpoint = a->flags.kv_events.endpoint; });
  add(cmd->add_option("--kv-events-replay-endpoint", ev.replay_endpoint,
                      "ZMQ ROUTER endpoint for replays (always bound): a DEALER sends [empty, "
                      "start_seq as 8 bytes big-endian] and gets the batches from start_seq, or a "
                      "snapshot of what is announced now if start_seq is older than the buffer, "
                      "then an end marker")
          ->type_name("ENDPOINT"),
      [a](ServeConfig& c) { c.kv_events.replay_endpoint = a->flags.kv_events.replay_endpoint; });
  add(cmd->add_option("--kv-events-bind-host", ev.bind_host,
                      "Address that replaces * in the endpoints (bind one interface)")
          ->type_name("ADDRESS"),
      [a](ServeConfig& c) { c.kv_events.bind_host = a->flags.kv_events.bind_host; });
  add(cmd->add_option("--kv-events-topic", ev.topic,
                      "Topic template: {host} (the host name or --kv-events-pod), {model} (the "
                      "client's model id), {ns} (its namespace group)")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.kv_events.topic = a->flags.kv_events.topic; });
  add(cmd->add_option("--kv-events-pod", ev.pod, "{host} in the topic (default: the host name)"),
      [a](ServeConfig& c) { c.kv_events.pod = a->flags.kv_events.pod; });
  add(cmd->add_option("--kv-events-media", ev.media,
                      "Medium names of L1 and the file tier, comma-separated")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.kv_events.media = a->flags.kv_events.media; });
  add(cmd->add_option("--kv-events-token-ids", ev.token_ids,
                      "Token ids in BlockStored (false: location-only events, block_size 0)")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.kv_events.token_ids = a->flags.kv_events.token_ids; });
  add(cmd->add_flag("--kv-events-clear-on-start", ev.clear_on_start,
                    "Send AllBlocksCleared first on each topic (only for a topic kvtier alone "
                    "uses)"),
      [a](ServeConfig& c) { c.kv_events.clear_on_start = a->flags.kv_events.clear_on_start; });
  add(cmd->add_option("--kv-events-batch-ms", ev.batch_ms,
                      "A batch closes after this (1 to 10000 ms), or at 256 events or 1 MiB")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.kv_events.batch_ms = a->flags.kv_events.batch_ms; });
  add(cmd->add_option("--kv-events-buffer-steps", ev.buffer_steps, "Batches kept for replay")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.kv_events.buffer_steps = a->flags.kv_events.buffer_steps; });
  add(cmd->add_option("--kv-events-buffer-mb", ev.buffer_mb, "...and at most this many MiB of them")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.kv_events.buffer_mb = a->flags.kv_events.buffer_mb; });
  add(cmd->add_option("--kv-events-hwm", ev.hwm,
                      "ZMQ send high-water mark (messages; a slower subscriber loses batches and "
                      "sees the gap in seq)")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.kv_events.hwm = a->flags.kv_events.hwm; });
  add(cmd->add_option("--kv-events-max-queue-size", ev.max_queue_size,
                      "Tier changes queued for the publisher; a full queue drops (counted), "
                      "never blocks a store or load")
          ->capture_default_str(),
      [a](ServeConfig& c) { c.kv_events.max_queue_size = a->flags.kv_events.max_queue_size; });
  add(cmd->add_option("--kv-events-replay-max-chunks", ev.replay_max_chunks,
                      "Chunks in one snapshot (shallow chunks first)")
          ->capture_default_str(),
      [a](ServeConfig& c) {
        c.kv_events.replay_max_chunks = a->flags.kv_events.replay_max_chunks;
      });
  add(cmd->add_option("--kv-events-describe-reads-per-s", ev.describe_reads_per_s,
                      "Chunk file headers read a second for the descriptors of files this "
                      "server did not store (another host's, or found at start); 0: none")
          ->capture_default_str(),
      [a](ServeConfig& c) {
        c.kv_events.describe_reads_per_s = a->flags.kv_events.describe_reads_per_s;
      });
  cmd->add_option("--config", args->config_path, "JSON file of settings (flags override it)")
      ->type_name("FILE");
  cmd->add_option("--log-level", args->log_level, "trace, debug, info, warn, error or off")
      ->capture_default_str();
  cmd->callback([args, &ctx] { ctx.exit_code = RunServe(*args); });
}

const bool kRegistered = RegisterCommand("", &AddServe);

}  // namespace
}  // namespace kvtier::tools

// kvtier bench engine: stores and loads chunks through the engine's memory tier and compares
// with a plain memcpy of the same buffers on as many threads as the engine's copy workers,
// measured in the same run, pass by pass. Also times 1,000-key lookups: on the memory tier, and
// with a file tier holding most of the chunks, counting the I/O calls such a lookup makes (none:
// the file tier answers from its index).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <thread>

#include "io/fault_injection_env.h"
#include "kvtier/engine.h"
#include "kvtier/file_tier.h"
#include "kvtier/io.h"
#include "testing/temp_dir.h"
#include "tools/command.h"

namespace kvtier::tools {
namespace {

using Clock = std::chrono::steady_clock;

struct BenchEngineArgs {
  uint64_t chunk_mib = 32;
  uint32_t chunks = 32;
  int threads = 2;
  int repeats = 3;
  bool json = false;
};

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct AlignedBuffers {
  explicit AlignedBuffers(size_t n, size_t bytes) : bytes(bytes) {
    for (size_t i = 0; i < n; ++i) {
      void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
      if (!p) break;
      ptrs.push_back(static_cast<uint8_t*>(p));
    }
  }
  ~AlignedBuffers() {
    for (auto* p : ptrs) std::free(p);
  }
  bool ok(size_t n) const { return ptrs.size() == n; }
  std::vector<std::span<const uint8_t>> In() const {
    std::vector<std::span<const uint8_t>> v;
    for (auto* p : ptrs) v.emplace_back(p, bytes);
    return v;
  }
  std::vector<std::span<uint8_t>> Out() const {
    std::vector<std::span<uint8_t>> v;
    for (auto* p : ptrs) v.emplace_back(p, bytes);
    return v;
  }
  size_t bytes;
  std::vector<uint8_t*> ptrs;
};

std::vector<ChunkKey> MakeKeys(const KeyNamespace& ns, uint32_t n, uint32_t seed) {
  std::vector<uint32_t> tokens(static_cast<size_t>(n) * ns.chunk_tokens);
  std::iota(tokens.begin(), tokens.end(), seed * 1000003u);
  return *ComputeChunkKeys(ns, tokens);
}

struct LookupTimes {
  double lookup_us = 0;             // Lookup of 1,000 resident keys, keys already derived
  double derive_and_lookup_us = 0;  // the chained SHA-256 key derivation from tokens, then Lookup
};

// Median times of a 1,000-key Lookup on an engine holding those 1,000 chunks (16-token chunks),
// without and with the key derivation every caller pays first (ComputeChunkKeys over 16,000
// tokens). Lookup cost does not depend on chunk size, so small chunks keep this cheap.
Result<LookupTimes> MeasureLookup1000() {
  constexpr uint32_t kKeys = 1000;
  EngineOptions o;
  o.ns.model_id = "kvtier-bench-lookup";
  o.ns.chunk_tokens = 16;
  o.chunk_bytes = 4096;
  o.memory.capacity_bytes = kKeys * 4096ull;
  o.max_queued_chunks = kKeys;
  KVTIER_ASSIGN_OR_RETURN(auto engine, Engine::Open(o));
  std::vector<uint32_t> tokens(static_cast<size_t>(kKeys) * o.ns.chunk_tokens);
  std::iota(tokens.begin(), tokens.end(), 7 * 1000003u);
  KVTIER_ASSIGN_OR_RETURN(std::vector<ChunkKey> keys, ComputeChunkKeys(o.ns, tokens));
  std::vector<uint8_t> chunk(4096, 1);
  std::vector<std::span<const uint8_t>> src(kKeys, chunk);
  KVTIER_ASSIGN_OR_RETURN(OpHandle h, engine->Store(keys, src));
  KVTIER_RETURN_IF_ERROR(h.Wait().status);
  std::vector<double> bare, derived;
  for (int i = 0; i < 2000; ++i) {
    auto t0 = Clock::now();
    LookupResult r = engine->Lookup(keys);
    auto t1 = Clock::now();
    if (r.total != kKeys) return Status::Internal("lookup benchmark lost chunks");
    bare.push_back(Seconds(t0, t1) * 1e6);
  }
  for (int i = 0; i < 500; ++i) {
    auto t0 = Clock::now();
    auto k = ComputeChunkKeys(o.ns, tokens);
    if (!k.ok()) return k.status();
    LookupResult r = engine->Lookup(*k);
    auto t1 = Clock::now();
    if (r.total != kKeys) return Status::Internal("lookup benchmark lost chunks");
    derived.push_back(Seconds(t0, t1) * 1e6);
  }
  return LookupTimes{Median(bare), Median(derived)};
}

// Read and write system calls of this process so far (all threads): syscr + syscw of
// /proc/self/io. -1 where unavailable.
int64_t ReadWriteSyscalls() {
  std::ifstream in("/proc/self/io");
  std::string name;
  int64_t value = 0, total = 0;
  int seen = 0;
  while (in >> name >> value) {
    if (name == "syscr:" || name == "syscw:") {
      total += value;
      ++seen;
    }
  }
  return seen == 2 ? total : -1;
}

struct FileLookupFigures {
  double lookup_us = 0;     // median of a 1,000-key Lookup, most chunks only in L2
  uint32_t in_memory = 0;   // of the 1,000, also in L1 (the leading ones)
  uint64_t lookups = 0;     // timed lookups
  uint64_t env_calls = 0;   // Env and File calls the file tier made during them, in all
  int64_t rw_syscalls = 0;  // read/write syscalls of the process during them (-1: unknown)
};

// A 1,000-key Lookup with a file tier configured: 1,000 chunks in L2 (written beforehand, in a
// temporary directory, as another process would have), the first 64 also in L1, which holds no
// more; the other 936 exist only on disk. The file tier's Env is a FaultInjectionEnv without
// faults, which counts every call made through it; background rescans are off, so that every
// call it counts would be a lookup's. /proc/self/io counts read and write system calls (only
// those) of the whole process, less what reading it costs.
Result<FileLookupFigures> MeasureFileLookup1000() {
  constexpr uint32_t kKeys = 1000, kInMemory = 64;
  constexpr uint64_t kChunk = 4096;
  testing::TempDir dir("kvtier-bench-lookup");
  if (dir.path().empty()) return Status::IOError("cannot create a temporary directory");
  KeyNamespace ns;
  ns.model_id = "kvtier-bench-lookup-l2";
  ns.chunk_tokens = 16;
  std::vector<uint32_t> tokens(static_cast<size_t>(kKeys) * ns.chunk_tokens);
  std::iota(tokens.begin(), tokens.end(), 11 * 1000003u);
  KVTIER_ASSIGN_OR_RETURN(std::vector<ChunkKey> keys, ComputeChunkKeys(ns, tokens));
  std::vector<uint8_t> chunk(kChunk, 7);
  {
    FileTierOptions w;
    w.root = dir.path();
    w.ns = ns;
    w.chunk_bytes = kChunk;
    w.sync_data = false;  // setup only: the lookup is what is timed
    w.use_o_direct = false;
    w.io_engine = IoEngineKind::kThreadPool;
    KVTIER_ASSIGN_OR_RETURN(auto writer, FileTier::Open(w));
    for (const ChunkKey& k : keys) KVTIER_RETURN_IF_ERROR(writer->Write(k, chunk));
  }
  FaultInjectionEnv counting(Env::Default(), {});  // no faults: a counter of calls
  EngineOptions o;
  o.ns = ns;
  o.chunk_bytes = kChunk;
  o.memory.capacity_bytes = kInMemory * kChunk;
  o.write_policy = WritePolicy::kWriteThrough;
  FileTierOptions f;
  f.root = dir.path();
  f.env = &counting;
  f.rescan_interval = std::chrono::milliseconds(0);
  f.max_queued_writes = 2 * kInMemory;  // the write-through of the L1 chunks (already there)
  o.file = f;
  FileLookupFigures fig;
  {
    KVTIER_ASSIGN_OR_RETURN(auto engine, Engine::Open(o));  // indexes the 1,000 at open
    std::vector<std::span<const uint8_t>> src(kInMemory, chunk);
    KVTIER_ASSIGN_OR_RETURN(OpHandle h,
                            engine->Store(std::span<const ChunkKey>(keys).first(kInMemory), src));
    KVTIER_RETURN_IF_ERROR(h.Wait().status);
    engine->Drain();
    LookupResult first = engine->Lookup(keys);
    if (first.total != kKeys || first.memory != kInMemory) {
      return Status::Internal(
          fmt::format("file lookup benchmark: {} found, {} in L1", first.total, first.memory));
    }
    fig.in_memory = static_cast<uint32_t>(first.memory);
    const int64_t r0 = ReadWriteSyscalls(), r1 = ReadWriteSyscalls();  // what reading costs
    const uint64_t calls_before = counting.calls();
    const int64_t before = ReadWriteSyscalls();
    std::vector<double> us;
    for (int i = 0; i < 2000; ++i) {
      auto t0 = Clock::now();
      LookupResult r = engine->Lookup(keys);
      auto t1 = Clock::now();
      if (r.total != kKeys) return Status::Internal("file lookup benchmark lost chunks");
      us.push_back(Seconds(t0, t1) * 1e6);
    }
    const int64_t after = ReadWriteSyscalls();
    fig.env_calls = counting.calls() - calls_before;
    fig.rw_syscalls = (r0 < 0 || after < 0) ? -1 : (after - before) - (r1 - r0);
    fig.lookups = us.size();
    fig.lookup_us = Median(us);
  }
  return fig;
}

// memcpy of chunk i on thread i % threads, as the engine's workers share a batch: the limit the
// engine is compared with must use the same number of cores.
void ParallelMemcpy(const AlignedBuffers& dst, const AlignedBuffers& src, int threads) {
  auto copy = [&](int t) {
    for (size_t i = static_cast<size_t>(t); i < src.ptrs.size(); i += threads) {
      std::memcpy(dst.ptrs[i], src.ptrs[i], src.bytes);
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(copy, t);
  copy(0);
  for (auto& th : pool) th.join();
}

int RunBenchEngine(const BenchEngineArgs& a) {
  const uint64_t chunk_bytes = a.chunk_mib << 20;
  auto progress = [&](const std::string& s) {
    if (!a.json) fmt::print(stderr, "{}\n", s);
  };
  AlignedBuffers src(a.chunks, chunk_bytes), dst(a.chunks, chunk_bytes);
  if (!src.ok(a.chunks) || !dst.ok(a.chunks)) {
    fmt::print(stderr, "error: cannot allocate 2 x {} MiB of buffers\n", a.chunks * a.chunk_mib);
    return 1;
  }
  progress(fmt::format("preparing {} chunks of {} MiB ({} MiB in all, {} copy threads)...",
                       a.chunks, a.chunk_mib, a.chunks * a.chunk_mib, a.threads));
  std::mt19937_64 rng(42);
  for (auto* p : src.ptrs) {
    for (size_t i = 0; i < chunk_bytes; i += 8) {
      uint64_t v = rng();
      std::memcpy(p + i, &v, std::min<size_t>(8, chunk_bytes - i));
    }
  }
  for (auto* p : dst.ptrs) std::memset(p, 0, chunk_bytes);  // fault the pages in
  const double total_gb = static_cast<double>(chunk_bytes) * a.chunks / 1e9;

  EngineOptions o;
  o.ns.model_id = "kvtier-bench-engine";
  o.ns.chunk_tokens = 256;
  o.chunk_bytes = chunk_bytes;
  o.memory.capacity_bytes = ((chunk_bytes + 4095) / 4096 * 4096) * a.chunks;
  o.worker_threads = a.threads;
  o.max_queued_chunks = std::max<size_t>(1024, a.chunks);
  progress(fmt::format("opening the engine (pre-faulting {} MiB of memory tier)...",
                       o.memory.capacity_bytes >> 20));
  auto engine = Engine::Open(o);
  if (!engine.ok()) {
    fmt::print(stderr, "error: {}\n", engine.status().ToString());
    return 1;
  }
  // Each pass times memcpy (the limit, on as many threads as the engine's workers), then a store
  // of fresh keys, then a load of those keys: the three phases interleave, so drift of a shared
  // machine over the run hits all three alike instead of reading as a ratio above 1.
  std::vector<double> memcpy_gbps, store_gbps, load_gbps;
  for (int r = 0; r < a.repeats; ++r) {
    auto t0 = Clock::now();
    ParallelMemcpy(dst, src, a.threads);
    memcpy_gbps.push_back(total_gb / Seconds(t0, Clock::now()));

    std::vector<ChunkKey> keys = MakeKeys(o.ns, a.chunks, r + 1);  // fresh: every store copies
    t0 = Clock::now();
    auto h = (*engine)->Store(keys, src.In());
    if (!h.ok()) {
      fmt::print(stderr, "error: store: {}\n", h.status().ToString());
      return 1;
    }
    OpResult sr = h->Wait();
    auto t1 = Clock::now();
    if (!sr.status.ok()) {
      fmt::print(stderr, "error: store: {}\n", sr.status.ToString());
      return 1;
    }
    store_gbps.push_back(total_gb / Seconds(t0, t1));

    for (auto* p : dst.ptrs) p[0] ^= 0xff;  // so a load that copies nothing is caught below
    t0 = Clock::now();
    auto lh = (*engine)->Load(keys, dst.Out());
    if (!lh.ok()) {
      fmt::print(stderr, "error: load: {}\n", lh.status().ToString());
      return 1;
    }
    OpResult lr = lh->Wait();
    t1 = Clock::now();
    if (!lr.status.ok() || lr.chunks != a.chunks) {
      fmt::print(stderr, "error: load returned {} of {} chunks: {}\n", lr.chunks, a.chunks,
                 lr.status.ToString());
      return 1;
    }
    load_gbps.push_back(total_gb / Seconds(t0, t1));
    for (uint32_t i = 0; i < a.chunks; ++i) {
      if (std::memcmp(src.ptrs[i], dst.ptrs[i], chunk_bytes) != 0) {
        fmt::print(stderr, "error: chunk {} came back different from what was stored\n", i);
        return 1;
      }
    }
  }
  progress("timing 1,000-key lookups...");
  auto lookup = MeasureLookup1000();
  if (!lookup.ok()) {
    fmt::print(stderr, "error: lookup benchmark: {}\n", lookup.status().ToString());
    return 1;
  }
  progress(
      "timing 1,000-key lookups with a file tier (writing 1,000 chunks to a temporary "
      "directory)...");
  auto file_lookup = MeasureFileLookup1000();
  if (!file_lookup.ok()) {
    fmt::print(stderr, "error: file lookup benchmark: {}\n", file_lookup.status().ToString());
    return 1;
  }
  const FileLookupFigures& fl = *file_lookup;

  double mem = Median(memcpy_gbps), st = Median(store_gbps), ld = Median(load_gbps);
  if (a.json) {
    nlohmann::json j = {
        {"chunk_bytes", chunk_bytes},
        {"chunks", a.chunks},
        {"threads", a.threads},
        {"memcpy_threads", a.threads},
        {"repeats", a.repeats},
        {"interleaved", true},
        {"memcpy_GBps", mem},
        {"store_GBps", st},
        {"load_GBps", ld},
        {"store_vs_memcpy", st / mem},
        {"load_vs_memcpy", ld / mem},
        {"memcpy_GBps_passes", memcpy_gbps},
        {"store_GBps_passes", store_gbps},
        {"load_GBps_passes", load_gbps},
        {"lookup_1000_us", lookup->lookup_us},
        {"lookup_1000_with_key_derivation_us", lookup->derive_and_lookup_us},
        {"lookup_1000_l2_us", fl.lookup_us},
        {"lookup_1000_l2_in_l1", fl.in_memory},
        {"lookup_1000_l2_timed_lookups", fl.lookups},
        {"lookup_1000_l2_env_calls", fl.env_calls},
        {"lookup_1000_l2_rw_syscalls", fl.rw_syscalls},
        {"huge_pages", (*engine)->Stats().memory_detail.huge_pages},
    };
    fmt::print("{}\n", j.dump());
  } else {
    fmt::print("{:<44} {:>8.2f} GB/s\n",
               fmt::format("memcpy, {} thread{} (limit)", a.threads, a.threads == 1 ? "" : "s"),
               mem);
    fmt::print("{:<44} {:>8.2f} GB/s  {:.2f} x memcpy\n",
               fmt::format("store, {} worker thread{}", a.threads, a.threads == 1 ? "" : "s"), st,
               st / mem);
    fmt::print("{:<44} {:>8.2f} GB/s  {:.2f} x memcpy\n",
               fmt::format("load, {} worker thread{}", a.threads, a.threads == 1 ? "" : "s"), ld,
               ld / mem);
    fmt::print("{:<44} {:>8.1f} us\n", "lookup of 1,000 keys (keys given)", lookup->lookup_us);
    fmt::print("{:<44} {:>8.1f} us\n", "lookup of 1,000 keys, SHA-256 derivation first",
               lookup->derive_and_lookup_us);
    fmt::print("{:<44} {:>8.1f} us  {} Env calls, {} read/write syscalls in {} lookups\n",
               fmt::format("lookup of 1,000 keys, {} only in L2 (file)", 1000 - fl.in_memory),
               fl.lookup_us, fl.env_calls,
               fl.rw_syscalls < 0 ? std::string("?") : std::to_string(fl.rw_syscalls), fl.lookups);
  }
  return 0;
}

void AddBenchEngine(CLI::App& parent, CommandContext& ctx) {
  auto args = std::make_shared<BenchEngineArgs>();
  CLI::App* cmd = parent.add_subcommand(
      "engine",
      "Store and load chunks through the engine's memory tier; compare with a memcpy of the same "
      "buffers on --threads threads, interleaved with them in every pass");
  cmd->add_option("--chunk-mib", args->chunk_mib, "Chunk size in MiB")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  cmd->add_option("--chunks", args->chunks,
                  "Number of chunks per pass (memory used: 3 x chunks x chunk size)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--threads", args->threads,
                  "Engine copy threads, and the threads of the memcpy it is compared with")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  cmd->add_option("--repeats", args->repeats, "Passes per figure; the median is reported")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "Print one JSON object instead of a table");
  cmd->callback([args, &ctx] { ctx.exit_code = RunBenchEngine(*args); });
}

const bool kRegistered = RegisterCommand("bench", &AddBenchEngine);

}  // namespace
}  // namespace kvtier::tools

// A FileTier in a process of its own, for the crash and sharing tests.
//
//   file_tier_worker serve  DIR CHUNK_BYTES CAPACITY   commands on stdin, one answer per line
//   file_tier_worker writer DIR CHUNK_BYTES CAPACITY KEYS SEED   writes and reads until killed
//
// serve commands: "write FIRST COUNT" -> "ok WRITTEN FAILED"; "read FIRST COUNT" ->
// "ok HITS MISSES WRONG ERRORS"; "lookup FIRST COUNT" -> "prefix N"; "rescan" -> "ok" (or
// "error MESSAGE"): index what other processes wrote; "quit".
// Chunk contents come from tier/file/test_chunks.h, so any process can verify them.
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kvtier/file_tier.h"
#include "tier/file/test_chunks.h"

using namespace kvtier;  // NOLINT

int Serve(FileTier& tier, uint64_t chunk) {
  AlignedBuffer buf(chunk);
  std::string line;
  std::cout << "ready" << std::endl;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    uint64_t first = 0, count = 0;
    in >> cmd >> first >> count;
    if (cmd == "quit") break;
    if (cmd == "write") {
      uint64_t ok = 0, failed = 0;
      for (uint64_t i = first; i < first + count; ++i) {
        ChunkKey key = testing::TestKey(i);
        testing::FillChunk(key, buf.first(chunk));
        (tier.Write(key, buf.first(chunk)).ok() ? ok : failed)++;
      }
      std::cout << "ok " << ok << " " << failed << std::endl;
    } else if (cmd == "read") {
      uint64_t hits = 0, misses = 0, wrong = 0, errors = 0;
      for (uint64_t i = first; i < first + count; ++i) {
        ChunkKey key = testing::TestKey(i);
        Status s = tier.Read(key, buf.first(chunk));
        if (s.ok()) {
          ++hits;
          wrong += !testing::VerifyChunk(key, buf.first(chunk));
        } else if (s.IsNotFound()) {
          ++misses;
        } else {
          ++errors;
        }
      }
      std::cout << "ok " << hits << " " << misses << " " << wrong << " " << errors << std::endl;
    } else if (cmd == "lookup") {
      std::vector<ChunkKey> keys;
      for (uint64_t i = first; i < first + count; ++i) keys.push_back(testing::TestKey(i));
      std::cout << "prefix " << tier.LookupPrefix(keys) << std::endl;
    } else if (cmd == "rescan") {
      Status s = tier.Rescan();
      std::cout << (s.ok() ? "ok" : "error " + s.ToString()) << std::endl;
    } else {
      std::cout << "error unknown command" << std::endl;
    }
  }
  return 0;
}

// Two writer threads and a reader thread, forever. A wrong chunk read back exits with status 3,
// which the test sees if it ever happens before the kill.
int Writer(FileTier& tier, uint64_t chunk, uint64_t keys, uint64_t seed) {
  std::cout << "ready" << std::endl;
  auto loop = [&](uint64_t thread_seed, bool writer) {
    std::mt19937_64 rng(thread_seed);
    AlignedBuffer buf(chunk);
    for (;;) {
      ChunkKey key = testing::TestKey(rng() % keys);
      if (writer) {
        testing::FillChunk(key, buf.first(chunk));
        Status s = tier.Write(key, buf.first(chunk));
        if (!s.ok() && s.code() != StatusCode::kNoSpace) {
          std::fprintf(stderr, "write failed: %s\n", s.ToString().c_str());
          _exit(2);
        }
      } else {
        Status s = tier.Read(key, buf.first(chunk));
        if (s.ok() && !testing::VerifyChunk(key, buf.first(chunk))) {
          std::fprintf(stderr, "WRONG DATA for key %s\n", key.ToHex().c_str());
          _exit(3);
        }
      }
    }
  };
  std::thread a(loop, seed * 3 + 1, true), b(loop, seed * 3 + 2, true);
  loop(seed * 3 + 3, false);
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s serve|writer DIR CHUNK_BYTES CAPACITY [KEYS SEED]\n", argv[0]);
    return 64;
  }
  std::string mode = argv[1];
  FileTierOptions o;
  o.root = argv[2];
  o.ns = testing::TestNamespace();
  o.chunk_bytes = std::stoull(argv[3]);
  o.capacity_bytes = std::stoull(argv[4]);
  o.negative_cache_ttl = std::chrono::milliseconds(0);
  auto tier = FileTier::Open(o);
  if (!tier.ok()) {
    std::fprintf(stderr, "open: %s\n", tier.status().ToString().c_str());
    return 1;
  }
  if (mode == "serve") return Serve(**tier, o.chunk_bytes);
  if (mode == "writer" && argc >= 7) {
    return Writer(**tier, o.chunk_bytes, std::stoull(argv[5]), std::stoull(argv[6]));
  }
  std::fprintf(stderr, "bad arguments\n");
  return 64;
}

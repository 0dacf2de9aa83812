// kvtier stress: a randomized crash test of `kvtier serve` with a file tier, in the spirit of
// RocksDB's db_stress and db_crashtest.py (docs/stress.md).
//
// The driver runs, for a bounded time and from one seed: a server on a temporary directory
// (alternately the real `kvtier serve` and the same server with a fault-injecting file tier),
// verifying clients (each chunk's bytes derive from its key, so any wrong byte served is
// caught), an adversarial client (malformed frames, protocol misuse, disconnects mid-operation),
// and random SIGKILLs of clients and of the server, with restarts on the same directory. It
// fails on any wrong byte, any pin left after every client is gone, any server death it did not
// cause, an unclean or slow SIGTERM, or a corrupt file left on disk.
//
// One binary, several roles: the driver starts itself again as `kvtier stress --role client`,
// `--role adversary` and `--role server` (the fault-injecting server).
#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/task_pool.h"
#include "io/fault_injection_env.h"
#include "kvtier/cache_dir.h"
#include "kvtier/client.h"
#include "kvtier/io.h"
#include "server/codec.h"
#include "server/config.h"
#include "server/server.h"
#include "tools/command.h"

namespace kvtier::tools {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// Exit codes of the child roles.
constexpr int kExitOk = 0;
constexpr int kExitWrongByte = 3;  // a verifying client saw a wrong byte
constexpr int kExitBroken = 4;     // a role could not work at all (bad setup)
constexpr int kExitLeak = 5;       // another tenant found a verifying client's chunk

struct StressArgs {
  std::string role = "driver";
  double seconds = 60;
  uint64_t seed = 0;  // 0: from the clock (printed, so a failure can be replayed)
  int clients = 3;
  std::string dir;  // empty: a fresh temporary directory, removed on success
  uint64_t chunk_bytes = 64 * 1024;
  double l1_mb = 4;          // small: evictions, write-backs and promotions all the time
  double l2_mb = 24;         // small: L2 evicts too
  double fault_rate = 0.02;  // per file-tier operation, in the fault-injecting server
  bool kill_server = true, kill_clients = true, adversary = true;
  // Servers isolate clients (private windows); the adversary then also scribbles over all the
  // memory it maps, which must never reach another tenant.
  bool isolate_clients = false;
  // Role arguments.
  std::string socket;
  std::string write_policy = "write_back";
  double until_unix = 0;  // clients and the adversary stop at this wall-clock time
  int client_id = 0;
  int http_port = -1;  // the fault-injecting server's HTTP port
  // With isolate_clients the servers take tenant tokens (<dir>/tenants): the verifying clients
  // are one tenant, the adversary another. This role's token.
  std::string token;
};

// The tenant token file of an isolated run, and the two tenants' tokens (from the seed).
std::string TenantFile(const StressArgs& a) { return a.dir + "/tenants"; }
std::string VerifierToken(const StressArgs& a) { return fmt::format("verifiers-{:x}", a.seed); }
std::string IntruderToken(const StressArgs& a) {
  return fmt::format("intruder-{:x}", a.seed * 31 + 7);
}

// The current server's HTTP port, for the adversary: <dir>/http-port, rewritten at every start.
std::string HttpPortFile(const StressArgs& a) { return a.dir + "/http-port"; }

std::string Self() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

double NowUnix() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// --- what the verifying clients store: keys and bytes any process can recompute ---

KeyNamespace StressNamespace() {
  KeyNamespace ns;
  ns.model_id = "kvtier-stress";
  ns.chunk_tokens = 16;
  return ns;
}

// Conversation c: up to kMaxChunks chunks. Conversations share prefixes (c / 4 picks the first
// chunk's tokens), so clients meet on common chunks as real tenants of one model do.
constexpr int kConversations = 48;
constexpr int kMaxChunks = 12;

std::vector<ChunkKey> ConversationKeys(int c) {
  std::vector<uint32_t> tokens(kMaxChunks * 16);
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<uint32_t>(i < 16 ? (c / 4) * 1000 + i : c * 100000 + i);
  }
  return *ComputeChunkKeys(StressNamespace(), tokens);
}

uint64_t SplitMix(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void FillChunk(const ChunkKey& key, std::span<uint8_t> out) {
  uint64_t state;
  std::memcpy(&state, key.data(), 8);
  size_t i = 0;
  for (; i + 8 <= out.size(); i += 8) {
    uint64_t v = SplitMix(state);
    std::memcpy(out.data() + i, &v, 8);
  }
  for (uint64_t v = SplitMix(state); i < out.size(); ++i, v >>= 8) out[i] = static_cast<uint8_t>(v);
}

// The offset of the first wrong byte, or -1.
int64_t FirstWrongByte(const ChunkKey& key, std::span<const uint8_t> data,
                       std::vector<uint8_t>* scratch) {
  scratch->resize(data.size());
  FillChunk(key, *scratch);
  if (std::memcmp(scratch->data(), data.data(), data.size()) == 0) return -1;
  for (size_t i = 0; i < data.size(); ++i) {
    if ((*scratch)[i] != data[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

// --- role: verifying client ---

int RunClient(const StressArgs& a) {
  std::mt19937_64 rng(a.seed * 1000003 + a.client_id);
  std::vector<uint8_t> scratch;
  std::vector<std::vector<uint8_t>> bufs(kMaxChunks, std::vector<uint8_t>(a.chunk_bytes));
  std::vector<std::vector<ChunkKey>> conversations;
  for (int c = 0; c < kConversations; ++c) conversations.push_back(ConversationKeys(c));
  uint64_t verified = 0, ops = 0, reconnects = 0;
  std::unique_ptr<Client> client;
  auto wrong = [&](const char* how, int c, size_t j, int64_t at) {
    fmt::print(stderr,
               "stress client {}: WRONG BYTE served by {}: conversation {} chunk {} offset {} "
               "(key {})\n",
               a.client_id, how, c, j, at, conversations[c][j].ToHex());
    return kExitWrongByte;
  };
  while (NowUnix() < a.until_unix) {
    if (!client || !client->connected()) {
      client.reset();
      ClientOptions o;
      o.socket_path = a.socket;
      o.ns = StressNamespace();
      o.chunk_bytes = a.chunk_bytes;
      o.client_name = fmt::format("stress-client-{}", a.client_id);
      o.token = a.token;
      o.connect_timeout = 1000ms;
      o.rpc_timeout = 5000ms;
      auto c = Client::Connect(o);
      if (!c.ok()) {
        std::this_thread::sleep_for(50ms);
        continue;
      }
      client = std::move(c).value();
      ++reconnects;
    }
    ++ops;
    const int c = static_cast<int>(rng() % kConversations);
    const size_t n = 1 + rng() % kMaxChunks;
    std::span<const ChunkKey> keys(conversations[c].data(), n);
    const int what = static_cast<int>(rng() % 10);
    if (what < 3) {  // Store through the client's copy path
      std::vector<std::span<const uint8_t>> src;
      for (size_t j = 0; j < n; ++j) {
        FillChunk(keys[j], bufs[j]);
        src.emplace_back(bufs[j]);
      }
      auto op = client->Store(keys, src);
      if (op.ok()) (void)op->Wait();
    } else if (what < 5) {  // Load and verify
      std::vector<std::span<uint8_t>> dst;
      for (size_t j = 0; j < n; ++j) {
        std::memset(bufs[j].data(), 0xEE, bufs[j].size());
        dst.emplace_back(bufs[j]);
      }
      auto op = client->Load(keys, dst);
      if (!op.ok()) continue;
      OpResult r = op->Wait();
      for (size_t j = 0; j < r.chunks && j < n; ++j) {
        if (int64_t at = FirstWrongByte(keys[j], bufs[j], &scratch); at >= 0) {
          return wrong("load", c, j, at);
        }
        ++verified;
      }
    } else if (what < 8) {  // PrepareLoad: verify the pinned slots in place, then unpin
      auto op = client->PrepareLoad(keys);
      if (!op.ok()) continue;
      OpResult r = op->Wait();
      for (size_t j = 0; j < r.slots.size(); ++j) {
        if (int64_t at = FirstWrongByte(keys[j], client->SlotData(r.slots[j]), &scratch); at >= 0) {
          return wrong("prepare_load", c, j, at);
        }
        ++verified;
      }
      if (rng() % 20 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 200));
      (void)client->Unpin(r.slots);
    } else {  // zero-copy store: reserve, fill in place, commit (or abort)
      auto slots = client->ReserveSlots(keys);
      if (!slots.ok()) continue;
      const bool abort = rng() % 5 == 0;
      std::vector<ChunkKey> committed(keys.begin(), keys.begin() + slots->size());
      for (size_t j = 0; j < slots->size(); ++j) {
        if ((*slots)[j] != kNoSlot) FillChunk(keys[j], client->SlotData((*slots)[j]));
      }
      if (abort) {
        (void)client->AbortSlots(*slots);
      } else {
        (void)client->CommitSlots(committed, *slots);
      }
    }
  }
  fmt::print(stderr, "stress client {}: {} ops, {} chunks verified, {} connections\n", a.client_id,
             ops, verified, reconnects);
  return kExitOk;
}

// --- role: adversarial client ---

// Connects without the client library. -1 if nobody listens.
int ConnectRaw(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  timeval tv{0, 300000};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  return fd;
}

void SendAll(int fd, std::span<const uint8_t> bytes) {
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

// Reads whatever comes within `wait` (replies are not checked: the server must merely survive).
void Drain(int fd, std::chrono::milliseconds wait) {
  uint8_t buf[4096];
  auto until = Clock::now() + wait;
  while (Clock::now() < until) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 20) <= 0) continue;
    if (::recv(fd, buf, sizeof(buf), MSG_DONTWAIT) <= 0) return;
  }
}

// Another tenant with a real client: stores and pins chunks of its own, overwriting every byte
// it maps meanwhile. Under --isolate-clients that is its own window only; with the shared pool
// it would be everyone's chunks (docs/security.md), so this runs only with isolation.
void ScribbleAsAnotherTenant(const StressArgs& a, std::mt19937_64& rng) {
  ClientOptions o;
  o.socket_path = a.socket;
  o.ns = StressNamespace();
  o.ns.tenant_salt = "stress-adversary";
  o.chunk_bytes = a.chunk_bytes;
  o.client_name = "stress-adversary-tenant";
  o.token = a.token;
  o.connect_timeout = 1000ms;
  o.rpc_timeout = 2000ms;
  auto c = Client::Connect(o);
  if (!c.ok()) return;
  // Overwrites every byte it maps, or deallocates every page of it (MADV_REMOVE: the server's
  // copies into and out of the window then meet holes, which must cost nothing but this
  // tenant's own data).
  auto scribble = [&] {
    const uint8_t junk = static_cast<uint8_t>(rng());
    const bool punch = rng() % 2 == 0;
    for (uint32_t s = 0; s < (*c)->num_slots(); ++s) {
      auto d = (*c)->SlotData(s);
      if (punch) {
        const size_t len = (d.size() + 4095) / 4096 * 4096;  // slots start on a page
        (void)::madvise(d.data(), len, MADV_REMOVE);
      } else {
        std::memset(d.data(), junk, d.size());
      }
    }
  };
  std::vector<ChunkKey> keys;
  for (int i = 0; i < 4; ++i) {
    keys.push_back(ConversationKeys(rng() % kConversations)[rng() % kMaxChunks]);
  }
  auto reserved = (*c)->ReserveSlots(keys);
  scribble();
  if (reserved.ok()) {
    (void)(*c)->CommitSlots(std::span(keys).first(reserved->size()), *reserved);
  }
  auto load = (*c)->PrepareLoad(keys);
  if (load.ok()) {
    OpResult r = load->Wait();
    scribble();
    (void)(*c)->Unpin(r.slots);
  }
  scribble();
}

// Connects to 127.0.0.1:port over TCP. -1 if nobody listens.
int ConnectTcp(int port) {
  if (port <= 0) return -1;
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  timeval tv{0, 300000};
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  return fd;
}

void SendText(int fd, const std::string& text) {
  SendAll(fd, std::span(reinterpret_cast<const uint8_t*>(text.data()), text.size()));
}

// One attack on the HTTP listener (docs/security.md, "A local user who is not a client"): idle
// connections by the dozen, oversized request lines, header lines, header counts and bodies,
// many ranges, and a request trickled a byte at a time. The server must only survive it, and
// its socket clients must not notice.
void AttackHttp(const StressArgs& a, std::mt19937_64& rng) {
  int port = -1;
  std::ifstream(HttpPortFile(a)) >> port;
  switch (rng() % 5) {
    case 0: {  // idle connections, more than the workers and the queue together
      std::vector<int> fds;
      for (int i = 0; i < 48; ++i) {
        if (int fd = ConnectTcp(port); fd >= 0) fds.push_back(fd);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200 + rng() % 600));
      for (int fd : fds) ::close(fd);
      return;
    }
    case 1: {  // a request line, a header line, or a header count far over the limits
      int fd = ConnectTcp(port);
      if (fd < 0) return;
      const int which = static_cast<int>(rng() % 3);
      std::string req = which == 0 ? "GET /" + std::string(64 << 10, 'a') + " HTTP/1.1\r\n"
                                   : "GET /stats HTTP/1.1\r\n";
      if (which == 1) req += "X-Big: " + std::string(64 << 10, 'b') + "\r\n";
      for (int i = 0; which == 2 && i < 500; ++i) req += fmt::format("X-H{}: v\r\n", i);
      SendText(fd, req + "\r\n");
      Drain(fd, 100ms);
      ::close(fd);
      return;
    }
    case 2: {  // a body announced at 1 GiB, a MiB of it sent
      int fd = ConnectTcp(port);
      if (fd < 0) return;
      SendText(fd, "POST /stats HTTP/1.1\r\nContent-Length: 1073741824\r\n\r\n");
      SendText(fd, std::string(1 << 20, 'x'));
      Drain(fd, 50ms);
      ::close(fd);
      return;
    }
    case 3: {  // hundreds of ranges of one document
      int fd = ConnectTcp(port);
      if (fd < 0) return;
      std::string ranges = "bytes=0-0";
      for (int i = 1; i < 400; ++i) ranges += fmt::format(",0-{}", i);
      SendText(fd, "GET /metrics HTTP/1.1\r\nRange: " + ranges + "\r\n\r\n");
      Drain(fd, 100ms);
      ::close(fd);
      return;
    }
    default: {  // a request trickled a byte at a time
      int fd = ConnectTcp(port);
      if (fd < 0) return;
      const std::string req = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
      for (size_t i = 0; i < req.size() && i < 12; ++i) {
        SendText(fd, req.substr(i, 1));
        std::this_thread::sleep_for(50ms);
      }
      ::close(fd);
      return;
    }
  }
}

// Another tenant declaring exactly the verifying clients' namespace (isolated runs). Probing the
// conversations of odd prefix groups (c / 4: groups share their first chunk), which it never
// stores, it must find nothing of theirs; under the keys of the even groups it stores garbage,
// which the verifying clients must never be served. Returns false on a leak.
bool IntrudeAsAnotherTenant(const StressArgs& a, std::mt19937_64& rng) {
  ClientOptions o;
  o.socket_path = a.socket;
  o.ns = StressNamespace();
  o.chunk_bytes = a.chunk_bytes;
  o.client_name = "stress-intruder";
  o.token = a.token;
  o.connect_timeout = 1000ms;
  o.rpc_timeout = 2000ms;
  auto c = Client::Connect(o);
  if (!c.ok()) return true;
  // Conversation c of group g = c / 4: odd groups are probed, even ones stored.
  auto in_group = [&](int parity) {
    const int g = parity + 2 * static_cast<int>(rng() % (kConversations / 8));
    return 4 * g + static_cast<int>(rng() % 4);
  };
  const int probe = in_group(1);
  auto theirs = ConversationKeys(probe);
  LookupResult found = (*c)->Lookup(theirs);
  if (found.total > 0) {
    fmt::print(stderr,
               "stress adversary: LEAK: another tenant found {} chunks of conversation {} of the "
               "verifying clients\n",
               found.total, probe);
    return false;
  }
  auto target = ConversationKeys(in_group(0));
  target.resize(1 + rng() % target.size());
  auto slots = (*c)->ReserveSlots(target);
  if (slots.ok()) {
    for (SlotId s : *slots) {
      if (s != kNoSlot) std::memset((*c)->SlotData(s).data(), 0x5A, (*c)->SlotData(s).size());
    }
    (void)(*c)->CommitSlots(std::span(target).first(slots->size()), *slots);
  }
  return true;
}

int RunAdversary(const StressArgs& a) {
  namespace codec = server;
  std::mt19937_64 rng(a.seed * 7919 + 17);
  uint64_t attacks = 0, http_attacks = 0;
  auto hello = [&](int fd, uint64_t chunk_bytes) {
    codec::HelloRequest h;
    h.ns = StressNamespace();
    h.chunk_bytes = chunk_bytes;
    h.client_name = "stress-adversary";
    h.token = a.token;
    SendAll(fd, codec::EncodeHelloRequest(1, h));
    Drain(fd, 50ms);
  };
  auto random_slots = [&](size_t n) {
    std::vector<SlotId> s(n);
    for (auto& x : s) x = static_cast<SlotId>(rng() % 4096);
    return s;
  };
  auto random_keys = [&](size_t n) {
    std::vector<ChunkKey> k;
    for (size_t i = 0; i < n; ++i)
      k.push_back(ConversationKeys(rng() % kConversations)[rng() % kMaxChunks]);
    return k;
  };
  while (NowUnix() < a.until_unix) {
    int fd = ConnectRaw(a.socket);
    if (fd < 0) {
      std::this_thread::sleep_for(50ms);
      continue;
    }
    ++attacks;
    if (a.isolate_clients && rng() % 10 == 0) {
      ::close(fd);
      ScribbleAsAnotherTenant(a, rng);
      continue;
    }
    if (a.isolate_clients && rng() % 10 == 0) {
      ::close(fd);
      if (!IntrudeAsAnotherTenant(a, rng)) return kExitLeak;
      continue;
    }
    if (rng() % 8 == 0) {
      ::close(fd);
      AttackHttp(a, rng);
      ++http_attacks;
      continue;
    }
    switch (rng() % 9) {
      case 0: {  // garbage
        std::vector<uint8_t> junk(1 + rng() % 512);
        for (auto& b : junk) b = static_cast<uint8_t>(rng());
        SendAll(fd, junk);
        Drain(fd, 50ms);
        break;
      }
      case 1: {  // a header announcing a huge body, then nothing
        codec::FrameHeader h;
        h.body_length = 0xFFFFFFF0u;
        h.opcode = static_cast<uint16_t>(codec::Opcode::kHello);
        uint8_t out[codec::kHeaderBytes];
        codec::EncodeHeader(h, out);
        SendAll(fd, std::span<const uint8_t>(out, sizeof(out)));
        Drain(fd, 50ms);
        break;
      }
      case 2: {  // requests before hello, unknown opcodes
        SendAll(fd, codec::EncodeKeysRequest(codec::Opcode::kLookup, 2, random_keys(3)));
        codec::FrameHeader h;
        h.opcode = static_cast<uint16_t>(50 + rng() % 100);
        uint8_t out[codec::kHeaderBytes];
        codec::EncodeHeader(h, out);
        SendAll(fd, std::span<const uint8_t>(out, sizeof(out)));
        Drain(fd, 50ms);
        break;
      }
      case 3: {  // a hello with a wrong chunk size, then a second hello
        hello(fd, a.chunk_bytes + 1 + rng() % 4096);
        hello(fd, a.chunk_bytes);
        break;
      }
      case 4: {  // release, commit and abort slots never given to us
        hello(fd, a.chunk_bytes);
        SendAll(fd, codec::EncodeSlotsRequest(codec::Opcode::kRelease, 3, random_slots(8)));
        SendAll(fd, codec::EncodeSlotsRequest(codec::Opcode::kAbort, 4, random_slots(8)));
        SendAll(fd, codec::EncodeSlotsRequest(codec::Opcode::kCommit, 5, random_slots(8)));
        Drain(fd, 50ms);
        break;
      }
      case 5: {  // reserve a lot, then vanish without committing
        hello(fd, a.chunk_bytes);
        SendAll(fd, codec::EncodeKeysRequest(codec::Opcode::kReserve, 6, random_keys(64)));
        Drain(fd, 20ms);
        break;
      }
      case 6: {  // pin a lot, then vanish without releasing
        hello(fd, a.chunk_bytes);
        SendAll(fd, codec::EncodeKeysRequest(codec::Opcode::kPrepareLoad, 7, random_keys(32)));
        if (rng() % 2) Drain(fd, 100ms);
        break;
      }
      case 7: {  // half a frame, then close
        auto frame = codec::EncodeKeysRequest(codec::Opcode::kLookup, 8, random_keys(4));
        SendAll(fd, std::span<const uint8_t>(frame.data(), 1 + rng() % (frame.size() - 1)));
        break;
      }
      default: {  // stats while others work, and a request flood
        hello(fd, a.chunk_bytes);
        for (int i = 0; i < 32; ++i) {
          SendAll(fd, codec::EncodeEmptyRequest(codec::Opcode::kStats, 100 + i));
        }
        Drain(fd, 30ms);
        break;
      }
    }
    ::close(fd);
  }
  fmt::print(stderr, "stress adversary: {} attacks ({} on the HTTP listener)\n", attacks,
             http_attacks);
  return kExitOk;
}

// --- role: the server with a fault-injecting file tier ---

server::ServeConfig ServerConfig(const StressArgs& a) {
  server::ServeConfig c;
  c.chunk_bytes = a.chunk_bytes;
  c.l1_size_gb = a.l1_mb / 1024.0;
  server::L2Spec l2;
  l2.path = a.dir + "/cache";
  l2.max_size_gb = a.l2_mb / 1024.0;
  c.l2 = {l2};
  c.socket = a.socket;
  c.http_port = a.http_port;
  c.write_policy = a.write_policy;
  c.isolate_clients = a.isolate_clients;
  if (a.isolate_clients) c.tenant_token_file = TenantFile(a);
  return c;
}

int RunFaultyServer(const StressArgs& a) {
  spdlog::set_level(spdlog::level::err);
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  auto options = server::BuildServerOptions(ServerConfig(a));
  if (!options.ok()) {
    fmt::print(stderr, "stress server: {}\n", options.status().ToString());
    return kExitBroken;
  }
  // Never destroyed: operations abandoned at shutdown may return into it.
  static FaultInjectionEnv* env = nullptr;
  if (a.fault_rate > 0) {
    FaultInjectionOptions f;
    f.seed = a.seed;
    f.read_error = f.write_error = f.no_space = a.fault_rate;
    f.short_read = f.short_write = a.fault_rate;
    f.bit_flip = a.fault_rate;
    f.sync_error = f.metadata_error = a.fault_rate / 4;
    env = new FaultInjectionEnv(Env::Default(), f);
    env->SetEnabled(false);  // opening (the directory scan) goes clean
    options->engine.file->env = env;
  }
  options->engine.file->stall_timeout = 2000ms;
  auto srv = server::Server::Start(*options);
  if (!srv.ok()) {
    fmt::print(stderr, "stress server: {}\n", srv.status().ToString());
    return kExitBroken;
  }
  if (env) env->SetEnabled(true);
  int sig = 0;
  sigwait(&signals, &sig);
  if (env) env->SetEnabled(false);  // a clean drain: the write-back at shutdown is not tested here
  (*srv)->Stop();
  srv->reset();
  if (TaskPool::DetachedRunning() > 0) std::quick_exit(kExitOk);  // as kvtier serve does
  return kExitOk;
}

// --- the driver ---

struct Child {
  pid_t pid = -1;
  std::string what;
  bool killed_by_us = false;
};

pid_t Spawn(const std::vector<std::string>& argv, const std::string& log_path) {
  pid_t pid = ::fork();
  if (pid != 0) return pid;
  // Child: own stderr to a log, so that a failure can be read after the run.
  if (!log_path.empty()) {
    FILE* f = std::freopen(log_path.c_str(), "a", stderr);
    (void)f;
    ::dup2(STDERR_FILENO, STDOUT_FILENO);
  }
  std::vector<char*> args;
  for (const auto& s : argv) args.push_back(const_cast<char*>(s.c_str()));
  args.push_back(nullptr);
  sigset_t none;
  sigemptyset(&none);
  pthread_sigmask(SIG_SETMASK, &none, nullptr);
  ::execv(args[0], args.data());
  _exit(127);
}

std::string Describe(int status) {
  if (WIFEXITED(status)) return fmt::format("exit status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return fmt::format("signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return fmt::format("status {}", status);
}

// A TCP port on 127.0.0.1 that nobody listens on now (the kernel's pick for an ephemeral bind).
int FreeLoopbackPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = -1;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  if (fd >= 0) ::close(fd);
  return port;
}

// What kvtier serve does with each signal (src/tools/serve_cmd.cc, docs/protocol.md): these
// drain it as SIGTERM does; the ignored ones must leave it serving.
constexpr int kDrainSignals[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGALRM, SIGXCPU, SIGPWR};
constexpr int kIgnoredSignals[] = {SIGPIPE, SIGUSR1, SIGUSR2, SIGXFSZ};

class Driver {
 public:
  explicit Driver(StressArgs a) : a_(std::move(a)), rng_(a_.seed) {}

  int Run();

 private:
  std::vector<std::string> RoleArgs(const std::string& role) const {
    return {Self(),          "stress",
            "--role",        role,
            "--socket",      a_.socket,
            "--dir",         a_.dir,
            "--seed",        std::to_string(a_.seed),
            "--chunk-bytes", std::to_string(a_.chunk_bytes),
            "--until-unix",  fmt::format("{:.3f}", until_unix_)};
  }
  // RoleArgs with what the server and the adversary must know of the run.
  std::vector<std::string> WithIsolation(std::vector<std::string> argv) const {
    if (a_.isolate_clients) argv.push_back("--isolate-clients");
    return argv;
  }
  void StartServer();
  bool StopServer(bool kill);  // false (with failure_ set) on an unclean or slow exit
  void StartClient(int id);
  void StartAdversary();
  void Reap(bool final);
  void PlantNonRegularFile();
  void SignalStorm();
  std::optional<nlohmann::json> Stats();
  void Fail(std::string why) {
    if (failure_.empty()) failure_ = std::move(why);
  }

  StressArgs a_;
  std::mt19937_64 rng_;
  double until_unix_ = 0;
  Child server_;
  std::map<pid_t, Child> clients_;  // verifying clients and the adversary, by pid
  std::map<pid_t, int> client_ids_;
  std::string failure_;
  int server_starts_ = 0, server_kills_ = 0, server_terms_ = 0, client_kills_ = 0;
  int faulty_starts_ = 0, fifos_ = 0, signal_storms_ = 0;
};

void Driver::StartServer() {
  const char* policies[] = {"write_back", "write_through"};
  a_.write_policy = policies[rng_() % 2];
#ifdef KVTIER_STRESS_STANDALONE
  // No `kvtier serve` in this binary: every server is the in-process one, with faults half the
  // time (the role's --fault-rate 0 makes it a plain server).
  const bool faulty = true;
  const double fault_rate = rng_() % 2 == 0 ? a_.fault_rate : 0;
#else
  const bool faulty = a_.fault_rate > 0 && rng_() % 2 == 0;
  const double fault_rate = a_.fault_rate;
#endif
  // A fresh HTTP port each start, told to the adversary through a file.
  const int http_port = FreeLoopbackPort();
  {
    const std::string tmp = HttpPortFile(a_) + ".tmp";
    std::ofstream(tmp) << http_port << "\n";
    std::filesystem::rename(tmp, HttpPortFile(a_));
  }
  std::vector<std::string> argv;
  if (faulty) {
    argv = RoleArgs("server");
    argv.insert(argv.end(), {"--write-policy", a_.write_policy, "--l1-mb",
                             fmt::format("{}", a_.l1_mb), "--l2-mb", fmt::format("{}", a_.l2_mb),
                             "--fault-rate", fmt::format("{}", fault_rate)});
    argv[9] = std::to_string(a_.seed + server_starts_);  // --seed: new faults each start
    argv.insert(argv.end(), {"--http-port", std::to_string(http_port)});
    if (fault_rate > 0) ++faulty_starts_;
  } else {
    argv = {Self(),
            "serve",
            "--socket",
            a_.socket,
            "--http-port",
            std::to_string(http_port),
            "--chunk-bytes",
            std::to_string(a_.chunk_bytes),
            "--l1-size-gb",
            fmt::format("{}", a_.l1_mb / 1024.0),
            "--l2",
            nlohmann::json{{"path", a_.dir + "/cache"}, {"max_size_gb", a_.l2_mb / 1024.0}}.dump(),
            "--write-policy",
            a_.write_policy,
            "--log-level",
            "warn"};
  }
  argv = WithIsolation(std::move(argv));
  if (a_.isolate_clients && !faulty) argv.insert(argv.end(), {"--tenant-token-file", TenantFile(a_)});
  server_ = {Spawn(argv, a_.dir + "/server.log"),
             !faulty          ? "kvtier serve"
             : fault_rate > 0 ? "fault-injecting server"
                              : "in-process server",
             false};
  ++server_starts_;
  // Ready when a client can connect.
  auto until = Clock::now() + 30s;
  while (Clock::now() < until) {
    ClientOptions o;
    o.socket_path = a_.socket;
    o.ns = StressNamespace();
    o.chunk_bytes = a_.chunk_bytes;
    o.token = a_.isolate_clients ? VerifierToken(a_) : "";
    o.connect_timeout = 500ms;
    if (Client::Connect(o).ok()) return;
    int status;
    if (::waitpid(server_.pid, &status, WNOHANG) == server_.pid) {
      Fail(fmt::format("{} did not start: {} (see {}/server.log)", server_.what, Describe(status),
                       a_.dir));
      server_.pid = -1;
      return;
    }
    std::this_thread::sleep_for(50ms);
  }
  Fail(fmt::format("{} did not accept a client within 30 s", server_.what));
}

bool Driver::StopServer(bool kill) {
  if (server_.pid <= 0) return false;
  server_.killed_by_us = true;
  // kvtier serve drains on any of its drain signals; the in-process server on SIGTERM.
  const int sig = kill                             ? SIGKILL
                  : server_.what != "kvtier serve" ? SIGTERM
                                                   : kDrainSignals[rng_() % std::size(kDrainSignals)];
  ::kill(server_.pid, sig);
  auto until = Clock::now() + 30s;
  int status = 0;
  for (;;) {
    pid_t r = ::waitpid(server_.pid, &status, WNOHANG);
    if (r == server_.pid) break;
    if (Clock::now() > until) {
      ::kill(server_.pid, SIGKILL);
      ::waitpid(server_.pid, &status, 0);
      Fail(fmt::format("{} did not finish within 30 s of {}", server_.what, strsignal(sig)));
      server_.pid = -1;
      return false;
    }
    std::this_thread::sleep_for(10ms);
  }
  server_.pid = -1;
  if (!kill && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
    Fail(fmt::format("{} ended by {} with {}, not a clean exit (see {}/server.log)",
                     server_.what, strsignal(sig), Describe(status), a_.dir));
    return false;
  }
  return true;
}

void Driver::StartClient(int id) {
  auto argv = RoleArgs("client");
  argv.insert(argv.end(), {"--client-id", std::to_string(id)});
  if (a_.isolate_clients) argv.insert(argv.end(), {"--token", VerifierToken(a_)});
  pid_t pid = Spawn(argv, fmt::format("{}/client-{}.log", a_.dir, id));
  clients_[pid] = {pid, fmt::format("client {}", id), false};
  client_ids_[pid] = id;
}

void Driver::StartAdversary() {
  auto argv = WithIsolation(RoleArgs("adversary"));
  if (a_.isolate_clients) argv.insert(argv.end(), {"--token", IntruderToken(a_)});
  pid_t pid = Spawn(argv, a_.dir + "/adversary.log");
  clients_[pid] = {pid, "adversary", false};
  client_ids_[pid] = -1;
}

// Collects exited children: a server that died on its own, or a client that saw a wrong byte,
// is a failure. Before the end, killed clients are replaced.
void Driver::Reap(bool final) {
  int status;
  if (server_.pid > 0 && ::waitpid(server_.pid, &status, WNOHANG) == server_.pid) {
    Fail(fmt::format("{} died on its own: {} (see {}/server.log)", server_.what, Describe(status),
                     a_.dir));
    server_.pid = -1;
  }
  for (auto it = clients_.begin(); it != clients_.end();) {
    pid_t r = ::waitpid(it->first, &status, WNOHANG);
    if (r != it->first) {
      ++it;
      continue;
    }
    const Child c = it->second;
    const int id = client_ids_[c.pid];
    client_ids_.erase(c.pid);
    it = clients_.erase(it);
    if (WIFEXITED(status) && WEXITSTATUS(status) == kExitWrongByte) {
      Fail(fmt::format("{} was served a wrong byte (see {}/client-{}.log)", c.what, a_.dir, id));
    } else if (WIFEXITED(status) && WEXITSTATUS(status) == kExitLeak) {
      Fail(fmt::format("another tenant found the verifying clients' chunks (see "
                       "{}/adversary.log)",
                       a_.dir));
    } else if (!c.killed_by_us && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
      Fail(fmt::format("{} ended with {}", c.what, Describe(status)));
    }
    if (!final && NowUnix() < until_unix_ - 1) {
      if (id >= 0) {
        StartClient(id);
      } else {
        StartAdversary();
      }
    }
  }
}

// Bad luck on the shared directory: a chunk file replaced by a FIFO (whose open would block
// forever, like a hung NFS server) or by a directory. The server must treat either as a miss and
// still stop promptly on SIGTERM.
void Driver::PlantNonRegularFile() {
  std::vector<std::filesystem::path> chunks;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(a_.dir + "/cache", ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_regular_file(ec) && it->path().filename().string().size() == 64) {
      chunks.push_back(it->path());
    }
  }
  if (chunks.empty()) return;
  const auto& path = chunks[rng_() % chunks.size()];
  if (::unlink(path.c_str()) != 0) return;
  if (rng_() % 2) {
    if (::mkfifo(path.c_str(), 0644) == 0) ++fifos_;
  } else {
    if (::mkdir(path.c_str(), 0755) == 0) ++fifos_;
  }
}

// Dozens of the signals kvtier serve ignores, back to back: it must go on serving (a death is
// caught by Reap as a server that died on its own).
void Driver::SignalStorm() {
  if (server_.pid <= 0 || server_.what != "kvtier serve") return;
  ++signal_storms_;
  for (int i = 0; i < 40; ++i) {
    ::kill(server_.pid, kIgnoredSignals[rng_() % std::size(kIgnoredSignals)]);
    if (i % 8 == 7) std::this_thread::sleep_for(1ms);
  }
}

std::optional<nlohmann::json> Driver::Stats() {
  ClientOptions o;
  o.socket_path = a_.socket;
  o.ns = StressNamespace();
  o.chunk_bytes = a_.chunk_bytes;
  o.client_name = "stress-driver";
  o.token = a_.isolate_clients ? VerifierToken(a_) : "";
  auto c = Client::Connect(o);
  if (!c.ok()) return std::nullopt;
  auto text = (*c)->StatsJson();
  if (!text.ok()) return std::nullopt;
  auto j = nlohmann::json::parse(*text, nullptr, false);
  if (j.is_discarded()) return std::nullopt;
  return j;
}

int Driver::Run() {
  const auto started = Clock::now();
  until_unix_ = NowUnix() + a_.seconds;
  fmt::print("kvtier stress: seed {}, {:.0f} s, {} clients, dir {}\n", a_.seed, a_.seconds,
             a_.clients, a_.dir);
  StartServer();
  for (int i = 0; i < a_.clients && failure_.empty(); ++i) StartClient(i);
  if (a_.adversary && failure_.empty()) StartAdversary();
  while (failure_.empty() && NowUnix() < until_unix_ - 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300 + rng_() % 1500));
    Reap(false);
    if (!failure_.empty() || NowUnix() >= until_unix_ - 3) break;
    const int action = static_cast<int>(rng_() % 10);
    if (a_.kill_clients && action < 4 && !clients_.empty()) {
      auto it = std::next(clients_.begin(), static_cast<long>(rng_() % clients_.size()));
      it->second.killed_by_us = true;
      ::kill(it->first, SIGKILL);
      ++client_kills_;
    } else if (action == 6) {
      PlantNonRegularFile();
    } else if (action == 7) {
      SignalStorm();
    } else if (a_.kill_server && action < 6) {
      const bool kill = action == 4;
      kill ? ++server_kills_ : ++server_terms_;
      if (StopServer(kill)) StartServer();
    }
  }
  // The end: clients stop by themselves at until_unix_; wait for them (bounded).
  auto until = Clock::now() + std::chrono::seconds(30);
  while (!clients_.empty() && Clock::now() < until) {
    Reap(true);
    std::this_thread::sleep_for(20ms);
  }
  for (auto& [pid, c] : clients_) {
    Fail(fmt::format("{} did not finish in time", c.what));
    ::kill(pid, SIGKILL);
  }
  Reap(true);
  // Every client is gone: no pin may remain once the server's own work has drained.
  uint64_t pinned = 0;
  if (failure_.empty()) {
    auto until_quiet = Clock::now() + 15s;
    for (;;) {
      auto st = Stats();
      if (!st) {
        Fail("could not read the server's stats after the clients exited");
        break;
      }
      pinned = (*st)["pool"].value("pinned", uint64_t{0});
      size_t clients = (*st)["clients"].size();
      if (pinned == 0 && clients <= 1) break;
      if (Clock::now() > until_quiet) {
        Fail(
            fmt::format("leaked pins: {} slots still pinned and {} clients listed 15 s after "
                        "every client exited:\n{}",
                        pinned, clients, st->dump(2)));
        break;
      }
      std::this_thread::sleep_for(100ms);
    }
  }
  if (server_.pid > 0) StopServer(false);
  // Nothing on disk may be corrupt: every publish is atomic, SIGKILL or not.
  if (failure_.empty()) {
    auto report = FsckCacheDir(a_.dir + "/cache", {});
    if (!report.ok()) {
      Fail(fmt::format("fsck: {}", report.status().ToString()));
    } else if (report->corrupt > 0) {
      Fail(fmt::format("fsck found {} corrupt chunk files, e.g. {}", report->corrupt,
                       report->findings.empty() ? "?" : report->findings[0].path));
    }
  }
  const double took = std::chrono::duration<double>(Clock::now() - started).count();
  fmt::print(
      "kvtier stress: {} server starts ({} fault-injecting), {} server SIGKILLs, {} drain "
      "signals, {} signal storms, {} client SIGKILLs, {} chunk files replaced by a FIFO or "
      "directory, {:.0f} s\n",
      server_starts_, faulty_starts_, server_kills_, server_terms_, signal_storms_, client_kills_,
      fifos_, took);
  if (!failure_.empty()) {
    fmt::print(stderr, "kvtier stress: FAILED (seed {}): {}\n", a_.seed, failure_);
    return 1;
  }
  fmt::print("kvtier stress: passed (seed {})\n", a_.seed);
  return 0;
}

int RunStress(StressArgs a) {
  if (a.role == "client") return RunClient(a);
  if (a.role == "adversary") return RunAdversary(a);
  if (a.role == "server") return RunFaultyServer(a);
  if (a.role != "driver") {
    fmt::print(stderr, "kvtier stress: unknown --role {}\n", a.role);
    return 2;
  }
  if (a.seconds <= 0 || a.clients < 1 || a.chunk_bytes == 0) {
    fmt::print(stderr, "kvtier stress: --seconds, --clients and --chunk-bytes must be positive\n");
    return 2;
  }
  if (a.seed == 0) a.seed = static_cast<uint64_t>(NowUnix() * 1000) % 1000000007;
  bool made_dir = false;
  if (a.dir.empty()) {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "kvtier-stress-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) {
      fmt::print(stderr, "kvtier stress: cannot make a temporary directory\n");
      return 2;
    }
    a.dir = pattern;
    made_dir = true;
  }
  std::filesystem::create_directories(a.dir);
  a.socket = a.dir + "/kvtier.sock";
  if (a.isolate_clients) {
    // Two tenants: the verifying clients and the adversary. Owner-only, as the server demands.
    const std::string path = TenantFile(a);
    std::ofstream(path) << "verifiers " << VerifierToken(a) << "\nintruder " << IntruderToken(a)
                        << "\n";
    std::filesystem::permissions(path, std::filesystem::perms::owner_read |
                                           std::filesystem::perms::owner_write);
  }
  ::signal(SIGPIPE, SIG_IGN);
  int rc = Driver(a).Run();
  if (rc == 0 && made_dir) {
    std::error_code ec;
    std::filesystem::remove_all(a.dir, ec);
  } else if (rc != 0) {
    fmt::print(stderr, "kvtier stress: logs and the cache directory are kept in {}\n", a.dir);
  }
  return rc;
}

void AddStress(CLI::App& parent, CommandContext& ctx) {
  auto a = std::make_shared<StressArgs>();
  auto* cmd = parent.add_subcommand(
      "stress",
      "Crash-test `kvtier serve` with a file tier: verifying clients, an adversarial client, "
      "random SIGKILLs and restarts, fault injection (docs/stress.md). Exit status 0: no wrong "
      "byte, no leaked pin, no unexpected server death");
  cmd->add_option("--seconds", a->seconds, "How long to run")->capture_default_str();
  cmd->add_option("--seed", a->seed, "Random seed (0: from the clock; printed either way)");
  cmd->add_option("--clients", a->clients, "Verifying client processes")->capture_default_str();
  cmd->add_option("--dir", a->dir, "Working directory (default: a new temporary one)");
  cmd->add_option("--chunk-bytes", a->chunk_bytes, "Chunk size")->capture_default_str();
  cmd->add_option("--l1-mb", a->l1_mb, "Server L1 pool, MiB")->capture_default_str();
  cmd->add_option("--l2-mb", a->l2_mb, "Server file tier capacity, MiB")->capture_default_str();
  cmd->add_option("--fault-rate", a->fault_rate,
                  "Per-operation fault probability in the fault-injecting server (0: never start "
                  "one)")
      ->capture_default_str();
  cmd->add_flag("!--no-server-kills", a->kill_server, "Never kill or restart the server");
  cmd->add_flag("!--no-client-kills", a->kill_clients, "Never kill clients");
  cmd->add_flag("!--no-adversary", a->adversary, "No adversarial client");
  cmd->add_flag("--isolate-clients", a->isolate_clients,
                "Servers isolate clients (kvtier serve --isolate-clients); the adversary also "
                "overwrites every byte it can map, as another tenant");
  // Internal: the roles the driver starts.
  cmd->add_option("--role", a->role)->group("");
  cmd->add_option("--socket", a->socket)->group("");
  cmd->add_option("--until-unix", a->until_unix)->group("");
  cmd->add_option("--client-id", a->client_id)->group("");
  cmd->add_option("--write-policy", a->write_policy)->group("");
  cmd->add_option("--http-port", a->http_port)->group("");
  cmd->add_option("--token", a->token)->group("");
  cmd->callback([a, &ctx] { ctx.exit_code = RunStress(*a); });
}

const bool kRegistered = RegisterCommand("", &AddStress);

}  // namespace
}  // namespace kvtier::tools

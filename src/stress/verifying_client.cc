// The verifying client: random stores and loads of the conversations of chunk_data.h through
// every path of the client library (copies, zero-copy reserve/commit/abort, pins), each byte
// served checked against the bytes its key derives. It reconnects to whichever server is up.
#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <thread>
#include <vector>

#include "kvtier/client.h"
#include "stress/chunk_data.h"
#include "stress/roles.h"

namespace kvtier::stress {
namespace {

using namespace std::chrono_literals;

class VerifyingClient {
 public:
  VerifyingClient(const StressOptions& run, const StressRoleOptions& role)
      : run_(run),
        role_(role),
        rng_(run.seed * 1000003 + role.client_id),
        bufs_(kMaxChunks, std::vector<uint8_t>(run.chunk_bytes)) {
    for (int c = 0; c < kConversations; ++c) conversations_.push_back(ConversationKeys(c));
  }

  int Run();

 private:
  // A connection to the server now up, made if the last one broke. False: none yet.
  bool Connected();
  // One random operation on a prefix of conversation c. kExitWrongByte on a wrong byte.
  int StoreByCopy(std::span<const ChunkKey> keys);
  int LoadAndVerify(int c, std::span<const ChunkKey> keys);
  int PrepareLoadAndVerify(int c, std::span<const ChunkKey> keys);
  int StoreInPlace(std::span<const ChunkKey> keys);
  int Wrong(const char* how, int c, size_t j, int64_t at);

  const StressOptions& run_;
  const StressRoleOptions& role_;
  std::mt19937_64 rng_;
  std::vector<uint8_t> scratch_;
  std::vector<std::vector<uint8_t>> bufs_;  // one chunk each
  std::vector<std::vector<ChunkKey>> conversations_;
  std::unique_ptr<Client> client_;
  uint64_t verified_ = 0, ops_ = 0, connections_ = 0;
};

int VerifyingClient::Run() {
  while (NowUnix() < role_.until_unix) {
    if (!Connected()) {
      std::this_thread::sleep_for(50ms);
      continue;
    }
    ++ops_;
    const int c = static_cast<int>(rng_() % kConversations);
    const size_t n = 1 + rng_() % kMaxChunks;
    std::span<const ChunkKey> keys(conversations_[c].data(), n);
    const int what = static_cast<int>(rng_() % 10);
    const int rc = what < 3   ? StoreByCopy(keys)
                   : what < 5 ? LoadAndVerify(c, keys)
                   : what < 8 ? PrepareLoadAndVerify(c, keys)
                              : StoreInPlace(keys);
    if (rc != kExitOk) return rc;
  }
  fmt::print(stderr, "stress client {}: {} ops, {} chunks verified, {} connections\n",
             role_.client_id, ops_, verified_, connections_);
  AppendRoleCounts(run_.dir, fmt::format("client {} {}", ops_, verified_));
  return kExitOk;
}

bool VerifyingClient::Connected() {
  if (client_ && client_->connected()) return true;
  client_.reset();
  ClientOptions o;
  o.socket_path = role_.socket;
  o.ns = StressNamespace();
  o.chunk_bytes = run_.chunk_bytes;
  o.client_name = fmt::format("stress-client-{}", role_.client_id);
  o.token = role_.token;
  o.connect_timeout = 1000ms;
  o.rpc_timeout = 5000ms;
  auto c = Client::Connect(o);
  if (!c.ok()) return false;
  client_ = std::move(c).value();
  ++connections_;
  return true;
}

int VerifyingClient::StoreByCopy(std::span<const ChunkKey> keys) {
  std::vector<std::span<const uint8_t>> src;
  for (size_t j = 0; j < keys.size(); ++j) {
    FillChunk(keys[j], bufs_[j]);
    src.emplace_back(bufs_[j]);
  }
  auto op = client_->Store(keys, src);
  if (op.ok()) (void)op->Wait();
  return kExitOk;
}

int VerifyingClient::LoadAndVerify(int c, std::span<const ChunkKey> keys) {
  std::vector<std::span<uint8_t>> dst;
  for (size_t j = 0; j < keys.size(); ++j) {
    std::memset(bufs_[j].data(), 0xEE, bufs_[j].size());
    dst.emplace_back(bufs_[j]);
  }
  auto op = client_->Load(keys, dst);
  if (!op.ok()) return kExitOk;
  OpResult r = op->Wait();
  for (size_t j = 0; j < r.chunks && j < keys.size(); ++j) {
    if (int64_t at = FirstWrongByte(keys[j], bufs_[j], &scratch_); at >= 0) {
      return Wrong("load", c, j, at);
    }
    ++verified_;
  }
  return kExitOk;
}

// The pinned slots are checked in place, in the server's pool (or this client's window), then
// unpinned, now and then after a pause that keeps them pinned across other clients' work.
int VerifyingClient::PrepareLoadAndVerify(int c, std::span<const ChunkKey> keys) {
  auto op = client_->PrepareLoad(keys);
  if (!op.ok()) return kExitOk;
  OpResult r = op->Wait();
  for (size_t j = 0; j < r.slots.size(); ++j) {
    if (int64_t at = FirstWrongByte(keys[j], client_->SlotData(r.slots[j]), &scratch_); at >= 0) {
      return Wrong("prepare_load", c, j, at);
    }
    ++verified_;
  }
  if (rng_() % 20 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(rng_() % 200));
  (void)client_->Unpin(r.slots);
  return kExitOk;
}

// Zero-copy: reserve, fill in place, commit (or abort).
int VerifyingClient::StoreInPlace(std::span<const ChunkKey> keys) {
  auto slots = client_->ReserveSlots(keys);
  if (!slots.ok()) return kExitOk;
  const bool abort = rng_() % 5 == 0;
  std::vector<ChunkKey> committed(keys.begin(), keys.begin() + slots->size());
  for (size_t j = 0; j < slots->size(); ++j) {
    if ((*slots)[j] != kNoSlot) FillChunk(keys[j], client_->SlotData((*slots)[j]));
  }
  if (abort) {
    (void)client_->AbortSlots(*slots);
  } else {
    (void)client_->CommitSlots(committed, *slots);
  }
  return kExitOk;
}

int VerifyingClient::Wrong(const char* how, int c, size_t j, int64_t at) {
  fmt::print(stderr,
             "stress client {}: WRONG BYTE served by {}: conversation {} chunk {} offset {} "
             "(key {})\n",
             role_.client_id, how, c, j, at, conversations_[c][j].ToHex());
  return kExitWrongByte;
}

}  // namespace

int RunVerifyingClient(const StressOptions& run, const StressRoleOptions& role) {
  return VerifyingClient(run, role).Run();
}

}  // namespace kvtier::stress

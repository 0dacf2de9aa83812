// The adversarial client: until the run's end, connection after connection, one attack each:
// malformed frames and protocol misuse on a raw connection (most of the time), an attack on the
// HTTP listener, or, in isolated runs, another tenant (attacks.h). The server must survive all
// of it with its verifying clients none the wiser.
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <random>
#include <thread>
#include <vector>

#include "server/codec.h"
#include "stress/attacks.h"
#include "stress/chunk_data.h"
#include "stress/raw_socket.h"
#include "stress/roles.h"

namespace kvtier::stress {
namespace {

using namespace std::chrono_literals;
namespace codec = server;

class Adversary {
 public:
  Adversary(const StressOptions& run, const StressRoleOptions& role)
      : run_(run), role_(role), rng_(run.seed * 7919 + 17) {}

  int Run();

 private:
  // One of the raw-connection attacks on `fd`, a connection this adversary then closes.
  void AttackProtocol(int fd);
  void Hello(int fd, uint64_t chunk_bytes);
  std::vector<SlotId> RandomSlots(size_t n);
  std::vector<ChunkKey> RandomKeys(size_t n);
  void SendHeader(int fd, const codec::FrameHeader& h);

  const StressOptions& run_;
  const StressRoleOptions& role_;
  std::mt19937_64 rng_;
};

int Adversary::Run() {
  uint64_t attacks = 0, http_attacks = 0;
  while (NowUnix() < role_.until_unix) {
    int fd = ConnectUnix(role_.socket);
    if (fd < 0) {
      std::this_thread::sleep_for(50ms);
      continue;
    }
    ++attacks;
    if (run_.isolate_clients && rng_() % 10 == 0) {
      ::close(fd);
      ScribbleAsAnotherTenant(run_, role_, rng_);
    } else if (run_.isolate_clients && rng_() % 10 == 0) {
      ::close(fd);
      if (!IntrudeAsAnotherTenant(run_, role_, rng_)) return kExitLeak;
    } else if (rng_() % 8 == 0) {
      ::close(fd);
      AttackHttp(run_, rng_);
      ++http_attacks;
    } else {
      AttackProtocol(fd);
      ::close(fd);
    }
  }
  fmt::print(stderr, "stress adversary: {} attacks ({} on the HTTP listener)\n", attacks,
             http_attacks);
  AppendRoleCounts(run_.dir, fmt::format("adversary {}", attacks));
  return kExitOk;
}

void Adversary::AttackProtocol(int fd) {
  switch (rng_() % 9) {
    case 0: {  // garbage
      std::vector<uint8_t> junk(1 + rng_() % 512);
      for (auto& b : junk) b = static_cast<uint8_t>(rng_());
      SendAll(fd, junk);
      Drain(fd, 50ms);
      break;
    }
    case 1: {  // a header announcing a huge body, then nothing
      codec::FrameHeader h;
      h.body_length = 0xFFFFFFF0u;
      h.opcode = static_cast<uint16_t>(codec::Opcode::kHello);
      SendHeader(fd, h);
      Drain(fd, 50ms);
      break;
    }
    case 2: {  // requests before hello, unknown opcodes
      SendAll(fd, codec::EncodeKeysRequest(codec::Opcode::kLookup, 2, RandomKeys(3)));
      codec::FrameHeader h;
      h.opcode = static_cast<uint16_t>(50 + rng_() % 100);
      SendHeader(fd, h);
      Drain(fd, 50ms);
      break;
    }
    case 3:  // a hello with a wrong chunk size, then a second hello
      Hello(fd, run_.chunk_bytes + 1 + rng_() % 4096);
      Hello(fd, run_.chunk_bytes);
      break;
    case 4:  // release, commit and abort slots never given to us
      Hello(fd, run_.chunk_bytes);
      SendAll(fd, codec::EncodeSlotsRequest(codec::Opcode::kRelease, 3, RandomSlots(8)));
      SendAll(fd, codec::EncodeSlotsRequest(codec::Opcode::kAbort, 4, RandomSlots(8)));
      SendAll(fd, codec::EncodeSlotsRequest(codec::Opcode::kCommit, 5, RandomSlots(8)));
      Drain(fd, 50ms);
      break;
    case 5:  // reserve a lot, then vanish without committing
      Hello(fd, run_.chunk_bytes);
      SendAll(fd, codec::EncodeKeysRequest(codec::Opcode::kReserve, 6, RandomKeys(64)));
      Drain(fd, 20ms);
      break;
    case 6:  // pin a lot, then vanish without releasing
      Hello(fd, run_.chunk_bytes);
      SendAll(fd, codec::EncodeKeysRequest(codec::Opcode::kPrepareLoad, 7, RandomKeys(32)));
      if (rng_() % 2) Drain(fd, 100ms);
      break;
    case 7: {  // half a frame, then close
      auto frame = codec::EncodeKeysRequest(codec::Opcode::kLookup, 8, RandomKeys(4));
      SendAll(fd, std::span<const uint8_t>(frame.data(), 1 + rng_() % (frame.size() - 1)));
      break;
    }
    default:  // stats while others work, and a request flood
      Hello(fd, run_.chunk_bytes);
      for (int i = 0; i < 32; ++i) {
        SendAll(fd, codec::EncodeEmptyRequest(codec::Opcode::kStats, 100 + i));
      }
      Drain(fd, 30ms);
      break;
  }
}

void Adversary::Hello(int fd, uint64_t chunk_bytes) {
  codec::HelloRequest h;
  h.ns = StressNamespace();
  h.chunk_bytes = chunk_bytes;
  h.client_name = "stress-adversary";
  h.token = role_.token;
  SendAll(fd, codec::EncodeHelloRequest(1, h));
  Drain(fd, 50ms);
}

std::vector<SlotId> Adversary::RandomSlots(size_t n) {
  std::vector<SlotId> s(n);
  for (auto& x : s) x = static_cast<SlotId>(rng_() % 4096);
  return s;
}

std::vector<ChunkKey> Adversary::RandomKeys(size_t n) {
  std::vector<ChunkKey> k;
  for (size_t i = 0; i < n; ++i) {
    k.push_back(ConversationKeys(rng_() % kConversations)[rng_() % kMaxChunks]);
  }
  return k;
}

void Adversary::SendHeader(int fd, const codec::FrameHeader& h) {
  uint8_t out[codec::kHeaderBytes];
  codec::EncodeHeader(h, out);
  SendAll(fd, std::span<const uint8_t>(out, sizeof(out)));
}

}  // namespace

int RunAdversary(const StressOptions& run, const StressRoleOptions& role) {
  return Adversary(run, role).Run();
}

}  // namespace kvtier::stress

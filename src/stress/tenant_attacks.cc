// The adversary as another tenant of an isolated server, through the real client library: what
// a tenant may do to its own window must cost nobody else anything, and no tenant may see
// another's chunks (docs/security.md).
#include <fmt/format.h>
#include <sys/mman.h>

#include <chrono>
#include <cstring>
#include <span>
#include <vector>

#include "kvtier/client.h"
#include "stress/attacks.h"
#include "stress/chunk_data.h"

namespace kvtier::stress {
namespace {

using namespace std::chrono_literals;

Result<std::unique_ptr<Client>> ConnectAsAnotherTenant(const StressOptions& run,
                                                       const StressRoleOptions& role,
                                                       const KeyNamespace& ns, const char* name) {
  ClientOptions o;
  o.socket_path = role.socket;
  o.ns = ns;
  o.chunk_bytes = run.chunk_bytes;
  o.client_name = name;
  o.token = role.token;
  o.connect_timeout = 1000ms;
  o.rpc_timeout = 2000ms;
  return Client::Connect(o);
}

// Overwrites every byte `c` maps, or deallocates every page of it (MADV_REMOVE: the server's
// copies into and out of the window then meet holes, which must cost nothing but this tenant's
// own data).
void Scribble(Client& c, std::mt19937_64& rng) {
  const uint8_t junk = static_cast<uint8_t>(rng());
  const bool punch = rng() % 2 == 0;
  for (uint32_t s = 0; s < c.num_slots(); ++s) {
    auto d = c.SlotData(s);
    if (punch) {
      const size_t len = (d.size() + 4095) / 4096 * 4096;  // slots start on a page
      (void)::madvise(d.data(), len, MADV_REMOVE);
    } else {
      std::memset(d.data(), junk, d.size());
    }
  }
}

}  // namespace

void ScribbleAsAnotherTenant(const StressOptions& run, const StressRoleOptions& role,
                             std::mt19937_64& rng) {
  KeyNamespace ns = StressNamespace();
  ns.tenant_salt = "stress-adversary";
  auto c = ConnectAsAnotherTenant(run, role, ns, "stress-adversary-tenant");
  if (!c.ok()) return;
  std::vector<ChunkKey> keys;
  for (int i = 0; i < 4; ++i) {
    keys.push_back(ConversationKeys(rng() % kConversations)[rng() % kMaxChunks]);
  }
  auto reserved = (*c)->ReserveSlots(keys);
  Scribble(**c, rng);
  if (reserved.ok()) {
    (void)(*c)->CommitSlots(std::span(keys).first(reserved->size()), *reserved);
  }
  auto load = (*c)->PrepareLoad(keys);
  if (load.ok()) {
    OpResult r = load->Wait();
    Scribble(**c, rng);
    (void)(*c)->Unpin(r.slots);
  }
  Scribble(**c, rng);
}

// Probing the conversations of odd prefix groups (c / 4: groups share their first chunk), which
// it never stores, it must find nothing; it stores garbage under the keys of the even groups.
bool IntrudeAsAnotherTenant(const StressOptions& run, const StressRoleOptions& role,
                            std::mt19937_64& rng) {
  auto c = ConnectAsAnotherTenant(run, role, StressNamespace(), "stress-intruder");
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

}  // namespace kvtier::stress

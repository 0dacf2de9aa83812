// The payload checksum (XXH3-64, seed 0), kept apart from the rest of the format code: it is the
// one part whose speed matters (every chunk read and written goes through it, cold from memory),
// and it is built differently from the header checksum.
//
// Where the xxHash library exports its runtime-dispatched entry points (x86-64 builds with
// DISPATCH=1, as Debian's), they pick the AVX-512 or AVX2 loop the CPU has. The project itself
// builds for baseline x86-64 (SSE2), so the inlined code would be SSE2 only. Measured on a
// 2.25 MiB payload not in the cache, 2-core VM: 11.1-11.5 GB/s through the dispatcher against
// 9.3-11.3 GB/s inlined one-shot and 9.1-9.2 GB/s inlined streaming; from the cache 33-39 against
// 24 GB/s. Elsewhere XXH3 is inlined (the library's generic build runs at ~6 GB/s).
#include <new>

#include "tier/file/chunk_file.h"

#if KVTIER_XXH3_DISPATCH
#include <xxh_x86dispatch.h>  // XXH3_64bits and XXH3_64bits_update become the _dispatch ones
#else
#define XXH_INLINE_ALL
#include <xxhash.h>
#endif

namespace kvtier::file_tier_internal {

uint64_t PayloadChecksum(std::span<const uint8_t> payload) {
  return XXH3_64bits(payload.data(), payload.size());
}

PayloadHasher::PayloadHasher() : state_(XXH3_createState()) {
  if (state_ == nullptr) throw std::bad_alloc();
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}
PayloadHasher::~PayloadHasher() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void PayloadHasher::Update(std::span<const uint8_t> bytes) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), bytes.data(), bytes.size());
}
uint64_t PayloadHasher::Digest() const {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_));
}

}  // namespace kvtier::file_tier_internal

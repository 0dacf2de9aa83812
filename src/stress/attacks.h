// The adversary's attacks other than malformed frames (adversary.cc): on the HTTP listener, and
// as another tenant through the real client library. Each connects, attacks once, and leaves;
// none checks replies, since the server must merely survive and its clients must not notice,
// except that another tenant must find nothing of the verifying clients'.
//
// Thread-safety: each call uses only its arguments; `rng` is the caller's.
#pragma once

#include <random>

#include "stress/stress.h"

namespace kvtier::stress {

// One attack on the current server's HTTP listener (docs/security.md, "A local user who is not
// a client"), at the port in HttpPortFile: idle connections by the dozen, oversized request
// lines, header lines, header counts and bodies, many ranges, or a request trickled a byte at a
// time.
void AttackHttp(const StressOptions& run, std::mt19937_64& rng);

// Another tenant with a real client: stores and pins chunks of its own, overwriting every byte
// it maps meanwhile or punching holes in it. REQUIRES: an isolated run (with the shared pool
// that would be everyone's chunks, docs/security.md).
void ScribbleAsAnotherTenant(const StressOptions& run, const StressRoleOptions& role,
                             std::mt19937_64& rng);

// Another tenant declaring exactly the verifying clients' namespace: it must find none of their
// chunks, and stores garbage under their keys, which they must never be served. False on a leak
// (said on stderr). REQUIRES: an isolated run.
bool IntrudeAsAnotherTenant(const StressOptions& run, const StressRoleOptions& role,
                            std::mt19937_64& rng);

}  // namespace kvtier::stress

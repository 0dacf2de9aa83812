// Where a `kvtier serve` daemon listens unless told otherwise: shared by the server, which binds
// there, and its clients, which connect there.
#pragma once

#include <string>

namespace kvtier {

// Where `kvtier serve` listens by default: $XDG_RUNTIME_DIR/kvtier.sock, else
// PrivateSocketDir()/kvtier.sock.
std::string DefaultSocketPath();
// $TMPDIR/kvtier-<uid> (TMPDIR defaulting to /tmp): the owner-only directory (0700) the server
// creates for its default socket when $XDG_RUNTIME_DIR is unset, so that no other user can bind
// the path first.
std::string PrivateSocketDir();

}  // namespace kvtier

// The server's Unix socket: refusing a path a live server answers on, replacing a stale one, and
// binding so that the path appears only once it listens.
#pragma once

#include <string>

#include "kvtier/status.h"

namespace kvtier::server {

// A live server at `path` is an error (kUnavailable); a stale socket file (its server died) is
// removed; anything else at the path is refused. A path inside PrivateSocketDir() gets that
// directory created (owner-only) or checked.
Status CheckSocketPath(const std::string& path);

// Binds a listening, non-blocking socket at `path` (checked as above): owner-only (0600), or
// 0660 and `group` when one is given. Returns its descriptor; the caller closes it and unlinks
// `path` when done.
Result<int> ListenOnSocketPath(const std::string& path, const std::string& group);

}  // namespace kvtier::server

// Internal: plain libnfs on one connection, the reference that benchmarks compare the NFS env
// with. A whole file per call, split into requests of the server's rsize/wsize that are all in
// flight at once, landing straight in the caller's buffer (libnfs's own whole-buffer calls would
// add a reassembly buffer and a copy). One client = one TCP connection; use one per thread.
#pragma once

#include <memory>
#include <span>
#include <string>

#include "kvtier/status.h"

struct nfs_context;

namespace kvtier::io {

class NfsRawClient {
 public:
  // Mounts the export of `url` (nfs://HOST/EXPORT[/PATH], as NewNfsEnv).
  static Result<std::unique_ptr<NfsRawClient>> Connect(const std::string& url);
  ~NfsRawClient();
  NfsRawClient(const NfsRawClient&) = delete;
  NfsRawClient& operator=(const NfsRawClient&) = delete;

  // Creates or truncates the file at `url`, writes `data`, COMMITs, closes.
  Status WriteFile(const std::string& url, std::span<const uint8_t> data);
  // Reads out.size() bytes from the start of the file; a short file is an error.
  Status ReadFile(const std::string& url, std::span<uint8_t> out);

 private:
  NfsRawClient() = default;
  nfs_context* nfs_ = nullptr;
  std::string prefix_;  // nfs://server/export
};

}  // namespace kvtier::io

// Internal: libnfs's own synchronous calls on one connection, the reference that benchmarks
// compare the NFS env with. A whole buffer per call: libnfs splits it into rsize/wsize requests
// and sends them all at once, as its `nfs-cp` does. One client = one TCP connection; use one per
// thread.
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

  // Creates or truncates the file at `url`, writes `data` in one call, COMMITs, closes.
  Status WriteFile(const std::string& url, std::span<const uint8_t> data);
  // Reads out.size() bytes from the start of the file in one call; a short file is kCorruption.
  Status ReadFile(const std::string& url, std::span<uint8_t> out);
  Status Unlink(const std::string& url);

 private:
  NfsRawClient() = default;
  nfs_context* nfs_ = nullptr;
  std::string prefix_;  // nfs://server/export
};

}  // namespace kvtier::io

// Internal: the engines behind PosixEnv. Both take a batch of positional ops on one descriptor,
// split large ops into pieces of `max_request_bytes`, keep up to `queue_depth` pieces in flight,
// and report per op the contiguous bytes moved (or -errno), as File::Submit promises.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvtier/io.h"

namespace kvtier::io {

class IoEngine {
 public:
  virtual ~IoEngine() = default;
  virtual std::string name() const = 0;
  // Returns non-OK only if nothing could be issued; otherwise every op's result is set.
  virtual Status Execute(int fd, std::span<IoOp> ops, IoObserver* observer) = 0;
};

// Fails if io_uring cannot be set up here (old kernel, seccomp, container policy).
Result<std::unique_ptr<IoEngine>> NewIoUringEngine(int queue_depth, size_t max_read_bytes,
                                                   size_t max_write_bytes);
std::unique_ptr<IoEngine> NewThreadPoolEngine(int threads, int queue_depth, size_t max_read_bytes,
                                              size_t max_write_bytes);

// A piece of an op, as the engines issue it.
struct IoPiece {
  size_t op;        // index into the ops
  uint64_t offset;
  uint8_t* buf;
  size_t len;
  int64_t result;
};
std::vector<IoPiece> SplitOps(std::span<const IoOp> ops, size_t max_read_bytes,
                              size_t max_write_bytes);
// Folds piece results back into the ops: an op's result is the bytes of its leading full pieces
// plus the first short piece's bytes; -errno if its first piece failed.
void GatherResults(std::span<IoOp> ops, std::span<const IoPiece> pieces);

}  // namespace kvtier::io

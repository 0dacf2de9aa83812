#include "io/io_engine.h"

#include <liburing.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include <fmt/format.h>

#include "common/task_pool.h"

namespace kvtier::io {

std::vector<IoPiece> SplitOps(std::span<const IoOp> ops, size_t max_read_bytes,
                              size_t max_write_bytes) {
  std::vector<IoPiece> pieces;
  for (size_t i = 0; i < ops.size(); ++i) {
    const IoOp& op = ops[i];
    if (op.len == 0) continue;
    const size_t max_request_bytes =
        op.kind == IoOp::Kind::kRead ? max_read_bytes : max_write_bytes;
    for (size_t done = 0; done < op.len; done += max_request_bytes) {
      size_t n = std::min(max_request_bytes, op.len - done);
      pieces.push_back({i, op.offset + done, op.buf + done, n, 0});
    }
  }
  return pieces;
}

void GatherResults(std::span<IoOp> ops, std::span<const IoPiece> pieces) {
  std::vector<bool> stopped(ops.size(), false);
  for (auto& op : ops) op.result = 0;
  for (const IoPiece& p : pieces) {  // pieces of one op are in offset order
    IoOp& op = ops[p.op];
    if (stopped[p.op]) continue;
    if (p.result < 0) {
      if (op.result == 0) op.result = p.result;
      stopped[p.op] = true;
    } else {
      op.result += p.result;
      if (static_cast<size_t>(p.result) < p.len) stopped[p.op] = true;
    }
  }
}

namespace {

// One ring per thread: rings are not safe for concurrent submitters, and a per-thread ring needs
// no lock on the I/O path. Rings are sized for the largest queue depth we allow.
constexpr unsigned kRingEntries = 64;

struct ThreadRing {
  io_uring ring;
  bool ready = false;
  int init_error = 0;
  ~ThreadRing() {
    if (ready) io_uring_queue_exit(&ring);
  }
  io_uring* Get() {
    if (!ready && init_error == 0) {
      int rc = io_uring_queue_init(kRingEntries, &ring, 0);
      if (rc < 0) {
        init_error = -rc;
      } else {
        ready = true;
      }
    }
    return ready ? &ring : nullptr;
  }
};
thread_local ThreadRing tls_ring;

class IoUringEngine final : public IoEngine {
 public:
  IoUringEngine(int queue_depth, size_t max_read_bytes, size_t max_write_bytes)
      : depth_(std::clamp(queue_depth, 1, static_cast<int>(kRingEntries))),
        max_read_bytes_(max_read_bytes),
        max_write_bytes_(max_write_bytes) {}

  std::string name() const override { return "io_uring"; }

  Status Execute(int fd, std::span<IoOp> ops, IoObserver* observer) override {
    io_uring* ring = tls_ring.Get();
    if (ring == nullptr) {
      return Status::FromErrno(tls_ring.init_error, "io_uring_queue_init on this thread");
    }
    std::vector<IoPiece> pieces = SplitOps(ops, max_read_bytes_, max_write_bytes_);
    // Progress reporting: pieces of an op are consecutive in `pieces`; an op's leading bytes are
    // done when its pieces up to there completed in full.
    std::vector<bool> complete(observer ? pieces.size() : 0, false);
    std::vector<size_t> frontier;  // per op: index of its first piece not yet reported
    if (observer) {
      frontier.assign(ops.size(), pieces.size());
      for (size_t i = pieces.size(); i-- > 0;) frontier[pieces[i].op] = i;
    }
    bool announced = false;
    size_t next = 0, inflight = 0;
    while (next < pieces.size() || inflight > 0) {
      while (next < pieces.size() && inflight < static_cast<size_t>(depth_)) {
        io_uring_sqe* sqe = io_uring_get_sqe(ring);
        if (sqe == nullptr) break;
        IoPiece& p = pieces[next];
        if (ops[p.op].kind == IoOp::Kind::kRead) {
          io_uring_prep_read(sqe, fd, p.buf, static_cast<unsigned>(p.len), p.offset);
        } else {
          io_uring_prep_write(sqe, fd, p.buf, static_cast<unsigned>(p.len), p.offset);
        }
        io_uring_sqe_set_data64(sqe, next);
        ++next;
        ++inflight;
      }
      int rc = io_uring_submit_and_wait(ring, 1);
      if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
        // Nothing more can be issued; collect what is in flight before failing the rest.
        for (size_t i = next; i < pieces.size(); ++i) pieces[i].result = rc;
        next = pieces.size();
        if (inflight == 0) break;
        io_uring_cqe* cqe;
        while (inflight > 0 && io_uring_wait_cqe(ring, &cqe) == 0) {
          pieces[io_uring_cqe_get_data64(cqe)].result = cqe->res;
          io_uring_cqe_seen(ring, cqe);
          --inflight;
        }
        break;
      }
      if (observer && !announced) {
        announced = true;
        observer->Submitted();
      }
      io_uring_cqe* cqe;
      bool advanced = false;
      while (io_uring_peek_cqe(ring, &cqe) == 0) {
        size_t idx = io_uring_cqe_get_data64(cqe);
        IoPiece& p = pieces[idx];
        p.result = cqe->res;
        io_uring_cqe_seen(ring, cqe);
        --inflight;
        if (observer && p.result == static_cast<int64_t>(p.len)) {
          complete[idx] = true;
          advanced = true;
        }
      }
      if (advanced) {
        for (size_t op = 0; op < ops.size(); ++op) {
          size_t f = frontier[op];
          size_t start = f;
          while (f < pieces.size() && pieces[f].op == op && complete[f]) ++f;
          if (f != start) {
            frontier[op] = f;
            const IoPiece& last = pieces[f - 1];
            observer->Progress(op, last.offset + last.len - ops[op].offset);
          }
        }
      }
    }
    if (observer && !announced) observer->Submitted();
    GatherResults(ops, pieces);
    return Status::Ok();
  }

 private:
  const int depth_;
  const size_t max_read_bytes_, max_write_bytes_;
};

int64_t DoPieceSync(int fd, bool read, const IoPiece& p) {
  for (;;) {
    ssize_t n = read ? ::pread(fd, p.buf, p.len, static_cast<off_t>(p.offset))
                     : ::pwrite(fd, p.buf, p.len, static_cast<off_t>(p.offset));
    if (n >= 0) return n;
    if (errno != EINTR) return -errno;
  }
}

class ThreadPoolEngine final : public IoEngine {
 public:
  ThreadPoolEngine(int threads, int queue_depth, size_t max_read_bytes, size_t max_write_bytes)
      : pool_(threads, /*max_queued=*/0, "kvtier-io"),
        depth_(std::max(queue_depth, 1)),
        max_read_bytes_(max_read_bytes),
        max_write_bytes_(max_write_bytes) {}

  std::string name() const override { return "threads"; }

  Status Execute(int fd, std::span<IoOp> ops, IoObserver* observer) override {
    std::vector<IoPiece> pieces = SplitOps(ops, max_read_bytes_, max_write_bytes_);
    if (pieces.empty()) {
      if (observer) observer->Submitted();
      GatherResults(ops, pieces);
      return Status::Ok();
    }
    // Up to depth_ workers pull pieces from a shared cursor; the calling thread is one of them,
    // so a busy pool slows a call down but can never deadlock it.
    struct Shared {
      std::atomic<size_t> next{0};
      std::mutex mu;
      std::condition_variable cv;
      int helpers_left = 0;
    } shared;
    auto work = [&shared, &pieces, &ops, fd] {
      for (;;) {
        size_t i = shared.next.fetch_add(1);
        if (i >= pieces.size()) return;
        pieces[i].result = DoPieceSync(fd, ops[pieces[i].op].kind == IoOp::Kind::kRead, pieces[i]);
      }
    };
    int helpers = static_cast<int>(std::min<size_t>(pieces.size(), depth_)) - 1;
    for (int h = 0; h < helpers; ++h) {
      {
        std::lock_guard<std::mutex> lock(shared.mu);
        ++shared.helpers_left;
      }
      bool queued = pool_.TrySubmit([&shared, work] {
        work();
        std::lock_guard<std::mutex> lock(shared.mu);
        if (--shared.helpers_left == 0) shared.cv.notify_all();
      }).ok();
      if (!queued) {
        std::lock_guard<std::mutex> lock(shared.mu);
        --shared.helpers_left;
      }
    }
    // With helpers running, the caller's CPU work overlaps their I/O; then it joins in.
    if (observer) observer->Submitted();
    work();
    std::unique_lock<std::mutex> lock(shared.mu);
    shared.cv.wait(lock, [&shared] { return shared.helpers_left == 0; });
    GatherResults(ops, pieces);
    return Status::Ok();
  }

 private:
  TaskPool pool_;
  const int depth_;
  const size_t max_read_bytes_, max_write_bytes_;
};

}  // namespace

Result<std::unique_ptr<IoEngine>> NewIoUringEngine(int queue_depth, size_t max_read_bytes,
                                                   size_t max_write_bytes) {
  // Probe on this thread: if io_uring is refused here, it will be everywhere in this process.
  if (tls_ring.Get() == nullptr) {
    return Status::FromErrno(tls_ring.init_error, "io_uring is unavailable")
        .WithContext("io engine");
  }
  return std::unique_ptr<IoEngine>(new IoUringEngine(queue_depth, max_read_bytes,
                                                     max_write_bytes));
}

std::unique_ptr<IoEngine> NewThreadPoolEngine(int threads, int queue_depth, size_t max_read_bytes,
                                              size_t max_write_bytes) {
  return std::make_unique<ThreadPoolEngine>(threads, queue_depth, max_read_bytes,
                                            max_write_bytes);
}

}  // namespace kvtier::io

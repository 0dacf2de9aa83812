#include "common/task_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <future>

#include "testing/wait.h"

namespace kvtier {
namespace {

TEST(TaskPoolTest, RunsEverything) {
  std::atomic<int> n{0};
  {
    TaskPool pool(2, 100, "test pool");
    for (int i = 0; i < 50; ++i) ASSERT_TRUE(pool.TrySubmit([&] { n++; }).ok());
    pool.Drain();
    EXPECT_EQ(n.load(), 50);
    for (int i = 0; i < 10; ++i) ASSERT_TRUE(pool.TrySubmit([&] { n++; }).ok());
  }  // destructor runs what is queued
  EXPECT_EQ(n.load(), 60);
}

TEST(TaskPoolTest, RejectsWholeBatchWhenFull) {
  TaskPool pool(1, 3, "test pool");
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  std::atomic<int> n{0};
  ASSERT_TRUE(pool.TrySubmit([open] { open.wait(); }).ok());  // occupies the worker
  while (pool.queued() != 0) std::this_thread::yield();
  std::vector<std::function<void()>> batch(4, [&] { n++; });
  Status s = pool.TrySubmit(batch);
  EXPECT_TRUE(s.IsRejected());
  EXPECT_TRUE(s.retryable());
  EXPECT_EQ(pool.queued(), 0u);  // nothing of the batch was queued
  batch.resize(3);
  EXPECT_TRUE(pool.TrySubmit(batch).ok());
  gate.set_value();
  pool.Drain();
  EXPECT_EQ(n.load(), 3);
  EXPECT_EQ(pool.rejections(), 1u);
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

TEST(TaskPoolTest, ZeroLimitMeansUnbounded) {
  TaskPool pool(1, 0, "unbounded pool");
  std::atomic<int> n{0};
  std::vector<std::function<void()>> batch(5000, [&] { n++; });
  EXPECT_TRUE(pool.TrySubmit(batch).ok());
  pool.Drain();
  EXPECT_EQ(n.load(), 5000);
}

}  // namespace
}  // namespace kvtier

namespace kvtier {
namespace {

using namespace std::chrono_literals;

// A task stuck "in the kernel" (here: on a gate) is replaced, so the queue keeps moving; Drain
// and shutdown stop waiting for it after a stall timeout instead of hanging.
TEST(TaskPoolTest, StalledTaskIsReplacedAndAbandonedAtShutdown) {
  TaskPoolOptions o;
  o.threads = 1;
  o.max_queued = 16;
  o.name = "stall test pool";
  o.stall_timeout = 50ms;
  o.max_extra_threads = 2;
  auto pool = std::make_unique<TaskPool>(o);
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  auto stuck_done = std::make_shared<std::atomic<bool>>(false);
  ASSERT_TRUE(pool->TrySubmit([open, stuck_done] {
                    open.wait();
                    stuck_done->store(true);
                  })
                  .ok());
  // Queued behind the stuck task: a replacement thread runs it once the stall is noticed.
  std::promise<void> ran;
  ASSERT_TRUE(pool->TrySubmit([&ran] { ran.set_value(); }).ok());
  ASSERT_EQ(ran.get_future().wait_for(10s), std::future_status::ready);
  EXPECT_GE(pool->replacements(), 1u);
  // The stuck task; the replacement that ran `ran` is busy until it takes the lock again, and
  // counts as stalled too if it is descheduled that long: wait for it to be idle.
  EXPECT_TRUE(testing::WaitUntil([&] { return pool->stalled() == 1u; })) << pool->stalled();
  EXPECT_LE(pool->threads(), 3u);

  EXPECT_FALSE(pool->Drain());  // gives up on the stuck task
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(pool->Shutdown(), 1u);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  EXPECT_TRUE(pool->TrySubmit([] {}).code() == StatusCode::kAborted);
  pool.reset();  // the stuck thread is detached; the pool object can go
  EXPECT_EQ(TaskPool::DetachedRunning(), 1u);  // before the gate opens: it could finish at once
  gate.set_value();
  EXPECT_TRUE(testing::WaitUntil([] { return TaskPool::DetachedRunning() == 0; }))
      << TaskPool::DetachedRunning() << " detached threads still running";
  EXPECT_TRUE(stuck_done->load());
}

// Without stall handling a slow task is waited for, as before.
TEST(TaskPoolTest, WithoutStallHandlingShutdownWaits) {
  std::atomic<bool> finished{false};
  {
    TaskPool pool(1, 4, "patient pool");
    ASSERT_TRUE(pool.TrySubmit([&] {
                      std::this_thread::sleep_for(100ms);
                      finished = true;
                    })
                    .ok());
  }
  EXPECT_TRUE(finished.load());
}

}  // namespace
}  // namespace kvtier

#include "common/task_pool.h"

#include <atomic>
#include <future>

#include <gtest/gtest.h>

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

#include "io/worker_pool.h"

#include <atomic>
#include <chrono>
#include <future>

#include <gtest/gtest.h>

namespace kvtier::io {
namespace {

TEST(WorkerPoolTest, RunsEveryTaskAndWaitsIdle) {
  WorkerPool pool("test", 3, 0);
  std::atomic<int> ran{0};
  for (int i = 0; i < 200; ++i) ASSERT_TRUE(pool.TrySubmit([&ran] { ran.fetch_add(1); }));
  pool.WaitIdle();
  EXPECT_EQ(ran.load(), 200);
}

TEST(WorkerPoolTest, FullQueueRefusesInsteadOfBlocking) {
  WorkerPool pool("test", 1, 2);
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  std::promise<void> started;
  ASSERT_TRUE(pool.TrySubmit([gate, &started] {
    started.set_value();
    gate.wait();
  }));
  started.get_future().wait();  // the worker is busy; the queue is empty
  EXPECT_TRUE(pool.TrySubmit([] {}));
  EXPECT_TRUE(pool.TrySubmit([] {}));
  EXPECT_FALSE(pool.TrySubmit([] {}));  // two queued: full
  EXPECT_EQ(pool.queued(), 2u);
  release.set_value();
  pool.WaitIdle();
  EXPECT_TRUE(pool.TrySubmit([] {}));
}

TEST(WorkerPoolTest, DestructorRunsQueuedWork) {
  std::atomic<int> ran{0};
  {
    WorkerPool pool("test", 1, 0);
    for (int i = 0; i < 50; ++i) {
      ASSERT_TRUE(pool.TrySubmit([&ran] {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        ran.fetch_add(1);
      }));
    }
  }
  EXPECT_EQ(ran.load(), 50);
}

}  // namespace
}  // namespace kvtier::io

// The reaper: one thread that destroys the C++ objects whose destructors may block, so that
// dropping a Python object never blocks its caller. Drained and joined by an atexit hook, before
// the interpreter finalizes; later drops are destroyed inline.
#include <Python.h>  // first, as Python's headers require
#include <nanobind/nanobind.h>
#include <pthread.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>

#include "python/binding.h"

namespace kvtier::python {

struct Reaper::State {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Work> queue;
  bool stop = false;
  std::thread thread;
};

Reaper::State* Reaper::state_ = nullptr;
bool Reaper::shut_down_ = false;

void Reaper::Reap(Work work) {
  if (shut_down_) {
    work();
    return;
  }
  if (state_ == nullptr) {
    state_ = new State;
    State* s = state_;
    s->thread = std::thread([s] { Loop(s); });
  }
  {
    std::lock_guard lock(state_->mu);
    state_->queue.push_back(std::move(work));
  }
  state_->cv.notify_one();
}

void Reaper::Shutdown() {
  shut_down_ = true;
  State* s = state_;
  if (s == nullptr) return;
  state_ = nullptr;
  {
    std::lock_guard lock(s->mu);
    s->stop = true;
  }
  s->cv.notify_one();
  {
    nb::gil_scoped_release release;
    s->thread.join();
  }
  delete s;
}

void Reaper::AfterForkInChild() { state_ = nullptr; }

void Reaper::Loop(State* s) {
  for (;;) {
    Work work;
    {
      std::unique_lock lock(s->mu);
      s->cv.wait(lock, [s] { return s->stop || !s->queue.empty(); });
      if (s->queue.empty()) return;  // stop requested and everything done
      work = std::move(s->queue.front());
      s->queue.pop_front();
    }
    work();
    work = nullptr;  // captured objects die here, off the caller's thread
  }
}

void RegisterReaper(nb::module_& m) {
  // Drain the reaper before the interpreter finalizes (its work may need the GIL), and give a
  // forked child a fresh one.
  nb::module_::import_("atexit").attr("register")(
      nb::cpp_function([] { Reaper::Shutdown(); }, nb::name("_shutdown_reaper")));
  pthread_atfork(nullptr, nullptr, [] { Reaper::AfterForkInChild(); });
}

}  // namespace kvtier::python

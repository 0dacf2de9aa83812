#include "server/connection.h"

#include <prometheus/counter.h>
#include <spdlog/spdlog.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/fd_passing.h"

namespace kvtier::server {

bool Connection::FlushLocked() {
  while (out_begin < out.size()) {
    ssize_t w =
        ::send(fd, out.data() + out_begin, out.size() - out_begin, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      out_begin += static_cast<size_t>(w);
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (out_begin > out.size() / 2) {  // the buffer stays under twice what is queued
        out.erase(out.begin(), out.begin() + static_cast<ptrdiff_t>(out_begin));
        out_begin = 0;
      }
      return true;
    }
    DropLocked();
    return false;
  }
  out.clear();
  out_begin = 0;
  return true;
}

void Connection::DropLocked() {
  if (out_closed) return;
  out_closed = true;
  ::shutdown(fd, SHUT_RDWR);
}

Connection::~Connection() {
  if (window_budget) {
    std::lock_guard lock(window_budget->mu);
    window_budget->used -= window_charge;
  }
}

Status OutputPump::Start() {
  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0) return Status::FromErrno(errno, "epoll_create1");
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) return Status::FromErrno(errno, "eventfd");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = 0;  // connection ids start at 1
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev) != 0) {
    return Status::FromErrno(errno, "epoll_ctl");
  }
  thread_ = std::thread([this] { Run(); });
  return Status::Ok();
}

void OutputPump::Stop() {
  stopping_ = true;
  if (wake_fd_ >= 0) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t w = ::write(wake_fd_, &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
  if (epoll_fd_ >= 0) ::close(epoll_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
  epoll_fd_ = wake_fd_ = -1;
}

void OutputPump::Watch(const std::shared_ptr<Connection>& c) {
  epoll_event ev{};
  ev.events = EPOLLOUT | EPOLLONESHOT;
  ev.data.u64 = c->id;
  {
    std::lock_guard lock(mu_);
    watched_[c->id] = c;
  }
  if (::epoll_ctl(epoll_fd_, c->out_armed ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, c->fd, &ev) != 0) {
    c->DropLocked();
    return;
  }
  c->out_armed = true;
}

void OutputPump::Forget(Connection& c) {
  if (c.out_armed && c.fd >= 0) ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c.fd, nullptr);
  c.out_armed = false;
  std::lock_guard lock(mu_);
  watched_.erase(c.id);
}

void OutputPump::Run() {
  epoll_event events[64];
  while (!stopping_) {
    int n = ::epoll_wait(epoll_fd_, events, 64, 250);
    std::vector<std::shared_ptr<Connection>> ready;
    {
      std::lock_guard lock(mu_);
      for (int i = 0; i < n; ++i) {
        auto it = watched_.find(events[i].data.u64);
        if (it == watched_.end()) continue;
        if (auto c = it->second.lock()) ready.push_back(std::move(c));
      }
    }
    for (auto& c : ready) {
      std::lock_guard lock(c->out_mu);
      if (c->out_closed) continue;
      if (c->FlushLocked() && !c->out.empty()) Watch(c);
    }
    // Deadlines: a client whose replies sit unread for timeout_ is dropped.
    std::vector<std::shared_ptr<Connection>> all;
    {
      std::lock_guard lock(mu_);
      for (auto it = watched_.begin(); it != watched_.end();) {
        auto c = it->second.lock();
        if (!c) {
          it = watched_.erase(it);
          continue;
        }
        all.push_back(std::move(c));
        ++it;
      }
    }
    const auto now = Clock::now();
    for (auto& c : all) {
      std::lock_guard lock(c->out_mu);
      if (c->out_closed || c->out.empty() || now - c->out_since < timeout_) continue;
      spdlog::warn(
          "dropping client {} (pid {}, \"{}\"): it left {} bytes of replies unread for "
          "{} ms",
          c->id, c->peer_pid, c->name, c->out.size() - c->out_begin, timeout_.count());
      dropped_->Increment();
      c->DropLocked();
    }
  }
}

bool SendFrame(Connection& c, const std::vector<uint8_t>& frame, int pass_fd,
               uint64_t max_output_bytes, OutputPump& pump, prometheus::Counter& dropped_slow) {
  std::lock_guard lock(c.out_mu);
  if (c.out_closed) return false;
  size_t sent = 0;
  if (c.out.empty()) {
    // Nothing queued: write directly, without blocking.
    while (sent < frame.size()) {
      ssize_t w;
      if (pass_fd >= 0 && sent == 0) {
        w = SendWithFd(c.fd, frame.data(), frame.size(), pass_fd, MSG_NOSIGNAL | MSG_DONTWAIT);
      } else {
        w = ::send(c.fd, frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      }
      if (w > 0) {
        sent += static_cast<size_t>(w);
        continue;
      }
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        if (pass_fd >= 0 && sent == 0) {  // the descriptor must ride on the first byte
          c.DropLocked();
          return false;
        }
        break;
      }
      c.DropLocked();
      return false;
    }
    if (sent == frame.size()) return true;
  }
  // The client is not reading as fast as it asks: queue, bounded.
  if (c.out.size() - c.out_begin + frame.size() - sent > max_output_bytes) {
    spdlog::warn("dropping client {} (pid {}, \"{}\"): more than {} bytes of replies unread", c.id,
                 c.peer_pid, c.name, max_output_bytes);
    dropped_slow.Increment();
    c.DropLocked();
    return false;
  }
  if (c.out.empty()) c.out_since = Clock::now();
  c.out.insert(c.out.end(), frame.begin() + static_cast<ptrdiff_t>(sent), frame.end());
  pump.Watch(c.shared_from_this());
  return !c.out_closed;
}

}  // namespace kvtier::server

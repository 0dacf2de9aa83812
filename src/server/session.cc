// A connection's life past its handshake: its thread reads requests and hands them to the
// handlers (handlers.cc), replies go out without blocking, and whatever it held is released
// however it ends.
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "server/printable.h"
#include "server/server_impl.h"

namespace kvtier::server {

bool Server::Impl::Send(Connection& c, const std::vector<uint8_t>& frame, int pass_fd) {
  return SendFrame(c, frame, pass_fd, options_.max_output_bytes, pump_, *slow_drops_);
}

void Server::Impl::Refuse(Connection& c, const FrameHeader& h, const Status& s,
                          const char* reason) {
  spdlog::warn("refusing client {} (pid {}, \"{}\"): {}", c.id, c.peer_pid, LogSafe(c.name),
               LogSafe(s.ToString()));
  if (auto it = metrics_.refused_by.find(reason); it != metrics_.refused_by.end()) {
    it->second->Increment();
  }
  Send(c, EncodeReply(h.opcode, h.request_id, s));
}

void Server::Impl::ProtocolError(Connection& c, const FrameHeader& h, const Status& s) {
  spdlog::warn("closing client {} (pid {}, \"{}\") after a protocol error: {}", c.id, c.peer_pid,
               LogSafe(c.name), LogSafe(s.ToString()));
  metrics_.protocol_errors.Increment();
  Send(c, EncodeReply(h.opcode & ~kReplyBit, h.request_id, s));
}

bool Server::Impl::ReadFrame(Connection& c, std::vector<uint8_t>& buf, size_t& begin, size_t& end,
                             FrameHeader* header, std::span<const uint8_t>* body) {
  auto fill = [&](size_t need) -> bool {
    if (end - begin >= need) return true;
    if (begin > 0) {  // compact: the unread bytes go to the front
      std::memmove(buf.data(), buf.data() + begin, end - begin);
      end -= begin;
      begin = 0;
    }
    if (buf.size() < need) buf.resize(need);
    while (end < need) {
      ssize_t r = ::recv(c.fd, buf.data() + end, buf.size() - end, 0);
      if (r == 0) return false;
      if (r < 0) {
        if (errno == EINTR) continue;
        return false;
      }
      end += static_cast<size_t>(r);
    }
    return true;
  };
  if (!fill(kHeaderBytes)) return false;
  *header = DecodeHeader(buf.data() + begin);
  Status s = CheckRequestHeader(*header, options_.max_message_bytes);
  if (!s.ok()) {
    // Oversized lengths are never read: the connection is closed right away.
    ProtocolError(c, *header, s);
    return false;
  }
  if (!fill(kHeaderBytes + header->body_length)) return false;
  *body = std::span<const uint8_t>(buf.data() + begin + kHeaderBytes, header->body_length);
  begin += kHeaderBytes + header->body_length;
  return true;
}

void Server::Impl::Serve(std::shared_ptr<Connection> conn, std::vector<uint8_t> hello_reply) {
  Connection& c = *conn;
  // What the client sent after its hello came in with it.
  std::vector<uint8_t> buf = std::move(c.in);
  size_t begin = 0, end = buf.size();
  if (buf.size() < 64 * 1024) buf.resize(64 * 1024);
  // Counted (and listed in /stats) before the client hears its reply: a client that has
  // connected must find itself in the metrics it reads next. A failed send undoes it in Release.
  {
    std::lock_guard lock(c.mu);
    c.handshaken = true;
  }
  metrics_.connected.Increment();
  if (Send(c, hello_reply, c.window ? c.window->fd() : engine_->pool().fd)) {
    spdlog::info("client {} connected: pid {}, uid {}, \"{}\", model \"{}\" rank {}/{}{}", c.id,
                 c.peer_pid, c.peer_uid, c.name, c.ns.model_id, c.ns.rank, c.ns.world_size,
                 c.tenant.empty() ? "" : ", tenant " + c.tenant);
    FrameHeader h;
    std::span<const uint8_t> body;
    while (ReadFrame(c, buf, begin, end, &h, &body)) {
      if (!Handle(conn, h, body)) break;
    }
  }
  Release(c);
  c.finished = true;
}

void Server::Impl::Release(Connection& c) {
  std::vector<SlotId> reserved, pinned;
  bool was_handshaken;
  {
    std::lock_guard lock(c.mu);
    c.closed = true;
    was_handshaken = c.handshaken;
    for (auto& [slot, r] : c.reservations) reserved.push_back(r.pool);
    for (auto& [slot, n] : c.pins) {
      for (uint32_t i = 0; i < n; ++i) pinned.push_back(slot);
    }
    if (c.window) {  // window pins hold nothing in the pool
      for (SlotId s : pinned) c.window->Give(s);
    }
    c.reservations.clear();
    c.pins.clear();
    c.pinned = 0;
    AccountLocked(c);  // what is left: prepare_loads still running (FinishPrepareLoad ends them)
  }
  {
    std::lock_guard lock(c.out_mu);
    c.out_closed = true;
    pump_.Forget(c);
    ::close(c.fd);
    c.fd = -1;
  }
  engine_->AbortSlots(reserved);
  if (!c.window) engine_->Unpin(pinned);
  if (was_handshaken) metrics_.connected.Decrement();
  if (!reserved.empty() || !pinned.empty()) {
    metrics_.released_on_disconnect.Increment(static_cast<double>(reserved.size() + pinned.size()));
    spdlog::info(
        "client {} (pid {}, \"{}\") disconnected holding {} reservations and {} pins: "
        "released",
        c.id, c.peer_pid, c.name, reserved.size(), pinned.size());
  } else {
    spdlog::debug("client {} disconnected", c.id);
  }
}

}  // namespace kvtier::server

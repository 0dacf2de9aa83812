// Sockets without the client library, for the adversary: it speaks bytes the client library
// would never send. Every call gives up quietly: the adversary's replies are not checked (the
// server must merely survive, and its other clients must not notice).
//
// Thread-safety: plain functions on the caller's descriptors.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>

namespace kvtier::stress {

// A connection to the Unix socket at `path`, or to 127.0.0.1:port over TCP, with a short send
// timeout (a server that stops reading must not stall the adversary). -1 if nobody listens.
int ConnectUnix(const std::string& path);
int ConnectTcp(int port);

// Sends what the peer takes; stops at the first error.
void SendAll(int fd, std::span<const uint8_t> bytes);
void SendText(int fd, const std::string& text);

// Reads and drops whatever comes within `wait`, or until the peer closes.
void Drain(int fd, std::chrono::milliseconds wait);

}  // namespace kvtier::stress

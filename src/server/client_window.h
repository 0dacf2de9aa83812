// ClientWindow: the shared memory an isolated client maps instead of the pool
// (docs/protocol.md, "Isolated clients").
//
// A memfd of `slots` slots of the pool's slot size, size-sealed so the client cannot resize it
// under the server's mapping, and handed to one client only. The server copies chunks between
// the pool and the window; the client sees window slot numbers alone. Pages are allocated as
// they are first touched.
//
// Thread-safety: Take and Give are not thread-safe (the connection's mutex guards them); Data
// may be used from any thread for a slot the caller holds.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "kvtier/eviction.h"
#include "kvtier/status.h"

namespace kvtier::server {

class ClientWindow {
 public:
  // kInvalidArgument for zero slots; kNoSpace/kIOError if the memfd cannot be made or mapped.
  static Result<std::unique_ptr<ClientWindow>> Create(uint32_t slots, uint64_t slot_bytes);
  ~ClientWindow();
  ClientWindow(const ClientWindow&) = delete;
  ClientWindow& operator=(const ClientWindow&) = delete;

  int fd() const { return fd_; }
  uint64_t bytes() const { return bytes_; }
  uint32_t num_slots() const { return num_slots_; }
  std::span<uint8_t> Data(SlotId slot, uint64_t length) const {
    return {base_ + static_cast<uint64_t>(slot) * slot_bytes_, length};
  }
  // A free slot, or kNoSlot when all are held.
  SlotId Take();
  void Give(SlotId slot);
  size_t free_slots() const { return free_.size(); }

 private:
  ClientWindow() = default;
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  uint64_t bytes_ = 0, slot_bytes_ = 0;
  uint32_t num_slots_ = 0;
  std::vector<SlotId> free_;
};

}  // namespace kvtier::server

#include "server/client_window.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

namespace kvtier::server {

Result<std::unique_ptr<ClientWindow>> ClientWindow::Create(uint32_t slots, uint64_t slot_bytes) {
  if (slots == 0 || slot_bytes == 0) {
    return Status::InvalidArgument("a client window needs at least one slot");
  }
  std::unique_ptr<ClientWindow> w(new ClientWindow());
  w->bytes_ = static_cast<uint64_t>(slots) * slot_bytes;
  w->slot_bytes_ = slot_bytes;
  w->num_slots_ = slots;
  w->fd_ = memfd_create("kvtier-client-window", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (w->fd_ < 0) return Status::FromErrno(errno, "memfd_create for a client window");
  if (ftruncate(w->fd_, static_cast<off_t>(w->bytes_)) != 0) {
    return Status::FromErrno(errno, fmt::format("sizing a client window to {} bytes", w->bytes_));
  }
  // Sealed before the client sees it: a shrink would make the server's copies fault (SIGBUS).
  if (fcntl(w->fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return Status::FromErrno(errno, "sealing a client window");
  }
  void* p = mmap(nullptr, w->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, w->fd_, 0);
  if (p == MAP_FAILED) return Status::FromErrno(errno, "mapping a client window");
  w->base_ = static_cast<uint8_t*>(p);
  w->free_.reserve(slots);
  for (uint32_t s = slots; s-- > 0;) w->free_.push_back(s);  // slot 0 first
  return w;
}

ClientWindow::~ClientWindow() {
  if (base_) munmap(base_, bytes_);
  if (fd_ >= 0) close(fd_);
}

SlotId ClientWindow::Take() {
  if (free_.empty()) return kNoSlot;
  SlotId s = free_.back();
  free_.pop_back();
  return s;
}

void ClientWindow::Give(SlotId slot) { free_.push_back(slot); }

}  // namespace kvtier::server

#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "kvtier/io.h"

namespace kvtier {

AlignedBuffer::AlignedBuffer(size_t size) : size_(AlignUp(size)) {
  if (size_ == 0) return;
  data_ = static_cast<uint8_t*>(std::aligned_alloc(kDirectIoAlignment, size_));
  if (data_ == nullptr) throw std::bad_alloc();  // like operator new: out of memory is fatal
  std::memset(data_, 0, size_);
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

}  // namespace kvtier

#include "strata/nvme/checksum.h"

#include <xxhash.h>

namespace strata::nvme {

uint64_t checksum64(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

struct ChecksumStream::State {
  XXH3_state_t* xxh = nullptr;
};

ChecksumStream::ChecksumStream() : state_(std::make_unique<State>()) {
  state_->xxh = XXH3_createState();
  XXH3_64bits_reset(state_->xxh);
}

ChecksumStream::~ChecksumStream() {
  if (state_ && state_->xxh) XXH3_freeState(state_->xxh);
}

ChecksumStream::ChecksumStream(ChecksumStream&&) noexcept = default;
ChecksumStream& ChecksumStream::operator=(ChecksumStream&& other) noexcept {
  if (this != &other) {
    if (state_ && state_->xxh) XXH3_freeState(state_->xxh);
    state_ = std::move(other.state_);
  }
  return *this;
}

void ChecksumStream::update(const void* data, size_t bytes) { XXH3_64bits_update(state_->xxh, data, bytes); }

uint64_t ChecksumStream::digest() const { return XXH3_64bits_digest(state_->xxh); }

}  // namespace strata::nvme

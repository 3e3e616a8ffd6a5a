#pragma once
// LentBuffers: device buffers under a cap, freed only once their users are
// done. Private to offload/src.
//
// Note [Lent buffers]
// The engine allocates two kinds of transient device buffers whose total a
// config key bounds: stage-3 gathered layers (stage3_max_live_parameters)
// and stage 2-3 full gradients (reduce_bucket_size). Each is lent out (to
// the model's stream, a collective, a copy) and handed back with a
// Completion `safe` that completes once every user is done; only then is it
// freed, successfully or not. Frees are not left to a stream's order alone,
// because a failed stream skips its waits and would free early (found by
// ASan when a rank failed mid-step). A buffer handed back still counts
// against the cap until it is freed, so the cap bounds what the device
// really holds.
//
// One LentBuffers per kind; only the driving thread calls it. Waits go
// through the engine's bounded wait (Note [Bounded waits] in engine.h).
#include <cstdint>
#include <deque>
#include <functional>
#include <string_view>
#include <utility>

#include "strata/core/completion.h"
#include "strata/core/device.h"
#include "strata/core/status.h"

namespace strata::offload {

class LentBuffers {
 public:
  // `frees`: a stream nothing gates, so a free on it runs at once.
  using BoundedWait = std::function<Status(const Completion&, std::string_view what)>;
  LentBuffers(Stream* frees, BoundedWait wait) : frees_(frees), wait_(std::move(wait)) {}

  // A buffer of `elements` was allocated for lending.
  void hold(uint64_t elements) { held_ += elements; }
  // Hands `buffer` back: freed once `safe` (the engine's own users) and
  // `returned` (memory the caller may still read: Note [Lent memory
  // outlives its release] in the Python bindings) have completed. Waits are
  // for `safe` only: what the caller holds is never waited for here (the
  // caller may be the thread that would wait), it is freed once returned
  // and counts against the cap until then.
  void give_back(DeviceBuffer&& buffer, Completion safe, uint64_t elements, Completion returned = {}) {
    held_ -= elements;
    freeing_.push_back(Deferred{std::move(safe), std::move(returned), std::move(buffer), elements});
  }
  // Elements allocated and not handed back.
  uint64_t held() const { return held_; }
  // Elements the device holds: held, plus handed back and not freed yet
  // (after freeing what is already safe to free).
  uint64_t live() {
    reap(false).ignore();
    uint64_t n = held_;
    for (const Deferred& d : freeing_) n += d.elements;
    return n;
  }
  // Waits (oldest first) until `more` elements fit under `cap`, or nothing
  // is left to wait for (a cap is never below one buffer; buffers the
  // caller still holds are not waited for).
  Status make_room(uint64_t more, uint64_t cap) {
    while (live() + more > cap && engine_still_uses_one()) STRATA_RETURN_IF_ERROR(reap(true));
    return Status::Ok();
  }
  // Frees everything handed back, waiting for the engine's users of each
  // (what the caller still holds is freed once returned).
  Status drain() {
    while (engine_still_uses_one()) STRATA_RETURN_IF_ERROR(reap(true));
    return reap(false);
  }

 private:
  struct Deferred {
    Completion safe;
    Completion returned;
    DeviceBuffer buffer;
    uint64_t elements = 0;
  };
  bool engine_still_uses_one() const {
    for (const Deferred& d : freeing_)
      if (!d.safe.done()) return true;
    return false;
  }
  // Frees what is safe to free; with `block`, first waits for the oldest
  // buffer the engine's own work still uses. Synchronizing the free stream
  // makes the memory reusable at once.
  Status reap(bool block) {
    if (block)
      for (const Deferred& d : freeing_)
        if (!d.safe.done()) {
          // Failed or not, its users are done once it completed.
          STRATA_RETURN_IF_ERROR(wait_(d.safe, "freeing a buffer lent to the model, a copy or a collective"));
          break;
        }
    bool freed = false;
    for (auto it = freeing_.begin(); it != freeing_.end();) {
      if (!it->safe.done() || !it->returned.done()) {
        ++it;
        continue;
      }
      STRATA_RETURN_IF_ERROR(frees_->free_async(std::move(it->buffer)));  // the device uncounts it when it runs
      it = freeing_.erase(it);
      freed = true;
    }
    return freed ? frees_->synchronize() : Status::Ok();
  }

  Stream* frees_;
  BoundedWait wait_;
  uint64_t held_ = 0;
  std::deque<Deferred> freeing_;
};

}  // namespace strata::offload

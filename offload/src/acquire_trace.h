#pragma once
// The acquire sequence of a training micro-batch, recorded once and then
// followed as a hint (Note [Acquire order] in engine.h). It answers three
// questions for the engine: where in the recorded sequence the micro-batch
// is (prefetch looks ahead from there), how many backward releases
// complete a layer's gradient, and whether the micro-batch still follows
// the recording (only then are those answers trusted).
#include <algorithm>
#include <cstddef>
#include <optional>
#include <utility>
#include <vector>

#include "strata/core/layered_model.h"

namespace strata::offload {

class AcquireTrace {
 public:
  using Entry = std::pair<size_t, Pass>;  // (layer, pass)

  explicit AcquireTrace(size_t layer_count)
      : forward_acquires_(layer_count, 0), recorded_backward_(layer_count, 0) {}

  // A training micro-batch starts: it is recorded when nothing is recorded
  // yet or the last one departed from the recording, else followed.
  void begin_micro_batch() {
    position_ = 0;
    departed_ = false;
    if (rerecord_) {
      sequence_.clear();
      std::fill(forward_acquires_.begin(), forward_acquires_.end(), 0);
      std::fill(recorded_backward_.begin(), recorded_backward_.end(), 0);
      recording_ = true;
      rerecord_ = false;
    }
  }
  // One acquire of the micro-batch: appended while recording, else compared
  // with the recording at the same position.
  void on_acquire(size_t layer, Pass pass) {
    if (recording_) {
      sequence_.emplace_back(layer, pass);
      if (pass == Pass::kForward) ++forward_acquires_[layer];
      if (pass == Pass::kBackward) ++recorded_backward_[layer];
    } else if (!departed_ && (position_ >= sequence_.size() || sequence_[position_] != Entry{layer, pass})) {
      departed_ = true;
      rerecord_ = true;
    }
    ++position_;
  }
  // The micro-batch ended: a recording is complete (unless it departed from
  // itself: it cannot), a departed micro-batch asks for a new recording.
  void end_micro_batch() {
    if (!recording_ && !departed_ && position_ != sequence_.size()) rerecord_ = true;  // ended early
    recording_ = false;
  }

  // The micro-batch was abandoned part-way (Engine::abandon_step): what it
  // recorded is incomplete, and what it followed says nothing of the next
  // one: the next micro-batch records afresh.
  void abandon_micro_batch() {
    recording_ = false;
    rerecord_ = true;
  }

  bool recording() const { return recording_; }
  // Not recording, and every acquire so far matched the recording.
  bool following() const { return !recording_ && !departed_; }
  // Index in sequence() of the latest acquire (following() only).
  size_t position() const { return position_ == 0 ? 0 : position_ - 1; }
  const std::vector<Entry>& sequence() const { return sequence_; }
  // The backward releases that complete `layer`'s gradient in this
  // micro-batch, when known: while recording, its forward acquires so far
  // (a backward mirrors its forward); while following, the recorded count;
  // once departed, unknown (its gradient is complete when the micro-batch ends).
  std::optional<int> backward_releases_expected(size_t layer) const {
    if (recording_) return forward_acquires_[layer];
    if (departed_) return std::nullopt;
    return recorded_backward_[layer];
  }

 private:
  std::vector<Entry> sequence_;
  std::vector<int> forward_acquires_;   // kForward acquires per layer in the recording
  std::vector<int> recorded_backward_;  // kBackward acquires per layer in the recording
  size_t position_ = 0;                 // acquires of this micro-batch so far
  bool recording_ = false;
  bool rerecord_ = true;                // the next micro-batch records
  bool departed_ = false;
};

}  // namespace strata::offload

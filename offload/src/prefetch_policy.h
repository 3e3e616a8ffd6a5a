#pragma once
// PrefetchPolicy: stage 3's decisions about gathered layers. Private to
// offload/src.
//
// Note [Prefetch policy]
// Three questions decide which stage-3 layers are gathered on the device:
//  - after an acquire, which layers to gather ahead: the next ones in the
//    recorded acquire order (AcquireTrace), while the micro-batch follows
//    it, up to stage3_prefetch_bucket_size elements and while what is
//    allocated stays under stage3_max_live_parameters;
//  - on a layer's last release, keep its gathered copy or drop it: kept
//    when its next use (in this micro-batch, or cyclically in the next one
//    of the step) is within max(stage3_max_reuse_distance, prefetch window)
//    elements; while the first micro-batch is recorded the next use is not
//    known, so kept only when that window spans a whole micro-batch; an
//    evaluation keeps everything until it ends;
//  - to fit an on-demand gather under the live cap, which kept copies to
//    drop: unheld ones, lowest layer index first.
// The answers depend only on the trace, the caps, the layer sizes and what
// is held, never on which frees happen to have completed: gathers are
// collectives and must be issued alike on every rank. This class is pure
// (no device, no I/O, no communicator); ParameterGathering carries the
// decisions out (allocation, waits for frees, the gathers themselves), so a
// different prefetch policy is a change here, tested by
// tests/offload/prefetch_policy_test.cpp without an engine.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "acquire_trace.h"

namespace strata::offload {

class PrefetchPolicy {
 public:
  struct Caps {
    uint64_t prefetch_bucket = 0;     // stage3_prefetch_bucket_size
    uint64_t max_live = 0;            // stage3_max_live_parameters
    uint64_t max_reuse_distance = 0;  // stage3_max_reuse_distance
  };
  struct Layer {
    uint64_t elements = 0;         // real elements: reuse distances count these
    uint64_t padded_elements = 0;  // the size of its gathered copy: the caps count these
    bool gathered = false;         // gathered for its uses (false: kept whole, or lent in place)
  };
  // What the executor holds of a layer now.
  struct Holding {
    bool gathered = false;  // a valid gathered copy is on the device
    int held = 0;           // passes holding it (acquired, not released)
  };
  // Where the driving thread is when a layer is released.
  struct PassPosition {
    bool training = false;    // inside a training micro-batch
    bool evaluation = false;  // inside an evaluation
    bool last_micro = false;  // the micro-batch is its step's last
  };

  PrefetchPolicy(Caps caps, std::vector<Layer> layers);

  // The layers to gather ahead, in order, after an acquire of a training
  // pass or not (`training`) at the trace's position. `allocated`: gathered
  // elements allocated and not handed back (LentBuffers::held). The
  // executor issues them in order and stops at the first it cannot.
  std::vector<size_t> gathers_after_acquire(const AcquireTrace& trace, bool training,
                                            std::span<const Holding> holdings, uint64_t allocated) const;
  // On the last release of gathered layer `layer`: keep its copy (true) or drop it.
  bool keep_on_release(size_t layer, const AcquireTrace& trace, const PassPosition& at) const;
  // The kept copies an on-demand gather of `layer` may drop to fit under
  // the live cap, in the order to drop them (the executor stops once it fits).
  std::vector<size_t> drops_to_make_room(size_t layer, std::span<const Holding> holdings) const;
  // Whether `more` elements fit beside `live` ones under stage3_max_live_parameters.
  bool fits(uint64_t live, uint64_t more) const { return live + more <= caps_.max_live; }

  uint64_t live_cap() const { return caps_.max_live; }
  // The reuse window: a copy whose next use is within it is kept.
  uint64_t keep_window() const { return keep_window(caps_); }
  static uint64_t keep_window(const Caps& caps) {
    return caps.max_reuse_distance > caps.prefetch_bucket ? caps.max_reuse_distance : caps.prefetch_bucket;
  }
  // The window spans every use of a micro-batch (twice every layer's elements).
  bool window_spans_micro_batch() const { return window_spans_micro_batch_; }
  const Layer& layer(size_t li) const { return layers_[li]; }

 private:
  Caps caps_;
  std::vector<Layer> layers_;
  bool window_spans_micro_batch_ = false;
};

}  // namespace strata::offload

// PrefetchPolicy (Note [Prefetch policy] in prefetch_policy.h).
#include "prefetch_policy.h"

#include <utility>

namespace strata::offload {

PrefetchPolicy::PrefetchPolicy(Caps caps, std::vector<Layer> layers) : caps_(caps), layers_(std::move(layers)) {
  uint64_t real = 0;
  for (const Layer& l : layers_) real += l.elements;
  window_spans_micro_batch_ = keep_window() >= 2 * real;
}

std::vector<size_t> PrefetchPolicy::gathers_after_acquire(const AcquireTrace& trace, bool training,
                                                          std::span<const Holding> holdings,
                                                          uint64_t allocated) const {
  std::vector<size_t> gathers;
  if (!training || !trace.following()) return gathers;
  const std::vector<AcquireTrace::Entry>& sequence = trace.sequence();
  uint64_t issued = 0;
  for (size_t p = trace.position() + 1; p < sequence.size(); ++p) {
    const size_t lj = sequence[p].first;
    if (!layers_[lj].gathered || holdings[lj].gathered) continue;
    bool planned = false;  // a layer used twice ahead (tied) is gathered once
    for (size_t g : gathers) planned = planned || g == lj;
    if (planned) continue;
    const uint64_t n = layers_[lj].padded_elements;
    if (issued + n > caps_.prefetch_bucket) break;
    // Decided on what is allocated (the same on every rank), never on which
    // frees have completed: the executor waits for those, as an on-demand
    // gather would.
    if (!fits(allocated + issued, n)) break;
    gathers.push_back(lj);
    issued += n;
  }
  return gathers;
}

bool PrefetchPolicy::keep_on_release(size_t layer, const AcquireTrace& trace, const PassPosition& at) const {
  bool keep = (at.training && trace.recording() && window_spans_micro_batch_) || at.evaluation;
  if (!at.training || !trace.following()) return keep;
  // The next use in this micro-batch's sequence, or, when another
  // micro-batch of this step follows, in its sequence (cyclically).
  const std::vector<AcquireTrace::Entry>& sequence = trace.sequence();
  const size_t here = trace.position(), n = sequence.size();
  const size_t span = at.last_micro ? n - here - 1 : n - 1;
  uint64_t distance = 0;
  for (size_t k = 1; k <= span; ++k) {
    const size_t p = (here + k) % n;
    // Soon reused, or within the prefetch window (a prefetch would gather
    // it again at once): dropping it would only cost a gather.
    if (sequence[p].first == layer) return distance <= keep_window();
    distance += layers_[sequence[p].first].elements;
  }
  return keep;
}

std::vector<size_t> PrefetchPolicy::drops_to_make_room(size_t layer, std::span<const Holding> holdings) const {
  std::vector<size_t> drops;
  for (size_t j = 0; j < layers_.size(); ++j)
    if (j != layer && layers_[j].gathered && holdings[j].gathered && holdings[j].held == 0) drops.push_back(j);
  return drops;
}

}  // namespace strata::offload

// PrefetchPolicy (offload/src/prefetch_policy.h, Note [Prefetch policy]):
// what stage 3 gathers ahead, keeps on release and drops for room, for given
// acquire traces, caps and holdings; no engine, no device.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "prefetch_policy.h"

namespace strata::offload {
namespace {

using Holding = PrefetchPolicy::Holding;
using Caps = PrefetchPolicy::Caps;
constexpr uint64_t kUnbounded = 1'000'000'000;

// `n` gathered layers of 100 real elements, 128 once padded.
std::vector<PrefetchPolicy::Layer> layers(size_t n) { return std::vector<PrefetchPolicy::Layer>(n, {100, 128, true}); }

// One micro-batch's acquires: forward over `order`, backward in reverse.
std::vector<AcquireTrace::Entry> forward_backward(const std::vector<size_t>& order) {
  std::vector<AcquireTrace::Entry> seq;
  for (size_t li : order) seq.emplace_back(li, Pass::kForward);
  for (auto it = order.rbegin(); it != order.rend(); ++it) seq.emplace_back(*it, Pass::kBackward);
  return seq;
}

// A trace that recorded `seq` and now follows it up to (and with) `acquires` acquires.
AcquireTrace followed(size_t layer_count, const std::vector<AcquireTrace::Entry>& seq, size_t acquires) {
  AcquireTrace t(layer_count);
  t.begin_micro_batch();
  for (const auto& [li, pass] : seq) t.on_acquire(li, pass);
  t.end_micro_batch();
  t.begin_micro_batch();
  for (size_t k = 0; k < acquires; ++k) t.on_acquire(seq[k].first, seq[k].second);
  return t;
}

std::vector<Holding> holding(size_t n, std::vector<size_t> gathered, std::vector<size_t> held = {}) {
  std::vector<Holding> h(n);
  for (size_t li : gathered) h[li].gathered = true;
  for (size_t li : held) ++h[li].held;
  return h;
}

TEST(PrefetchPolicy, GathersTheNextLayersOfTheRecordingUpToTheBucket) {
  const auto seq = forward_backward({0, 1, 2, 3});
  const AcquireTrace t = followed(4, seq, 1);  // layer 0's forward
  const auto h = holding(4, {0}, {0});
  EXPECT_EQ(PrefetchPolicy({256, kUnbounded, 0}, layers(4)).gathers_after_acquire(t, true, h, 128),
            (std::vector<size_t>{1, 2}));
  // A bucket of one layer: one layer ahead; below one layer: none.
  EXPECT_EQ(PrefetchPolicy({128, kUnbounded, 0}, layers(4)).gathers_after_acquire(t, true, h, 128),
            (std::vector<size_t>{1}));
  EXPECT_TRUE(PrefetchPolicy({127, kUnbounded, 0}, layers(4)).gathers_after_acquire(t, true, h, 128).empty());
  // The bucket reaches past the forward: the backward's layers come in its order, each once.
  EXPECT_EQ(PrefetchPolicy({kUnbounded, kUnbounded, 0}, layers(4)).gathers_after_acquire(t, true, h, 128),
            (std::vector<size_t>{1, 2, 3}));
}

TEST(PrefetchPolicy, TheLiveCapCountsWhatIsAllocated) {
  const auto seq = forward_backward({0, 1, 2, 3});
  const AcquireTrace t = followed(4, seq, 1);
  const auto h = holding(4, {0}, {0});
  const PrefetchPolicy p({kUnbounded, 384, 0}, layers(4));
  EXPECT_EQ(p.gathers_after_acquire(t, true, h, 128), (std::vector<size_t>{1, 2}));
  EXPECT_EQ(p.gathers_after_acquire(t, true, h, 256), (std::vector<size_t>{1}));
  EXPECT_TRUE(p.gathers_after_acquire(t, true, h, 384).empty());
  EXPECT_TRUE(p.fits(256, 128));
  EXPECT_FALSE(p.fits(257, 128));
}

TEST(PrefetchPolicy, SkipsWhatIsGatheredOrNotGatheredAtAll) {
  auto sizes = layers(5);
  sizes[2].gathered = false;  // kept whole (or lent in place)
  const auto seq = forward_backward({0, 1, 2, 3, 4});
  const AcquireTrace t = followed(5, seq, 1);
  // Layer 3 is still gathered (kept from before): the bucket goes on past it.
  EXPECT_EQ(PrefetchPolicy({256, kUnbounded, 0}, sizes).gathers_after_acquire(t, true, holding(5, {0, 3}, {0}), 128),
            (std::vector<size_t>{1, 4}));
}

TEST(PrefetchPolicy, ATiedLayerUsedTwiceAheadIsGatheredOnce) {
  // Layer 0 is the embedding and the tied head: acquired first and last in the forward.
  const auto seq = forward_backward({0, 1, 2, 0});
  const AcquireTrace t = followed(3, seq, 1);
  // Layer 0 (held) is skipped; 1 and 2 are gathered once each although the backward uses them again.
  const PrefetchPolicy p({kUnbounded, kUnbounded, 0}, layers(3));
  EXPECT_EQ(p.gathers_after_acquire(t, true, holding(3, {0}, {0}), 128), (std::vector<size_t>{1, 2}));
  // Dropped after its first use, layer 0 is gathered again, once, for its second.
  const AcquireTrace t2 = followed(3, seq, 2);
  EXPECT_EQ(p.gathers_after_acquire(t2, true, holding(3, {1}, {1}), 128), (std::vector<size_t>{2, 0}));
}

TEST(PrefetchPolicy, NothingAheadWhileRecordingAfterADepartureOrOutsideTraining) {
  const auto seq = forward_backward({0, 1, 2});
  const PrefetchPolicy p({kUnbounded, kUnbounded, 0}, layers(3));
  const auto h = holding(3, {0}, {0});
  AcquireTrace recording(3);
  recording.begin_micro_batch();
  recording.on_acquire(0, Pass::kForward);
  EXPECT_TRUE(p.gathers_after_acquire(recording, true, h, 128).empty());
  const AcquireTrace t = followed(3, seq, 1);
  EXPECT_FALSE(p.gathers_after_acquire(t, true, h, 128).empty());
  EXPECT_TRUE(p.gathers_after_acquire(t, false, h, 128).empty());  // an evaluation's acquire
  AcquireTrace departed = followed(3, seq, 1);
  departed.on_acquire(2, Pass::kForward);  // the recording has layer 1 here
  EXPECT_TRUE(p.gathers_after_acquire(departed, true, holding(3, {0, 2}, {0, 2}), 256).empty());
}

TEST(PrefetchPolicy, KeepsAReleasedLayerWhoseNextUseIsWithinTheReuseDistance) {
  const auto seq = forward_backward({0, 1, 2, 3});
  const PrefetchPolicy::PassPosition mid{true, false, false}, last{true, false, true};
  // Layer 3's forward release: its backward is next (distance 0): kept under any window.
  EXPECT_TRUE(PrefetchPolicy({0, kUnbounded, 0}, layers(4)).keep_on_release(3, followed(4, seq, 4), last));
  // Layer 0's forward release: its backward is 6 layers (600 real elements) later.
  const AcquireTrace t = followed(4, seq, 1);
  EXPECT_TRUE(PrefetchPolicy({0, kUnbounded, 600}, layers(4)).keep_on_release(0, t, last));
  EXPECT_FALSE(PrefetchPolicy({0, kUnbounded, 599}, layers(4)).keep_on_release(0, t, last));
  // The prefetch window counts as reuse distance too (a prefetch would gather it again at once).
  EXPECT_TRUE(PrefetchPolicy({600, kUnbounded, 0}, layers(4)).keep_on_release(0, t, last));
  // Layer 0's backward release, the micro-batch's last acquire: the next
  // micro-batch of the step starts with it; after the step's last, nothing comes.
  const AcquireTrace end = followed(4, seq, 8);
  EXPECT_TRUE(PrefetchPolicy({0, kUnbounded, 0}, layers(4)).keep_on_release(0, end, mid));
  EXPECT_FALSE(PrefetchPolicy({0, kUnbounded, kUnbounded}, layers(4)).keep_on_release(0, end, last));
}

TEST(PrefetchPolicy, WhileRecordingKeepsOnlyWhenTheWindowSpansTheMicroBatch) {
  // Four layers of 100 real elements: a micro-batch uses 800.
  AcquireTrace recording(4);
  recording.begin_micro_batch();
  recording.on_acquire(0, Pass::kForward);
  const PrefetchPolicy::PassPosition training{true, false, false}, evaluation{false, true, false};
  EXPECT_TRUE(PrefetchPolicy({0, kUnbounded, 800}, layers(4)).window_spans_micro_batch());
  EXPECT_TRUE(PrefetchPolicy({0, kUnbounded, 800}, layers(4)).keep_on_release(0, recording, training));
  EXPECT_TRUE(PrefetchPolicy({800, kUnbounded, 0}, layers(4)).keep_on_release(0, recording, training));
  EXPECT_FALSE(PrefetchPolicy({0, kUnbounded, 799}, layers(4)).keep_on_release(0, recording, training));
  // An evaluation keeps every layer until it ends; a release outside both drops.
  EXPECT_TRUE(PrefetchPolicy({0, kUnbounded, 0}, layers(4)).keep_on_release(0, recording, evaluation));
  EXPECT_FALSE(PrefetchPolicy({0, kUnbounded, kUnbounded}, layers(4)).keep_on_release(0, recording, {}));
  // Departed from the recording: the next use is unknown, the copy goes.
  AcquireTrace departed = followed(4, forward_backward({0, 1, 2, 3}), 1);
  departed.on_acquire(3, Pass::kForward);
  EXPECT_FALSE(PrefetchPolicy({0, kUnbounded, 799}, layers(4)).keep_on_release(3, departed, training));
}

TEST(PrefetchPolicy, MakesRoomByDroppingUnheldCopiesLowestIndexFirst) {
  auto sizes = layers(6);
  sizes[4].gathered = false;
  const PrefetchPolicy p({0, 256, 0}, sizes);
  // 0: held, 1: kept, 2: not gathered, 3: kept, 4: kept whole, 5: the layer to gather.
  auto h = holding(6, {0, 1, 3, 5}, {0});
  EXPECT_EQ(p.drops_to_make_room(5, h), (std::vector<size_t>{1, 3}));
  EXPECT_EQ(p.drops_to_make_room(1, h), (std::vector<size_t>{3, 5}));
}

// Carries the policy's decisions out as ParameterGathering does, logging
// them: "g3" an on-demand gather of layer 3, "p3" a prefetch, "k3"/"d3" a
// last release that keeps/drops, "e3" a copy dropped to make room.
struct Executor {
  Executor(Caps caps, std::vector<PrefetchPolicy::Layer> sizes)
      : policy(caps, sizes), trace(sizes.size()), holdings(sizes.size()) {}

  void acquire(size_t li, Pass pass) {
    trace.on_acquire(li, pass);
    if (!holdings[li].gathered) {
      const uint64_t more = policy.layer(li).padded_elements;
      if (!policy.fits(allocated, more))
        for (size_t j : policy.drops_to_make_room(li, holdings)) {
          drop(j, "e");
          if (policy.fits(allocated, more)) break;
        }
      gather(li, "g");
    }
    for (size_t lj : policy.gathers_after_acquire(trace, true, holdings, allocated)) gather(lj, "p");
    ++holdings[li].held;
  }
  void release(size_t li, bool last_micro) {
    if (--holdings[li].held > 0) return;
    if (policy.keep_on_release(li, trace, {true, false, last_micro}))
      log.push_back("k" + std::to_string(li));
    else
      drop(li, "d");
  }
  // One micro-batch over `seq`, each layer released right after its acquire.
  void micro_batch(const std::vector<AcquireTrace::Entry>& seq, bool last_micro) {
    trace.begin_micro_batch();
    for (const auto& [li, pass] : seq) {
      acquire(li, pass);
      release(li, last_micro);
    }
    trace.end_micro_batch();
    if (!last_micro) return;
    for (size_t li = 0; li < holdings.size(); ++li)  // the step's end drops what no pass holds
      if (holdings[li].gathered && holdings[li].held == 0) drop(li, "");
  }
  std::vector<std::string> take_log() { return std::exchange(log, {}); }

  void gather(size_t li, const char* why) {
    holdings[li].gathered = true;
    allocated += policy.layer(li).padded_elements;
    log.push_back(why + std::to_string(li));
  }
  void drop(size_t li, const char* why) {
    holdings[li].gathered = false;
    allocated -= policy.layer(li).padded_elements;
    if (*why != '\0') log.push_back(why + std::to_string(li));
  }

  PrefetchPolicy policy;
  AcquireTrace trace;
  std::vector<Holding> holdings;
  uint64_t allocated = 0;
  std::vector<std::string> log;
};

using Log = std::vector<std::string>;

TEST(PrefetchPolicySequence, ARepeatedTraceIsRecordedOnceThenPrefetchedOneLayerAhead) {
  Executor e({128, kUnbounded, 0}, layers(3));
  const auto seq = forward_backward({0, 1, 2});
  e.micro_batch(seq, true);  // recording: on demand, nothing kept (the window spans no micro-batch)
  EXPECT_EQ(e.take_log(), (Log{"g0", "d0", "g1", "d1", "g2", "d2", "g2", "d2", "g1", "d1", "g0", "d0"}));
  // Following: each acquire gathers the next layer not gathered (before its
  // release decides); only layer 2, used again at once, is kept.
  for (int step = 0; step < 2; ++step) {
    e.micro_batch(seq, true);
    EXPECT_EQ(e.take_log(), (Log{"g0", "p1", "d0", "p2", "d1", "p1", "k2", "p0", "d2", "d1", "d0"}))
        << "step " << step;
  }
}

TEST(PrefetchPolicySequence, ATraceThatChangesIsFollowedUntilItDepartsThenRecordedAgain) {
  Executor e({256, kUnbounded, 0}, layers(3));  // two layers ahead; a micro-batch uses 600 elements
  e.micro_batch(forward_backward({0, 1, 2}), true);
  e.take_log();
  // Layer 1 is skipped: prefetched after layer 0's acquire; the departure
  // stops prefetching and keeping (the step's end drops the unused copy of 1).
  const auto skipping = forward_backward({0, 2});
  e.micro_batch(skipping, true);
  EXPECT_EQ(e.take_log(), (Log{"g0", "p1", "p2", "d0", "d2", "g2", "d2", "g0", "d0"}));
  // The next micro-batch records the new order, the one after follows it:
  // layer 0's next use is now 200 elements away, within the window.
  e.micro_batch(skipping, true);
  EXPECT_EQ(e.take_log(), (Log{"g0", "d0", "g2", "d2", "g2", "d2", "g0", "d0"}));
  e.micro_batch(skipping, true);
  EXPECT_EQ(e.take_log(), (Log{"g0", "p2", "k0", "k2", "d2", "d0"}));
}

TEST(PrefetchPolicySequence, ALiveCapOfTwoLayersDropsKeptCopiesToGatherOnDemand) {
  // Everything is kept (the window spans the micro-batch), but only two layers fit.
  Executor e({0, 256, kUnbounded}, layers(3));
  const auto seq = forward_backward({0, 1, 2});
  e.micro_batch(seq, false);
  EXPECT_EQ(e.take_log(), (Log{"g0", "k0", "g1", "k1", "e0", "g2", "k2", "k2", "k1", "e1", "g0", "k0"}));
}

TEST(PrefetchPolicySequence, ANestedAcquireKeepsItsCopyUntilTheOuterRelease) {
  Executor e({0, 256, 0}, layers(3));
  e.trace.begin_micro_batch();
  e.acquire(0, Pass::kForward);
  e.acquire(0, Pass::kForward);  // nested: a tied use inside the outer one
  e.release(0, true);
  EXPECT_EQ(e.take_log(), (Log{"g0"}));  // still held: neither kept nor dropped yet
  e.acquire(1, Pass::kForward);
  e.acquire(2, Pass::kForward);  // the cap is full and layer 0 is held: nothing to drop
  EXPECT_EQ(e.take_log(), (Log{"g1", "g2"}));
  EXPECT_TRUE(e.policy.drops_to_make_room(2, e.holdings).empty());
  e.release(0, true);
  EXPECT_EQ(e.take_log(), (Log{"d0"}));
}

}  // namespace
}  // namespace strata::offload

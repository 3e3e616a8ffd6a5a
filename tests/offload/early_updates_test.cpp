// Early, exact updates (strata.speculative_optimizer; Note [Early, exact
// updates] in docs/engine.md): each layer's update starts under the step's
// last backward, assuming no clipping and finite gradients, writing the new
// state out of place (pending buffers in pinned memory, a pending version on
// NVMe), and is kept, redone from the untouched state or forgotten at the
// step's end.
//  - losses are bit-identical with early updates on and off at every
//    placement that allows them, worlds 1 and 2, overlap on and off;
//  - with a clip threshold that clips some steps and not others, both
//    outcomes happen (kept and redone layers) and the losses still match;
//  - an fp16 overflow forgets the layers stepped early (the state after
//    the skipped step is the state before it, bit for bit);
//  - on NVMe, a failed write of a pending version redoes that layer only;
//  - a kernel failure in an update under the backward changes no state and
//    the step ends as it would without early updates;
//  - the updates do start under the backward: the driven MLP's backward
//    waits, before its last layers, for the head's early update to start;
//  - the kept layers' values reach the device's copy queue in forward
//    order, behind the redo of a layer before them;
//  - the plan counts the pending buffers, auto turns them off when they do not fit
//    strata.host_memory_budget, and "on" where the placement cannot is
//    refused naming the key.
#include <functional>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <optional>

#include <fmt/format.h>

#include "engine_harness.h"
#include "mlp_model.h"
#include "strata/core/spec_model.h"
#include "strata/cpu_adam/grad_stats.h"
#include "strata/offload/state_placement.h"

namespace strata::offload {
namespace {

using D = OffloadDevice;

// The placements that allow early updates: state the host steps, in pinned
// memory (pending buffers) or on NVMe (pending versions); with a ratio < 1
// the host part is stepped early, the device part at the step's end; a
// stage-3 shard on NVMe is written back by the early update.
std::vector<Placement> early_placements() {
  std::vector<Placement> out;
  for (const Placement& p : matrix())
    if (p.optimizer != D::kNone) out.push_back(p);
  return out;
}

// Every early update runs (the testing seam): the paths below do not depend
// on whether the optimizer thread got to a layer before the step's end.
TrainRun with_early(TrainRun r, SpeculationMode mode) {
  r.opt.speculative_optimizer = mode;
  r.faults.run_every_early_update = true;
  return r;
}

int64_t total(const Outcome& o, int64_t StepMetrics::*field) {
  int64_t n = 0;
  for (const StepMetrics& m : o.metrics) n += m.*field;
  return n;
}

class EarlyParity : public ::testing::TestWithParam<int> {};

TEST_P(EarlyParity, OnAndOffGiveTheSameLossesAtEveryPlacement) {
  const int world = GetParam();
  for (const Placement& p : early_placements()) {
    TrainRun base;
    base.world = world;
    base.steps = 12;
    apply_placement(base, p);
    const Outcome off = train(with_early(base, SpeculationMode::kOff));
    ASSERT_TRUE(off.status.ok()) << p.name() << ": " << off.status.to_string();
    EXPECT_EQ(total(off, &StepMetrics::speculated_layers), 0) << p.name();
    const Outcome on = train(with_early(base, SpeculationMode::kOn));
    expect_same_losses(off, on, fmt::format("world {} {} early on vs off", world, p.name()));
    // The harness clips on most steps (grad_clip 0.5): layers stepped early
    // are redone there.
    EXPECT_GT(total(on, &StepMetrics::speculated_layers), 0) << p.name();
    EXPECT_GT(total(on, &StepMetrics::redone_layers), 0) << p.name();
    EXPECT_LE(total(on, &StepMetrics::redone_layers), total(on, &StepMetrics::speculated_layers)) << p.name();
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, EarlyParity, ::testing::Values(1, 2),
                         [](const auto& info) { return fmt::format("world{}", info.param); });

// A clip threshold between the run's gradient norms: the steps whose norm
// is below it keep their early updates, the others redo them; losses match
// the run without early updates at every step, and so does the state.
class EarlyOnEachTier : public ::testing::TestWithParam<Placement> {};

TEST_P(EarlyOnEachTier, ClippingOnSomeStepsAndNotOthersStaysExact) {
  TrainRun base;
  base.steps = 16;
  apply_placement(base, GetParam());
  base.opt.grad_clip = 0;  // first, the norms without clipping
  const Outcome probe = train(with_early(base, SpeculationMode::kOff));
  ASSERT_TRUE(probe.status.ok()) << probe.status.to_string();
  std::vector<double> norms;
  for (const StepMetrics& m : probe.metrics) norms.push_back(m.grad_norm);
  std::sort(norms.begin(), norms.end());
  base.opt.grad_clip = norms[norms.size() / 2];  // the median: about half the steps clip
  const Outcome off = train(with_early(base, SpeculationMode::kOff));
  const Outcome on = train(with_early(base, SpeculationMode::kOn));
  ASSERT_TRUE(off.status.ok()) << off.status.to_string();
  expect_same_losses(off, on, "early updates with clipping on some steps");
  int kept_steps = 0, redone_steps = 0;
  bool previous_clipped = false;
  for (const StepMetrics& m : on.metrics) {
    // A step after one that clipped does not start its updates early (they
    // would most likely be redone); every other step does.
    EXPECT_EQ(m.speculated_layers > 0, !previous_clipped) << "step " << m.step;
    previous_clipped = cpu_adam::clip_coefficient(m.grad_norm, base.opt.grad_clip) < 1.0;
    if (m.speculated_layers == 0) continue;
    if (m.redone_layers == 0) ++kept_steps;
    if (m.redone_layers == m.speculated_layers) ++redone_steps;
    // A step either clips or it does not: all its early layers share the fate.
    EXPECT_TRUE(m.redone_layers == 0 || m.redone_layers == m.speculated_layers) << "step " << m.step;
  }
  EXPECT_GT(kept_steps, 0) << "no step kept its early updates";
  EXPECT_GT(redone_steps, 0) << "no step redid its early updates";
}

// Which I/O engine a fault goes into: the optimizer state's or the
// stage-3 parameter shards'.
enum class FaultedIo { kOptimizerState, kParameterShards };

// Overlap off, no clipping, 6 steps: the 8th early update's first write
// fails (nothing else writes under the backward: every write-back of a step
// has ended at its end). That layer alone is redone at the step's end, the
// others are kept, and the losses are those of the run without early updates.
void expect_a_failed_write_under_the_backward_redoes_one_layer(const Placement& placement, FaultedIo io,
                                                              const std::string& what) {
  TrainRun r;
  r.steps = 6;
  apply_placement(r, placement);
  r.opt.grad_clip = 0;  // nothing clips: every other early update is kept
  const Outcome off = train(with_early(r, SpeculationMode::kOff));
  ASSERT_TRUE(off.status.ok()) << off.status.to_string();
  FaultyEngines faulty(1, /*reads=*/false, /*writes=*/true);
  auto engine = [&](int rank) { return faulty[rank]; };
  if (io == FaultedIo::kOptimizerState)
    r.engine_for_rank = engine;
  else
    r.param_engine_for_rank = engine;
  std::atomic<int> started{0};
  r.faults.early_update_started = [&](size_t) {
    if (++started == 8) faulty.counters[0]->arm(0, 1);
  };
  const Outcome on = train(with_early(r, SpeculationMode::kOn));
  ASSERT_TRUE(on.status.ok()) << on.status.to_string();
  EXPECT_EQ(faulty.eio(), 1u);
  expect_same_losses(off, on, what);
  EXPECT_EQ(total(on, &StepMetrics::redone_layers), 1);
  EXPECT_GT(total(on, &StepMetrics::speculated_layers), 8);
}

// A lost write of an early update's pending version (NVMe, Note [Piece
// versions]) is no lost step.
TEST(EarlyUpdates, AFailedPendingWriteOnNvmeRedoesThatLayer) {
  expect_a_failed_write_under_the_backward_redoes_one_layer(Placement{2, D::kNvme, D::kNone, /*overlap=*/false},
                                                            FaultedIo::kOptimizerState,
                                                            "a failed pending write under the backward");
}

// A stage-3 shard on NVMe is written back by its early update (a shadow
// write): when that write fails, the previous shard stays and the layer's
// redo writes it at the step's end.
TEST(EarlyUpdates, AFailedShardWriteUnderTheBackwardRedoesThatLayer) {
  expect_a_failed_write_under_the_backward_redoes_one_layer(
      Placement{3, D::kCpu, D::kNvme, /*overlap=*/false, 1'000'000'000, 1'000'000'000, 1'000'000'000, 0},
      FaultedIo::kParameterShards, "a failed shard write under the backward");
}

// Note [Kept values in forward order]: in a step where the first layer's
// early update failed under the backward (so it is redone at the step's end)
// and the others are kept, every kept layer reaches the device's copy queue
// after that redo: the forward needs the first layer first. The redo holds
// the optimizer thread in the observer for a while, so a kept copy queued
// from another thread would be seen then, if not before.
TEST(EarlyUpdates, KeptLayersReachTheDeviceBehindTheRedoOfALayerBeforeThem) {
  TrainRun r;
  r.steps = 4;
  apply_placement(r, Placement{2, D::kCpu, D::kNone});
  r.opt.grad_clip = 0;  // nothing clips: every other early update is kept
  r.faults.update = testing::UpdateFault{3, 0, mlp::kEmbedIn, /*early_only=*/true};
  enum class Kind { kNormal, kKept };
  struct Event {
    Kind kind;
    size_t layer;
    int64_t step;
    bool during_redo;  // while the redo held the optimizer thread
  };
  std::mutex mutex;
  std::condition_variable queued_cv;
  std::vector<Event> events;
  std::optional<size_t> redo_at;  // index in events
  bool holding = false;
  int64_t step = 0;  // the step whose updates are queued: the first layer's come first
  r.faults.update_values_queued = [&](size_t layer, bool kept) {
    std::unique_lock<std::mutex> lock(mutex);
    if (layer == mlp::kEmbedIn) ++step;
    events.push_back({kept ? Kind::kKept : Kind::kNormal, layer, step, holding});
    queued_cv.notify_all();
    if (kept || events.back().step != 3 || layer != mlp::kEmbedIn) return;
    redo_at = events.size() - 1;
    holding = true;
    const size_t seen = events.size();
    queued_cv.wait_for(lock, std::chrono::milliseconds(300), [&] { return events.size() > seen; });
    holding = false;
  };
  const Outcome on = train(with_early(r, SpeculationMode::kOn));
  ASSERT_TRUE(on.status.ok()) << on.status.to_string();
  ASSERT_EQ(on.metrics.size(), 4u);
  EXPECT_EQ(on.metrics[2].redone_layers, 1);
  ASSERT_TRUE(redo_at.has_value()) << "no redo of the first layer in step 3";
  std::string sequence;
  for (size_t i = 0; i < events.size(); ++i)
    sequence += fmt::format("{}{}{}@{} ", i == *redo_at ? "*" : "", events[i].kind == Kind::kKept ? "k" : "n",
                            events[i].layer, events[i].step);
  int kept_after_it = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    const Event& e = events[i];
    EXPECT_FALSE(e.during_redo) << "layer " << e.layer << " was queued while the redo ran: " << sequence;
    if (e.kind != Kind::kKept || e.step != 3) continue;
    ++kept_after_it;
    EXPECT_GT(i, *redo_at) << "kept layer " << e.layer << " reached the copy queue before the redo: " << sequence;
  }
  // The checks mean something only if a later layer was kept.
  EXPECT_GT(kept_after_it, 0) << "no layer was kept in step 3: " << sequence;
}

// Note [A step's NVMe bytes]: with early updates on NVMe each report still
// carries one step's updates: every piece read and written back once, as
// without them. Read-ahead follows the walks (Note [Read-ahead at the step's
// end]) and never reads a piece whose pending version is not kept yet, so
// no read is dropped and read again.
TEST(EarlyUpdates, EachStepsNvmeBytesAreOneStepsUpdates) {
  TrainRun r;
  r.steps = 6;
  apply_placement(r, Placement{2, D::kNvme, D::kNone, true, 8192});
  r.opt.grad_clip = 0;  // every step starts its updates early
  const Outcome off = train(with_early(r, SpeculationMode::kOff));
  const Outcome on = train(with_early(r, SpeculationMode::kOn));
  ASSERT_TRUE(off.status.ok()) << off.status.to_string();
  ASSERT_TRUE(on.status.ok()) << on.status.to_string();
  ASSERT_EQ(on.metrics.size(), off.metrics.size());
  // (The first report has no committed updates yet, in either run.)
  for (size_t s = 1; s < on.metrics.size(); ++s) {
    SCOPED_TRACE(fmt::format("step {}", s + 1));
    EXPECT_GT(on.metrics[s].speculated_layers, 0);
    EXPECT_GT(off.metrics[s].nvme_write_bytes, 0u);
    EXPECT_EQ(on.metrics[s].nvme_write_bytes, off.metrics[s].nvme_write_bytes);
    EXPECT_EQ(on.metrics[s].nvme_read_bytes, off.metrics[s].nvme_read_bytes);
  }
}

// A failed write-back of a step's (late) updates on NVMe rolls that step
// back at its commit point, under which the next step's early updates have
// already written pending versions: they are forgotten with it, the step is
// repeated, and the losses are those of a run without the fault and without
// early updates. A step's updates are late when the step before clipped (it
// then does not start early): the clip threshold makes step T clip and the
// steps around it not, so step T+1 runs late and step T+2 early.
TEST(EarlyUpdates, ARollbackFromAFailedNvmeWriteForgetsThePendingVersions) {
  TrainRun r;
  r.steps = 6;
  apply_placement(r, Placement{2, D::kNvme, D::kNone, true, 8192});
  r.opt.grad_clip = 0;
  const Outcome probe = train(with_early(r, SpeculationMode::kOff));
  ASSERT_TRUE(probe.status.ok()) << probe.status.to_string();
  // The first step T whose norm is above the next one's and every earlier
  // one's: a threshold between them clips step T only, up to T + 1.
  int64_t clipped = 0;
  double threshold = 0;
  for (size_t t = 0; t + 1 < probe.metrics.size() && clipped == 0; ++t) {
    const double here = probe.metrics[t].grad_norm, next = probe.metrics[t + 1].grad_norm;
    double earlier = 0;
    for (size_t i = 0; i < t; ++i) earlier = std::max(earlier, probe.metrics[i].grad_norm);
    const double mid = 0.5 * (here + std::max(next, earlier));
    if (here > next && here > earlier && static_cast<int64_t>(t) + 3 <= r.steps) {
      clipped = static_cast<int64_t>(t) + 1;
      threshold = mid;
    }
  }
  ASSERT_GT(clipped, 0) << "no step's gradient norm stands above its neighbours' in this run";
  r.opt.grad_clip = threshold;
  const Outcome straight = train(with_early(r, SpeculationMode::kOff));
  ASSERT_TRUE(straight.status.ok()) << straight.status.to_string();
  ASSERT_LT(cpu_adam::clip_coefficient(straight.metrics[clipped - 1].grad_norm, threshold), 1.0f);
  ASSERT_EQ(cpu_adam::clip_coefficient(straight.metrics[clipped].grad_norm, threshold), 1.0f);
  FaultyEngines faulty(1, /*reads=*/false, /*writes=*/true);
  r.engine_for_rank = [&](int rank) { return faulty[rank]; };
  // After step T+1 (late: T clipped) its updates, queued at its end, write
  // under step T+2's forward; the third of those writes fails. Step T+2's
  // early updates then start before its commit point rolls T+1 back.
  std::atomic<bool> armed{false}, early_while_armed{false};
  r.after_step = [&](Engine&, int64_t step) {
    if (step == clipped + 1 && faulty.eio() == 0 && !armed) {
      armed = true;
      faulty.counters[0]->arm(2, 1);
    }
  };
  r.faults.early_update_started = [&](size_t) {
    if (armed && faulty.eio() == 1) early_while_armed = true;
  };
  r.retries = 1;
  const Outcome on = train(with_early(r, SpeculationMode::kOn));
  ASSERT_TRUE(on.status.ok()) << on.status.to_string();
  EXPECT_EQ(faulty.eio(), 1u);
  ASSERT_EQ(on.failures.size(), 1u);
  EXPECT_NE(on.failures[0].message().find("rolled back to the state after step"), std::string::npos)
      << on.failures[0].to_string();
  EXPECT_TRUE(early_while_armed) << "no early update ran between the failed write and its step's rollback";
  expect_same_losses(straight, on, "a rollback under early updates on NVMe");
}

// (The third: offload_optimizer.ratio 0.5, the host part stepped early, the
// device part at the step's end. The fourth: stage-3 shards on NVMe, written
// back by the early update, rewritten when it is not kept.)
INSTANTIATE_TEST_SUITE_P(Tiers, EarlyOnEachTier,
                         ::testing::Values(Placement{2, D::kCpu, D::kNone}, Placement{2, D::kNvme, D::kNone, true, 4096},
                                           Placement{3, D::kCpu, D::kNone, true, 1'000'000'000, 1'000'000'000,
                                                     1'000'000'000, 0, 0.5},
                                           Placement{3, D::kCpu, D::kNvme, true, 1'000'000'000, 1'000'000'000,
                                                     1'000'000'000, 0}),
                         [](const auto& info) {
                           return std::string(offload_device_name(info.param.optimizer)) +
                                  (info.param.ratio < 1.0 ? "_ratio_half" : "") +
                                  (info.param.param == D::kNvme ? "_params_nvme" : "");
                         });

// An Inf gradient on rank 1 at step 4 (fp16, hysteresis 1): the layers it
// stepped early are restored; the state after the skipped step equals the
// state before it, and the run matches one without early updates.
TEST_P(EarlyOnEachTier, AnOverflowRestoresTheLayersSteppedEarly) {
  TrainRun r;
  r.world = 2;
  r.steps = 6;
  r.gpt = small_gpt(DType::kF16);
  r.opt.grad_dtype = DType::kF16;
  r.opt.fp16.enabled = true;
  r.opt.fp16.hysteresis = 1;
  Placement p = GetParam();
  p.stage = 3;
  // (a ratio < 1 keeps the parameters on the device; shards on NVMe stay there)
  if (p.param == D::kNone && p.ratio >= 1.0) p.param = D::kCpu;
  apply_placement(r, p);
  r.opt.grad_clip = 0;  // no step clips, so every step starts its updates early
  r.faults.gradient = testing::GradientFault{.step = 4, .rank = 1, .layer = 1,
                                             .value = std::numeric_limits<float>::infinity()};
  using K = Engine::StateKind;
  std::mutex mu;
  std::map<int64_t, std::vector<std::vector<float>>> snapshots;  // rank 1's, per step (the rank that overflowed)
  r.after_step = [&](Engine& e, int64_t step) {
    std::vector<std::vector<float>> all;
    for (size_t li = 0; li < e.partition().layer_count(); ++li)
      for (K k : {K::kMaster, K::kExpAvg, K::kExpAvgSq}) all.push_back(e.gather_state(li, k).value());
    if (e.rank() == 1) {
      std::lock_guard<std::mutex> lock(mu);
      snapshots[step] = std::move(all);
    }
  };
  const Outcome off = train(with_early(r, SpeculationMode::kOff));
  snapshots.clear();
  const Outcome on = train(with_early(r, SpeculationMode::kOn));
  expect_same_losses(off, on, "fp16 overflow with early updates");
  ASSERT_EQ(on.metrics.size(), 6u);
  EXPECT_TRUE(on.metrics[3].skipped);
  EXPECT_GT(on.metrics[3].redone_layers, 0) << "no layer was stepped early in the skipped step";
  ASSERT_EQ(snapshots[3].size(), snapshots[4].size());
  for (size_t i = 0; i < snapshots[3].size(); ++i)
    EXPECT_EQ(0, std::memcmp(snapshots[3][i].data(), snapshots[4][i].data(), snapshots[3][i].size() * 4))
        << "state " << i << " changed in the skipped step";
}

// A kernel failure in step 3's update of layer 1 (testing::UpdateFault): the
// update under the backward fails, having changed no state, and is redone at
// the step's end, where it fails again as the update would without early
// updates: torn state kept in place, the engine stops, the same error.
TEST(EarlyUpdates, AFailedUpdateUnderTheBackwardEndsAsWithoutIt) {
  TrainRun r;
  r.steps = 5;
  apply_placement(r, Placement{1, D::kCpu, D::kNone});
  r.opt.grad_clip = 0;  // no step clips, so step 3 starts its updates early
  r.faults.update = testing::UpdateFault{3, 0, 1};
  const Outcome off = train(with_early(r, SpeculationMode::kOff));
  const Outcome on = train(with_early(r, SpeculationMode::kOn));
  ASSERT_FALSE(off.status.ok());
  ASSERT_FALSE(on.status.ok());
  EXPECT_EQ(on.status.code(), off.status.code()) << on.status.to_string();
  EXPECT_EQ(on.losses, off.losses);
  EXPECT_NE(on.status.message().find("injected kernel failure"), std::string::npos) << on.status.to_string();
}

TEST(EarlyUpdates, ThePlanCountsThePendingStateAndTheMeasuredPeakStaysUnderIt) {
  TrainRun r;
  r.steps = 3;
  apply_placement(r, Placement{2, D::kCpu, D::kNone});
  const Outcome off = train(with_early(r, SpeculationMode::kOff));
  const Outcome on = train(with_early(r, SpeculationMode::kOn));
  ASSERT_TRUE(off.status.ok()) << off.status.to_string();
  ASSERT_TRUE(on.status.ok()) << on.status.to_string();
  EXPECT_EQ(off.predicted[0].pinned_speculation, 0u);
  // About the optimizer state's size (master and moments, 12 B per element).
  EXPECT_GE(on.predicted[0].pinned_speculation, on.predicted[0].pinned_optimizer * 9 / 10);
  // ... and a staging buffer per layer (the values wait for the commit)
  // instead of one piece's (Note [Update staging]).
  EXPECT_GT(on.predicted[0].pinned_staging, off.predicted[0].pinned_staging);
  EXPECT_EQ(on.predicted[0].pinned, off.predicted[0].pinned - off.predicted[0].pinned_staging +
                                        on.predicted[0].pinned_staging + on.predicted[0].pinned_speculation);
  EXPECT_GE(on.predicted[0].pinned, on.measured[0].pinned);
  EXPECT_GT(on.measured[0].pinned, off.measured[0].pinned);
  EXPECT_GT(total(on, &StepMetrics::speculated_layers), 0);
  // The staged values of a kept update go to the device once, a redone one's
  // with the redo: the same bytes per step as without early updates.
  uint64_t h2d_on = 0, h2d_off = 0;
  for (const StepMetrics& m : on.metrics) h2d_on += m.h2d_bytes;
  for (const StepMetrics& m : off.metrics) h2d_off += m.h2d_bytes;
  EXPECT_EQ(h2d_on, h2d_off);
}

// offload_optimizer.ratio < 1: only the host part is stepped early, so only
// its state has a pending buffer (the plan counts about half of ratio 1's).
TEST(EarlyUpdates, WithARatioOnlyTheHostPartHasPendingState) {
  TrainRun r;
  r.steps = 3;
  apply_placement(r, Placement{3, D::kCpu, D::kNone, true, 1'000'000'000, 1'000'000'000, 1'000'000'000, 0, 1.0});
  const Outcome whole = train(with_early(r, SpeculationMode::kOn));
  r.opt.ratio = 0.5;
  const Outcome half = train(with_early(r, SpeculationMode::kOn));
  ASSERT_TRUE(whole.status.ok()) << whole.status.to_string();
  ASSERT_TRUE(half.status.ok()) << half.status.to_string();
  const uint64_t pending_whole = whole.predicted[0].pinned_speculation, pending_half = half.predicted[0].pinned_speculation;
  EXPECT_GT(pending_half, pending_whole * 4 / 10);
  EXPECT_LT(pending_half, pending_whole * 6 / 10);
  EXPECT_GE(half.predicted[0].pinned, half.measured[0].pinned);
  EXPECT_GT(total(half, &StepMetrics::speculated_layers), 0);
}

// auto: on where the model's compute does not share the host's cores (a
// GPU) and the plan with the pending state fits the host budget; off on the
// cpu device (measured no faster there) and under a budget it breaks.
TEST(EarlyUpdates, AutoIsOnOffTheHostsCoresWhereThePendingStateFits) {
  std::vector<LayerDescription> layers;
  for (int i = 0; i < 3; ++i)
    layers.push_back({fmt::format("l{}", i), {{fmt::format("l{}.weight", i), {4096}, DType::kBF16, true, std::nullopt, 1.0}}});
  const SpecModel model = SpecModel::create(std::move(layers)).value();
  EngineOptions o;
  o.stage = 2;
  o.offload_optimizer = D::kCpu;
  auto plan = [&](const EngineOptions& opt, const PlannedDevice& device) {
    const Partition part = Partition::create(model.layers(), 1, opt.sub_group_size).value();
    const StatePlacement p = StatePlacement::compute(opt, model.layers(), part, 0, device).value();
    return std::make_pair(p, plan_engine_memory(opt, part, p));
  };
  const auto [gpu, gpu_memory] = plan(o, PlannedDevice::gpu());
  EXPECT_TRUE(gpu.early_updates) << gpu.early_updates_off;
  EXPECT_GT(gpu_memory.pinned_speculation, 0u);
  const auto [cpu, cpu_memory] = plan(o, PlannedDevice::cpu());
  EXPECT_FALSE(cpu.early_updates);
  EXPECT_NE(cpu.early_updates_off.find("cpu device"), std::string::npos) << cpu.early_updates_off;
  EXPECT_EQ(cpu_memory.pinned_speculation, 0u);
  // A budget with room for the plan without the pending state, not with it.
  EngineOptions tight = o;
  tight.host_memory_budget = gpu_memory.pinned - gpu_memory.pinned_speculation + 64;
  const auto [capped, capped_memory] = plan(tight, PlannedDevice::gpu());
  EXPECT_FALSE(capped.early_updates);
  EXPECT_NE(capped.early_updates_off.find("strata.host_memory_budget"), std::string::npos) << capped.early_updates_off;
  EXPECT_EQ(capped_memory.pinned_speculation, 0u);
  // on: the budget is the engine's check at start-up, not auto's.
  tight.speculative_optimizer = SpeculationMode::kOn;
  EXPECT_TRUE(plan(tight, PlannedDevice::gpu()).first.early_updates);
  // off: never.
  o.speculative_optimizer = SpeculationMode::kOff;
  EXPECT_FALSE(plan(o, PlannedDevice::gpu()).first.early_updates);
}

TEST(EarlyUpdates, OnIsRefusedWhereThePlacementCannotNamingTheKey) {
  struct Case {
    Placement placement;
    const char* names;
  };
  const Case cases[] = {
      {Placement{2, D::kNone, D::kNone}, "offload_optimizer.device none"},
  };
  for (const Case& c : cases) {
    TrainRun r;
    r.steps = 1;
    apply_placement(r, c.placement);
    const Outcome o = train(with_early(r, SpeculationMode::kOn));
    ASSERT_FALSE(o.status.ok()) << c.placement.name();
    EXPECT_EQ(o.status.code(), StatusCode::kUnsupported) << o.status.to_string();
    EXPECT_NE(o.status.message().find("strata.speculative_optimizer"), std::string::npos) << o.status.to_string();
    EXPECT_NE(o.status.message().find(c.names), std::string::npos) << o.status.to_string();
    // auto: the same placement trains, without early updates.
    const Outcome automatic = train(with_early(r, SpeculationMode::kAuto));
    ASSERT_TRUE(automatic.status.ok()) << automatic.status.to_string();
    EXPECT_EQ(total(automatic, &StepMetrics::speculated_layers), 0);
  }
}

// A caller-driven model (mlp_model.h) whose backward, before its last
// layers (the frozen layer, then the embedding whose gradient is the step's
// last), waits for the head's early update to start, seen through the seam's
// observer. An engine that only started updates at the step's end would
// make every wait run out (the test then fails instead of hanging); this
// one starts the head's update while the backward still runs, and keeps it.
class WaitBeforeFrozenBackward : public ParameterProvider {
 public:
  WaitBeforeFrozenBackward(Engine& engine, std::function<bool()> wait) : engine_(engine), wait_(std::move(wait)) {}
  Result<LayerMemory> acquire(size_t layer_index, Pass pass) override {
    if (layer_index == mlp::kFrozen && pass == Pass::kBackward && !wait_()) ++timeouts;
    return engine_.acquire(layer_index, pass);
  }
  Status release(size_t layer_index, Pass pass, const Completion& done) override {
    return engine_.release(layer_index, pass, done);
  }
  int timeouts = 0;

 private:
  Engine& engine_;
  std::function<bool()> wait_;
};

// `optimizer`: where the state is (cpu: pinned memory, nvme: streamed).
void expect_early_updates_under_the_backward(OffloadDevice optimizer,
                                             const std::function<void(EngineOptions&)>& placement = {}) {
  EngineOptions o;
  o.stage = 2;
  o.offload_optimizer = optimizer;
  if (optimizer == D::kNvme) o.nvme.path = ::testing::TempDir();
  if (placement) placement(o);
  o.speculative_optimizer = SpeculationMode::kOn;
  o.grad_clip = 0;  // nothing to redo: the head's early update is kept
  o.hyper.lr = 1e-2;
  o.source = "early updates test";
  std::mutex mutex;
  std::condition_variable started_cv;
  bool head_started = false;
  testing::EngineFaults faults;
  faults.early_update_started = [&](size_t layer) {
    if (layer != mlp::kHead) return;
    std::lock_guard<std::mutex> lock(mutex);
    head_started = true;
    started_cv.notify_all();
  };
  auto comms = comm::create_local_group(1).value();
  DeviceOptions dopt;
  dopt.device_memory_bytes = uint64_t{64} << 20;
  std::unique_ptr<Device> device = make_device(DeviceKind::kCpu, dopt).value();
  const mlp::MlpSpecOptions spec_options;
  const SpecModel spec = SpecModel::create(mlp::layer_descriptions(spec_options)).value();
  mlp::MlpModel model(spec.layers());
  Result<std::unique_ptr<Engine>> created = testing::create_engine(o, spec, *device, *comms[0], faults);
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  Engine& engine = **created;
  const std::vector<std::vector<float>> init = mlp::initial_values(20240611);
  for (size_t li = 0; li < mlp::kLayerCount; ++li)
    ASSERT_TRUE(engine.put_initial_layer(li, mlp::to_bytes(init[li], spec_options.dtype), init[li]).ok());
  WaitBeforeFrozenBackward provider(engine, [&] {
    std::unique_lock<std::mutex> lock(mutex);
    return started_cv.wait_for(lock, std::chrono::seconds(30), [&] { return head_started; });
  });
  for (int64_t step = 1; step <= 3; ++step) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      head_started = false;
    }
    ASSERT_TRUE(engine.begin_step().ok());
    ASSERT_TRUE(engine.begin_micro_batch(true).ok());
    const mlp::Batch batch = mlp::make_batch(77, step, 0, 0, 8);
    // The conditional layer in every step: the same acquire order each time,
    // so reductions go out at each layer's last release (a step that departs
    // from the recorded order reduces at its end: Note [Acquire order]).
    Result<double> loss = model.train_micro_batch(provider, batch, /*cond=*/true, engine.gradient_scale());
    ASSERT_TRUE(loss.ok()) << loss.status().to_string();
    ASSERT_TRUE(engine.end_micro_batch(*loss, 8).ok());
    Result<StepOutcome> out = engine.finish_step();
    ASSERT_TRUE(out.ok()) << out.status().to_string();
    ASSERT_TRUE(out->applied()) << out->reason.to_string();
    EXPECT_EQ(provider.timeouts, 0) << "step " << step << ": the head's early update did not start under the backward";
    EXPECT_GE(out->metrics.speculated_layers, 1) << "step " << step;
    EXPECT_EQ(out->metrics.redone_layers, 0) << "step " << step;  // no clipping: kept
  }
  ASSERT_TRUE(engine.synchronize().ok());
}

TEST(EarlyUpdates, TheyStartWhileTheBackwardStillRuns) { expect_early_updates_under_the_backward(D::kCpu); }

TEST(EarlyUpdates, TheyStartWhileTheBackwardStillRunsWithTheStateOnNvme) {
  expect_early_updates_under_the_backward(D::kNvme);
}

// The state in host memory, stage-3 shards and the reduced gradients on
// NVMe (the parameters' folder): the head's early update reads its gradient
// back from NVMe while the backward still runs.
TEST(EarlyUpdates, TheyStartWhileTheBackwardStillRunsWithTheGradientsOnNvme) {
  expect_early_updates_under_the_backward(D::kCpu, [](EngineOptions& o) {
    o.stage = 3;
    o.offload_param = D::kNvme;
    o.nvme_param.path = ::testing::TempDir();
    o.nvme_param.max_in_cpu = 0;
    o.gradient_shards = GradientShardsMode::kNvme;
  });
}

TEST(EarlyUpdates, ParseNamesTheFieldAndTheValue) {
  EXPECT_EQ(parse_speculation_mode("auto", "k").value(), SpeculationMode::kAuto);
  EXPECT_EQ(parse_speculation_mode("on", "k").value(), SpeculationMode::kOn);
  EXPECT_EQ(parse_speculation_mode("off", "k").value(), SpeculationMode::kOff);
  const Status bad = parse_speculation_mode("yes\n", "--speculative-optimizer").status();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("--speculative-optimizer 'yes\\x0a'"), std::string::npos) << bad.message();
}

}  // namespace
}  // namespace strata::offload

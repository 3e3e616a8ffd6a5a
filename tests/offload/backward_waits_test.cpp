// What a layer's backward must not wait for: the previous layer's gradient
// reduction and copy out (the engine's copy stream, `xfer`, waits for the
// backward before it copies a gradient out).
//  - Note [Gradient buffers zeroed apart] (offload/src/gradient_reduction.cpp):
//    a layer's gradient buffer is zeroed on a stream of its own. Two local
//    ranks drive the MLP's passes by hand; rank 1 holds back its backward,
//    so rank 0's reduction of the last layer cannot run and its copy stream
//    stays gated on it; rank 0's next backward acquire must still be ready.
//    (With the memset on the copy stream that layer's buffer was zeroed only
//    after the reduction, so the acquire waited for rank 1.)
//  - A stage-3 parameter shard in host memory goes to the device for its
//    re-gather in the backward on a stream of its own (`shard_h2d`). One
//    rank; the last layer's backward is released with a `done` the test
//    holds back, so its gradient's copy out waits; the next layer's
//    re-gather must still be ready.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <thread>

#include "driven_harness.h"

namespace strata::offload {
namespace {

// One rank's step: every layer acquired and released for forward, then for
// backward from the last; `before_backward` runs before the backward's first
// acquire, `second_backward_acquired` once the second layer of the backward
// is acquired (the first released, its pass ending at `first_backward_done`),
// with its LayerMemory.
Status drive_step(DrivenRank& d, const std::function<void()>& before_backward,
                  const std::function<void(const LayerMemory&)>& second_backward_acquired,
                  const Completion& first_backward_done = Completion()) {
  Engine& e = d.engine();
  STRATA_RETURN_IF_ERROR(e.begin_step());
  STRATA_RETURN_IF_ERROR(e.begin_micro_batch(true));
  for (size_t li = 0; li < mlp::kLayerCount; ++li) {
    STRATA_ASSIGN_OR_RETURN(LayerMemory mem, e.acquire(li, Pass::kForward));
    STRATA_RETURN_IF_ERROR(mem.ready.wait());
    STRATA_RETURN_IF_ERROR(e.release(li, Pass::kForward, Completion()));
  }
  if (before_backward) before_backward();
  for (size_t k = 0; k < mlp::kLayerCount; ++k) {
    const size_t li = mlp::kLayerCount - 1 - k;
    STRATA_ASSIGN_OR_RETURN(LayerMemory mem, e.acquire(li, Pass::kBackward));
    if (k == 1 && second_backward_acquired) second_backward_acquired(mem);
    STRATA_RETURN_IF_ERROR(mem.ready.wait());
    STRATA_RETURN_IF_ERROR(e.release(li, Pass::kBackward, k == 0 ? first_backward_done : Completion()));
  }
  STRATA_RETURN_IF_ERROR(e.end_micro_batch(1.0, kBatch));
  STRATA_ASSIGN_OR_RETURN(StepOutcome out, e.finish_step());
  if (!out.applied()) return Internal(fmt::format("rank {}: the step was not applied: {}", d.rank(), out.reason.to_string()));
  return e.synchronize();
}

class GradientZeroing : public ::testing::TestWithParam<int> {};

TEST_P(GradientZeroing, ABackwardDoesNotWaitForThePreviousLayersReduction) {
  Watchdog dog("gradient zeroing", std::chrono::seconds(120));
  EngineOptions opt = base_options();
  opt.grad_accum = 1;
  opt.stage = GetParam();  // stages 2 and 3: a fresh gradient buffer per backward
  opt.offload_optimizer = OffloadDevice::kCpu;  // each reduced gradient is copied out on the copy stream
  auto comms = comm::create_local_group(2).value();
  std::promise<void> rank1_may_go_on;
  std::shared_future<void> go_on = rank1_may_go_on.get_future().share();
  bool ready_without_rank1 = false;
  Status st[2];
  std::thread rank1([&] {
    auto body = [&]() -> Status {
      STRATA_ASSIGN_OR_RETURN(auto d, DrivenRank::create(opt, MlpSpecOptions{}, *comms[1]));
      STRATA_RETURN_IF_ERROR(d->put_all());
      return drive_step(*d, [&] { go_on.wait(); }, {});
    };
    st[1] = body();
    if (!st[1].ok()) comms[1].reset();
  });
  auto body0 = [&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(auto d, DrivenRank::create(opt, MlpSpecOptions{}, *comms[0]));
    STRATA_RETURN_IF_ERROR(d->put_all());
    return drive_step(*d, {}, [&](const LayerMemory& mem) {
      // Rank 1 has not begun its backward: the last layer's reduction waits for it.
      ready_without_rank1 = mem.ready.wait_for(std::chrono::seconds(5));
      rank1_may_go_on.set_value();
    });
  };
  st[0] = body0();
  if (!st[0].ok()) {
    comms[0].reset();
    try {
      rank1_may_go_on.set_value();  // not set if rank 0 failed before its backward
    } catch (const std::future_error&) {
    }
  }
  rank1.join();
  ASSERT_TRUE(st[0].ok()) << st[0].to_string();
  ASSERT_TRUE(st[1].ok()) << st[1].to_string();
  EXPECT_TRUE(ready_without_rank1)
      << "rank 0's second backward acquire was not ready while the last layer's reduction waited for rank 1: its "
         "gradient buffer's zeroing queued behind that reduction";
}

INSTANTIATE_TEST_SUITE_P(Stages, GradientZeroing, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& p) { return fmt::format("stage{}", p.param); });

TEST(ShardCopies, ABackwardsRegatherDoesNotWaitForThePreviousLayersCopyOut) {
  Watchdog dog("shard copies", std::chrono::seconds(120));
  EngineOptions opt = base_options();
  opt.grad_accum = 1;
  opt.stage = 3;
  opt.offload_optimizer = opt.offload_param = OffloadDevice::kCpu;  // shards in pinned memory, H2D before a gather
  // Nothing kept between the passes (the backward gathers every layer again), but room for two of the MLP's
  // layers at once (padded: 4096 + 10240 elements for the head and the conditional layer).
  opt.max_reuse_distance = 0;
  opt.max_live_parameters = 20'000;
  opt.prefetch_bucket_size = 0;
  auto comms = comm::create_local_group(1).value();
  bool ready_while_copy_out_waited = false;
  auto body = [&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(auto d, DrivenRank::create(opt, MlpSpecOptions{}, *comms[0]));
    STRATA_RETURN_IF_ERROR(d->put_all());
    // The last layer's backward "runs" until the test says so: its gradient's copy out waits.
    CompletionSource head_backward("the test's backward of the last layer");
    return drive_step(
        *d, {},
        [&](const LayerMemory& next) {
          ready_while_copy_out_waited = next.ready.wait_for(std::chrono::seconds(5));
          head_backward.complete(Status::Ok());
        },
        head_backward.completion());
  };
  const Status st = body();
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_TRUE(ready_while_copy_out_waited)
      << "the re-gather of the backward's second layer was not ready while the last layer's gradient copy out "
         "waited for its backward: the shard's H2D queued behind it";
}

}  // namespace
}  // namespace strata::offload

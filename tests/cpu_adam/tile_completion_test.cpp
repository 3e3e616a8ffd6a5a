// A CPU Adam tile as a completion (issue 10): a device stream copies each
// tile's updated bf16 parameters as soon as that tile is stepped, gated only
// by the tile's Completion, while later tiles are still computing. This is
// the overlap the engine builds on (updated tiles go H2D from the tile
// callback), shown on the cpu device.
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "strata/core/completion.h"
#include "strata/core/device.h"
#include "strata/core/device_registry.h"
#include "strata/cpu_adam/optimizer.h"

namespace strata::cpu_adam {
namespace {

TEST(TileCompletion, CopiesGatedByTileCompletionsSeeTheUpdatedTiles) {
  constexpr size_t kTile = 4096;
  constexpr size_t kTiles = 6;
  constexpr size_t kCount = kTile * kTiles;
  auto device = make_device("cpu", {.device_memory_bytes = 16u << 20});
  ASSERT_TRUE(device.ok()) << device.status().to_string();
  Device& dev = **device;
  auto stream = dev.create_stream();
  ASSERT_TRUE(stream.ok());
  auto opt = CpuOptimizer::create({.kind = OptimizerKind::kAdamW, .threads = 2, .tile_elements = kTile});
  ASSERT_TRUE(opt.ok()) << opt.status().to_string();

  std::vector<float> params(kCount), grads(kCount), m(kCount, 0.0f), v(kCount, 0.0f);
  for (size_t i = 0; i < kCount; ++i) {
    params[i] = 0.01f * static_cast<float>(i % 97) - 0.4f;
    grads[i] = 0.001f * static_cast<float>(i % 31) - 0.015f;
  }
  // The bf16 copy lives in pinned memory so that the stream's copies are
  // truly asynchronous; it starts as a pattern no step can write.
  const size_t copy_bytes = kCount * sizeof(uint16_t);
  auto pinned = dev.allocate_pinned_host(copy_bytes);
  ASSERT_TRUE(pinned.ok()) << pinned.status().to_string();
  auto* copy = static_cast<uint16_t*>(*pinned);
  std::memset(copy, 0xff, copy_bytes);
  auto dst = dev.allocate(copy_bytes);
  ASSERT_TRUE(dst.ok());

  // Every tile's copy is queued before the step starts, each behind the
  // Completion of its own tile.
  std::vector<CompletionSource> tile_done;
  for (size_t t = 0; t < kTiles; ++t) tile_done.emplace_back("cpu adam tile " + std::to_string(t));
  for (size_t t = 0; t < kTiles; ++t) {
    ASSERT_TRUE((*stream)->wait(tile_done[t].completion()).ok());
    ASSERT_TRUE((*stream)
                    ->copy_async(dst->as<uint16_t>() + t * kTile, copy + t * kTile, kTile * sizeof(uint16_t),
                                 CopyKind::kHostToDevice)
                    .ok());
  }
  Completion all_copied = (*stream)->record_completion();
  EXPECT_FALSE(all_copied.done());

  StepArgs args;
  args.step = 1;
  args.hyper = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01, .bias_correction = true};
  args.overflow_check = OverflowCheck::kAssumeFinite;
  StateSpans spans;
  spans.count = kCount;
  spans.params = params.data();
  spans.grads = grads.data();
  spans.exp_avg = m.data();
  spans.exp_avg_sq = v.data();
  spans.param_copy = copy;
  spans.param_copy_dtype = DType::kBF16;
  Status step_status;
  std::thread stepper([&] {
    auto r = opt->step(args, spans, [&](const TileRange& tile) { tile_done[tile.index].complete(Status::Ok()); });
    step_status = r.status();
  });
  stepper.join();
  ASSERT_TRUE(step_status.ok()) << step_status.to_string();
  ASSERT_TRUE(all_copied.wait().ok());

  std::vector<uint16_t> on_device(kCount);
  ASSERT_TRUE(dev.copy(on_device.data(), dst->data(), copy_bytes, CopyKind::kDeviceToHost).ok());
  size_t stale = 0;
  for (size_t i = 0; i < kCount; ++i) stale += on_device[i] != copy[i] || on_device[i] == 0xffff;
  EXPECT_EQ(stale, 0u) << "a copy ran before its tile was stepped";
  (*stream)->synchronize().ignore();
  dst->reset();
  dev.free_pinned_host(copy, copy_bytes);
}

}  // namespace
}  // namespace strata::cpu_adam

// Step metrics measure what their names say (issue 22, defect 10), and the
// engine's measured memory is the Device's own accounting of its
// allocations (Note [Accounts] in strata/core/device.h).
//
// The model is described by specs and driven from the test (Note [Driving
// the engine]): its passes acquire each layer, write a fixed gradient, and
// wait where the test says, so the test knows which phase a wait belongs to.
// Timing checks are inequalities against a known sleep, whatever the
// machine's speed.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <thread>

#include <fmt/format.h>

#include "strata/comm/backends.h"
#include "strata/core/device_registry.h"
#include "strata/core/spec_model.h"
#include "strata/offload/engine.h"
#include "strata/offload/testing/engine_faults.h"
#include "strata/offload/testing/engine_seam.h"

namespace strata::offload {
namespace {

constexpr auto kSleep = std::chrono::milliseconds(1000);  // far above a tiny forward under TSan
constexpr double kSleepMs = 1000;

// Odd sizes: optimizer state pieces whose bytes are no multiple of 256.
SpecModel metrics_model() {
  std::vector<LayerDescription> layers;
  const int64_t sizes[] = {1000, 3001, 777};
  for (int i = 0; i < 3; ++i)
    layers.push_back({fmt::format("l{}", i), {{fmt::format("l{}.weight", i), {sizes[i]}, DType::kF32, true,
                                               std::nullopt, 1.0}}});
  return SpecModel::create(std::move(layers)).value();
}

Status initialize(Engine& engine, const SpecModel& model) {
  for (size_t li = 0; li < model.layers().size(); ++li) {
    std::vector<float> values(model.layers()[li].param_count);
    for (size_t e = 0; e < values.size(); ++e) values[e] = 0.01f * static_cast<float>((e + li) % 13);
    STRATA_RETURN_IF_ERROR(engine.put_initial_layer(li, std::as_bytes(std::span<const float>(values))));
  }
  return Status::Ok();
}

// Called before layer `li`'s backward acquire of micro-batch `micro`; may
// sleep or hold up the gathers.
using BeforeBackward = std::function<void(int micro, size_t li, Engine& engine)>;

// One step of grad_accum micro-batches: forward in order, backward in reverse.
// `waiter`: who the acquires say waits for each layer (the caller waits on
// the host either way).
Result<StepMetrics> drive_step(Engine& engine, const SpecModel& model, const BeforeBackward& before_backward = {},
                               AcquireWaiter waiter = AcquireWaiter::model_stream()) {
  const int accum = engine.options().grad_accum;
  const size_t n = model.layers().size();
  STRATA_RETURN_IF_ERROR(engine.begin_step());
  for (int micro = 0; micro < accum; ++micro) {
    STRATA_RETURN_IF_ERROR(engine.begin_micro_batch(micro == accum - 1));
    for (size_t li = 0; li < n; ++li) {
      STRATA_ASSIGN_OR_RETURN(LayerMemory mem, engine.acquire(li, Pass::kForward, waiter));
      STRATA_RETURN_IF_ERROR(mem.ready.wait());
      STRATA_RETURN_IF_ERROR(engine.release(li, Pass::kForward, Completion()));
    }
    for (size_t k = n; k-- > 0;) {
      if (before_backward) before_backward(micro, k, engine);
      STRATA_ASSIGN_OR_RETURN(LayerMemory mem, engine.acquire(k, Pass::kBackward, waiter));
      STRATA_RETURN_IF_ERROR(mem.ready.wait());
      float* g = static_cast<float*>(mem.grads);
      for (size_t e = 0; e < model.layers()[k].param_count; ++e) g[e] += 1e-3f * static_cast<float>((e % 7) + 1);
      STRATA_RETURN_IF_ERROR(engine.release(k, Pass::kBackward, Completion()));
    }
    STRATA_RETURN_IF_ERROR(engine.end_micro_batch(1.0, 1));
  }
  STRATA_ASSIGN_OR_RETURN(StepOutcome out, engine.finish_step());
  if (!out.applied()) return out.reason;
  return out.metrics;
}

struct Rig {
  std::unique_ptr<Device> device;
  std::vector<std::unique_ptr<comm::Communicator>> comms;
  std::unique_ptr<Stream> model_stream;
  SpecModel model = metrics_model();
  std::unique_ptr<Engine> engine;
};

// `faults`: the engine is made through the testing seam with them.
// `with_model_stream` false: a driven engine without one (as strata.torch's).
std::unique_ptr<Rig> make_rig(const EngineOptions& o, const testing::EngineFaults* faults = nullptr,
                              bool with_model_stream = true) {
  auto rig = std::make_unique<Rig>();
  DeviceOptions dopt;
  dopt.device_memory_bytes = uint64_t{64} << 20;
  rig->device = make_device(DeviceKind::kCpu, dopt).value();
  rig->comms = comm::create_local_group(1).value();
  if (with_model_stream) rig->model_stream = rig->device->create_stream().value();
  auto engine = faults != nullptr ? testing::create_engine(o, rig->model, *rig->device, *rig->comms[0], *faults,
                                                           rig->model_stream.get())
                                  : Engine::create(o, rig->model, *rig->device, *rig->comms[0], rig->model_stream.get());
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  if (!engine.ok()) return nullptr;
  rig->engine = std::move(engine).value();
  EXPECT_TRUE(initialize(*rig->engine, rig->model).ok());
  return rig;
}

EngineOptions base_options() {
  EngineOptions o;
  o.grad_clip = 0;
  o.optimizer_threads = 1;
  o.persistence_threshold = 0;
  o.source = "engine metrics test";
  return o;
}

// A known sleep in the backward of the first of two micro-batches is
// backward time: forward_ms (the forwards only) stays below it.
TEST(EngineMetrics, ForwardTimeExcludesAnEarlierMicroBatchsBackward) {
  EngineOptions o = base_options();
  o.grad_accum = 2;
  auto rig = make_rig(o);
  ASSERT_TRUE(rig);
  Result<StepMetrics> m = drive_step(*rig->engine, rig->model, [](int micro, size_t li, Engine&) {
    if (micro == 0 && li == 0) std::this_thread::sleep_for(kSleep);
  });
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_LT(m->forward_ms, kSleepMs) << "the first micro-batch's backward was counted as forward";
  EXPECT_GE(m->backward_ms, kSleepMs) << "the first micro-batch's backward is backward time";
  EXPECT_LE(m->forward_ms + m->backward_ms, m->step_ms);
}

// Stage 3 with the shards in host memory: a layer dropped after its forward
// is gathered again for backward. The test holds the gather queue up for a
// known time before one backward acquire: the model's stream waits for that
// gather, and the wait is the backward's, not the forward's.
TEST(EngineMetrics, AGatherWaitInBackwardIsReportedAsBackwards) {
  EngineOptions o = base_options();
  o.stage = 3;
  o.offload_optimizer = OffloadDevice::kCpu;
  o.offload_param = OffloadDevice::kCpu;
  o.prefetch_bucket_size = 0;  // gathered on demand, at the acquire
  o.max_reuse_distance = 0;    // dropped after the forward
  o.overlap_optimizer = false; // no update left for a forward to wait for
  auto rig = make_rig(o);
  ASSERT_TRUE(rig);
  comm::Communicator& comm = *rig->comms[0];
  ASSERT_TRUE(drive_step(*rig->engine, rig->model).ok());  // records the acquire order
  auto held_up = [&comm](int, size_t li, Engine&) {
    if (li != 1) return;
    auto gate = std::make_shared<CompletionSource>("the test holds the gathers up");
    ASSERT_TRUE(comm.wait(gate->completion(), comm::CommQueue::kGather).ok());
    std::thread([gate] {
      std::this_thread::sleep_for(kSleep);
      gate->complete(Status::Ok());
    }).detach();
  };
  Result<StepMetrics> m = drive_step(*rig->engine, rig->model, held_up);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_GE(m->wait_gather_backward_ms, kSleepMs / 2) << "the backward's gather wait was not reported";
  EXPECT_LT(m->wait_gather_ms, kSleepMs / 2) << "the backward's gather wait was counted as the forward's";
  EXPECT_GT(m->gather_bytes, 0u);
  ASSERT_TRUE(rig->engine->synchronize().ok());
}

// optimizer_ms is one step's updates, not the optimizer thread's other work
// (the gradients' block sums) nor another step's. Overlap off: this step's,
// done before finish_step() returns. On: the previous step's (done at this
// step's commit point), so the first step reports none.
TEST(EngineMetrics, OptimizerTimeIsOneStepsUpdates) {
  for (const bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "overlap on" : "overlap off");
    EngineOptions o = base_options();
    o.overlap_optimizer = overlap;
    auto rig = make_rig(o);
    ASSERT_TRUE(rig);
    for (int s = 0; s < 3; ++s) {
      Result<StepMetrics> m = drive_step(*rig->engine, rig->model);
      ASSERT_TRUE(m.ok()) << m.status().to_string();
      if (overlap && s == 0) {
        EXPECT_EQ(m->optimizer_ms, 0.0) << "the first step has no earlier step's updates to report";
      } else {
        EXPECT_GT(m->optimizer_ms, 0.0);
        if (!overlap) {
          EXPECT_LE(m->optimizer_ms, m->step_ms);
        }
      }
    }
    ASSERT_TRUE(rig->engine->synchronize().ok());
  }
}

// Overlap on: step 1's updates run under step 2's forward. The test holds
// the update of layer 1 on the optimizer thread for a known time (the
// testing seam's observer), so step 2's forward waits for it at layer 1:
// optimizer_waits names that layer, and the waits add up to
// wait_optimizer_ms.
// The CPU optimizer overlapped with the next step, no early updates.
EngineOptions overlapped_cpu_optimizer() {
  EngineOptions o = base_options();
  o.offload_optimizer = OffloadDevice::kCpu;
  o.overlap_optimizer = true;
  o.speculative_optimizer = SpeculationMode::kOff;
  return o;
}

// The testing seam's observer holds the next update of layer 1 for kSleep
// once `hold` is set.
testing::EngineFaults holding_layer_1_update(std::atomic<bool>& hold) {
  testing::EngineFaults faults;
  faults.update_values_queued = [&hold](size_t layer, bool) {
    if (layer == 1 && hold.exchange(false)) std::this_thread::sleep_for(kSleep);
  };
  return faults;
}

TEST(EngineMetrics, AHeldUpdateIsReportedAgainstItsLayer) {
  std::atomic<bool> hold{false};
  const testing::EngineFaults faults = holding_layer_1_update(hold);
  auto rig = make_rig(overlapped_cpu_optimizer(), &faults);
  ASSERT_TRUE(rig);
  hold = true;  // step 1's update of layer 1, which step 2's forward needs
  ASSERT_TRUE(drive_step(*rig->engine, rig->model).ok());
  Result<StepMetrics> m = drive_step(*rig->engine, rig->model);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_GE(m->wait_optimizer_ms, kSleepMs / 2);
  double sum = 0, at_layer_1 = 0;
  for (const StepMetrics::LayerWait& w : m->optimizer_waits) {
    EXPECT_GT(w.ms, 0.0);
    sum += w.ms;
    if (w.layer == 1) at_layer_1 += w.ms;
  }
  EXPECT_EQ(sum, m->wait_optimizer_ms);  // the same additions in the same order
  EXPECT_GE(at_layer_1, kSleepMs / 2) << "the held update was not reported against layer 1";
  ASSERT_TRUE(rig->engine->synchronize().ok());
}

// A driven engine without a model stream (strata.torch's): the acquires say
// who waits (Note [Who waits for an acquired layer]), the host on the cpu
// device or torch's stream on a GPU (here a stream of the test's), and the
// held update is reported against its layer as with the model stream;
// without a waiter nothing is probed.
class HeldUpdateWaiter : public ::testing::TestWithParam<const char*> {};

TEST_P(HeldUpdateWaiter, IsReportedAgainstItsLayerWithoutAModelStream) {
  const std::string who = GetParam();
  std::atomic<bool> hold{false};
  const testing::EngineFaults faults = holding_layer_1_update(hold);
  auto rig = make_rig(overlapped_cpu_optimizer(), &faults, /*with_model_stream=*/false);
  ASSERT_TRUE(rig);
  std::unique_ptr<Stream> callers_stream = rig->device->create_stream().value();
  const AcquireWaiter waiter = who == "host"     ? AcquireWaiter::host()
                               : who == "stream" ? AcquireWaiter::stream(*callers_stream)
                                                 : AcquireWaiter::model_stream();
  hold = true;
  ASSERT_TRUE(drive_step(*rig->engine, rig->model, {}, waiter).ok());
  Result<StepMetrics> m = drive_step(*rig->engine, rig->model, {}, waiter);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  if (who == "none") {
    EXPECT_EQ(m->wait_optimizer_ms, 0.0) << "no model stream and no waiter named: nothing to time from";
    EXPECT_TRUE(m->optimizer_waits.empty());
  } else {
    EXPECT_GE(m->wait_optimizer_ms, kSleepMs / 2) << who;
    double at_layer_1 = 0;
    for (const StepMetrics::LayerWait& w : m->optimizer_waits)
      if (w.layer == 1) at_layer_1 += w.ms;
    EXPECT_GE(at_layer_1, kSleepMs / 2) << "the held update was not reported against layer 1";
  }
  ASSERT_TRUE(rig->engine->synchronize().ok());
}

INSTANTIATE_TEST_SUITE_P(EngineMetrics, HeldUpdateWaiter, ::testing::Values("host", "stream", "none"));

// The engine's measured device memory is what the Device counted for the
// engine's allocations: here the model allocates nothing, so it equals the
// device's own peak, footprints included (odd-sized state pieces).
TEST(EngineMetrics, MeasuredMemoryIsTheDevicesOwnAccounting) {
  struct Case {
    int stage;
    OffloadDevice optimizer, param;
  };
  for (const Case c : {Case{1, OffloadDevice::kNone, OffloadDevice::kNone},
                       Case{3, OffloadDevice::kNone, OffloadDevice::kNone},
                       Case{3, OffloadDevice::kCpu, OffloadDevice::kCpu}}) {
    SCOPED_TRACE(fmt::format("stage {} optimizer {} param {}", c.stage, offload_device_name(c.optimizer),
                             offload_device_name(c.param)));
    EngineOptions o = base_options();
    o.stage = c.stage;
    o.offload_optimizer = c.optimizer;
    o.offload_param = c.param;
    auto rig = make_rig(o);
    ASSERT_TRUE(rig);
    for (int s = 0; s < 2; ++s) ASSERT_TRUE(drive_step(*rig->engine, rig->model).ok());
    ASSERT_TRUE(rig->engine->synchronize().ok());
    const EngineMemory measured = rig->engine->measured_memory();
    const TierStats device = rig->device->memory_stats().get(Tier::kDevice);
    EXPECT_EQ(measured.device, device.peak_bytes);
    if (c.optimizer == OffloadDevice::kCpu) {
      EXPECT_GT(measured.pinned, 0u);
    }
    rig->engine.reset();
    EXPECT_EQ(rig->device->memory_stats().get(Tier::kDevice).current_bytes, 0u) << "the engine freed everything";
  }
}

// Stage 3 at world 1 with the shards on the device (issue 22, defect 16): a
// shard is its whole layer, so acquire hands out the shard's own memory: no
// gather (gather_bytes 0), no gathered copy in the plan or the measurement,
// the same address in every pass and step, and the values the updates wrote.
TEST(EngineMetrics, StageThreeAtWorldOneAcquiresTheShardInPlace) {
  for (const OffloadDevice optimizer : {OffloadDevice::kNone, OffloadDevice::kCpu}) {
    SCOPED_TRACE(fmt::format("optimizer {}", offload_device_name(optimizer)));
    EngineOptions o = base_options();
    o.stage = 3;
    o.offload_optimizer = optimizer;
    o.max_reuse_distance = 0;  // a gathered copy would be dropped and gathered again
    o.prefetch_bucket_size = 0;
    auto rig = make_rig(o);
    ASSERT_TRUE(rig);
    EXPECT_EQ(rig->engine->predicted_memory().device_gathered, 0u);
    std::vector<const std::byte*> first(rig->model.layers().size(), nullptr);
    for (int s = 0; s < 3; ++s) {
      Result<StepMetrics> m = drive_step(*rig->engine, rig->model);
      ASSERT_TRUE(m.ok()) << m.status().to_string();
      EXPECT_EQ(m->gather_bytes, 0u) << "step " << s + 1;
      ASSERT_TRUE(rig->engine->begin_evaluation().ok());
      for (size_t li = 0; li < first.size(); ++li) {
        Result<LayerMemory> mem = rig->engine->acquire(li, Pass::kEval);
        ASSERT_TRUE(mem.ok()) << mem.status().to_string();
        ASSERT_TRUE(mem->ready.wait().ok());
        if (first[li] == nullptr) first[li] = mem->params;
        EXPECT_EQ(mem->params, first[li]) << "layer " << li << ": a copy, not the shard";
        // The parameters the updates wrote (fp32: the master itself).
        std::vector<float> held(rig->model.layers()[li].param_count);
        ASSERT_TRUE(rig->device->copy(held.data(), mem->params, held.size() * 4, CopyKind::kDeviceToHost).ok());
        ASSERT_TRUE(rig->engine->release(li, Pass::kEval, Completion()).ok());
        if (li == 1) {
          Result<double> loss = rig->engine->finish_evaluation(1.0, 1);
          ASSERT_TRUE(loss.ok());
          Result<std::vector<float>> master = rig->engine->gather_state(li);
          ASSERT_TRUE(master.ok()) << master.status().to_string();
          EXPECT_EQ(held, *master) << "layer " << li << " after step " << s + 1;
          ASSERT_TRUE(rig->engine->begin_evaluation().ok());
        }
      }
      ASSERT_TRUE(rig->engine->finish_evaluation(1.0, 1).ok());
    }
    ASSERT_TRUE(rig->engine->synchronize().ok());
    EXPECT_LE(rig->engine->measured_memory().device, rig->engine->predicted_memory().device);
  }
}

}  // namespace
}  // namespace strata::offload

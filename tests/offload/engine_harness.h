#pragma once
// The engine tests' harness: a small GPT trained on local ranks (threads)
// with hooks for the checkpoint tests; the placement matrix. Shared by
// engine_test.cpp and checkpoint_test.cpp.
#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <functional>
#include <thread>

#include <fmt/format.h>

#include "strata/comm/backends.h"
#include "strata/core/device_registry.h"
#include "strata/model/gpt.h"
#include "strata/model/gpt_executor.h"
#include "strata/model/gpt_runner.h"
#include "strata/model/text_data.h"
#include "strata/nvme/aio_config.h"
#include "strata/nvme/testing/fault_injection.h"
#include "strata/nvme/io_engine.h"
#include "strata/offload/engine.h"
#include "strata/offload/testing/engine_seam.h"

namespace strata::offload {
namespace {

using model::GptConfig;
using model::TextDataset;

const TextDataset& corpus() {
  static const TextDataset data = TextDataset::load(model::default_corpus_path(), 16).value();
  return data;
}

// A small GPT that trains in milliseconds per step.
GptConfig small_gpt(DType dtype = DType::kF32) {
  GptConfig g;
  g.vocab_size = 256;
  g.max_seq_len = 16;
  g.n_layer = 2;
  g.n_head = 2;
  g.n_embd = 32;
  g.param_dtype = dtype;
  return g;
}

// Fault-injecting NVMe I/O engines, one per rank (TrainRun::engine_for_rank
// or param_engine_for_rank), each EIO on every faulted I/O while armed and
// disarmed until a test arms it.
struct FaultyEngines {
  std::vector<std::unique_ptr<nvme::IoEngine>> engines;
  std::vector<std::shared_ptr<nvme::FaultCounters>> counters;
  FaultyEngines(int world, bool reads, bool writes) {
    nvme::IoEngineConfig ec = nvme::io_engine_config(AioConfig{}).value();
    nvme::FaultPlan plan;
    plan.eio_probability = 1.0;
    plan.fault_reads = reads;
    plan.fault_writes = writes;
    counters.resize(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) {
      engines.push_back(nvme::make_fault_injecting_engine(ec.options, plan, &counters[r]).value());
      counters[r]->disarm();
    }
  }
  nvme::IoEngine* operator[](int rank) const { return engines[static_cast<size_t>(rank)].get(); }
  uint64_t eio() const {
    uint64_t n = 0;
    for (const auto& c : counters) n += c->eio.load();
    return n;
  }
};

struct TrainRun {
  int world = 1;
  int global_batch = 8;
  int seq_len = 16;
  int steps = 30;
  uint64_t device_bytes = uint64_t{256} << 20;
  GptConfig gpt = small_gpt();
  EngineOptions opt;
  // Called on every rank after each step (collectives allowed).
  std::function<void(Engine&, int64_t step)> after_step;
  // Checkpoint hooks, on every rank: before the first step (a load), after
  // each step (a save) and after the last (waiting for the save in flight).
  std::function<Status(Engine&, int rank)> on_start;
  std::function<Status(Engine&, int rank, int64_t step)> on_step;
  std::function<Status(Engine&, int rank)> on_end;
  // Rank `fail_rank` returns an error after step `fail_step` (0: never) and
  // leaves the group, as a crashed rank would.
  int fail_rank = -1;
  int fail_step = 0;
  // Faults every rank's engine is created with (the testing seam); the I/O
  // engines of the two hooks below go into its optimizer_io and param_io.
  testing::EngineFaults faults;
  // Per-rank NVMe I/O engine for the optimizer state, or null.
  std::function<nvme::IoEngine*(int rank)> engine_for_rank;
  // The same for the stage-3 parameter shards on NVMe.
  std::function<nvme::IoEngine*(int rank)> param_engine_for_rank;
  // The same for gradient shards on NVMe (strata.gradient_shards nvme).
  std::function<nvme::IoEngine*(int rank)> gradient_engine_for_rank;
  // Failed step() calls a rank goes past (calling step() again) before
  // giving up; rank 0's are kept in Outcome::failures.
  int retries = 0;
  TrainRun() {
    opt.grad_accum = 2;
    opt.grad_clip = 0.5;  // clipping active on most steps
    opt.hyper.lr = 3e-3;
    opt.hyper.weight_decay = 0.01;
  }
};

struct Outcome {
  Status status;
  std::vector<double> losses;          // rank 0's (the global mean)
  std::vector<StepMetrics> metrics;    // rank 0's
  std::vector<uint64_t> peak_device;   // per rank
  std::vector<double> val;             // rank 0's final validation loss
  std::vector<EngineMemory> predicted, measured;  // per rank
  std::vector<Status> failures;        // rank 0's step() errors gone past (TrainRun::retries)
};

Outcome train(const TrainRun& run) {
  Outcome out;
  auto comms = comm::create_local_group(run.world).value();
  std::vector<Status> st(run.world);
  out.peak_device.assign(run.world, 0);
  out.predicted.resize(run.world);
  out.measured.resize(run.world);
  std::vector<std::thread> threads;
  for (int r = 0; r < run.world; ++r) {
    threads.emplace_back([&, r] {
      auto body = [&]() -> Status {
        DeviceOptions dopt;
        dopt.device_memory_bytes = run.device_bytes;
        STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, make_device(DeviceKind::kCpu, dopt));
        STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, device->create_stream());
        STRATA_ASSIGN_OR_RETURN(auto gpt, model::GptModel::create(run.gpt, 1234));
        STRATA_ASSIGN_OR_RETURN(auto exec, model::GptExecutor::create(*gpt, *device, *stream,
                                                                      run.global_batch / run.world, run.seq_len));
        STRATA_ASSIGN_OR_RETURN(auto runner, model::GptRunner::create(*gpt, *exec, corpus(), 1234, 2,
                                                                      model::RankSlice{r, run.world}));
        testing::EngineFaults faults = run.faults;
        if (run.engine_for_rank) faults.optimizer_io = run.engine_for_rank(r);
        if (run.param_engine_for_rank) faults.param_io = run.param_engine_for_rank(r);
        if (run.gradient_engine_for_rank) faults.gradient_io = run.gradient_engine_for_rank(r);
        STRATA_ASSIGN_OR_RETURN(auto engine, testing::create_engine(run.opt, *runner, *device, *comms[r], faults));
        if (run.on_start) STRATA_RETURN_IF_ERROR(run.on_start(*engine, r));
        const int64_t first = engine->steps_begun();
        int retries = run.retries;
        for (int64_t s = first + 1; s <= run.steps; ++s) {
          Result<StepMetrics> tried = engine->step();
          if (!tried.ok() && retries > 0) {
            // A rolled-back step: the calls it undid are repeated.
            --retries;
            if (r == 0) {
              out.failures.push_back(tried.status());
              out.losses.resize(static_cast<size_t>(engine->steps_begun() - first));
              out.metrics.resize(out.losses.size());
            }
            s = engine->steps_begun();
            continue;
          }
          STRATA_ASSIGN_OR_RETURN(StepMetrics m, std::move(tried));
          if (r == 0) {
            out.losses.push_back(m.loss);
            out.metrics.push_back(m);
          }
          if (run.after_step) run.after_step(*engine, s);
          if (run.on_step) STRATA_RETURN_IF_ERROR(run.on_step(*engine, r, s));
          if (r == run.fail_rank && s == run.fail_step) return Internal(fmt::format("rank {} crashed", r));
        }
        if (run.on_end) STRATA_RETURN_IF_ERROR(run.on_end(*engine, r));
        STRATA_ASSIGN_OR_RETURN(double v, engine->evaluate());
        if (r == 0) out.val.push_back(v);
        STRATA_RETURN_IF_ERROR(engine->synchronize());
        out.peak_device[r] = device->memory_stats().get(Tier::kDevice).peak_bytes;
        out.predicted[r] = engine->predicted_memory();
        out.measured[r] = engine->measured_memory();
        return Status::Ok();
      };
      st[r] = body();
      if (!st[r].ok()) comms[r].reset();  // a failed rank leaves the group
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : st)
    if (!s.ok()) {
      out.status = s;
      break;
    }
  return out;
}

struct Placement {
  int stage;
  OffloadDevice optimizer, param;
  bool overlap = true;
  int64_t sub_group = 1'000'000'000;
  int64_t max_live = 1'000'000'000, reuse = 1'000'000'000, persistence = 100'000;
  double ratio = 1.0;
  std::string name() const {
    return fmt::format("stage {} optimizer {} param {} overlap {} sub_group {} live {} reuse {} persist {} ratio {}",
                       stage, offload_device_name(optimizer), offload_device_name(param), overlap, sub_group, max_live,
                       reuse, persistence, ratio);
  }
};

[[maybe_unused]] std::vector<Placement> matrix() {
  using D = OffloadDevice;
  std::vector<Placement> m;
  for (int stage = 1; stage <= 3; ++stage)
    for (D o : {D::kNone, D::kCpu}) m.push_back({stage, o, D::kNone});
  m.push_back({3, D::kCpu, D::kCpu});
  // Overlap off, several sub-groups per layer, and stage 3 with every layer
  // partitioned, nothing kept (live cap of one layer, no reuse) or all kept.
  m.push_back({3, D::kCpu, D::kCpu, false, 4096, 1'000'000'000, 1'000'000'000, 0});
  m.push_back({3, D::kNone, D::kNone, true, 4096, 20'000, 0, 0});
  m.push_back({2, D::kCpu, D::kNone, false, 8192});
  // Partial offload: part of every piece's state stays on the device and is
  // stepped there at the same time.
  m.push_back({3, D::kCpu, D::kNone, true, 1'000'000'000, 1'000'000'000, 1'000'000'000, 0, 0.5});
  m.push_back({3, D::kCpu, D::kNone, false, 4096, 1'000'000'000, 1'000'000'000, 100'000, 0.3});
  // Optimizer state on NVMe (streamed through pinned slots, read ahead and
  // written back asynchronously), at stages 1 and 3, several sub-groups.
  m.push_back({1, D::kNvme, D::kNone});
  m.push_back({3, D::kNvme, D::kCpu, true, 4096});
  // Parameter shards on NVMe: every partitioned layer (max_in_cpu 0), and
  // with the optimizer on NVMe too.
  m.push_back({3, D::kCpu, D::kNvme, true, 1'000'000'000, 1'000'000'000, 1'000'000'000, 0});
  m.push_back({3, D::kNvme, D::kNvme, false, 4096, 20'000, 0, 0});
  return m;
}

// Sets `r`'s engine options to placement `p` (NVMe folders under the test's temporary folder).
void apply_placement(TrainRun& r, const Placement& p) {
  r.opt.stage = p.stage;
  r.opt.offload_optimizer = p.optimizer;
  r.opt.offload_param = p.param;
  r.opt.overlap_optimizer = p.overlap;
  r.opt.sub_group_size = p.sub_group;
  r.opt.max_live_parameters = p.max_live;
  r.opt.max_reuse_distance = p.reuse;
  r.opt.persistence_threshold = p.persistence;
  r.opt.ratio = p.ratio;
  if (p.optimizer == OffloadDevice::kNvme) {
    r.opt.nvme.path = ::testing::TempDir();
    r.opt.nvme.buffer_count = 3;
    r.opt.nvme.pipeline_read = r.opt.nvme.pipeline_write = true;
  }
  if (p.param == OffloadDevice::kNvme) {
    r.opt.nvme_param.path = ::testing::TempDir();
    r.opt.nvme_param.buffer_count = 2;
    r.opt.nvme_param.max_in_cpu = 0;
  }
}

[[maybe_unused]] void expect_same_losses(const Outcome& base, const Outcome& other, const std::string& what) {
  ASSERT_TRUE(other.status.ok()) << what << ": " << other.status.to_string();
  ASSERT_EQ(base.losses.size(), other.losses.size()) << what;
  for (size_t i = 0; i < base.losses.size(); ++i)
    ASSERT_EQ(std::bit_cast<uint64_t>(base.losses[i]), std::bit_cast<uint64_t>(other.losses[i]))
        << what << ": step " << i + 1 << " loss " << other.losses[i] << " vs stage 0 " << base.losses[i];
  ASSERT_EQ(base.val, other.val) << what;
}

}  // namespace
}  // namespace strata::offload

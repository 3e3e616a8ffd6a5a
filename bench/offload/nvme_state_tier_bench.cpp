// Optimizer state streamed through the NVMe tier: every piece opened, its
// state touched (one pass, like a step), closed modified, in the engine's
// order, with the pipeline on and off. Bytes/s counts NVMe reads + writes.
// Ceiling: the raw IoEngine sequential read + write of the same bytes with
// the same aio settings and slots, on the same folder (`strata io-bench`'s
// measurement); compare with `strata io-bench --path <dir>` too.
//
//   STRATA_BENCH_DIR=/mnt/nvme STRATA_BENCH_STATE_MIB=256 strata_nvme_state_tier_bench
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include "strata/core/device_registry.h"
#include "strata/core/slot_pool.h"
#include "strata/core/units.h"
#include "strata/cpu_adam/optimizer.h"
#include "strata/nvme/io_engine.h"
#include "strata/offload/nvme_state_tier.h"

namespace {

using namespace strata;
using namespace strata::offload;

std::string bench_dir() {
  const char* dir = std::getenv("STRATA_BENCH_DIR");
  return dir != nullptr ? dir : "/tmp";
}
uint64_t state_bytes() {
  const char* mib = std::getenv("STRATA_BENCH_STATE_MIB");
  return (mib != nullptr ? std::strtoull(mib, nullptr, 10) : 256) << 20;
}
constexpr size_t kPieceElements = 1u << 20;  // 4 MiB master + 8 MiB moments: a 12 MiB piece

std::unique_ptr<Device> cpu_device() {
  DeviceOptions o;
  o.device_memory_bytes = 64u << 20;
  return std::move(make_device("cpu", o)).value();
}

// range(0): buffer_count; range(1): pipeline read and write on (1) / off (0);
// range(2): 1 = a real AdamW step of each piece (cpu_adam, one thread) between
// open and close, so the pipeline has compute to hide the I/O behind;
// 0 = I/O only (one float touched).
void BM_NvmeStateTierStep(benchmark::State& state) {
  const size_t buffers = static_cast<size_t>(state.range(0));
  const bool pipeline = state.range(1) != 0;
  const bool adam = state.range(2) != 0;
  cpu_adam::OptimizerOptions oo;
  oo.threads = 1;
  auto optimizer = std::move(cpu_adam::CpuOptimizer::create(oo)).value();
  std::vector<float> grads(kPieceElements, 0.01f);
  int64_t step = 0;
  const uint64_t piece_bytes = nvme_piece_bytes(kPieceElements, true, cpu_adam::MomentStorage::fp32());
  const size_t pieces = std::max<uint64_t>(1, state_bytes() / piece_bytes);
  auto device = cpu_device();
  MemoryStats stats;
  NvmeStateTierOptions o;
  o.nvme_paths = {bench_dir()};
  o.job = fmt::format("bench-{}", ::getpid());
  o.capacity_bytes = pieces * piece_bytes;
  o.slot_bytes = piece_bytes;
  o.buffer_count = buffers;
  o.pipeline_read = o.pipeline_write = pipeline;
  auto made = make_nvme_state_tier(o, *device, stats);
  if (!made.ok()) {
    state.SkipWithError(made.status().to_string().c_str());
    return;
  }
  std::unique_ptr<OptimizerStateTier> tier = std::move(made).value();
  std::vector<float> master(kPieceElements, 0.5f);
  for (size_t i = 0; i < pieces; ++i) {
    Status st = tier->add({0, static_cast<uint32_t>(i), 0}, fmt::format("piece {}", i), kPieceElements, master);
    if (!st.ok()) return state.SkipWithError(st.to_string().c_str());
  }
  if (Status st = tier->flush(); !st.ok()) return state.SkipWithError(st.to_string().c_str());
  const StateTierIoStats before = tier->io_stats();
  for (auto _ : state) {
    for (size_t i = 0; i < pieces; ++i) {
      auto s = tier->open({0, static_cast<uint32_t>(i), 0});
      if (!s.ok()) return state.SkipWithError(s.status().to_string().c_str());
      if (adam) {
        cpu_adam::StepArgs args;
        args.step = ++step;
        cpu_adam::StateSpans sp;
        sp.count = s->count;
        sp.params = s->master;
        sp.grads = grads.data();
        sp.exp_avg = s->exp_avg;
        sp.exp_avg_sq = s->exp_avg_sq;
        if (auto r = optimizer.step(args, sp); !r.ok()) return state.SkipWithError(r.status().to_string().c_str());
      } else {
        s->master[i % kPieceElements] += 1.0f;
      }
      if (Status st = tier->close({0, static_cast<uint32_t>(i), 0}, true); !st.ok())
        return state.SkipWithError(st.to_string().c_str());
    }
    if (Status st = tier->flush(); !st.ok()) return state.SkipWithError(st.to_string().c_str());
  }
  const StateTierIoStats after = tier->io_stats();
  const double moved = static_cast<double>((after.bytes_read - before.bytes_read) + (after.bytes_written - before.bytes_written));
  state.SetBytesProcessed(static_cast<int64_t>(moved));
  state.counters["read_wait_s"] = static_cast<double>(after.read_wait_ns - before.read_wait_ns) / 1e9;
  state.counters["prefetched_opens"] = static_cast<double>(after.prefetched_opens - before.prefetched_opens);
  state.counters["peak_slots"] = static_cast<double>(after.peak_slots_in_use);
  state.SetLabel(fmt::format("{} of state, {}", strata::format_bytes(pieces * piece_bytes, true), tier->describe()));
}

// The ceiling: the same bytes read then written sequentially through a raw
// engine with the same slots (no checksums, no shadow extents).
void BM_RawEngineCeiling(benchmark::State& state) {
  const size_t buffers = static_cast<size_t>(state.range(0));
  const uint64_t piece_bytes = nvme_piece_bytes(kPieceElements, true, cpu_adam::MomentStorage::fp32());
  const size_t pieces = std::max<uint64_t>(1, state_bytes() / piece_bytes);
  auto device = cpu_device();
  SlotPoolOptions po;
  po.slot_count = buffers;
  po.slot_bytes = piece_bytes;
  auto pool = std::move(SlotPool::create(*device, po)).value();
  auto engine = std::move(nvme::make_io_engine({})).value();
  engine->register_buffer(pool->base(), pool->total_bytes()).ignore();
  const std::string path = fmt::format("{}/strata-bench-ceiling-{}.bin", bench_dir(), ::getpid());
  auto file = engine->open(path, nvme::OpenMode::kCreate);
  if (!file.ok()) return state.SkipWithError(file.status().to_string().c_str());
  std::memset(pool->base(), 1, pool->total_bytes());
  for (size_t i = 0; i < pieces; ++i) {
    Status st = engine->write_sync(*file, i * piece_bytes, piece_bytes, static_cast<std::byte*>(pool->base()));
    if (!st.ok()) return state.SkipWithError(st.to_string().c_str());
  }
  for (auto _ : state) {
    for (nvme::IoOp op : {nvme::IoOp::kRead, nvme::IoOp::kWrite}) {
      std::vector<Completion> done;
      for (size_t i = 0; i < pieces; ++i) {
        Slot slot = std::move(pool->acquire("ceiling")).value();
        nvme::IoSegment seg{*file, i * piece_bytes, piece_bytes, slot.data()};
        nvme::IoHandle h = engine->submit(op, std::span<const nvme::IoSegment>(&seg, 1));
        slot.release_after(h.completion());
        done.push_back(h.completion());
      }
      for (const Completion& c : done)
        if (Status st = c.wait(); !st.ok()) return state.SkipWithError(st.to_string().c_str());
    }
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * 2 * pieces * piece_bytes));
  state.SetLabel(fmt::format("ceiling: raw {} read + write, {}", strata::format_bytes(pieces * piece_bytes, true),
                             engine->describe()));
  engine->close(*file).ignore();
  ::unlink(path.c_str());
  engine->unregister_buffer(pool->base()).ignore();
}

// The step alone, in memory (no tier): what a pipeline can hide I/O behind.
void BM_AdamStepInMemory(benchmark::State& state) {
  cpu_adam::OptimizerOptions oo;
  oo.threads = 1;
  auto optimizer = std::move(cpu_adam::CpuOptimizer::create(oo)).value();
  const uint64_t piece_bytes = nvme_piece_bytes(kPieceElements, true, cpu_adam::MomentStorage::fp32());
  const size_t pieces = std::max<uint64_t>(1, state_bytes() / piece_bytes);
  std::vector<float> master(kPieceElements, 0.5f), m(kPieceElements), v(kPieceElements), grads(kPieceElements, 0.01f);
  int64_t step = 0;
  for (auto _ : state) {
    for (size_t i = 0; i < pieces; ++i) {
      cpu_adam::StepArgs args;
      args.step = ++step;
      cpu_adam::StateSpans sp;
      sp.count = kPieceElements;
      sp.params = master.data();
      sp.grads = grads.data();
      sp.exp_avg = m.data();
      sp.exp_avg_sq = v.data();
      if (auto r = optimizer.step(args, sp); !r.ok()) return state.SkipWithError(r.status().to_string().c_str());
    }
  }
  state.SetLabel(fmt::format("{} pieces of {} elements, one thread", pieces, kPieceElements));
}

BENCHMARK(BM_AdamStepInMemory)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_RawEngineCeiling)->Arg(4)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_NvmeStateTierStep)
    ->Args({4, 1, 0})
    ->Args({4, 0, 0})
    ->Args({2, 1, 0})
    ->Args({8, 1, 0})
    ->Args({4, 1, 1})
    ->Args({4, 0, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();

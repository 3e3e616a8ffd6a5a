// strata report --calibrate: this machine's component rates as a hardware
// profile (strata/offload/hardware_profile.h), measured the way the engine
// uses each component, on the cpu device or (--calibrate-device cuda) a GPU:
//   - H2D / D2H: 64 MiB copies between pinned host memory and the device
//     through a Stream (the cpu device: the copy thread the engine's copies
//     use; cuda: the copy engines);
//   - the device optimizer: on cuda, the fused Adam kernel over 16M
//     parameters (bf16 gradients and copy, fp32 moments); the cpu device
//     steps its state with the CPU kernels, so its rate is CPU Adam's;
//   - CPU Adam: CpuOptimizer steps of 4M elements for 1..all threads, with
//     fp32 gradients (the fp32 mix) and with bf16 gradients plus the bf16
//     parameter copy (the bf16 mix); the profile's rates are those at
//     --calibrate-optimizer-threads (every core by default);
//   - NVMe: 256 MiB written then read back, five times (the median of each),
//     through the IoEngine the aio
//     defaults pick (O_DIRECT where the file system allows it) in --path;
//   - collectives: all_reduce of 64 MiB over 2 local ranks, nccl-tests'
//     busbw (x 2(n-1)/n);
//   - compute: the reference GPT (--preset, batch x seq) at stage 0 on the
//     device; the step minus what the step-time model charges the
//     optimizer and the reductions is the compute, so the model reproduces
//     this row exactly and the other rows test it (Note [The engine's
//     schedule, as a model], step_time_model.h).
//   With --calibrate-device-threads D and --calibrate-optimizer-threads K on
//   the cpu device, the compute is timed on D threads, and when D + K fit the
//   cores the profile says so (optimizer_on_own_cores): strata train
//   --device-threads D --optimizer-threads K overlaps the optimizer with the
//   compute there, and the model predicts such runs as that.
#include "calibrate.h"
#include "command.h"
#include "config_fit_cli.h"
#include "sample_stats.h"

#include <sys/statvfs.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine_run.h"
#include "strata/core/printable.h"
#include "strata/comm/backends.h"
#include "strata/core/device_registry.h"
#include "strata/core/units.h"
#include "strata/cpu_adam/optimizer.h"
#include "strata/nvme/aio_config.h"
#include "strata/nvme/aligned_buffer.h"
#include "strata/offload/device_adam.h"
#include "strata/offload/hardware_profile.h"
#include "strata/offload/step_time_model.h"

namespace strata::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct CopyRates {
  double h2d = 0, d2h = 0;
};

Result<CopyRates> measure_copies(DeviceKind kind_of_device, nlohmann::ordered_json& cal) {
  constexpr size_t kBytes = size_t{64} << 20;
  DeviceOptions dopt;
  dopt.device_memory_bytes = 2 * kBytes;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, make_device(kind_of_device, dopt));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, device->create_stream());
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer dev, device->allocate(kBytes));
  STRATA_ASSIGN_OR_RETURN(void* host, device->allocate_pinned_host(kBytes));
  std::memset(host, 1, kBytes);
  if (Status st = device->memset(dev.data(), 2, kBytes); !st.ok()) {
    device->free_pinned_host(host, kBytes);
    return st;
  }
  CopyRates r;
  for (CopyKind kind : {CopyKind::kHostToDevice, CopyKind::kDeviceToHost}) {
    std::vector<double> t;
    for (int rep = 0; rep < 6; ++rep) {
      const auto t0 = Clock::now();
      Status st = kind == CopyKind::kHostToDevice ? stream->copy_async(dev.data(), host, kBytes, kind)
                                                  : stream->copy_async(host, dev.data(), kBytes, kind);
      if (st.ok()) st = stream->synchronize();
      if (!st.ok()) {
        device->free_pinned_host(host, kBytes);
        return st.with_context("calibrating copies");
      }
      if (rep > 0) t.push_back(seconds_since(t0));  // the first touches the pages
    }
    (kind == CopyKind::kHostToDevice ? r.h2d : r.d2h) = kBytes / median(t) / 1e9;
  }
  device->free_pinned_host(host, kBytes);
  cal["copies"] = {{"bytes", kBytes}, {"h2d_gb_per_s", r.h2d}, {"d2h_gb_per_s", r.d2h},
                   {"device", device_kind_name(kind_of_device)}, {"device_name", device->caps().name}};
  return r;
}

// The fused device Adam kernel (offload_optimizer none on cuda): parameters
// per second over 16M elements, the engine's usual mix (bf16 gradients and
// parameter copy, fp32 moments), the median of 5 timed steps after one.
Result<double> measure_device_adam(Device& device, nlohmann::ordered_json& cal) {
  constexpr size_t kCount = size_t{16} << 20;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, device.create_stream());
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer params, device.allocate(kCount * 4));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer grads, device.allocate(kCount * 2));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer exp_avg, device.allocate(kCount * 4));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer exp_avg_sq, device.allocate(kCount * 4));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer copy, device.allocate(kCount * 2));
  // Every byte 0x3c: fp32 0x3c3c3c3c and bf16 0x3c3c are both about 0.0115,
  // ordinary positive numbers, so no zero or subnormal takes a special path
  // through the kernel's exact division and square root.
  for (DeviceBuffer* b : {&params, &grads, &exp_avg, &exp_avg_sq, &copy})
    STRATA_RETURN_IF_ERROR(device.memset(b->data(), 0x3c, b->size_bytes()));
  STRATA_RETURN_IF_ERROR(offload::load_device_adam_kernels(*stream));
  const offload::DeviceAdamTensor tensor{params.as<float>(), grads.data(), exp_avg.data(), exp_avg_sq.data(),
                                         copy.data(), kCount};
  std::vector<double> t;
  for (int rep = 0; rep < 6; ++rep) {
    offload::DeviceAdamArgs args;
    args.step = rep + 1;
    args.hyper = {.lr = 1e-4, .weight_decay = 0.01};
    args.grad_dtype = DType::kBF16;
    const auto t0 = Clock::now();
    STRATA_RETURN_IF_ERROR(offload::device_adam_step(*stream, args, {&tensor, 1}));
    STRATA_RETURN_IF_ERROR(stream->synchronize());
    if (rep > 0) t.push_back(seconds_since(t0));  // the first pays the launch's first-time costs
  }
  const double rate = kCount / median(t);
  cal["device_adam"] = {{"params", kCount}, {"mix", "bf16 gradients and copy, fp32 moments"},
                        {"params_per_s", rate}, {"device", device.caps().name}};
  return rate;
}

struct AdamRates {
  double fp32 = 0, bf16 = 0, int8 = 0;
};

// The profile's rates are those at `requested_threads` threads (0: every core).
Result<AdamRates> measure_cpu_adam(int requested_threads, nlohmann::ordered_json& cal) {
  using namespace cpu_adam;
  constexpr size_t kCount = size_t{4} << 20;
  std::vector<float> params(kCount, 0.5f), grads32(kCount, 1e-3f), m(kCount, 0.f), v(kCount, 0.f);
  std::vector<uint16_t> grads16(kCount, fp32_to_bf16_bits(1e-3f)), copy(kCount, 0);
  const MomentStorage int8 = MomentStorage::int8();
  std::vector<std::byte> m8(int8.moment_bytes(kCount)), v8(int8.moment_bytes(kCount));
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  AdamRates all;
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  std::vector<int> thread_counts;  // 1, 2, 4, ..., every core, and rate_threads
  for (int threads = 1; threads <= cores; threads = threads < cores ? std::min(cores, threads * 2) : cores + 1)
    thread_counts.push_back(threads);
  const int rate_threads = requested_threads > 0 ? requested_threads : cores;
  if (std::find(thread_counts.begin(), thread_counts.end(), rate_threads) == thread_counts.end()) {
    thread_counts.push_back(rate_threads);
    std::sort(thread_counts.begin(), thread_counts.end());
  }
  for (int threads : thread_counts) {
    STRATA_ASSIGN_OR_RETURN(CpuOptimizer opt, CpuOptimizer::create({.kind = OptimizerKind::kAdamW, .threads = threads}));
    nlohmann::ordered_json row;
    row["threads"] = threads;
    for (const char* kind : {"fp32", "bf16", "int8"}) {
      const bool bf16 = kind != std::string_view("fp32");  // int8: bf16 gradients and copy, 8-bit moments
      StateSpans s{.count = kCount, .params = params.data(),
                   .grads = bf16 ? static_cast<const void*>(grads16.data()) : grads32.data(),
                   .grad_dtype = bf16 ? DType::kBF16 : DType::kF32, .exp_avg = m.data(), .exp_avg_sq = v.data(),
                   .moment_dtype = DType::kF32, .param_copy = bf16 ? copy.data() : nullptr,
                   .param_copy_dtype = DType::kBF16};
      if (kind == std::string_view("int8")) int8.point(s, m8.data(), v8.data(), kCount, 0);
      std::vector<double> t;
      for (int rep = 0; rep < 4; ++rep) {
        StepArgs a;
        a.step = rep + 1;
        a.hyper = {.lr = 1e-4, .weight_decay = 0.01};
        const auto t0 = Clock::now();
        STRATA_ASSIGN_OR_RETURN(StepReport r, opt.step(a, s));
        (void)r;
        if (rep > 0) t.push_back(seconds_since(t0));
      }
      const double rate = kCount / median(t);
      row[kind] = rate;
      if (threads == opt.threads() && threads == rate_threads)
        (kind == std::string_view("fp32") ? all.fp32 : kind == std::string_view("bf16") ? all.bf16 : all.int8) = rate;
    }
    rows.push_back(row);
  }
  cal["cpu_adam"] = {{"elements", kCount}, {"kernel", "adamw"}, {"fp32", "fp32 gradients, no parameter copy"},
                     {"bf16", "bf16 gradients, bf16 parameter copy"},
                     {"int8", "bf16 gradients, bf16 parameter copy, block-wise 8-bit moments"},
                     {"params_per_s_by_threads", rows}, {"optimizer_threads", requested_threads}};
  if (all.fp32 <= 0)
    return Internal(fmt::format("CPU Adam: the optimizer ran fewer threads than the {} asked for", rate_threads));
  return all;
}

struct NvmeRates {
  double read = 0, write = 0;
};

Result<NvmeRates> measure_nvme(const std::string& dir, const AioConfig& aio, nlohmann::ordered_json& cal) {
  constexpr size_t kChunk = size_t{64} << 20;
  constexpr int kChunks = 4;
  STRATA_ASSIGN_OR_RETURN(nvme::IoEngineConfig ec, nvme::io_engine_config(aio));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<nvme::IoEngine> io, nvme::make_io_engine(ec.options));
  const std::string file = (std::filesystem::path(dir) / fmt::format("strata-calibrate-{}.bin", getpid())).string();
  STRATA_ASSIGN_OR_RETURN(nvme::AlignedBuffer buf, nvme::AlignedBuffer::allocate(kChunk));
  for (size_t i = 0; i < kChunk; ++i) buf.data()[i] = static_cast<std::byte>(i * 131);
  Result<nvme::FileId> f = io->open(file, nvme::OpenMode::kCreate);
  if (!f.ok()) return f.status().with_context("--path");
  struct Remove {
    std::string path;
    ~Remove() { std::filesystem::remove(path); }
  } remove{file};
  STRATA_ASSIGN_OR_RETURN(nvme::FileInfo info, io->file_info(*f));
  auto pass = [&](nvme::IoOp op) -> Result<double> {
    const auto t0 = Clock::now();
    std::vector<nvme::IoHandle> handles;
    for (int c = 0; c < kChunks; ++c)
      handles.push_back(op == nvme::IoOp::kWrite ? io->write(*f, c * kChunk, kChunk, buf.data())
                                                 : io->read(*f, c * kChunk, kChunk, buf.data()));
    for (auto& h : handles) STRATA_RETURN_IF_ERROR(h.wait().with_context(file));
    if (op == nvme::IoOp::kWrite && ::fsync(-1) == 0) {}  // O_DIRECT writes are on the device when they complete
    return kChunks * kChunk / seconds_since(t0) / 1e9;
  };
  // Alternating passes, the median of each: one pass of a virtio disk varied 2x between runs a minute apart
  // (1.04 vs 2.21 GB/s written, 2026-12-02), and the NVMe rows' predictions with it.
  constexpr int kPasses = 5;
  std::vector<double> writes, reads;
  for (int i = 0; i < kPasses; ++i) {
    STRATA_ASSIGN_OR_RETURN(double w, pass(nvme::IoOp::kWrite));
    STRATA_ASSIGN_OR_RETURN(double r, pass(nvme::IoOp::kRead));
    writes.push_back(w);
    reads.push_back(r);
  }
  const nlohmann::ordered_json write_passes = writes, read_passes = reads;
  const double w = median(writes), r = median(reads);
  STRATA_RETURN_IF_ERROR(io->close(*f));
  cal["nvme"] = {{"path", dir}, {"engine", io->describe()}, {"direct", info.direct},
                 {"fallback_reason", info.fallback_reason}, {"bytes", kChunks * kChunk},
                 {"block_size", ec.options.block_size}, {"queue_depth", ec.options.queue_depth},
                 {"intra_op_parallelism", ec.options.intra_op_parallelism},
                 {"read_gb_per_s", r}, {"write_gb_per_s", w}, {"read_passes_gb_per_s", read_passes},
                 {"write_passes_gb_per_s", write_passes}};
  return NvmeRates{r, w};
}

Result<double> measure_collective(nlohmann::ordered_json& cal) {
  constexpr size_t kCount = size_t{16} << 20;  // 64 MiB of fp32
  constexpr int kRanks = 2;
  STRATA_ASSIGN_OR_RETURN(auto comms, comm::create_local_group(kRanks, {}));
  std::vector<double> times[kRanks];
  Status st = run_rank_threads(comms, [&](size_t i, comm::Communicator& c) -> Status {
    std::vector<float> send(kCount, 1.0f), recv(kCount);
    for (int rep = 0; rep < 4; ++rep) {
      const auto t0 = Clock::now();
      STRATA_ASSIGN_OR_RETURN(comm::CommWork w, c.all_reduce(send.data(), recv.data(), kCount, DType::kF32));
      STRATA_RETURN_IF_ERROR(w.wait());
      if (rep > 0) times[i].push_back(seconds_since(t0));
    }
    return Status::Ok();
  });
  STRATA_RETURN_IF_ERROR(st.with_context("calibrating collectives"));
  const double t = std::max(median(times[0]), median(times[1]));
  const double busbw = kCount * 4.0 * 2 * (kRanks - 1) / kRanks / t / 1e9;
  cal["collective"] = {{"op", "all_reduce"}, {"ranks", kRanks}, {"bytes", kCount * 4}, {"busbw_gb_per_s", busbw},
                       {"backend", "local"}};
  return busbw;
}

int calibrate_failed(const Status& st) {
  fmt::print(stderr, "strata report --calibrate: error: {}\n", printable_message(st.to_string()));
  return st.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace

int run_calibrate(const CalibrateOptions& o) {
  // The profile is written after about ten seconds of measuring: a file it
  // cannot be written to is refused first (strata plan --fit --out's check).
  if (o.out_given) {
    if (Status st = check_output_path(o.out, "--out"); !st.ok()) return calibrate_failed(st);
  }
  Result<model::GptConfig> preset = model::preset(o.preset);
  if (!preset.ok()) return calibrate_failed(preset.status().with_context("--calibrate-model"));
  model::GptConfig g = *preset;
  Result<DType> dt = parse_dtype(o.dtype);
  if (!dt.ok() || !is_state_float(*dt))
    return calibrate_failed(InvalidArgument(fmt::format(
        "--calibrate-dtype '{}' is not a parameter dtype; use fp32, bf16 or fp16", printable(o.dtype, 64))));
  g.param_dtype = *dt;
  if (Status v = g.validate(); !v.ok()) return calibrate_failed(v);
  if (o.seq > g.max_seq_len)
    return calibrate_failed(
        InvalidArgument(fmt::format("--calibrate-seq {} is longer than the model's max_seq {}", o.seq, g.max_seq_len)));
  Result<DeviceKind> requested = parse_device_flag(o.device, "--calibrate-device");
  if (!requested.ok()) return calibrate_failed(requested.status());
  const DeviceChoice choice = resolve_device_kind(*requested);
  const DeviceKind kind = choice.kind;
  if (choice.automatic) fmt::print(stderr, "calibrate: --calibrate-device {}\n", choice.reason);
  if (kind == DeviceKind::kCuda && o.ranks != 1)
    return calibrate_failed(InvalidArgument(fmt::format(
        "--calibrate-ranks {} with --calibrate-device cuda: a GPU is calibrated with one rank (the profile is per "
        "device; gpus_per_node says how many a node has)",
        o.ranks)));
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  if (o.device_threads > 0 && kind != DeviceKind::kCpu)
    return calibrate_failed(InvalidArgument(fmt::format(
        "--calibrate-device-threads {} with --calibrate-device {}: it sets the cpu device's compute threads; leave it "
        "out (or 0) for a GPU",
        o.device_threads, device_kind_name(kind))));
  for (const auto& [flag, value] : {std::pair{"--calibrate-device-threads", o.device_threads},
                                    std::pair{"--calibrate-optimizer-threads", o.optimizer_threads}})
    if (value > cores)
      return calibrate_failed(InvalidArgument(
          fmt::format("{} {} is more than this machine's {} cores; give 1..{} (0: every core)", flag, value, cores, cores)));
  // The optimizer has cores of its own only when both counts are given and fit.
  const bool optimizer_on_own_cores = kind == DeviceKind::kCpu && o.device_threads > 0 && o.optimizer_threads > 0 &&
                                      o.device_threads + o.optimizer_threads <= cores;
  std::string dir = o.path;
  std::error_code ec;
  if (dir.empty()) dir = std::filesystem::temp_directory_path(ec).string();
  if (!std::filesystem::is_directory(dir, ec))
    return calibrate_failed(InvalidArgument(fmt::format("--path '{}' is not a directory", printable(dir, 256))));

  AioConfig aio;  // DeepSpeed's defaults, or the config's aio section
  if (!o.config.empty()) {
    Result<Config> c = load_config(o.config);
    if (!c.ok()) return calibrate_failed(c.status().with_context("--calibrate-config"));
    aio = c->aio;
  }

  nlohmann::ordered_json cal;
  cal["date"] = utc_timestamp();
  offload::HardwareProfile p;
  char host[256] = "this machine";
  gethostname(host, sizeof host - 1);
  p.name = fmt::format("{} (calibrated)", host);
  p.gpus_per_node = 1;
  // On the cpu device the model computes on the cores the optimizer and the copies use.
  p.shared_cores = kind == DeviceKind::kCpu;
  p.optimizer_on_own_cores = optimizer_on_own_cores;
  p.device_memory_bytes = default_cpu_device_bytes();
  struct sysinfo si {};
  p.host_memory_bytes = sysinfo(&si) == 0 ? static_cast<uint64_t>(si.totalram) * si.mem_unit : 0;
  struct statvfs vfs {};
  p.nvme_bytes = statvfs(dir.c_str(), &vfs) == 0 ? static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize : 0;

  fmt::print(stderr, "calibrate: copies H2D / D2H ...\n");
  Result<CopyRates> copies = measure_copies(kind, cal);
  if (!copies.ok())
    return calibrate_failed(copies.status().with_context(
        fmt::format("calibrating copies on the {} device (--calibrate-device)", device_kind_name(kind))));
  p.h2d_gb_per_s = copies->h2d;
  p.d2h_gb_per_s = copies->d2h;
  fmt::print(stderr, "calibrate: CPU Adam ...\n");
  Result<AdamRates> adam = measure_cpu_adam(o.optimizer_threads, cal);
  if (!adam.ok()) return calibrate_failed(adam.status());
  p.cpu_adam_params_per_s_fp32 = adam->fp32;
  p.cpu_adam_params_per_s_bf16 = adam->bf16;
  p.cpu_adam_params_per_s_int8 = adam->int8;
  p.device_adam_params_per_s = adam->fp32;  // the cpu device steps its state with the same CPU kernels
  if (kind == DeviceKind::kCuda) {
    fmt::print(stderr, "calibrate: device Adam ...\n");
    Result<std::unique_ptr<Device>> gpu = make_device(kind);
    if (!gpu.ok()) return calibrate_failed(gpu.status().with_context("--calibrate-device"));
    p.device_memory_bytes = (*gpu)->caps().memory_bytes;
    Result<double> rate = measure_device_adam(**gpu, cal);
    if (!rate.ok()) return calibrate_failed(rate.status().with_context("calibrating the device optimizer"));
    p.device_adam_params_per_s = *rate;
  }
  fmt::print(stderr, "calibrate: NVMe in {} ...\n", printable(dir, 256));
  Result<NvmeRates> nv = measure_nvme(dir, aio, cal);
  if (!nv.ok()) return calibrate_failed(nv.status());
  p.nvme_read_gb_per_s = nv->read;
  p.nvme_write_gb_per_s = nv->write;
  fmt::print(stderr, "calibrate: collectives ...\n");
  Result<double> bus = measure_collective(cal);
  if (!bus.ok()) return calibrate_failed(bus.status());
  p.collective_bus_gb_per_s = *bus;

  // Compute: the stage-0 in-memory step of the model, less what the
  // step-time model charges the optimizer and the reductions.
  fmt::print(stderr, "calibrate: compute ({}, {} rank(s), batch {} x seq {}) ...\n", g.describe(), o.ranks, o.batch,
             o.seq);
  Result<model::TextDataset> data = model::TextDataset::load(model::default_corpus_path(), o.seq);
  if (!data.ok()) return calibrate_failed(data.status());
  RankSetup setup;
  setup.batch = o.batch;
  setup.seq_len = o.seq;
  setup.eval_batches = 1;
  setup.engine.grad_dtype = *dt;
  setup.engine.fp16.enabled = *dt == DType::kF16;
  // The stage-0 step's optimizer on the threads its rate above was taken at, so that the charge subtracted
  // below is what this run spent (the rows of strata train --optimizer-threads K run the same way).
  setup.engine.optimizer_threads = o.optimizer_threads;
  Result<std::vector<std::unique_ptr<comm::Communicator>>> comms = comm::create_local_group(o.ranks, {});
  if (!comms.ok()) return calibrate_failed(comms.status());
  std::vector<offload::StepMetrics> steps;  // rank 0's
  // The compute on --calibrate-device-threads threads, as strata train --device-threads runs it.
  std::optional<ComputeThreadLimit> compute_threads(std::in_place, o.device_threads);
  Status ran = run_rank_threads(*comms, [&](size_t i, comm::Communicator& c) -> Status {
    RankState rs;
    STRATA_RETURN_IF_ERROR(vote(c, build_rank(setup, g, *data, kind, c, rs), "to set up"));
    for (int s = 0; s < 1 + o.steps; ++s) {
      STRATA_ASSIGN_OR_RETURN(offload::StepMetrics m, rs.engine->step());
      if (s > 0 && i == 0) steps.push_back(m);
    }
    return rs.engine->synchronize();
  });
  const std::string matmul = matmul_description(kind);  // while the thread limit holds: it prints it
  compute_threads.reset();
  if (!ran.ok()) return calibrate_failed(ran.with_context("calibrating compute (lower --preset or --batch)"));
  std::vector<double> step_ms, fb_ms, opt_ms;
  for (const auto& m : steps) {
    step_ms.push_back(m.step_ms);
    fb_ms.push_back(m.forward_ms + m.backward_ms);
    opt_ms.push_back(m.optimizer_ms);
  }
  offload::StepTimeInput in;
  in.params = static_cast<uint64_t>(g.param_count());
  in.layers = g.n_layer + 2;
  in.world = o.ranks;
  in.tokens_per_rank = static_cast<double>(o.batch) * o.seq;
  in.flops_per_token = g.train_flops_per_token(o.seq);
  in.param_dtype = in.grad_dtype = *dt;
  p.compute_gflops = 1;  // placeholder for the charge below: only the non-compute terms are read
  Result<offload::StepTimePrediction> charge = offload::predict_step_time(in, p);
  if (!charge.ok()) return calibrate_failed(charge.status());
  const double overhead_ms = charge->step_ms - charge->compute_ms;
  double compute_ms = median(step_ms) - overhead_ms;
  const bool fallback = compute_ms < 0.5 * median(fb_ms);
  if (fallback) compute_ms = median(fb_ms);  // the charges do not fit this machine: use forward + backward
  // Per device; the ranks of this machine share its cores (shared_cores), so
  // each rank's compute ran at a world-th of it.
  p.compute_gflops = o.ranks * in.tokens_per_rank * in.flops_per_token / (compute_ms / 1e3) / 1e9;
  cal["compute"] = {{"model", g.describe()},
                    {"device", device_kind_name(kind)},
                    {"dtype", dtype_name(*dt)},
                    {"ranks", o.ranks},
                    {"device_threads", o.device_threads},
                    {"batch", o.batch},
                    {"seq", o.seq},
                    {"steps", o.steps},
                    {"train_flops_per_token", in.flops_per_token},
                    {"step_ms", median(step_ms)},
                    {"forward_backward_ms", median(fb_ms)},
                    {"optimizer_ms", median(opt_ms)},
                    {"charged_optimizer_and_reduce_ms", overhead_ms},
                    {"compute_ms", compute_ms},
                    {"fallback_forward_backward", fallback},
                    {"matmul", matmul}};
  p.calibration = cal;
  p.notes = fmt::format("measured by strata report --calibrate on {}; {}{}", cal["date"].get<std::string>(),
                        kind != DeviceKind::kCpu ? std::string("the model computed on the GPU, the CPU optimizer on the "
                                                               "host's cores; collectives measured on the host (local ranks)")
                        : optimizer_on_own_cores
                            ? fmt::format("the cpu device computed on {} thread(s) and the CPU optimizer has {} core(s) of "
                                          "its own (optimizer_on_own_cores); copies and collectives share the cores",
                                          o.device_threads, o.optimizer_threads)
                            : std::string("the cpu device shares the host's cores with copies, collectives and the CPU "
                                          "optimizer (shared_cores)"),
                        o.path.empty() ? "; NVMe rates measured in the temporary folder, give --path DIR on the drive"
                                       : "");
  // The profile must pass its own checks (a zero rate would be a bug here).
  const nlohmann::ordered_json j = offload::hardware_profile_to_json(p);
  Result<offload::HardwareProfile> check = offload::parse_hardware_profile(j, "the calibrated profile");
  if (!check.ok()) return calibrate_failed(check.status());
  const std::string text = j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  fmt::print(stderr,
             "calibrate: compute {:.1f} GFLOP/s, H2D {:.2f} GB/s, D2H {:.2f} GB/s, CPU Adam {:.0f}M/{:.0f}M/{:.0f}M params/s "
             "(fp32/bf16/int8 moments), NVMe read {:.2f} write {:.2f} GB/s, all_reduce busbw {:.2f} GB/s\n",
             p.compute_gflops, p.h2d_gb_per_s, p.d2h_gb_per_s, p.cpu_adam_params_per_s_fp32 / 1e6,
             p.cpu_adam_params_per_s_bf16 / 1e6, p.cpu_adam_params_per_s_int8 / 1e6, p.nvme_read_gb_per_s, p.nvme_write_gb_per_s,
             p.collective_bus_gb_per_s);
  if (o.out.empty()) {
    fmt::print("{}", text);
    return 0;
  }
  // Atomically (a temp file renamed over --out); should it fail now (the
  // folder changed since the check), the profile goes to stdout instead, so
  // the measurements are not lost.
  if (Status w = write_file_atomically(o.out, text, "--out"); !w.ok()) {
    fmt::print("{}", text);
    std::fflush(stdout);
    const int rc = calibrate_failed(w);
    fmt::print(stderr, "strata report --calibrate: the measured profile went to stdout instead; save it from there\n");
    return rc;
  }
  fmt::print("profile  {}\n", printable(o.out, 256));
  return 0;
}

}  // namespace strata::cli

// strata bench pipeline: chunks flowing NVMe read -> pinned slot -> H2D ->
// compute -> D2H -> pinned slot -> NVMe write, chained only by completions
// and events, against each stage timed alone over the same chunks.
//
//   strata bench pipeline --path DIR [--out-path DIR2] [--chunks 32] [--chunk-mib 8] [--slots 3]
//                         [--device-threads 1] [--compute-passes 1] [--repeats 3]
//                         [--engine auto|io_uring|libaio|psync] [--json [FILE]]
//
// Note [The pipeline]
// One issuing thread walks the chunks in order and never waits on the work
// it issued; the only host blocking is SlotPool::acquire, i.e. back-pressure
// when all staging slots are in flight. Per chunk i, with k = i % (2 x slots)
// the device buffer (the output half is issued `slots` chunks later, see
// Note [Issue order]):
//   in slot <- acquire;  read_i = nvme read(in file, i) (IoHandle::completion())
//   h2d stream:     wait(read_i), wait(d2h_done[k]) (device buffer k free),
//                   copy in slot -> dev[k], record h2d_done[k];
//                   in slot.release_after(h2d.record_completion())
//   compute stream: wait(h2d_done[k]), launch_host(kernel on dev[k]), record compute_done[k]
//   out slot <- acquire
//   d2h stream:     wait(compute_done[k]), copy dev[k] -> out slot, record d2h_done[k];
//                   d2h.record_completion().then(start nvme write(out file, i) -> write_i)
//   out slot.release_after(write_i)
// The run ends when every write_i has completed (when_all). The device is
// the cpu device: its copies run on copy-engine threads, its kernels on the
// compute stream's worker, so all five stages can run at once.
//
// Note [Efficiency]
// Each repeat times every stage alone over the same chunks (read, H2D,
// compute, D2H, write; the I/O stages with at most `slots` requests in
// flight, like the pipeline), then runs the pipeline twice. Efficiency =
// max(stage alone) / pipelined time: 1.0 means the pipeline is as fast as
// its slowest stage, i.e. every other stage is hidden. The output file is
// checked at the end against the kernel applied to the input, element by
// element (#wrong, as nccl-tests), so a pipeline that skipped or reordered
// work cannot report a good time.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "command.h"
#include "sample_stats.h"
#include "strata/core/printable.h"
#include "strata/core/completion.h"
#include "strata/core/device.h"
#include "strata/core/device_registry.h"
#include "strata/core/slot_pool.h"
#include "strata/core/units.h"
#include "strata/nvme/fs_probe.h"
#include "strata/nvme/io_engine.h"

namespace strata::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct PipelineOptions {
  int64_t chunks = 32;
  int64_t chunk_mib = 8;
  int64_t slots = 3;
  std::string path;
  std::string out_path;  // output file's directory; empty = --path
  int64_t device_threads = 1;
  int64_t compute_passes = 1;
  int64_t repeats = 3;
  std::string engine = "auto";
  std::string json;      // file, or "-" for stdout
  bool json_set = false;
  bool inject_corruption = false;  // tests: one input element differs, so verify must report #wrong 1
};

// The compute step: `passes` fp32 scale+add passes over the chunk, split over
// `threads` threads. The verifier calls the same function, so the expected
// output is bit-exact whatever the compiler does with the arithmetic.
[[gnu::noinline]] void scale_add(float* data, size_t n, int passes) {
  for (int p = 0; p < passes; ++p) {
    for (size_t i = 0; i < n; ++i) data[i] = data[i] * 1.0001f + 0.25f;
  }
}

void compute_kernel(float* data, size_t n, int passes, int threads) {
  if (threads <= 1) {
    scale_add(data, n, passes);
    return;
  }
  std::vector<std::thread> helpers;
  const size_t part = (n + static_cast<size_t>(threads) - 1) / static_cast<size_t>(threads);
  for (int t = 1; t < threads; ++t) {
    const size_t begin = std::min(n, part * static_cast<size_t>(t));
    const size_t end = std::min(n, begin + part);
    helpers.emplace_back([=] { scale_add(data + begin, end - begin, passes); });
  }
  scale_add(data, std::min(n, part), passes);
  for (auto& h : helpers) h.join();
}

// The input: distinct values per chunk and element, exactly representable.
float input_value(uint64_t chunk, uint64_t element, uint64_t elements_per_chunk) {
  return static_cast<float>((chunk * elements_per_chunk + element) % 1000003u) * 0.125f;
}

// Files the bench creates inside --path and removes when it ends (also on
// errors). Creation is exclusive and does not follow symlinks, so an existing
// file or a planted link is refused instead of overwritten.
class ScratchFile {
 public:
  ScratchFile() = default;
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;
  ~ScratchFile() {
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  Status create(const std::string& path, uint64_t bytes) {
    const int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
      if (errno == EEXIST || errno == ELOOP)
        return InvalidArgument(fmt::format("--path: {} already exists (or is a symlink); the bench only writes "
                                           "files it creates, remove it or pick another --path", path));
      return ErrnoStatus(errno, fmt::format("--path: create {} (is the directory writable?)", path));
    }
    path_ = path;
    const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    ::close(fd);
    if (rc != 0 && rc != EOPNOTSUPP && rc != EINVAL)
      return ErrnoStatus(rc, fmt::format("--path: reserve {} for {}", format_bytes(bytes, true), path));
    return Status::Ok();
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

struct StageTimes {
  double read = 0, h2d = 0, compute = 0, d2h = 0, write = 0;
  double io_together = 0;  // read + write at once (not a stage; the shared-drive floor)
  double max() const { return std::max({read, h2d, compute, d2h, write}); }
  double sum() const { return read + h2d + compute + d2h + write; }
  std::string bottleneck() const {
    const double m = max();
    return m == read ? "read" : m == h2d ? "h2d" : m == compute ? "compute" : m == d2h ? "d2h" : "write";
  }
};

class PipelineBench {
 public:
  explicit PipelineBench(const PipelineOptions& o)
      : o_(o),
        chunk_bytes_(static_cast<size_t>(o.chunk_mib) << 20),
        chunks_(static_cast<uint64_t>(o.chunks)),
        slots_(static_cast<size_t>(o.slots)) {}

  ~PipelineBench() {
    // pipeline() and the stage timers wait for all they issued on every path,
    // so nothing is in flight here; members then go in reverse order.
    if (engine_) {
      if (in_pool_) engine_->unregister_buffer(in_pool_->base()).ignore();
      if (out_pool_) engine_->unregister_buffer(out_pool_->base()).ignore();
    }
  }

  Status setup(nvme::EngineKind engine_kind) {
    DeviceOptions device_options;
    device_options.device_memory_bytes = std::max<uint64_t>(uint64_t{1} << 30, 4 * slots_ * chunk_bytes_);
    STRATA_ASSIGN_OR_RETURN(device_, make_device("cpu", device_options));
    STRATA_ASSIGN_OR_RETURN(h2d_, device_->create_stream());
    STRATA_ASSIGN_OR_RETURN(compute_, device_->create_stream());
    STRATA_ASSIGN_OR_RETURN(d2h_, device_->create_stream());
    for (size_t k = 0; k < 2 * slots_; ++k) {  // the device ring, Note [Issue order]
      STRATA_ASSIGN_OR_RETURN(DeviceBuffer buffer, device_->allocate(chunk_bytes_));
      dev_.push_back(std::move(buffer));
      STRATA_ASSIGN_OR_RETURN(auto a, device_->create_event());
      STRATA_ASSIGN_OR_RETURN(auto b, device_->create_event());
      STRATA_ASSIGN_OR_RETURN(auto c, device_->create_event());
      h2d_done_.push_back(std::move(a));
      compute_done_.push_back(std::move(b));
      d2h_done_.push_back(std::move(c));
    }
    SlotPoolOptions pool_options;
    pool_options.slot_count = slots_;
    pool_options.slot_bytes = chunk_bytes_;
    pool_options.acquire_timeout = std::chrono::milliseconds(120000);
    pool_options.name = "pipeline input";
    STRATA_ASSIGN_OR_RETURN(in_pool_, SlotPool::create(*device_, pool_options));
    pool_options.name = "pipeline output";
    STRATA_ASSIGN_OR_RETURN(out_pool_, SlotPool::create(*device_, pool_options));

    nvme::IoEngineOptions io;
    io.engine = engine_kind;
    STRATA_ASSIGN_OR_RETURN(engine_, nvme::make_io_engine(io));
    // One registration per pool region (io_uring fixed buffers).
    STRATA_RETURN_IF_ERROR(engine_->register_buffer(in_pool_->base(), in_pool_->total_bytes()));
    STRATA_RETURN_IF_ERROR(engine_->register_buffer(out_pool_->base(), out_pool_->total_bytes()));

    const uint64_t file_bytes = chunks_ * chunk_bytes_;
    const std::string name = fmt::format("strata-bench-pipeline-{}", ::getpid());
    const std::string& out_dir = o_.out_path.empty() ? o_.path : o_.out_path;
    STRATA_RETURN_IF_ERROR(in_file_.create(fmt::format("{}/{}.in", o_.path, name), file_bytes));
    STRATA_RETURN_IF_ERROR(out_file_.create(fmt::format("{}/{}.out", out_dir, name), file_bytes));
    STRATA_ASSIGN_OR_RETURN(in_id_, engine_->open(in_file_.path(), nvme::OpenMode::kReadWrite));
    STRATA_ASSIGN_OR_RETURN(out_id_, engine_->open(out_file_.path(), nvme::OpenMode::kReadWrite));
    STRATA_ASSIGN_OR_RETURN(nvme::FileInfo info, engine_->file_info(in_id_));
    direct_ = info.direct;
    direct_note_ = info.direct ? "O_DIRECT" : "buffered: " + info.fallback_reason;
    STRATA_ASSIGN_OR_RETURN(nvme::FileInfo out_info, engine_->file_info(out_id_));
    out_direct_ = out_info.direct;
    if (!o_.out_path.empty()) {
      direct_note_ = fmt::format("input {}, output in {} {}", direct_note_, o_.out_path,
                                 out_info.direct ? "O_DIRECT" : "buffered: " + out_info.fallback_reason);
    }

    // The input file, chunk by chunk through one slot.
    STRATA_ASSIGN_OR_RETURN(Slot slot, in_pool_->acquire("input file fill", chunk_bytes_));
    const uint64_t elements = chunk_bytes_ / sizeof(float);
    for (uint64_t c = 0; c < chunks_; ++c) {
      auto* f = slot.as<float>();
      for (uint64_t j = 0; j < elements; ++j) f[j] = input_value(c, j, elements);
      if (c == chunks_ - 1 && o_.inject_corruption) f[elements / 2] += 1.0f;
      STRATA_RETURN_IF_ERROR(engine_->write_sync(in_id_, c * chunk_bytes_, chunk_bytes_, slot.data()));
    }
    return Status::Ok();
  }

  // --- stages alone ------------------------------------------------------

  // Reads (or writes) every chunk with at most `slots` requests in flight.
  Result<double> io_alone(nvme::IoOp op) {
    SlotPool& pool = op == nvme::IoOp::kRead ? *in_pool_ : *out_pool_;
    const nvme::FileId file = op == nvme::IoOp::kRead ? in_id_ : out_id_;
    std::vector<Completion> done;
    const auto t0 = Clock::now();
    for (uint64_t c = 0; c < chunks_; ++c) {
      STRATA_ASSIGN_OR_RETURN(Slot slot, pool.acquire(fmt::format("{} alone, chunk {}", nvme::io_op_name(op), c)));
      Completion io = submit_io(op, file, c, slot.data());
      slot.release_after(io);
      done.push_back(io);
    }
    STRATA_RETURN_IF_ERROR(when_all(done, "io alone").wait());
    return seconds_since(t0);
  }

  // Reads and writes of every chunk at the same time, with the pipeline's
  // slots and no device work: what the drive gives when both directions
  // share it, the pipeline's I/O floor when read and write use one drive.
  Result<double> io_together() {
    std::vector<Completion> done;
    const auto t0 = Clock::now();
    for (uint64_t c = 0; c < chunks_; ++c) {
      STRATA_ASSIGN_OR_RETURN(Slot in, in_pool_->acquire(fmt::format("read+write together, chunk {}", c)));
      Completion r = submit_io(nvme::IoOp::kRead, in_id_, c, in.data());
      in.release_after(r);
      STRATA_ASSIGN_OR_RETURN(Slot out, out_pool_->acquire(fmt::format("read+write together, chunk {}", c)));
      Completion w = submit_io(nvme::IoOp::kWrite, out_id_, c, out.data());
      out.release_after(w);
      done.push_back(r);
      done.push_back(w);
    }
    STRATA_RETURN_IF_ERROR(when_all(done, "io together").wait());
    return seconds_since(t0);
  }

  Result<double> copy_alone(CopyKind kind) {
    Stream& stream = kind == CopyKind::kHostToDevice ? *h2d_ : *d2h_;
    SlotPool& pool = kind == CopyKind::kHostToDevice ? *in_pool_ : *out_pool_;
    std::vector<Slot> held;
    for (size_t k = 0; k < slots_; ++k) {
      STRATA_ASSIGN_OR_RETURN(Slot slot, pool.acquire(fmt::format("{} alone", copy_kind_name(kind))));
      held.push_back(std::move(slot));
    }
    const auto t0 = Clock::now();
    for (uint64_t c = 0; c < chunks_; ++c) {
      void* host = held[c % slots_].data();
      void* device = dev_[c % slots_].data();
      STRATA_RETURN_IF_ERROR(kind == CopyKind::kHostToDevice ? stream.copy_async(device, host, chunk_bytes_, kind)
                                                             : stream.copy_async(host, device, chunk_bytes_, kind));
    }
    STRATA_RETURN_IF_ERROR(stream.synchronize());
    return seconds_since(t0);
  }

  Result<double> compute_alone() {
    const auto t0 = Clock::now();
    for (uint64_t c = 0; c < chunks_; ++c) STRATA_RETURN_IF_ERROR(compute_->launch_host(kernel_for(c % slots_)));
    STRATA_RETURN_IF_ERROR(compute_->synchronize());
    return seconds_since(t0);
  }

  Result<StageTimes> stages_alone() {
    StageTimes t;
    STRATA_ASSIGN_OR_RETURN(t.read, io_alone(nvme::IoOp::kRead));
    STRATA_ASSIGN_OR_RETURN(t.h2d, copy_alone(CopyKind::kHostToDevice));
    STRATA_ASSIGN_OR_RETURN(t.compute, compute_alone());
    STRATA_ASSIGN_OR_RETURN(t.d2h, copy_alone(CopyKind::kDeviceToHost));
    STRATA_ASSIGN_OR_RETURN(t.write, io_alone(nvme::IoOp::kWrite));
    STRATA_ASSIGN_OR_RETURN(t.io_together, io_together());
    return t;
  }

  // --- the pipeline (Note [The pipeline]) --------------------------------

  Result<double> pipeline() {
    std::vector<Completion> writes;
    writes.reserve(chunks_);
    const auto t0 = Clock::now();
    Status issued = issue_pipeline(writes);
    // Drain whatever was issued, also after an issue error, before anything
    // the callbacks use can go away.
    Status finished = when_all(writes, "pipeline writes").wait();
    Status streams = sync_streams();
    const double seconds = seconds_since(t0);
    STRATA_RETURN_IF_ERROR(issued);
    STRATA_RETURN_IF_ERROR(finished);
    STRATA_RETURN_IF_ERROR(streams);
    return seconds;
  }

  // #wrong elements of the output file against the kernel applied to the input.
  Result<uint64_t> verify(uint64_t* checked) {
    STRATA_ASSIGN_OR_RETURN(Slot slot, in_pool_->acquire("verify", chunk_bytes_));
    const uint64_t elements = chunk_bytes_ / sizeof(float);
    std::vector<float> expected(elements);
    uint64_t wrong = 0;
    for (uint64_t c = 0; c < chunks_; ++c) {
      STRATA_RETURN_IF_ERROR(engine_->read_sync(out_id_, c * chunk_bytes_, chunk_bytes_, slot.data()));
      for (uint64_t j = 0; j < elements; ++j) expected[j] = input_value(c, j, elements);
      scale_add(expected.data(), elements, static_cast<int>(o_.compute_passes));
      const auto* got = slot.as<const float>();
      for (uint64_t j = 0; j < elements; ++j) wrong += std::memcmp(&expected[j], &got[j], sizeof(float)) != 0;
    }
    *checked = chunks_ * elements;
    return wrong;
  }

  std::string engine_description() const { return engine_->describe(); }
  std::vector<std::string> engine_notes() const { return engine_->notes(); }
  nvme::IoEngineStats engine_stats() const { return engine_->stats(); }
  const std::string& direct_note() const { return direct_note_; }
  bool direct() const { return direct_; }
  bool out_direct() const { return out_direct_; }
  const SlotPool& in_pool() const { return *in_pool_; }
  const SlotPool& out_pool() const { return *out_pool_; }

 private:
  HostFn kernel_for(size_t k) {
    auto* data = dev_[k].as<float>();  // cpu device memory is host-addressable
    const size_t n = chunk_bytes_ / sizeof(float);
    const int passes = static_cast<int>(o_.compute_passes);
    const int threads = static_cast<int>(o_.device_threads);
    return [data, n, passes, threads] { compute_kernel(data, n, passes, threads); };
  }

  // An I/O request's Completion (its Status names file, offset and length).
  Completion submit_io(nvme::IoOp op, nvme::FileId file, uint64_t chunk, void* buffer) {
    const uint64_t offset = chunk * chunk_bytes_;
    nvme::IoHandle handle = op == nvme::IoOp::kRead ? engine_->read(file, offset, chunk_bytes_, buffer)
                                                    : engine_->write(file, offset, chunk_bytes_, buffer);
    return handle.completion();
  }

  // Note [Issue order]: the input side of chunk c is issued before the
  // output side of chunk c - slots. An output slot is held from its acquire
  // to the end of its write, so acquiring it when the chunk's read is only
  // just issued would keep it busy through read, copy and compute and stall
  // the reads behind it; `slots` chunks later the chunk's data is on the
  // device, so the slot is held only for compute, D2H and write. The device
  // ring has 2 x slots buffers, so the H2D of chunk c waits for the D2H of
  // chunk c - 2 x slots, which was issued `slots` iterations earlier.
  Status issue_pipeline(std::vector<Completion>& writes) {
    const uint64_t lag = slots_;
    for (uint64_t c = 0; c < chunks_ + lag; ++c) {
      if (c < chunks_) STRATA_RETURN_IF_ERROR(issue_input(c));
      if (c >= lag) STRATA_RETURN_IF_ERROR(issue_output(c - lag, writes));
    }
    return Status::Ok();
  }

  Status issue_input(uint64_t c) {
    const size_t k = c % dev_.size();
    STRATA_ASSIGN_OR_RETURN(Slot in, in_pool_->acquire(fmt::format("pipeline read, chunk {}", c), chunk_bytes_));
    Completion read_done = submit_io(nvme::IoOp::kRead, in_id_, c, in.data());
    Status st = issue_h2d_and_compute(k, in.data(), read_done);
    // On an error the slot still waits for whatever was issued into it.
    in.release_after(st.ok() ? h2d_->record_completion()
                             : when_all(std::vector<Completion>{read_done, h2d_->record_completion()}));
    return st;
  }

  Status issue_output(uint64_t c, std::vector<Completion>& writes) {
    const size_t k = c % dev_.size();
    STRATA_ASSIGN_OR_RETURN(Slot out, out_pool_->acquire(fmt::format("pipeline write, chunk {}", c), chunk_bytes_));
    Status st = issue_d2h(k, out.data());
    if (!st.ok()) {
      out.release_after(d2h_->record_completion());
      return st;
    }
    // The write starts from the D2H's completion, on the stream's worker
    // (the engine accepts submissions from any thread); its Completion is
    // forwarded into `write`. A failed copy fails the write's completion
    // with the copy's Status instead of writing stale bytes.
    auto write = std::make_shared<CompletionSource>(
        fmt::format("nvme write of chunk {} [{}, +{})", c, c * chunk_bytes_, chunk_bytes_));
    Completion write_done = write->completion();
    void* host = out.data();
    d2h_->record_completion().then([this, write, c, host](const Status& st) {
      if (!st.ok()) {
        write->complete(st);
        return;
      }
      submit_io(nvme::IoOp::kWrite, out_id_, c, host).then([write](const Status& ws) { write->complete(ws); });
    });
    out.release_after(write_done);
    writes.push_back(std::move(write_done));
    return Status::Ok();
  }

  Status issue_h2d_and_compute(size_t k, void* host, const Completion& read_done) {
    void* dev = dev_[k].data();
    STRATA_RETURN_IF_ERROR(h2d_->wait(read_done));
    STRATA_RETURN_IF_ERROR(h2d_->wait(*d2h_done_[k]));  // dev[k] no longer read by the D2H of chunk c - 2 x slots
    STRATA_RETURN_IF_ERROR(h2d_->copy_async(dev, host, chunk_bytes_, CopyKind::kHostToDevice));
    STRATA_RETURN_IF_ERROR(h2d_->record(*h2d_done_[k]));
    STRATA_RETURN_IF_ERROR(compute_->wait(*h2d_done_[k]));
    STRATA_RETURN_IF_ERROR(compute_->launch_host(kernel_for(k)));
    return compute_->record(*compute_done_[k]);
  }

  Status issue_d2h(size_t k, void* host) {
    STRATA_RETURN_IF_ERROR(d2h_->wait(*compute_done_[k]));
    STRATA_RETURN_IF_ERROR(d2h_->copy_async(host, dev_[k].data(), chunk_bytes_, CopyKind::kDeviceToHost));
    return d2h_->record(*d2h_done_[k]);
  }

  Status sync_streams() {
    Status a = h2d_->synchronize(), b = compute_->synchronize(), c = d2h_->synchronize();
    if (!a.ok()) return a;
    if (!b.ok()) return b;
    return c;
  }

  const PipelineOptions& o_;
  const size_t chunk_bytes_;
  const uint64_t chunks_;
  const size_t slots_;
  // Destruction runs bottom-up: files are closed/removed after the engine
  // and pools are gone, streams drain before the device goes.
  std::unique_ptr<Device> device_;
  std::vector<DeviceBuffer> dev_;
  std::vector<std::unique_ptr<Event>> h2d_done_, compute_done_, d2h_done_;
  std::unique_ptr<Stream> h2d_, compute_, d2h_;
  std::unique_ptr<SlotPool> in_pool_, out_pool_;
  ScratchFile in_file_, out_file_;
  std::unique_ptr<nvme::IoEngine> engine_;
  nvme::FileId in_id_ = 0, out_id_ = 0;
  bool direct_ = false;
  bool out_direct_ = false;
  std::string direct_note_;
};

Status check_options(const PipelineOptions& o) {
  if (o.path.empty()) return InvalidArgument("--path DIR is required (a directory on the drive to stream through)");
  auto in_range = [](int64_t value, int64_t lo, int64_t hi, const char* flag, const char* hint) -> Status {
    if (value >= lo && value <= hi) return Status::Ok();
    return InvalidArgument(fmt::format("{} {} must be in [{}, {}]{}", flag, value, lo, hi, hint));
  };
  STRATA_RETURN_IF_ERROR(in_range(o.chunks, 1, 1'000'000, "--chunks", ""));
  STRATA_RETURN_IF_ERROR(in_range(o.chunk_mib, 1, 4096, "--chunk-mib", ""));
  STRATA_RETURN_IF_ERROR(in_range(o.slots, 1, 64, "--slots", " (3 overlaps read, copy and write)"));
  STRATA_RETURN_IF_ERROR(in_range(o.device_threads, 1, 256, "--device-threads", ""));
  STRATA_RETURN_IF_ERROR(in_range(o.compute_passes, 1, 1000, "--compute-passes", ""));
  STRATA_RETURN_IF_ERROR(in_range(o.repeats, 1, 100, "--repeats", ""));
  for (const auto& [flag, dir] : {std::pair<const char*, const std::string*>{"--path", &o.path},
                                  std::pair<const char*, const std::string*>{"--out-path", &o.out_path}}) {
    if (dir->empty()) continue;
    struct stat st {};
    if (::stat(dir->c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      return InvalidArgument(fmt::format("{} {} is not a directory", flag, *dir));
    if (::access(dir->c_str(), W_OK) != 0) return ErrnoStatus(errno, fmt::format("{} {} is not writable", flag, *dir));
  }
  return Status::Ok();
}

nlohmann::ordered_json stages_json(const StageTimes& t) {
  return {{"read", t.read}, {"h2d", t.h2d}, {"compute", t.compute}, {"d2h", t.d2h}, {"write", t.write},
          {"read_write_together", t.io_together}};
}

nlohmann::ordered_json pool_json(const SlotPool& pool) {
  const SlotPoolStats s = pool.stats();
  return {{"acquires", s.acquires}, {"waits", s.waits}, {"wait_seconds", static_cast<double>(s.total_wait_ns) / 1e9},
          {"peak_in_use", s.peak_in_use}, {"failed_releases", s.failed_releases}};
}

Status run_pipeline_bench(const PipelineOptions& o) {
  STRATA_RETURN_IF_ERROR(check_options(o));
  auto engine_kind = nvme::parse_engine_kind(o.engine, "--engine");
  if (!engine_kind.ok()) return engine_kind.status();
  const uint64_t chunk_bytes = static_cast<uint64_t>(o.chunk_mib) << 20;
  const uint64_t total = static_cast<uint64_t>(o.chunks) * chunk_bytes;
  // Input and output files, on one drive or two (--out-path).
  for (const std::string* dir : {&o.path, &o.out_path}) {
    if (dir->empty()) continue;
    const uint64_t need = (o.out_path.empty() ? 2 : 1) * total + (64u << 20);
    auto avail = nvme::available_bytes(*dir);
    if (avail.ok() && *avail < need) {
      return ResourceExhausted(fmt::format("{}: {} needed for the bench's files, {} available; lower --chunks or "
                                           "--chunk-mib", *dir, format_bytes(need, true), format_bytes(*avail, true)));
    }
  }
  const bool to_stdout = o.json_set && (o.json.empty() || o.json == "-");
  const bool text = !to_stdout;
  std::ofstream json_file;
  if (o.json_set && !to_stdout) {  // opened first: a bad --json FILE fails before the run, not after
    json_file.open(o.json, std::ios::out | std::ios::trunc);
    if (!json_file) return ErrnoStatus(errno, fmt::format("--json: cannot write {}", o.json));
  }

  PipelineBench bench(o);
  STRATA_RETURN_IF_ERROR(bench.setup(*engine_kind));
  if (text) {
    fmt::print("strata bench pipeline: {} chunks x {} MiB, {} slots per direction, cpu device ({} compute thread(s), "
               "{} pass(es)), {}, {}\n", o.chunks, o.chunk_mib, o.slots, o.device_threads, o.compute_passes,
               bench.engine_description(), bench.direct_note());
  }
  STRATA_RETURN_IF_ERROR(bench.pipeline().status());  // warm-up: threads, page tables, engine queues

  std::vector<StageTimes> alone;
  std::vector<double> piped;
  std::vector<double> efficiency;
  std::vector<double> drive_efficiency;  // against max(stage alone, read+write together)
  std::vector<nlohmann::ordered_json> per_repeat;
  for (int64_t r = 0; r < o.repeats; ++r) {
    STRATA_ASSIGN_OR_RETURN(StageTimes t, bench.stages_alone());
    STRATA_ASSIGN_OR_RETURN(double p1, bench.pipeline());
    STRATA_ASSIGN_OR_RETURN(double p2, bench.pipeline());
    alone.push_back(t);
    piped.push_back(p1);
    piped.push_back(p2);
    const double eff = t.max() / (0.5 * (p1 + p2));
    const double eff_drive = std::max(t.max(), t.io_together) / (0.5 * (p1 + p2));
    efficiency.push_back(eff);
    drive_efficiency.push_back(eff_drive);
    per_repeat.push_back({{"alone_seconds", stages_json(t)}, {"max_alone_seconds", t.max()},
                          {"sum_alone_seconds", t.sum()}, {"pipelined_seconds", {p1, p2}}, {"efficiency", eff},
                          {"efficiency_vs_shared_drive", eff_drive}});
    if (text) {
      fmt::print("  repeat {}: alone read {:.3f} h2d {:.3f} compute {:.3f} d2h {:.3f} write {:.3f} s (max {:.3f}, "
                 "sum {:.3f}); read+write together {:.3f}; pipelined {:.3f} / {:.3f} s; efficiency {:.3f} "
                 "({:.3f} vs the shared drive)\n",
                 r, t.read, t.h2d, t.compute, t.d2h, t.write, t.max(), t.sum(), t.io_together, p1, p2, eff, eff_drive);
    }
  }
  uint64_t checked = 0;
  STRATA_ASSIGN_OR_RETURN(uint64_t wrong, bench.verify(&checked));

  auto stage_median = [&](double StageTimes::*field) {
    std::vector<double> v;
    for (const StageTimes& t : alone) v.push_back(t.*field);
    return median(v);
  };
  StageTimes med{stage_median(&StageTimes::read), stage_median(&StageTimes::h2d), stage_median(&StageTimes::compute),
                 stage_median(&StageTimes::d2h), stage_median(&StageTimes::write),
                 stage_median(&StageTimes::io_together)};
  const double piped_median = median(piped);
  const double eff_median = median(efficiency);

  nlohmann::ordered_json j;
  j["bench"] = "pipeline";
  j["chunks"] = o.chunks;
  j["chunk_bytes"] = chunk_bytes;
  j["slots"] = o.slots;
  j["device"] = "cpu";
  j["device_threads"] = o.device_threads;
  j["compute_passes"] = o.compute_passes;
  j["engine"] = bench.engine_description();
  j["direct_io"] = bench.direct();
  j["output_direct_io"] = bench.out_direct();
  j["out_path"] = o.out_path.empty() ? o.path : o.out_path;
  j["engine_notes"] = bench.engine_notes();
  j["fixed_buffer_pieces"] = bench.engine_stats().fixed_buffer_pieces;
  j["io_pieces"] = bench.engine_stats().pieces;
  j["repeats"] = o.repeats;
  j["alone_seconds"] = stages_json(med);
  j["sum_alone_seconds"] = med.sum();
  j["max_alone_seconds"] = med.max();
  j["bottleneck"] = med.bottleneck();
  j["pipelined_seconds"] = piped_median;
  j["pipelined_gb_per_s"] = static_cast<double>(total) / piped_median / 1e9;
  j["efficiency"] = eff_median;
  j["efficiency_vs_shared_drive"] = median(drive_efficiency);
  j["per_repeat"] = per_repeat;
  j["slot_pools"] = {{"input", pool_json(bench.in_pool())}, {"output", pool_json(bench.out_pool())}};
  j["verify"] = {{"elements", checked}, {"wrong", wrong}};

  if (json_file.is_open()) {
    json_file << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    json_file.close();
    if (!json_file) return ErrnoStatus(errno, fmt::format("--json: write {}", o.json));
  }
  if (to_stdout) {
    fmt::print("{}\n", j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
  } else {
    fmt::print("  medians: alone read {:.3f} h2d {:.3f} compute {:.3f} d2h {:.3f} write {:.3f} s; max {:.3f} ({}), "
               "sum {:.3f}\n", med.read, med.h2d, med.compute, med.d2h, med.write, med.max(), med.bottleneck(),
               med.sum());
    fmt::print("  pipelined: {:.3f} s ({:.2f} GB/s); overlap efficiency max(alone)/pipelined = {:.3f} "
               "(bar: >= 0.85); sum(alone)/pipelined = {:.2f}\n", piped_median,
               static_cast<double>(total) / piped_median / 1e9, eff_median, med.sum() / piped_median);
    fmt::print("  read+write together on the drive: {:.3f} s; efficiency against max(stage alone, that) = {:.3f}\n",
               med.io_together, median(drive_efficiency));
    fmt::print("  verify: {} elements, #wrong {}\n", checked, wrong);
  }
  if (wrong != 0) {
    return DataLoss(fmt::format("pipeline output differs from the expected transform in {} of {} elements", wrong,
                                checked));
  }
  return Status::Ok();
}

CommandRegistration bench_pipeline("bench pipeline", [](CLI::App& root) {
  CLI::App* bench = ensure_subcommand(root, "bench", "Benchmarks of Strata's kernels and engines");
  auto o = std::make_shared<PipelineOptions>();
  CLI::App* cmd = bench->add_subcommand(
      "pipeline", "NVMe read -> slot -> H2D -> compute -> D2H -> slot -> NVMe write, chained by events, vs each stage alone");
  cmd->add_option("--path", o->path, "Directory for the input and output files (created and removed by the bench)")
      ->required();
  cmd->add_option("--out-path", o->out_path,
                  "Directory for the output file (default: --path); another drive separates reads from writes");
  cmd->add_option("--chunks", o->chunks, "Chunks per run")->capture_default_str();
  cmd->add_option("--chunk-mib", o->chunk_mib, "MiB per chunk")->capture_default_str();
  cmd->add_option("--slots", o->slots, "Pinned staging slots per direction (input and output pools)")
      ->capture_default_str();
  cmd->add_option("--device-threads", o->device_threads, "Threads of the compute step on the cpu device")
      ->capture_default_str();
  cmd->add_option("--compute-passes", o->compute_passes, "fp32 scale+add passes per chunk (work per byte)")
      ->capture_default_str();
  cmd->add_option("--repeats", o->repeats, "Interleaved repeats (alone set, pipeline, pipeline); medians reported")
      ->capture_default_str();
  cmd->add_option("--engine", o->engine, "auto | io_uring | libaio | psync")->capture_default_str();
  cmd->add_option("--json", o->json, "Print one JSON object (to FILE when given, else stdout)")->expected(0, 1);
  cmd->add_flag("--inject-corruption", o->inject_corruption,
                "Testing: change one input element so that the verification must fail")
      ->group("");  // hidden
  cmd->callback([o, cmd] {
    o->json_set = cmd->count("--json") > 0;
    Status st = run_pipeline_bench(*o);
    if (!st.ok()) {
      fmt::print(stderr, "strata bench pipeline: {}\n", printable_message(st.to_string()));
      exit_with(1);
    }
    exit_with(0);
  });
});

}  // namespace
}  // namespace strata::cli

// strata io-bench: sequential read and write throughput through the real
// IoEngine (O_DIRECT, aligned buffers registered with the engine), and a
// --sweep over block sizes, queue depths, thread counts and engines that
// ends with a ready-to-paste "aio" config block.
//
//   strata io-bench --path DIR [--size 4GiB] [--engine auto|io_uring|libaio|psync]
//                   [--block-size 1MiB] [--queue-depth 32] [--threads T]
//                   [--mode read|write|both] [--json] [--sweep]
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "command.h"
#include "strata/core/pinned_pool.h"
#include "strata/core/units.h"
#include "strata/nvme/aio_config.h"
#include "strata/nvme/aligned_buffer.h"
#include "strata/nvme/fs_probe.h"
#include "strata/nvme/io_engine.h"

namespace strata::cli {
namespace {

using nvme::EngineKind;

struct IoBenchOptions {
  std::string path;
  std::string size = "4GiB";
  std::string engine = "auto";
  std::string block_size = "1MiB";
  uint32_t queue_depth = 32;
  uint32_t threads = 1;
  std::string mode = "both";
  bool json = false;
  bool sweep = false;
  bool keep = false;
  bool sqpoll = false;
  std::string file;  // fixed test file (kept), instead of a temporary one
  std::string sweep_block_sizes = "256KiB,1MiB,4MiB";
  std::string sweep_queue_depths = "8,32";
  std::string sweep_threads = "1,2";
};

struct Trial {
  EngineKind engine = EngineKind::kAuto;
  uint64_t block_size = 1u << 20;
  uint32_t queue_depth = 32;
  uint32_t threads = 1;
};

struct TrialResult {
  std::string engine;
  std::string mode;
  uint64_t block_size = 0;
  uint32_t queue_depth = 0;
  uint32_t threads = 0;
  uint64_t bytes = 0;
  double seconds = 0;
  double gb_per_s = 0;
  std::vector<std::string> notes;
};

// Streams `size` bytes sequentially through the engine, keeping up to
// 2 x threads x depth block requests outstanding.
Result<double> stream(nvme::IoEngine& engine, nvme::FileId file, nvme::IoOp op, uint64_t size, uint64_t block,
                      uint32_t outstanding_max, std::byte* window, uint64_t window_bytes) {
  std::deque<nvme::IoHandle> inflight;
  auto start = std::chrono::steady_clock::now();
  uint64_t offset = 0;
  Status first_error;
  while (offset < size || !inflight.empty()) {
    while (offset < size && inflight.size() < outstanding_max) {
      uint64_t length = std::min(block, size - offset);
      std::byte* buf = window + (offset % window_bytes);
      inflight.push_back(op == nvme::IoOp::kRead ? engine.read(file, offset, length, buf)
                                                 : engine.write(file, offset, length, buf));
      offset += length;
    }
    Status st = inflight.front().wait();
    inflight.pop_front();
    if (!st.ok() && first_error.ok()) first_error = st;
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!first_error.ok()) return first_error;
  return seconds;
}

Status drop_cache(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, fmt::format("open {}", path));
  fdatasync(fd);
  posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  return Status::Ok();
}

Result<std::vector<TrialResult>> run_trial(const std::string& file_path, uint64_t size, const Trial& trial,
                                           bool do_write, bool do_read, bool sqpoll) {
  struct stat before {};
  bool already_written = ::stat(file_path.c_str(), &before) == 0 && static_cast<uint64_t>(before.st_size) >= size &&
                         static_cast<uint64_t>(before.st_blocks) * 512 >= size;
  nvme::IoEngineOptions o;
  o.engine = trial.engine;
  o.block_size = trial.block_size;
  o.queue_depth = trial.queue_depth;
  o.intra_op_parallelism = trial.threads;
  o.sqpoll = sqpoll;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<nvme::IoEngine> engine, nvme::make_io_engine(o));
  uint32_t outstanding = std::max<uint32_t>(2 * trial.threads * trial.queue_depth, 2);
  uint64_t window_bytes = std::min<uint64_t>(size, static_cast<uint64_t>(outstanding) * trial.block_size);
  window_bytes = (window_bytes + trial.block_size - 1) / trial.block_size * trial.block_size;
  // Pinned buffers from the core pool (mlock; pageable with one warning when RLIMIT_MEMLOCK refuses).
  std::vector<std::string> pool_warnings;
  PinnedPoolOptions pool_options;
  pool_options.warn = [&pool_warnings](std::string_view w) { pool_warnings.emplace_back(w); };
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<PinnedPool> pool, PinnedPool::create(nullptr, pool_options));
  STRATA_ASSIGN_OR_RETURN(PinnedBuffer window, pool->allocate(window_bytes));
  auto* window_data = window.as<std::byte>();
  for (size_t i = 0; i < window_bytes; i += 4096) window_data[i] = static_cast<std::byte>(i / 4096);
  STRATA_RETURN_IF_ERROR(engine->register_buffer(window_data, window_bytes));
  STRATA_ASSIGN_OR_RETURN(nvme::FileId file, engine->open(file_path, nvme::OpenMode::kCreate));
  std::vector<TrialResult> results;
  auto record = [&](const char* mode, double seconds) {
    TrialResult r;
    r.engine = std::string(nvme::engine_kind_name(engine->kind()));
    r.mode = mode;
    r.block_size = trial.block_size;
    r.queue_depth = trial.queue_depth;
    r.threads = trial.threads;
    r.bytes = size;
    r.seconds = seconds;
    r.gb_per_s = seconds > 0 ? static_cast<double>(size) / seconds / 1e9 : 0;
    r.notes = engine->notes();
    nvme::IoEngineStats stats = engine->stats();
    if (stats.buffered_pieces > 0) {
      r.notes.push_back(fmt::format("{} of {} pieces went through the page cache (no O_DIRECT)",
                                    stats.buffered_pieces, stats.pieces));
    }
    if (!window.pinned()) r.notes.push_back("buffer not pinned (RLIMIT_MEMLOCK); pageable memory used");
    for (const std::string& w : pool_warnings) r.notes.push_back(w);
    results.push_back(std::move(r));
  };
  // The file is preallocated (as swap files are), so writes overwrite.
  {
    int fd = ::open(file_path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus(errno, fmt::format("open {}", file_path));
    int rc = fallocate(fd, 0, 0, static_cast<off_t>(size));
    int err = errno;
    ::close(fd);
    if (rc != 0 && err != EOPNOTSUPP) {
      return ErrnoStatus(err, fmt::format("preallocate {} for {}", format_bytes(size, true), file_path));
    }
  }
  if (do_write) {
    STRATA_ASSIGN_OR_RETURN(double s, stream(*engine, file, nvme::IoOp::kWrite, size, trial.block_size, outstanding,
                                             window_data, window_bytes));
    record("write", s);
  }
  if (do_read) {
    if (!do_write && !already_written) {
      // Write every byte once, untimed: an unwritten extent reads as zeros without touching the disk.
      STRATA_ASSIGN_OR_RETURN(double s, stream(*engine, file, nvme::IoOp::kWrite, size, trial.block_size,
                                               outstanding, window_data, window_bytes));
      (void)s;
    }
    STRATA_RETURN_IF_ERROR(drop_cache(file_path));
    STRATA_ASSIGN_OR_RETURN(double s, stream(*engine, file, nvme::IoOp::kRead, size, trial.block_size, outstanding,
                                             window_data, window_bytes));
    record("read", s);
  }
  STRATA_RETURN_IF_ERROR(engine->close(file));
  STRATA_RETURN_IF_ERROR(engine->unregister_buffer(window_data));
  return results;
}

template <typename T, typename Parse>
Result<std::vector<T>> parse_list(const std::string& text, const std::string& flag, Parse parse) {
  std::vector<T> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    std::string item = text.substr(pos, comma - pos);
    if (!item.empty()) {
      STRATA_ASSIGN_OR_RETURN(T value, parse(item));
      out.push_back(value);
    }
    pos = comma + 1;
  }
  if (out.empty()) return InvalidArgument(fmt::format("{}: empty list", flag));
  return out;
}

nlohmann::ordered_json result_json(const TrialResult& r) {
  return nlohmann::ordered_json{{"engine", r.engine},       {"mode", r.mode},       {"block_size", r.block_size},
                        {"queue_depth", r.queue_depth}, {"threads", r.threads}, {"bytes", r.bytes},
                        {"seconds", r.seconds},     {"gb_per_s", r.gb_per_s}};
}

int fail(const Status& st) {
  fmt::print(stderr, "strata io-bench: {}\n", st.to_string());
  return 1;
}

int run_io_bench(const IoBenchOptions& opts) {
  if (opts.path.empty()) return fail(InvalidArgument("--path DIR is required (a directory on the drive to test)"));
  auto size = parse_bytes(opts.size, "--size");
  if (!size.ok()) return fail(size.status());
  auto block = parse_bytes(opts.block_size, "--block-size");
  if (!block.ok()) return fail(block.status());
  auto engine = nvme::parse_engine_kind(opts.engine, "--engine");
  if (!engine.ok()) return fail(engine.status());
  if (opts.mode != "read" && opts.mode != "write" && opts.mode != "both") {
    return fail(InvalidArgument(fmt::format("--mode {}: use read, write or both", opts.mode)));
  }
  if (*size < *block) {
    return fail(InvalidArgument(fmt::format("--size {} is smaller than --block-size {}", opts.size, opts.block_size)));
  }
  auto probe = nvme::probe_path(opts.path);
  if (!probe.ok()) return fail(probe.status().with_context("--path"));
  if (probe->free_bytes < *size) {
    return fail(ResourceExhausted(fmt::format("--path {}: {} needed for the test file, {} available; lower --size",
                                              opts.path, format_bytes(*size, true),
                                              format_bytes(probe->free_bytes, true))));
  }
  bool do_write = opts.mode != "read";
  bool do_read = opts.mode != "write";

  std::vector<Trial> trials;
  if (opts.sweep) {
    auto blocks = parse_list<uint64_t>(opts.sweep_block_sizes, "--sweep-block-sizes",
                                       [](const std::string& s) { return parse_bytes(s, "--sweep-block-sizes"); });
    auto depths = parse_list<uint32_t>(opts.sweep_queue_depths, "--sweep-queue-depths",
                                       [](const std::string& s) -> Result<uint32_t> {
                                         STRATA_ASSIGN_OR_RETURN(uint64_t v, parse_count(s, "--sweep-queue-depths"));
                                         return static_cast<uint32_t>(v);
                                       });
    auto threads = parse_list<uint32_t>(opts.sweep_threads, "--sweep-threads",
                                        [](const std::string& s) -> Result<uint32_t> {
                                          STRATA_ASSIGN_OR_RETURN(uint64_t v, parse_count(s, "--sweep-threads"));
                                          return static_cast<uint32_t>(v);
                                        });
    if (!blocks.ok()) return fail(blocks.status());
    if (!depths.ok()) return fail(depths.status());
    if (!threads.ok()) return fail(threads.status());
    std::vector<EngineKind> engines;
    if (*engine == EngineKind::kAuto) {
      for (const nvme::EngineProbe& p : nvme::probe_engines()) {
        if (p.works) engines.push_back(p.kind);
      }
    } else {
      engines.push_back(*engine);
    }
    for (EngineKind e : engines)
      for (uint64_t b : *blocks)
        for (uint32_t d : *depths)
          for (uint32_t t : *threads) {
            if (b <= *size) trials.push_back(Trial{e, b, d, t});
          }
  } else {
    trials.push_back(Trial{*engine, *block, opts.queue_depth, opts.threads});
  }
  for (const Trial& t : trials) {
    nvme::IoEngineOptions o;
    o.block_size = t.block_size;
    o.queue_depth = t.queue_depth;
    o.intra_op_parallelism = t.threads;
    Status st = o.validate();
    if (!st.ok()) return fail(st);
  }

  std::string file_path =
      opts.file.empty() ? opts.path + fmt::format("/strata-io-bench-{}.dat", getpid()) : opts.path + "/" + opts.file;
  bool keep = opts.keep || !opts.file.empty();
  if (!opts.json) {
    fmt::print("strata io-bench: {} on {} ({}), {} per run, O_DIRECT {}\n", opts.path, probe->fs_type,
               format_bytes(probe->free_bytes, true) + " free", format_bytes(*size, true),
               probe->direct_io ? fmt::format("yes (alignment {} B)", probe->direct_alignment)
                                : "no: " + probe->direct_detail + " (buffered: page-cache speed, not the drive's)");
    fmt::print("{:<9} {:<6} {:>10} {:>6} {:>8} {:>10} {:>9} {:>8}\n", "engine", "mode", "block", "depth", "threads",
               "bytes", "seconds", "GB/s");
  }
  std::vector<TrialResult> all;
  std::vector<std::string> notes;
  for (const Trial& t : trials) {
    auto results = run_trial(file_path, *size, t, do_write, do_read, opts.sqpoll);
    if (!results.ok()) {
      if (!keep) ::unlink(file_path.c_str());
      return fail(results.status());
    }
    for (TrialResult& r : *results) {
      if (!opts.json) {
        fmt::print("{:<9} {:<6} {:>10} {:>6} {:>8} {:>10} {:>9.3f} {:>8.3f}\n", r.engine, r.mode,
                   format_bytes(r.block_size, true), r.queue_depth, r.threads, format_bytes(r.bytes, true), r.seconds,
                   r.gb_per_s);
        std::fflush(stdout);
      }
      for (const std::string& n : r.notes) {
        if (std::find(notes.begin(), notes.end(), n) == notes.end()) notes.push_back(n);
      }
      all.push_back(std::move(r));
    }
  }
  if (!keep) ::unlink(file_path.c_str());

  nlohmann::ordered_json aio;
  if (opts.sweep) {
    // Best configuration by combined throughput of the modes measured.
    std::map<std::tuple<std::string, uint64_t, uint32_t, uint32_t>, double> score;
    for (const TrialResult& r : all) score[{r.engine, r.block_size, r.queue_depth, r.threads}] += r.gb_per_s;
    auto best = std::max_element(score.begin(), score.end(),
                                 [](const auto& a, const auto& b) { return a.second < b.second; });
    const auto& [e, b, d, t] = best->first;
    nvme::IoEngineOptions o;
    o.block_size = b;
    o.queue_depth = d;
    o.intra_op_parallelism = t;
    aio = nvme::aio_config_block(o, nvme::parse_engine_kind(e).value_or(EngineKind::kAuto));
  }
  if (opts.json) {
    nlohmann::ordered_json out;
    out["results"] = nlohmann::ordered_json::array();
    for (const TrialResult& r : all) out["results"].push_back(result_json(r));
    if (opts.sweep) out["aio"] = aio;
    fmt::print("{}\n", out.dump(2));
  } else {
    for (const std::string& n : notes) fmt::print("note: {}\n", n);
    if (opts.sweep) {
      fmt::print("\nBest configuration ({} of the modes measured); paste into your config:\n",
                 do_read && do_write ? "sum" : "throughput");
      fmt::print("\"aio\": {}\n", aio.dump(2));
      fmt::print("(the disk's speed may drift between runs: repeat a sweep before trusting small differences)\n");
    }
  }
  return 0;
}

CommandRegistration io_bench_command("io-bench", [](CLI::App& root) {
  auto opts = std::make_shared<IoBenchOptions>();
  CLI::App* cmd = root.add_subcommand("io-bench", "Measure sequential NVMe read/write throughput through the I/O engine");
  cmd->add_option("--path", opts->path, "Directory on the drive to test (a temporary file is created there)")->required();
  cmd->add_option("--size", opts->size, "Bytes per run (default 4GiB)");
  cmd->add_option("--engine", opts->engine, "auto|io_uring|libaio|psync (default auto; with --sweep: every working one)");
  cmd->add_option("--block-size", opts->block_size, "Bytes per request (aio.block_size, default 1MiB)");
  cmd->add_option("--queue-depth", opts->queue_depth, "Requests in flight per thread (aio.queue_depth, default 32)");
  cmd->add_option("--threads", opts->threads, "Rings / contexts / thread groups (aio.intra_op_parallelism, default 1)");
  cmd->add_option("--mode", opts->mode, "read|write|both (default both)");
  cmd->add_flag("--json", opts->json, "Print {\"results\":[...]} as JSON");
  cmd->add_flag("--sweep", opts->sweep, "Try block sizes, depths, threads and engines; print the best \"aio\" block");
  cmd->add_option("--sweep-block-sizes", opts->sweep_block_sizes, "Block sizes for --sweep (default 256KiB,1MiB,4MiB)");
  cmd->add_option("--sweep-queue-depths", opts->sweep_queue_depths, "Queue depths for --sweep (default 8,32)");
  cmd->add_option("--sweep-threads", opts->sweep_threads, "Thread counts for --sweep (default 1,2)");
  cmd->add_flag("--keep", opts->keep, "Keep the test file");
  cmd->add_flag("--sqpoll", opts->sqpoll, "io_uring: kernel submission-polling thread (costs a core)");
  cmd->add_option("--file", opts->file, "Use (and keep) this file name inside --path; reads skip the initial fill "
                                        "when it is already written");
  cmd->callback([opts] { exit_with(run_io_bench(*opts)); });
});

}  // namespace
}  // namespace strata::cli

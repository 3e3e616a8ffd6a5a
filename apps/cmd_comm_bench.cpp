// strata comm-bench: collective bandwidth like nccl-tests, on any backend.
//
//   strata comm-bench --backend local|mpi|nccl [--ranks N]
//                     [--op all_gather|reduce_scatter|all_reduce|broadcast|all]
//                     [--min-bytes 8] [--max-bytes 256MiB] [--step-factor 2]
//                     [--dtype fp32|bf16|fp16|fp64|int64] [--iters 20] [--warmup 5]
//                     [--in-place] [--timeout-ms N] [--json]
//
// One row per op and size: size (bytes of the full buffer: recv for
// all_gather, send for reduce_scatter), count (elements of that buffer),
// dtype, time per op (slowest rank), algbw = size / time and busbw = algbw
// x 2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter), 1
// (broadcast), and #wrong: elements (summed over ranks) that differ bit for
// bit from the expected result of the crafted inputs (strata/comm/pattern.h)
// in a separate checked run. Under mpirun -np N (--backend mpi) each process
// is one rank and rank 0 prints. Text mode also prints the memory-copy
// ceiling measured in the same run. Exit status 1 if any element was wrong.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "command.h"
#include "strata/core/printable.h"
#include "strata/comm/backends.h"
#include "strata/comm/pattern.h"
#include "strata/core/units.h"

namespace strata::cli {
namespace {

using comm::CollectiveDesc;
using comm::CollectiveOp;
using comm::Communicator;
using Clock = std::chrono::steady_clock;

struct CommBenchOptions {
  std::string backend = "local";
  int ranks = 0;  // 0: 4 for local, the mpirun size for mpi, 1 for nccl
  std::string op = "all";
  std::string min_bytes = "8";
  std::string max_bytes = "256MiB";
  int step_factor = 2;
  std::string dtype = "fp32";
  int iters = 20;
  int warmup = 5;
  bool in_place = false;
  int64_t timeout_ms = -1;
  bool json = false;
};

struct Plan {
  std::vector<CollectiveOp> ops;
  uint64_t min_bytes = 8;
  uint64_t max_bytes = 0;
  DType dtype = DType::kF32;
};

struct Row {
  CollectiveOp op;
  uint64_t bytes;
  uint64_t count;
  double time_us;
  double algbw_gbps;
  double busbw_gbps;
  uint64_t wrong;
};

double bus_factor(CollectiveOp op, int n) {
  switch (op) {
    case CollectiveOp::kAllReduce: return 2.0 * (n - 1) / n;
    case CollectiveOp::kAllGather:
    case CollectiveOp::kReduceScatter: return static_cast<double>(n - 1) / n;
    default: return 1.0;
  }
}

// Descriptor for a nominal buffer size, rounded down like nccl-tests.
CollectiveDesc desc_for(CollectiveOp op, DType dtype, uint64_t bytes, int n) {
  CollectiveDesc d;
  d.op = op;
  d.dtype = dtype;
  d.reduce = comm::ReduceOp::kSum;
  const uint64_t elements = bytes / dtype_size(dtype);
  const bool per_rank = op == CollectiveOp::kAllGather || op == CollectiveOp::kReduceScatter;
  d.count = per_rank ? elements / static_cast<uint64_t>(n) : elements;
  return d;
}

uint64_t full_count(const CollectiveDesc& d, int n) {
  return d.op == CollectiveOp::kAllGather || d.op == CollectiveOp::kReduceScatter ? d.count * static_cast<uint64_t>(n)
                                                                                  : d.count;
}

// Issues one collective of `d` on buffers a (send) and b (recv); in place
// uses a alone, laid out as docs/comm.md says.
Result<comm::CommWork> issue(Communicator& c, const CollectiveDesc& d, char* a, char* b, bool in_place) {
  const size_t elt = dtype_size(d.dtype);
  const size_t rank_offset = static_cast<size_t>(c.rank()) * d.count * elt;
  switch (d.op) {
    case CollectiveOp::kAllGather:
      return in_place ? c.all_gather(a + rank_offset, a, d.count, d.dtype) : c.all_gather(a, b, d.count, d.dtype);
    case CollectiveOp::kReduceScatter:
      return in_place ? c.reduce_scatter(a, a + rank_offset, d.count, d.dtype, d.reduce)
                      : c.reduce_scatter(a, b, d.count, d.dtype, d.reduce);
    case CollectiveOp::kAllReduce:
      return c.all_reduce(a, in_place ? a : b, d.count, d.dtype, d.reduce);
    case CollectiveOp::kBroadcast: return c.broadcast(a, in_place ? a : b, d.count, d.dtype, d.root);
    case CollectiveOp::kBarrier: return c.barrier();
  }
  return Internal("unknown op");
}

// One checked run from fresh inputs; returns this rank's wrong elements.
Result<uint64_t> checked_run(Communicator& c, const CollectiveDesc& d, char* a, char* b, bool in_place) {
  const int n = c.world_size();
  const int r = c.rank();
  const size_t elt = dtype_size(d.dtype);
  const size_t n_send = comm::send_count(d, n);
  const size_t n_recv = comm::recv_count(d, n);
  std::vector<unsigned char> send(std::max<size_t>(n_send, 1) * elt);
  std::vector<unsigned char> recv(std::max<size_t>(n_recv, 1) * elt);
  comm::fill_send_pattern(d, r, n, send.data());
  comm::fill_sentinel(d.dtype, recv.data(), n_recv);
  char* out = b;
  if (!in_place) {
    STRATA_RETURN_IF_ERROR(c.upload(a, send.data(), n_send * elt));
    STRATA_RETURN_IF_ERROR(c.upload(b, recv.data(), n_recv * elt));
  } else if (d.op == CollectiveOp::kAllGather) {
    std::memcpy(recv.data() + static_cast<size_t>(r) * d.count * elt, send.data(), d.count * elt);
    STRATA_RETURN_IF_ERROR(c.upload(a, recv.data(), n_recv * elt));
    out = a;
  } else if (d.op == CollectiveOp::kBroadcast && r != d.root) {
    STRATA_RETURN_IF_ERROR(c.upload(a, recv.data(), n_recv * elt));
    out = a;
  } else {
    STRATA_RETURN_IF_ERROR(c.upload(a, send.data(), n_send * elt));
    out = d.op == CollectiveOp::kReduceScatter ? a + static_cast<size_t>(r) * d.count * elt : a;
  }
  STRATA_ASSIGN_OR_RETURN(comm::CommWork work, issue(c, d, a, b, in_place));
  STRATA_RETURN_IF_ERROR(work.wait());
  STRATA_RETURN_IF_ERROR(c.download(recv.data(), out, n_recv * elt));
  return static_cast<uint64_t>(comm::count_wrong(d, r, n, recv.data()));
}

// Max (time) and sum (wrong) over ranks, through the communicator itself.
Result<std::pair<double, uint64_t>> combine(Communicator& c, double time_us, uint64_t wrong, char* scratch) {
  float t = static_cast<float>(time_us);
  float w = static_cast<float>(wrong);
  STRATA_RETURN_IF_ERROR(c.upload(scratch, &t, sizeof(float)));
  STRATA_RETURN_IF_ERROR(c.upload(scratch + 64, &w, sizeof(float)));
  STRATA_ASSIGN_OR_RETURN(comm::CommWork tw, c.all_reduce(scratch, scratch, 1, DType::kF32, comm::ReduceOp::kMax));
  STRATA_ASSIGN_OR_RETURN(comm::CommWork ww, c.all_reduce(scratch + 64, scratch + 64, 1, DType::kF32));
  STRATA_RETURN_IF_ERROR(tw.wait());
  STRATA_RETURN_IF_ERROR(ww.wait());
  STRATA_RETURN_IF_ERROR(c.download(&t, scratch, sizeof(float)));
  STRATA_RETURN_IF_ERROR(c.download(&w, scratch + 64, sizeof(float)));
  return std::make_pair(static_cast<double>(t), static_cast<uint64_t>(w));
}

// The whole sweep on one rank; rank 0 gets the rows.
Result<std::vector<Row>> run_rank(Communicator& c, const Plan& plan, const CommBenchOptions& o) {
  const int n = c.world_size();
  // Buffers big enough for the largest size (+ room for in-place layouts).
  const uint64_t buffer_bytes = plan.max_bytes + 64;
  STRATA_ASSIGN_OR_RETURN(comm::CommBuffer a, c.allocate_buffer(buffer_bytes));
  STRATA_ASSIGN_OR_RETURN(comm::CommBuffer b, c.allocate_buffer(buffer_bytes));
  STRATA_ASSIGN_OR_RETURN(comm::CommBuffer scratch, c.allocate_buffer(128));
  auto* pa = static_cast<char*>(a.data());
  auto* pb = static_cast<char*>(b.data());
  std::vector<Row> rows;
  for (CollectiveOp op : plan.ops) {
    for (uint64_t bytes = plan.min_bytes; bytes <= plan.max_bytes;
         bytes = bytes * static_cast<uint64_t>(o.step_factor)) {
      CollectiveDesc d = desc_for(op, plan.dtype, bytes, n);
      STRATA_ASSIGN_OR_RETURN(uint64_t wrong, checked_run(c, d, pa, pb, o.in_place));
      for (int i = 0; i < o.warmup; ++i) {
        STRATA_ASSIGN_OR_RETURN(comm::CommWork w, issue(c, d, pa, pb, o.in_place));
        STRATA_RETURN_IF_ERROR(w.wait());
      }
      STRATA_ASSIGN_OR_RETURN(comm::CommWork aligned, c.barrier());
      STRATA_RETURN_IF_ERROR(aligned.wait());
      const auto start = Clock::now();
      for (int i = 0; i < o.iters; ++i) {
        STRATA_ASSIGN_OR_RETURN(comm::CommWork w, issue(c, d, pa, pb, o.in_place));
        (void)w;
      }
      STRATA_RETURN_IF_ERROR(c.synchronize());
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count() / o.iters;
      STRATA_ASSIGN_OR_RETURN(auto combined, combine(c, us, wrong, static_cast<char*>(scratch.data())));
      Row row;
      row.op = op;
      row.count = full_count(d, n);
      row.bytes = row.count * dtype_size(plan.dtype);
      row.time_us = combined.first;
      row.algbw_gbps = row.time_us > 0 ? static_cast<double>(row.bytes) / (row.time_us * 1e3) : 0.0;
      row.busbw_gbps = row.algbw_gbps * bus_factor(op, n);
      row.wrong = combined.second;
      rows.push_back(row);
      if (o.step_factor < 2) break;
    }
  }
  return rows;
}

// Copy bandwidth ceiling: `threads` threads each copying their own 64 MiB
// buffer; aggregate bytes copied per second, best of 3.
double memcpy_gbps(int threads) {
  constexpr size_t kBytes = 64u << 20;
  std::vector<std::vector<char>> src(static_cast<size_t>(threads), std::vector<char>(kBytes, 1));
  std::vector<std::vector<char>> dst(static_cast<size_t>(threads), std::vector<char>(kBytes, 0));
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto start = Clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        for (int k = 0; k < 2; ++k) std::memcpy(dst[static_cast<size_t>(t)].data(), src[static_cast<size_t>(t)].data(), kBytes);
      });
    }
    for (auto& th : pool) th.join();
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    best = std::max(best, 2.0 * kBytes * threads / s / 1e9);
  }
  return best;
}

void print_rows(const std::vector<Row>& rows, const Plan& plan, int n, const CommBenchOptions& o,
                std::string_view backend) {
  if (o.json) {
    nlohmann::json results = nlohmann::json::array();
    for (const Row& r : rows) {
      results.push_back({{"op", std::string(comm::op_name(r.op))},
                         {"dtype", std::string(dtype_name(plan.dtype))},
                         {"bytes", r.bytes},
                         {"ranks", n},
                         {"time_us", r.time_us},
                         {"algbw_gbps", r.algbw_gbps},
                         {"busbw_gbps", r.busbw_gbps},
                         {"wrong", r.wrong}});
    }
    fmt::print("{}\n", nlohmann::json{{"results", results}}.dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
    return;
  }
  fmt::print("#\n# {:>15} {:>12} {:>12} {:>6} {:>12} {:>12} {:>12} {:>7}\n", "op", "size", "count", "type",
             "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong");
  for (const Row& r : rows) {
    fmt::print("  {:>15} {:>12} {:>12} {:>6} {:>12.1f} {:>12.2f} {:>12.2f} {:>7}\n", comm::op_name(r.op), r.bytes,
               r.count, dtype_name(plan.dtype), r.time_us, r.algbw_gbps, r.busbw_gbps, r.wrong);
  }
  uint64_t wrong = 0;
  double busbw_sum = 0;
  for (const Row& r : rows) {
    wrong += r.wrong;
    busbw_sum += r.busbw_gbps;
  }
  fmt::print("# backend {}: out of bounds values: {} {}\n", backend, wrong, wrong == 0 ? "OK" : "FAILED");
  fmt::print("# avg busbw: {:.2f} GB/s\n#\n", rows.empty() ? 0.0 : busbw_sum / static_cast<double>(rows.size()));
}

Result<Plan> make_plan(const CommBenchOptions& o) {
  Plan plan;
  if (o.op == "all") {
    plan.ops = {CollectiveOp::kAllGather, CollectiveOp::kReduceScatter, CollectiveOp::kAllReduce,
                CollectiveOp::kBroadcast};
  } else {
    STRATA_ASSIGN_OR_RETURN(CollectiveOp op, comm::parse_op(o.op, "--op"));
    if (op == CollectiveOp::kBarrier) return InvalidArgument("--op barrier moves no bytes; choose a data collective or all");
    plan.ops = {op};
  }
  STRATA_ASSIGN_OR_RETURN(plan.min_bytes, parse_bytes(o.min_bytes, "--min-bytes"));
  STRATA_ASSIGN_OR_RETURN(plan.max_bytes, parse_bytes(o.max_bytes, "--max-bytes"));
  STRATA_ASSIGN_OR_RETURN(plan.dtype, parse_dtype(o.dtype));
  if (plan.min_bytes == 0) return InvalidArgument("--min-bytes must be at least 1 byte");
  if (plan.max_bytes < plan.min_bytes) {
    return InvalidArgument(fmt::format("--max-bytes {} is below --min-bytes {}", o.max_bytes, o.min_bytes));
  }
  if (o.step_factor < 1) return InvalidArgument(fmt::format("--step-factor {} must be >= 1", o.step_factor));
  if (o.iters < 1) return InvalidArgument(fmt::format("--iters {} must be >= 1", o.iters));
  if (o.warmup < 0) return InvalidArgument(fmt::format("--warmup {} must be >= 0", o.warmup));
  return plan;
}

Result<comm::CommOptions> comm_options(const CommBenchOptions& o) {
  STRATA_ASSIGN_OR_RETURN(comm::CommOptions opts, comm::apply_comm_environment({}));
  if (o.timeout_ms >= 0) opts.timeout = std::chrono::milliseconds(o.timeout_ms);
  return opts;
}

void print_header(const CommBenchOptions& o, std::string_view backend, int n, bool local) {
  if (o.json) return;
  fmt::print("# strata comm-bench: backend {}, {} ranks, dtype {}, {}, iters {}, warmup {}\n", backend, n, o.dtype,
             o.in_place ? "in-place" : "out-of-place", o.iters, o.warmup);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const double one = memcpy_gbps(1);
  const int threads = std::min(n, cores);
  const double all = threads > 1 ? memcpy_gbps(threads) : one;
  fmt::print("# ceiling: memcpy {:.2f} GB/s with 1 thread, {:.2f} GB/s aggregate with {} threads ({} cores)\n", one,
             all, threads, cores);
  if (local) {
    // Every local rank copies its whole recv buffer (all_gather: world
    // chunks; broadcast: the root's buffer), all ranks at once, so the
    // aggregate copy rate bounds world x (size / time).
    fmt::print("#   local bound for buffers beyond the caches: all_gather busbw <= A(n-1)/n^2 = {:.2f} GB/s, "
               "broadcast busbw <= A/n = {:.2f} GB/s (A = aggregate memcpy)\n",
               all * (n - 1) / (static_cast<double>(n) * n), all / n);
  }
}

int comm_bench_failed(const Status& s) {
  fmt::print(stderr, "strata comm-bench: {}\n", printable_message(s.to_string()));
  return 2;
}

int run_comm_bench(const CommBenchOptions& o) {
  Result<comm::Backend> backend = comm::parse_backend(o.backend, "--backend");
  if (!backend.ok()) return comm_bench_failed(backend.status());
  Result<Plan> plan = make_plan(o);
  if (!plan.ok()) return comm_bench_failed(plan.status());
  Result<comm::CommOptions> opts = comm_options(o);
  if (!opts.ok()) return comm_bench_failed(opts.status());
  const std::string_view name = comm::backend_name(*backend);

  std::vector<std::unique_ptr<Communicator>> comms;
  if (*backend == comm::Backend::kLocal) {
    const int n = o.ranks > 0 ? o.ranks : 4;
    auto group = comm::create_local_group(n, *opts);
    if (!group.ok()) return comm_bench_failed(group.status());
    comms = std::move(group).value();
  } else {
    Result<std::unique_ptr<Communicator>> c = Status(Internal("unset"));
    if (*backend == comm::Backend::kMpi) {
      c = comm::create_mpi_communicator(*opts);
    } else {
      comm::NcclOptions nopts;
      nopts.common = *opts;
      c = comm::create_nccl_communicator(nopts);
    }
    if (!c.ok()) return comm_bench_failed(c.status());
    if (o.ranks > 0 && o.ranks != (*c)->world_size()) {
      return comm_bench_failed(InvalidArgument(
          fmt::format("--ranks {} but the {} world has {} ranks; start it with mpirun -np {} or drop --ranks", o.ranks,
                      name, (*c)->world_size(), o.ranks)));
    }
    comms.push_back(std::move(c).value());
  }
  const int n = comms[0]->world_size();
  const bool printer = comms[0]->rank() == 0;
  if (printer) print_header(o, name, n, *backend == comm::Backend::kLocal);

  std::vector<Result<std::vector<Row>>> results(comms.size(), Status(Internal("not run")));
  if (comms.size() == 1) {
    results[0] = run_rank(*comms[0], *plan, o);
  } else {
    std::vector<std::thread> threads;
    for (size_t r = 0; r < comms.size(); ++r) {
      threads.emplace_back([&, r] { results[r] = run_rank(*comms[r], *plan, o); });
    }
    for (auto& t : threads) t.join();
  }
  for (auto& r : results) {
    if (!r.ok()) return comm_bench_failed(r.status());
  }
  if (!printer) return 0;
  print_rows(*results[0], *plan, n, o, name);
  for (const Row& r : *results[0]) {
    if (r.wrong > 0) {
      fmt::print(stderr, "strata comm-bench: {} wrong elements in {} of {} B; the {} backend is broken\n", r.wrong,
                 comm::op_name(r.op), r.bytes, name);
      return 1;
    }
  }
  return 0;
}

CommandRegistration comm_bench_command("comm-bench", [](CLI::App& root) {
  auto o = std::make_shared<CommBenchOptions>();
  CLI::App* cmd = root.add_subcommand(
      "comm-bench", "Collective bandwidth (algbw, busbw) and exactness (#wrong) like nccl-tests, on local, mpi or nccl");
  cmd->add_option("--backend", o->backend, "local | mpi | nccl")->capture_default_str();
  cmd->add_option("--ranks", o->ranks, "Ranks: threads for local (default 4); must match mpirun -np for mpi");
  cmd->add_option("--op", o->op, "all_gather | reduce_scatter | all_reduce | broadcast | all")->capture_default_str();
  cmd->add_option("--min-bytes", o->min_bytes, "Smallest buffer size")->capture_default_str();
  cmd->add_option("--max-bytes", o->max_bytes, "Largest buffer size")->capture_default_str();
  cmd->add_option("--step-factor", o->step_factor, "Multiply the size by this each row")->capture_default_str();
  cmd->add_option("--dtype", o->dtype, "fp32 | bf16 | fp16 (reductions accumulate in fp32) | fp64 | int64")
      ->capture_default_str();
  cmd->add_option("--iters", o->iters, "Timed iterations per size")->capture_default_str();
  cmd->add_option("--warmup", o->warmup, "Untimed iterations per size")->capture_default_str();
  cmd->add_flag("--in-place", o->in_place, "Run the collectives in place");
  cmd->add_option("--timeout-ms", o->timeout_ms, "Watchdog per collective (default 300000 or STRATA_COMM_TIMEOUT_MS)")
      ->check(CLI::Range(int64_t{0}, static_cast<int64_t>(comm::kMaxCommTimeout.count())));
  cmd->add_flag("--json", o->json, "Print {\"results\":[...]} instead of the table");
  cmd->callback([o] { exit_with(run_comm_bench(*o)); });
});

}  // namespace
}  // namespace strata::cli

// Driving the engine with the reference GPT: see engine_run.h.
#include "engine_run.h"

#include <sys/sysinfo.h>

#include <cstdlib>
#include <thread>

#include <fmt/format.h>

#include "strata/comm/host_collective.h"
#include "strata/core/device_registry.h"
#include "strata/core/printable.h"
#include "strata/core/units.h"
#include "strata/model/cpu_ops.h"

namespace strata::cli {

ComputeThreadLimit::ComputeThreadLimit(int threads) {
  if (threads <= 0) return;
  tbb_limit_.emplace(tbb::global_control::max_allowed_parallelism, static_cast<size_t>(threads));
  model::cpu::limit_gemm_threads(threads);
}

ComputeThreadLimit::~ComputeThreadLimit() {
  if (tbb_limit_) model::cpu::limit_gemm_threads(0);
}

std::string matmul_description(DeviceKind kind) {
  return kind == DeviceKind::kCpu ? model::cpu::gemm_backend_description() : std::string("cuBLAS sgemm (fp32, no TF32)");
}

uint64_t default_cpu_device_bytes() {
  struct sysinfo info {};
  if (sysinfo(&info) != 0) return uint64_t{4} << 30;
  return static_cast<uint64_t>(info.totalram) * info.mem_unit / 4;
}

DefaultNvmeDir default_nvme_dir() {
  for (const char* variable : {"STRATA_NVME_DIR", "TMPDIR"}) {
    const char* dir = std::getenv(variable);
    if (dir != nullptr && *dir != '\0') return {dir, fmt::format("${}", variable)};
  }
  return {"/tmp", "neither $STRATA_NVME_DIR nor $TMPDIR is set"};
}

Result<DeviceKind> parse_device_flag(const std::string& text, const char* flag) {
  Result<DeviceKind> kind = parse_device_kind(text, flag);
  if (kind.ok()) return kind;
  return InvalidArgument(fmt::format("{} '{}' is not a device; use cpu, cuda or auto", flag, printable(text, 64)));
}

Result<OffloadDevice> parse_offload(const std::string& text, const char* flag) {
  if (text == "none") return OffloadDevice::kNone;
  if (text == "cpu") return OffloadDevice::kCpu;
  if (text == "nvme") return OffloadDevice::kNvme;
  return InvalidArgument(fmt::format("{} '{}' is not none, cpu or nvme", flag, printable(text, 64)));
}

Status build_rank(const RankSetup& t, const model::GptConfig& g, const model::TextDataset& data, DeviceKind kind,
                  comm::Communicator& comm, RankState& rs) {
  DeviceOptions dopt;
  dopt.device_memory_bytes = t.device_memory_bytes;
  dopt.cuda_memory_limit_bytes = t.device_memory_bytes;  // 0: the whole GPU
  if (kind == DeviceKind::kCpu && dopt.device_memory_bytes == 0)
    dopt.device_memory_bytes = default_cpu_device_bytes() / static_cast<uint64_t>(comm.world_size());
  Result<std::unique_ptr<Device>> device = make_device(kind, dopt);
  if (!device.ok())
    return device.status().with_context(fmt::format("--device {}{}", device_kind_name(kind),
                                                    kind == DeviceKind::kCuda ? " (use --device cpu)" : ""));
  rs.device = std::move(*device);
  STRATA_ASSIGN_OR_RETURN(rs.stream, rs.device->create_stream());
  STRATA_ASSIGN_OR_RETURN(rs.model, model::GptModel::create(g, t.seed));
  STRATA_ASSIGN_OR_RETURN(rs.executor, model::GptExecutor::create(*rs.model, *rs.device, *rs.stream, t.batch, t.seq_len));
  STRATA_ASSIGN_OR_RETURN(rs.runner, model::GptRunner::create(*rs.model, *rs.executor, data, t.seed, t.eval_batches,
                                                              {comm.rank(), comm.world_size()}));
  return create_rank_engine(t.engine, comm, rs);
}

Status vote(comm::Communicator& comm, const Status& mine, const char* what) {
  int64_t failed = mine.ok() ? 0 : comm.rank() + 1, first = 0;
  STRATA_RETURN_IF_ERROR(comm::host_collective(
      comm, &failed, sizeof(failed), &first, sizeof(first),
      [&](const void* s, void* r) { return comm.all_reduce(s, r, 1, DType::kI64, comm::ReduceOp::kMax); },
      "the ranks' vote"));
  if (!mine.ok()) return mine;
  if (first != 0) return FailedPrecondition(fmt::format("rank {} failed {}; every rank stops", first - 1, what));
  return Status::Ok();
}

Status run_rank_threads(std::vector<std::unique_ptr<comm::Communicator>>& comms,
                        const std::function<Status(size_t index, comm::Communicator& comm)>& fn) {
  std::vector<Status> results(comms.size());
  {
    std::vector<std::thread> threads;
    threads.reserve(comms.size());
    for (size_t i = 0; i < comms.size(); ++i) {
      threads.emplace_back([&, i] {
        results[i] = fn(i, *comms[i]);
        if (!results[i].ok()) comms[i].reset();
      });
    }
    for (auto& th : threads) th.join();
  }
  // A rank that only saw a peer fail comes after the peer's own error.
  for (const Status& st : results)
    if (!st.ok() && st.message().find("every rank stops") == std::string::npos) return st;
  for (const Status& st : results)
    if (!st.ok()) return st;
  return Status::Ok();
}

}  // namespace strata::cli

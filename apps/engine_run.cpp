// Driving the engine with the reference GPT: see engine_run.h.
#include "engine_run.h"

#include <sys/sysinfo.h>

#include <cstdlib>
#include <thread>

#include <fmt/format.h>

#include "strata/comm/host_collective.h"
#include "strata/core/device_registry.h"
#include "strata/core/units.h"
#include "strata/nvme/aio_config.h"
#include "strata/nvme/fault_injection.h"

namespace strata::cli {

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

Result<OffloadDevice> parse_offload(const std::string& text, const char* flag) {
  if (text == "none") return OffloadDevice::kNone;
  if (text == "cpu") return OffloadDevice::kCpu;
  if (text == "nvme") return OffloadDevice::kNvme;
  return InvalidArgument(fmt::format("{} '{}' is not none, cpu or nvme", flag, printable(text, 64)));
}

namespace {

// STRATA_FAULTS: the fault plan's text and where it goes (on=optimizer|params).
struct FaultsSpec {
  std::string plan;
  std::string on = "optimizer";
};

Result<FaultsSpec> split_faults_spec(std::string_view text) {
  FaultsSpec f;
  size_t at = 0;
  while (at <= text.size()) {
    size_t end = text.find(',', at);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view item = text.substr(at, end - at);
    if (item.rfind("on=", 0) == 0) {
      f.on = std::string(item.substr(3));
      if (f.on != "optimizer" && f.on != "params")
        return InvalidArgument(fmt::format("STRATA_FAULTS '{}': on '{}' must be optimizer or params",
                                           printable(text, 200), printable(f.on, 32)));
    } else if (!item.empty()) {
      f.plan += (f.plan.empty() ? "" : ",") + std::string(item);
    }
    at = end + 1;
  }
  return f;
}

}  // namespace

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
  offload::EngineOptions eo = t.engine;
  // STRATA_FAULTS (docs/engine.md "Errors"): faults injected into the NVMe
  // I/O of the optimizer state (on=optimizer, the default) or the stage-3
  // parameter shards (on=params), to see what a failing drive does to a run.
  if (const char* env = std::getenv("STRATA_FAULTS"); env != nullptr && *env != '\0') {
    STRATA_ASSIGN_OR_RETURN(FaultsSpec f, split_faults_spec(env));
    const bool params = f.on == "params";
    if (!params && eo.offload_optimizer != OffloadDevice::kNvme)
      return InvalidArgument("STRATA_FAULTS is set but the optimizer state is not on NVMe (offload_optimizer.device "
                             "nvme, or --offload-optimizer nvme); unset it, or add on=params for parameter shards");
    if (params && eo.offload_param != OffloadDevice::kNvme)
      return InvalidArgument("STRATA_FAULTS on=params is set but the parameter shards are not on NVMe "
                             "(offload_param.device nvme at stage 3); unset it");
    STRATA_ASSIGN_OR_RETURN(nvme::FaultPlan plan, nvme::parse_fault_plan(f.plan));
    STRATA_ASSIGN_OR_RETURN(nvme::IoEngineConfig ec, nvme::io_engine_config(eo.nvme.aio));
    plan.seed += static_cast<uint64_t>(comm.rank());
    STRATA_ASSIGN_OR_RETURN(rs.fault_engine, nvme::make_fault_injecting_engine(ec.options, plan));
    (params ? eo.nvme_param.io_engine : eo.nvme.io_engine) = rs.fault_engine.get();
    if (comm.rank() == 0)
      fmt::print(stderr, "STRATA_FAULTS '{}': faults injected into the NVMe I/O of the {} of every rank\n",
                 printable(env, 200), params ? "parameter shards" : "optimizer state");
  }
  STRATA_ASSIGN_OR_RETURN(rs.engine, offload::Engine::create(eo, *rs.runner, *rs.device, comm));
  return Status::Ok();
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

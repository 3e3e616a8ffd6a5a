#pragma once
// Driving the ZeRO engine with the reference GPT, one rank per thread or
// process: what `strata train` and `strata bench offload` share. A rank
// builds its device, model, executor, runner and engine inside its own
// thread (build_rank), the ranks vote before anyone issues a collective
// (vote), and run_rank_threads runs N local ranks and picks the error to
// report.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <tbb/global_control.h>

#include "strata/comm/communicator.h"
#include "strata/core/config.h"
#include "strata/core/device.h"
#include "strata/core/status.h"
#include "strata/model/gpt.h"
#include "strata/model/gpt_executor.h"
#include "strata/model/gpt_runner.h"
#include "strata/model/text_data.h"
#include "strata/nvme/io_engine.h"
#include "strata/offload/engine.h"

namespace strata::cli {

// --device-threads: the cpu device's compute on `threads` threads (0: every
// core) while this lives, through oneTBB's global limit (the model's loops)
// and OpenBLAS's (model::cpu::limit_gemm_threads); lifted on destruction.
// The CPU optimizer runs its own threads, outside both.
class ComputeThreadLimit {
 public:
  explicit ComputeThreadLimit(int threads);
  ~ComputeThreadLimit();
  ComputeThreadLimit(const ComputeThreadLimit&) = delete;
  ComputeThreadLimit& operator=(const ComputeThreadLimit&) = delete;

 private:
  std::optional<tbb::global_control> tbb_limit_;
};

// What the model's matrix products run on for a device kind, for reports.
std::string matmul_description(DeviceKind kind);

// What one rank is built from, besides the model's shape and the data.
struct RankSetup {
  offload::EngineOptions engine;
  int batch = 8;
  int seq_len = 64;
  uint64_t seed = 1234;
  int eval_batches = 8;
  uint64_t device_memory_bytes = 0;  // 0: cpu a quarter of host memory (split over ranks), cuda the whole GPU
};

// Everything one rank trains with. Members are destroyed in reverse order:
// the engine first, the device last.
struct RankState {
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> stream;
  std::unique_ptr<model::GptModel> model;
  std::unique_ptr<model::GptExecutor> executor;
  std::unique_ptr<model::GptRunner> runner;
  // strata-testing's STRATA_FAULTS: the NVMe I/O through a fault-injecting
  // engine (outlives the engine, which uses it); null in `strata`.
  std::unique_ptr<nvme::IoEngine> fault_engine;
  std::unique_ptr<offload::Engine> engine;
};

// The cpu device's default capacity: a quarter of host memory.
uint64_t default_cpu_device_bytes();

// Where NVMe swap files go when no --nvme-path is given: $STRATA_NVME_DIR,
// else $TMPDIR, else /tmp (the folder scripts/quickstart.sh gives strata
// train), with where that came from ("$STRATA_NVME_DIR") for messages.
// The folder is not checked here.
struct DefaultNvmeDir {
  std::string path;
  std::string origin;
};
DefaultNvmeDir default_nvme_dir();

// "cpu" | "cuda" | "auto" given as `flag` (--device, --calibrate-device);
// the error names the flag and shows the value escaped.
Result<DeviceKind> parse_device_flag(const std::string& text, const char* flag);

// "none" | "cpu" | "nvme"; the error names `flag`.
Result<OffloadDevice> parse_offload(const std::string& text, const char* flag);

// Builds rank `comm.rank()`'s device (of `kind`), model, executor, runner
// and engine into `rs`. Call it on the rank's own thread.
Status build_rank(const RankSetup& t, const model::GptConfig& g, const model::TextDataset& data, DeviceKind kind,
                  comm::Communicator& comm, RankState& rs);

// Creates rs.engine from `options` for rs's runner and device. Defined
// twice: the installed `strata` links apps/release/rank_engine.cpp
// (Engine::create, nothing else); the test-only `strata-testing` links
// apps/testing/rank_engine.cpp, which also applies the faults of the
// STRATA_FAULTS and STRATA_CHECKPOINT_CRASH_AT environment variables through
// the engine's testing seam (docs/engine.md "Errors"). Every other source of
// the CLI is shared (apps/CMakeLists.txt).
Status create_rank_engine(const offload::EngineOptions& options, comm::Communicator& comm, RankState& rs);

// Every rank says whether it is ready; a rank that failed makes all stop
// (so no rank waits for a peer that will never issue its collectives).
// Returns the rank's own error, or "rank R failed <what>; every rank stops".
Status vote(comm::Communicator& comm, const Status& mine, const char* what);

// Runs fn(i, *comms[i]) on one thread per communicator and joins them. A
// rank that fails leaves the group at once (its communicator is destroyed),
// so its peers' collectives fail naming it instead of waiting for the
// watchdog. Returns the first failure in rank order, preferring a rank's
// own error to a peer's "every rank stops"; Ok when all succeeded.
Status run_rank_threads(std::vector<std::unique_ptr<comm::Communicator>>& comms,
                        const std::function<Status(size_t index, comm::Communicator& comm)>& fn);

}  // namespace strata::cli

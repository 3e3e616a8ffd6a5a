#pragma once
// A DeepSpeed JSON config, parsed strictly into typed structs.
//
// Every key Strata knows is listed once, in the key table of
// config_schema.h (path, type, default, range, meaning); the defaults below
// are the same values and a test keeps the two equal. Unlike DeepSpeed,
// an unknown key anywhere is an error naming its JSON path with a
// did-you-mean, a wrong JSON type is an error ("false" is not false), and
// invalid combinations are errors that say the fix. Every problem is
// collected, not just the first.
//
//   strata::ConfigOptions options;
//   options.world_size = 8;
//   STRATA_ASSIGN_OR_RETURN(strata::Config config, strata::load_config(path, options));
//   if (config.zero_optimization.offload_optimizer.device == strata::OffloadDevice::kNvme) ...
//
// "auto" (as written by the Hugging Face integration) is resolved from
// ConfigOptions (world size, hidden size, explicit values) or from the
// defaults where that is safe; what stays open is listed in
// Config::unresolved and, unless allow_unresolved_auto is false, is a
// warning rather than an error.

#include <array>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "strata/core/printable.h"
#include "strata/core/device_registry.h"  // DeviceKind (strata.device), device_kind_name
#include "strata/core/dtype.h"
#include "strata/core/status.h"

namespace strata {

enum class OffloadDevice : uint8_t { kNone, kCpu, kNvme };
enum class AioEngineKind : uint8_t { kAuto, kIoUring, kLibaio, kPsync };
enum class OptimizerType : uint8_t { kAdam, kAdamW, kAdagrad, kLion };
enum class SchedulerType : uint8_t { kNone, kWarmupLR, kWarmupDecayLR, kWarmupCosineLR, kOneCycle, kLRRangeTest };
// Element type of the 16-bit (or 32-bit) training parameters.
enum class TrainPrecision : uint8_t { kFp32, kFp16, kBf16 };

std::string_view offload_device_name(OffloadDevice d);   // "none" | "cpu" | "nvme"
std::string_view aio_engine_name(AioEngineKind e);       // "auto" | "io_uring" | "libaio" | "psync"
std::string_view optimizer_type_name(OptimizerType t);   // "Adam" | "AdamW" | "Adagrad" | "Lion"
std::string_view scheduler_type_name(SchedulerType t);   // "none" | "WarmupLR" | ...
std::string_view train_precision_name(TrainPrecision p); // "fp32" | "fp16" | "bf16"

// zero_optimization.offload_optimizer
struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;      // empty: not set
  bool pin_memory = true;
  int64_t buffer_count = 4;   // swap buffers (NVMe)
  bool fast_init = false;
  bool pipeline_read = false;
  bool pipeline_write = false;
  double ratio = 1.0;         // fraction of optimizer state offloaded; < 1 only at stage 3
};

// zero_optimization.offload_param (stage 3 only)
struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;
  bool pin_memory = true;
  int64_t buffer_count = 5;
  int64_t buffer_size = 100'000'000;   // elements per swap buffer
  int64_t max_in_cpu = 1'000'000'000;  // elements kept in host memory with NVMe offload
};

// zero_optimization. Sizes are element counts, as in DeepSpeed.
struct ZeroConfig {
  int stage = 0;
  bool contiguous_gradients = true;
  bool reduce_scatter = true;
  int64_t reduce_bucket_size = 500'000'000;
  bool allgather_partitions = true;
  int64_t allgather_bucket_size = 500'000'000;
  bool overlap_comm = false;  // resolved: unset means true at stage 3, false below
  bool round_robin_gradients = false;
  int64_t sub_group_size = 1'000'000'000;
  bool load_from_fp32_weights = true;
  int64_t stage3_prefetch_bucket_size = 50'000'000;
  int64_t stage3_param_persistence_threshold = 100'000;
  int64_t stage3_model_persistence_threshold = std::numeric_limits<int64_t>::max();
  int64_t stage3_max_live_parameters = 1'000'000'000;
  int64_t stage3_max_reuse_distance = 1'000'000'000;
  bool stage3_gather_16bit_weights_on_model_save = false;
  bool ignore_unused_parameters = true;
  bool use_multi_rank_bucket_allreduce = true;
  int64_t zero_hpz_partition_size = 1;
  bool zero_quantized_weights = false;
  bool zero_quantized_gradients = false;
  bool memory_efficient_linear = true;
  bool elastic_checkpoint = false;
  OffloadOptimizerConfig offload_optimizer;
  OffloadParamConfig offload_param;
};

// Top-level aio: the NVMe I/O engine's settings.
struct AioConfig {
  int64_t block_size = 1'048'576;   // bytes per request
  int64_t queue_depth = 8;          // requests in flight per thread
  int64_t intra_op_parallelism = 1; // threads per operation ("thread_count" is an alias)
  bool single_submit = false;
  bool overlap_events = true;
  bool use_gds = false;
  AioEngineKind engine = AioEngineKind::kAuto;  // Strata extension
};

struct Fp16Config {
  bool enabled = false;
  bool auto_cast = false;
  double loss_scale = 0;  // 0: dynamic loss scaling
  int64_t initial_scale_power = 16;
  int64_t loss_scale_window = 1000;
  int64_t hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1;
  bool fp16_master_weights_and_grads = false;
};

struct Bf16Config {
  bool enabled = false;
  bool immediate_grad_update = false;
};

struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdam;
  bool given = false;  // the file had an optimizer section
  double lr = 1e-3;
  std::array<double, 2> betas{0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adam_w_mode = true;       // decoupled weight decay (AdamW) for type Adam
  bool bias_correction = true;
  bool amsgrad = false;          // must stay false: not implemented
  bool torch_adam = false;       // accepted, no effect in Strata
  double initial_accumulator_value = 0.0;  // Adagrad
};

struct SchedulerConfig {
  SchedulerType type = SchedulerType::kNone;
  // Parameters of `type` with that type's defaults filled in, by name
  // (e.g. "warmup_num_steps"). Numbers are JSON numbers, warmup_type a string.
  nlohmann::json params = nlohmann::json::object();
};

// train_batch_size = micro batch x gradient accumulation steps x world size.
// After resolution all three are set unless one of them stayed "auto".
struct BatchConfig {
  std::optional<int64_t> train_batch_size;
  std::optional<int64_t> train_micro_batch_size_per_gpu;
  std::optional<int64_t> gradient_accumulation_steps;
};

// data_types
struct DataTypesConfig {
  std::string grad_accum_dtype;  // empty (default: the training dtype) | fp32 | fp16 | bf16
};

// Strata's own section ("strata": {...}).
struct StrataSection {
  DeviceKind device = DeviceKind::kAuto;
  uint64_t device_memory = 0;       // bytes the cpu device may use; 0: a quarter of host memory
  uint64_t host_memory_budget = 0;  // bytes of pinned + pageable host state; 0: unlimited
  bool verify_checksums = true;     // checksum NVMe extents on read
  std::string optimizer_state_dtype = "fp32";  // fp32 | bf16: dtype of Adam's m and v
  bool overlap_optimizer = true;    // step layer by layer under the next forward (exact)
  std::string speculative_optimizer = "auto";  // auto | on | off: updates under the backward (exact)
  std::string gradient_shards = "auto";        // auto | pinned | nvme: where reduced gradient shards wait for the step
  double wait_timeout_s = 600;      // the bound on each of the engine's waits (a hung I/O or kernel ends in an error)
};

enum class IssueSeverity : uint8_t { kWarning, kError };

// One problem in a config: where (JSON path), what, and how to fix it.
struct ConfigIssue {
  IssueSeverity severity = IssueSeverity::kError;
  std::string path;     // "zero_optimization.offload_optimizer.pin_memroy"; "" for the file
  std::string message;  // "unknown key"
  std::string hint;     // "did you mean 'pin_memory'?"
};

// "file.json: error: path: message (hint: ...)". Control characters in any
// field are printed as \xNN and overlong fields are cut with their size said,
// so no input can forge or cut a line of output.
std::string format_issue(const ConfigIssue& issue, std::string_view source = {});

// The largest config text accepted (a DeepSpeed config weighs a few KB).
inline constexpr size_t kMaxConfigBytes = size_t{16} << 20;

struct Config {
  ZeroConfig zero_optimization;
  AioConfig aio;
  Fp16Config fp16;
  Bf16Config bf16;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  double gradient_clipping = 1.0;  // 0: no clipping
  BatchConfig batch;
  int64_t steps_per_print = 10;
  bool wall_clock_breakdown = false;
  bool prescale_gradients = false;
  double gradient_predivide_factor = 1.0;
  bool zero_allow_untested_optimizer = false;
  bool zero_force_ds_cpu_optimizer = true;
  std::string communication_data_type;  // empty: the training dtype
  bool memory_breakdown = false;
  bool dump_state = false;
  DataTypesConfig data_types;
  StrataSection strata;

  // Keys DeepSpeed knows that Strata accepts without acting on them
  // (tensorboard, wandb, flops_profiler, ...), by JSON path, as given.
  nlohmann::ordered_json ignored = nlohmann::ordered_json::object();
  // JSON paths still "auto" after resolution.
  std::vector<std::string> unresolved;
  // Warnings found while parsing (deprecated keys, no-effect keys, ...).
  std::vector<ConfigIssue> warnings;
  // World size the batch keys were resolved with.
  int64_t world_size = 1;
  // Where the config came from (file path), for messages.
  std::string source;

  TrainPrecision precision() const {
    return fp16.enabled ? TrainPrecision::kFp16 : bf16.enabled ? TrainPrecision::kBf16 : TrainPrecision::kFp32;
  }
  // The dtype of the training parameters (and, by default, gradients).
  DType precision_dtype() const {
    const TrainPrecision p = precision();
    return p == TrainPrecision::kBf16 ? DType::kBF16 : p == TrainPrecision::kFp16 ? DType::kF16 : DType::kF32;
  }
  bool is_unresolved(std::string_view path) const;
};

struct ConfigOptions {
  // Data-parallel world size used for the batch arithmetic and "auto".
  int64_t world_size = 1;
  // Where world_size came from, named in batch errors ("the MPI communicator
  // (mpirun -np 2)", "--ranks 1"). Empty: the caller passed it as
  // --world-size (the errors say to pass it when it is 1).
  std::string world_size_origin;
  // Model hidden size: resolves the "auto" bucket sizes the way the
  // Hugging Face integration does (h*h, 0.9*h*h, 10*h).
  std::optional<int64_t> hidden_size;
  // Values for "auto" keys, by canonical JSON path (e.g. "optimizer.params.lr").
  std::map<std::string, nlohmann::json> auto_values;
  // When false, an "auto" left unresolved is an error instead of a warning.
  bool allow_unresolved_auto = true;
  // Name used in messages (the file path); load_config sets it.
  std::string source;
};

// The full outcome of checking a config: the config (meaningful when ok())
// and every issue found, errors and warnings, in document order.
struct ConfigCheck {
  Config config;
  std::vector<ConfigIssue> issues;
  bool ok() const;
  size_t error_count() const;
  size_t warning_count() const;
  // Every issue, one per line, prefixed with the source.
  std::string format() const;
};

// Checks JSON text (parse errors included, with line and column; duplicate
// keys are errors, as in DeepSpeed).
ConfigCheck check_config_text(std::string_view text, const ConfigOptions& options = {});
// Checks an already-parsed JSON value.
ConfigCheck check_config(const nlohmann::json& json, const ConfigOptions& options = {});
// Reads and checks a file; a missing file is an error naming the path.
ConfigCheck check_config_file(const std::string& path, const ConfigOptions& options = {});
// Reads a config file: regular files only (a FIFO, /dev/zero or a folder is
// an error naming it, never a hang or an unbounded read), at most
// kMaxConfigBytes.
Result<std::string> read_config_file(const std::string& path);

// The same, as a Result: InvalidArgument listing every error when any; the
// warnings are in Config::warnings.
Result<Config> parse_config(const nlohmann::json& json, const ConfigOptions& options = {});
Result<Config> parse_config_text(std::string_view text, const ConfigOptions& options = {});
Result<Config> load_config(const std::string& path, const ConfigOptions& options = {});

// The fully resolved config as DeepSpeed-style JSON, canonical key names,
// every key present (unresolved "auto" values stay "auto").
nlohmann::ordered_json config_to_json(const Config& config);

}  // namespace strata

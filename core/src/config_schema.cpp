// The key table of the DeepSpeed-compatible config (see config_schema.h).
// Note [One table]
// Every key is declared once below with its type, default, range and
// meaning, and bound to its field of strata::Config. The parser, the
// resolved JSON (`strata config show`), the defaults (`strata config
// defaults`) and docs/config.md all read this table; a test checks that the
// struct initializers in config.h equal the defaults declared here.
#include "strata/core/config_schema.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "config_values.h"
#include "strata/core/config.h"

namespace strata {
namespace {

using nlohmann::json;
using namespace config_detail;

// Builder for table rows.
struct Key : ConfigKey {
  Key(std::string_view p, KeyType t, std::string_view def, std::string_view what) {
    path = p;
    type = t;
    default_json = def;
    meaning = what;
  }
  Key& range(double lo, double hi) { min = lo; max = hi; return *this; }
  Key& above(double lo) { min = lo; flags |= kKeyMinExclusive; return *this; }
  Key& one_of(std::string_view c) { choices = c; return *this; }
  Key& alias(std::string_view a) { aliases = a; return *this; }
  Key& flag(uint32_t f) { flags |= f; return *this; }
  Key& only(std::string_view types) { applies_to = types; return *this; }
  Key& note(std::string_view n) { default_note = n; return *this; }
  Key& bind(void (*s)(Config&, const json&), json (*g)(const Config&)) { set = s; get = g; return *this; }
};

Key section(std::string_view p, std::string_view what) { return Key(p, KeyType::kSection, "{}", what); }

#define STRATA_BIND(member)                                                   \
  [](Config& c, const nlohmann::json& v) { set_field(c.member, v); },         \
  [](const Config& c) -> nlohmann::json { return get_field(c.member); }

constexpr KeyType B = KeyType::kBool;
constexpr KeyType I = KeyType::kInteger;
constexpr KeyType N = KeyType::kNumber;
constexpr KeyType S = KeyType::kString;
constexpr KeyType E = KeyType::kEnum;
constexpr KeyType BY = KeyType::kBytes;
constexpr KeyType P2 = KeyType::kNumberPair;
constexpr KeyType SL = KeyType::kStringList;
constexpr double kInf = std::numeric_limits<double>::infinity();

std::vector<ConfigKey> build_table() {
  std::vector<ConfigKey> t;
  auto add = [&t](const Key& k) { t.push_back(k); };

  // --- batch and top-level training keys -----------------------------------
  add(Key("train_batch_size", I, "null",
          "Global batch: micro batch x gradient accumulation steps x world size. Any two of the three imply the third.")
          .range(1, kInf).flag(kKeyAuto | kKeyNullable).note("derived").bind(STRATA_BIND(batch.train_batch_size)));
  add(Key("train_micro_batch_size_per_gpu", I, "null", "Samples per GPU per forward/backward pass.")
          .range(1, kInf).flag(kKeyAuto | kKeyNullable).note("derived")
          .bind(STRATA_BIND(batch.train_micro_batch_size_per_gpu)));
  add(Key("gradient_accumulation_steps", I, "null", "Micro batches accumulated before each optimizer step.")
          .range(1, kInf).flag(kKeyAuto | kKeyNullable).note("derived (1 when only one other batch key is given)")
          .bind(STRATA_BIND(batch.gradient_accumulation_steps)));
  add(Key("gradient_clipping", N, "1.0", "Clip the global gradient norm to this value; 0 disables clipping.")
          .range(0, kInf).flag(kKeyAuto).bind(STRATA_BIND(gradient_clipping)));
  add(Key("steps_per_print", I, "10", "Print training progress every this many steps.")
          .range(1, kInf).bind(STRATA_BIND(steps_per_print)));
  add(Key("wall_clock_breakdown", B, "false", "Report the time of forward, backward, optimizer and transfers per step.")
          .bind(STRATA_BIND(wall_clock_breakdown)));
  add(Key("prescale_gradients", B, "false", "Divide gradients by the world size before (instead of after) reduction.")
          .bind(STRATA_BIND(prescale_gradients)));
  add(Key("gradient_predivide_factor", N, "1.0", "Divide gradients by this factor before reduction, the rest after.")
          .above(0).bind(STRATA_BIND(gradient_predivide_factor)));
  add(Key("zero_allow_untested_optimizer", B, "false", "DeepSpeed: allow a client optimizer with ZeRO. Accepted for compatibility.")
          .bind(STRATA_BIND(zero_allow_untested_optimizer)));
  add(Key("zero_force_ds_cpu_optimizer", B, "true", "DeepSpeed: require its CPU Adam with optimizer offload. Strata always uses its own CPU kernels.")
          .bind(STRATA_BIND(zero_force_ds_cpu_optimizer)));
  add(Key("communication_data_type", E, "null", "Element type of gradient reduction; unset: the training dtype.")
          .one_of("fp32|fp16|bf16").flag(kKeyNullable).note("training dtype").bind(STRATA_BIND(communication_data_type)));
  add(Key("memory_breakdown", B, "false", "Print memory use per tier after each step.").bind(STRATA_BIND(memory_breakdown)));
  add(Key("dump_state", B, "false", "Print the resolved engine state at start-up.").bind(STRATA_BIND(dump_state)));

  // --- zero_optimization -------------------------------------------------------
  add(section("zero_optimization", "ZeRO: what is sharded across data-parallel ranks, and what is offloaded."));
  add(Key("zero_optimization.stage", I, "0",
          "0: plain data parallel; 1: shard optimizer state; 2: + gradients; 3: + parameters.")
          .range(0, 3).bind(STRATA_BIND(zero_optimization.stage)));
  add(Key("zero_optimization.contiguous_gradients", B, "true", "Copy gradients into one contiguous buffer as they are produced.")
          .bind(STRATA_BIND(zero_optimization.contiguous_gradients)));
  add(Key("zero_optimization.reduce_scatter", B, "true",
          "DeepSpeed: false reduces gradients with all-reduce instead of reduce-scatter. Strata always "
          "reduce-scatters (each piece summed in rank order, which keeps the losses identical at every stage): "
          "false has no effect (a warning).")
          .bind(STRATA_BIND(zero_optimization.reduce_scatter)));
  add(Key("zero_optimization.reduce_bucket_size", I, "500000000",
          "Elements of gradients waiting for their reduction (gradient bucket). Never below one layer: 0 (in DeepSpeed, "
          "each gradient reduced on its own) reduces each layer's gradients on their own.")
          .range(0, kInf).flag(kKeyAuto).bind(STRATA_BIND(zero_optimization.reduce_bucket_size)));
  add(Key("zero_optimization.allgather_partitions", B, "true", "All-gather updated parameters per partition (stages 1-2).")
          .bind(STRATA_BIND(zero_optimization.allgather_partitions)));
  add(Key("zero_optimization.allgather_bucket_size", I, "500000000",
          "DeepSpeed: elements all-gathered at once. No effect in Strata (a warning when set): each sub-group is "
          "all-gathered as one collective, so sub_group_size sets how much one all-gather moves.")
          .range(0, kInf).bind(STRATA_BIND(zero_optimization.allgather_bucket_size)));
  add(Key("zero_optimization.overlap_comm", B, "null", "Overlap gradient reduction with backward (uses two reduce buckets).")
          .flag(kKeyNullable).note("true at stage 3, false below").bind(STRATA_BIND(zero_optimization.overlap_comm)));
  add(Key("zero_optimization.round_robin_gradients", B, "false",
          "DeepSpeed: spread gradient copies across ranks round robin (stages 1-2). Strata copies each layer's "
          "gradients to the host as its reduction finishes: true has no effect (a warning).")
          .bind(STRATA_BIND(zero_optimization.round_robin_gradients)));
  add(Key("zero_optimization.sub_group_size", I, "1000000000",
          "Elements per optimizer sub-group: the tile the CPU optimizer steps and NVMe swaps at once.")
          .range(1, kInf).bind(STRATA_BIND(zero_optimization.sub_group_size)));
  add(Key("zero_optimization.load_from_fp32_weights", B, "true", "Restore fp32 master weights from the checkpoint (not from 16-bit weights).")
          .bind(STRATA_BIND(zero_optimization.load_from_fp32_weights)));
  add(Key("zero_optimization.stage3_prefetch_bucket_size", I, "50000000", "Stage 3: parameter elements fetched ahead of use.")
          .range(0, kInf).alias("prefetch_bucket_size").flag(kKeyAuto)
          .bind(STRATA_BIND(zero_optimization.stage3_prefetch_bucket_size)));
  add(Key("zero_optimization.stage3_param_persistence_threshold", I, "100000",
          "Stage 3: parameters with fewer elements stay whole on every rank (never partitioned).")
          .range(0, kInf).alias("param_persistence_threshold").flag(kKeyAuto)
          .bind(STRATA_BIND(zero_optimization.stage3_param_persistence_threshold)));
  add(Key("zero_optimization.stage3_model_persistence_threshold", I, "9223372036854775807",
          "DeepSpeed, stage 3: total elements of persistent (unpartitioned) parameters allowed. No effect in "
          "Strata (a warning when set): a layer is persistent when it has fewer elements than "
          "stage3_param_persistence_threshold, with no cap on the total.")
          .range(0, kInf).alias("model_persistence_threshold").note("unlimited")
          .bind(STRATA_BIND(zero_optimization.stage3_model_persistence_threshold)));
  add(Key("zero_optimization.stage3_max_live_parameters", I, "1000000000",
          "Stage 3: most gathered parameter elements resident on the GPU at once.")
          .range(0, kInf).alias("max_live_parameters").bind(STRATA_BIND(zero_optimization.stage3_max_live_parameters)));
  add(Key("zero_optimization.stage3_max_reuse_distance", I, "1000000000",
          "Stage 3: keep a gathered parameter if it is used again within this many elements.")
          .range(0, kInf).alias("max_reuse_distance").bind(STRATA_BIND(zero_optimization.stage3_max_reuse_distance)));
  add(Key("zero_optimization.stage3_gather_16bit_weights_on_model_save", B, "false",
          "Stage 3: gather full 16-bit weights when saving the model.")
          .alias("gather_16bit_weights_on_model_save,~stage3_gather_fp16_weights_on_model_save")
          .bind(STRATA_BIND(zero_optimization.stage3_gather_16bit_weights_on_model_save)));
  add(Key("zero_optimization.ignore_unused_parameters", B, "true", "Stage 2-3: tolerate parameters that get no gradient.")
          .bind(STRATA_BIND(zero_optimization.ignore_unused_parameters)));
  add(Key("zero_optimization.use_multi_rank_bucket_allreduce", B, "true", "Combine buckets of several ranks into one all-reduce.")
          .bind(STRATA_BIND(zero_optimization.use_multi_rank_bucket_allreduce)));
  add(Key("zero_optimization.zero_hpz_partition_size", I, "1", "ZeRO++ hierarchical partition size (not implemented by Strata: 1 only acts).")
          .range(1, kInf).bind(STRATA_BIND(zero_optimization.zero_hpz_partition_size)));
  add(Key("zero_optimization.zero_quantized_weights", B, "false", "ZeRO++ quantized weights (not implemented by Strata).")
          .bind(STRATA_BIND(zero_optimization.zero_quantized_weights)));
  add(Key("zero_optimization.zero_quantized_gradients", B, "false", "ZeRO++ quantized gradients (not implemented by Strata).")
          .bind(STRATA_BIND(zero_optimization.zero_quantized_gradients)));
  add(Key("zero_optimization.memory_efficient_linear", B, "true", "Stage 3: linear layers that do not keep gathered weights for backward.")
          .bind(STRATA_BIND(zero_optimization.memory_efficient_linear)));
  add(Key("zero_optimization.elastic_checkpoint", B, "false", "Allow loading a checkpoint saved with another world size.")
          .bind(STRATA_BIND(zero_optimization.elastic_checkpoint)));
  add(Key("zero_optimization.cpu_offload", B, "false", "Deprecated: write offload_optimizer: {\"device\": \"cpu\"}.")
          .flag(kKeyDeprecated)
          .bind([](Config& c, const json& v) {
                  if (v.get<bool>()) c.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
                },
                nullptr));
  add(Key("zero_optimization.cpu_offload_param", B, "false", "Deprecated: write offload_param: {\"device\": \"cpu\"}.")
          .flag(kKeyDeprecated)
          .bind([](Config& c, const json& v) {
                  if (v.get<bool>()) c.zero_optimization.offload_param.device = OffloadDevice::kCpu;
                },
                nullptr));
  add(Key("zero_optimization.cpu_offload_use_pin_memory", B, "false",
          "Deprecated: write pin_memory inside offload_optimizer / offload_param.")
          .flag(kKeyDeprecated)
          .bind([](Config& c, const json& v) {
                  c.zero_optimization.offload_optimizer.pin_memory = v.get<bool>();
                  c.zero_optimization.offload_param.pin_memory = v.get<bool>();
                },
                nullptr));

  add(section("zero_optimization.offload_optimizer",
              "Where the optimizer state (fp32 master, m, v) and fp32 gradients live; the optimizer then runs on the CPU. Stages 1-3."));
  add(Key("zero_optimization.offload_optimizer.device", E, "\"none\"", "none: GPU; cpu: pinned host memory; nvme: files under nvme_path.")
          .one_of("none|cpu|nvme").bind(STRATA_BIND(zero_optimization.offload_optimizer.device)));
  add(Key("zero_optimization.offload_optimizer.nvme_path", S, "null", "Directory on a local NVMe file system (device nvme).")
          .flag(kKeyNullable).bind(STRATA_BIND(zero_optimization.offload_optimizer.nvme_path)));
  add(Key("zero_optimization.offload_optimizer.pin_memory", B, "true", "Use page-locked host memory (faster transfers).")
          .bind(STRATA_BIND(zero_optimization.offload_optimizer.pin_memory)));
  add(Key("zero_optimization.offload_optimizer.buffer_count", I, "4", "Swap buffers, each one sub-group of optimizer state (device nvme).")
          .range(1, 1024).bind(STRATA_BIND(zero_optimization.offload_optimizer.buffer_count)));
  add(Key("zero_optimization.offload_optimizer.fast_init", B, "false", "Initialize the NVMe optimizer state without a round trip through the CPU.")
          .bind(STRATA_BIND(zero_optimization.offload_optimizer.fast_init)));
  add(Key("zero_optimization.offload_optimizer.pipeline_read", B, "false", "Read the next sub-group while stepping this one (device nvme); with pipeline_write it takes the state's NVMe I/O off the step's path (docs/engine.md, Note [Read-ahead at the step's end]).")
          .bind(STRATA_BIND(zero_optimization.offload_optimizer.pipeline_read)));
  add(Key("zero_optimization.offload_optimizer.pipeline_write", B, "false", "Write the previous sub-group while stepping this one (device nvme); without it each write is waited for, behind the reads ahead.")
          .bind(STRATA_BIND(zero_optimization.offload_optimizer.pipeline_write)));
  add(Key("zero_optimization.offload_optimizer.ratio", N, "1.0", "Fraction of the optimizer state offloaded; below 1 only at stage 3.")
          .range(0, 1).bind(STRATA_BIND(zero_optimization.offload_optimizer.ratio)));

  add(section("zero_optimization.offload_param", "Where the 16-bit parameter shards live between uses. Stage 3 only."));
  add(Key("zero_optimization.offload_param.device", E, "\"none\"", "none: GPU; cpu: pinned host memory; nvme: files under nvme_path.")
          .one_of("none|cpu|nvme").bind(STRATA_BIND(zero_optimization.offload_param.device)));
  add(Key("zero_optimization.offload_param.nvme_path", S, "null", "Directory on a local NVMe file system (device nvme).")
          .flag(kKeyNullable).bind(STRATA_BIND(zero_optimization.offload_param.nvme_path)));
  add(Key("zero_optimization.offload_param.pin_memory", B, "true", "Use page-locked host memory (faster transfers).")
          .bind(STRATA_BIND(zero_optimization.offload_param.pin_memory)));
  add(Key("zero_optimization.offload_param.buffer_count", I, "5", "Parameter swap buffers in host memory (device nvme).")
          .range(1, 1024).bind(STRATA_BIND(zero_optimization.offload_param.buffer_count)));
  add(Key("zero_optimization.offload_param.buffer_size", I, "100000000", "Elements per parameter swap buffer (device nvme).")
          .range(1, kInf).bind(STRATA_BIND(zero_optimization.offload_param.buffer_size)));
  add(Key("zero_optimization.offload_param.max_in_cpu", I, "1000000000", "Parameter elements cached in host memory with device nvme.")
          .range(0, kInf).bind(STRATA_BIND(zero_optimization.offload_param.max_in_cpu)));

  // --- aio ----------------------------------------------------------------------
  add(section("aio", "NVMe I/O engine settings (top level, not inside zero_optimization)."));
  add(Key("aio.block_size", I, "1048576", "Bytes per I/O request; a multiple of 4096 (O_DIRECT alignment).")
          .range(4096, 1 << 30).bind(STRATA_BIND(aio.block_size)));
  add(Key("aio.queue_depth", I, "8", "Requests in flight per thread.").range(1, 32768).bind(STRATA_BIND(aio.queue_depth)));
  add(Key("aio.intra_op_parallelism", I, "1", "I/O threads per operation.")
          .range(1, 256).alias("thread_count").bind(STRATA_BIND(aio.intra_op_parallelism)));
  add(Key("aio.single_submit", B, "false", "Submit requests one at a time instead of in batches.").bind(STRATA_BIND(aio.single_submit)));
  add(Key("aio.overlap_events", B, "true", "Submit new requests while earlier ones complete.").bind(STRATA_BIND(aio.overlap_events)));
  add(Key("aio.use_gds", B, "false", "GPUDirect Storage (not implemented by Strata; data goes through pinned host memory).")
          .bind(STRATA_BIND(aio.use_gds)));
  add(Key("aio.engine", E, "\"auto\"", "Strata extension: I/O engine; auto picks io_uring, then libaio, then psync, and reports why.")
          .one_of("auto|io_uring|libaio|psync").bind(STRATA_BIND(aio.engine)));

  // --- precision ----------------------------------------------------------------
  add(section("fp16", "fp16 mixed precision with loss scaling."));
  add(Key("fp16.enabled", B, "false", "Train with fp16 parameters and gradients, fp32 master weights.")
          .flag(kKeyAuto).bind(STRATA_BIND(fp16.enabled)));
  add(Key("fp16.auto_cast", B, "false", "Cast module inputs to fp16.").bind(STRATA_BIND(fp16.auto_cast)));
  add(Key("fp16.loss_scale", N, "0", "Static loss scale; 0 selects dynamic loss scaling.").range(0, kInf).bind(STRATA_BIND(fp16.loss_scale)));
  add(Key("fp16.initial_scale_power", I, "16", "Dynamic loss scaling starts at 2^this.").range(0, 64).bind(STRATA_BIND(fp16.initial_scale_power)));
  add(Key("fp16.loss_scale_window", I, "1000", "Overflow-free steps before the loss scale grows.")
          .range(1, kInf).bind(STRATA_BIND(fp16.loss_scale_window)));
  add(Key("fp16.hysteresis", I, "2", "Overflows tolerated before the loss scale shrinks.").range(1, kInf).bind(STRATA_BIND(fp16.hysteresis)));
  add(Key("fp16.consecutive_hysteresis", B, "false", "Refill hysteresis after each overflow-free step.")
          .bind(STRATA_BIND(fp16.consecutive_hysteresis)));
  add(Key("fp16.min_loss_scale", N, "1", "Smallest dynamic loss scale.").above(0).bind(STRATA_BIND(fp16.min_loss_scale)));
  add(Key("fp16.fp16_master_weights_and_grads", B, "false", "Keep master weights and gradients in fp16 (not recommended).")
          .bind(STRATA_BIND(fp16.fp16_master_weights_and_grads)));
  add(section("bf16", "bf16 mixed precision (legacy name: bfloat16).").alias("~bfloat16"));
  add(Key("bf16.enabled", B, "false", "Train with bf16 parameters and gradients, fp32 master weights.")
          .flag(kKeyAuto).bind(STRATA_BIND(bf16.enabled)));
  add(Key("bf16.immediate_grad_update", B, "false", "Apply gradients to the fp32 accumulation buffer as soon as they are produced.")
          .bind(STRATA_BIND(bf16.immediate_grad_update)));
  add(section("data_types", "Element types of training buffers."));
  add(Key("data_types.grad_accum_dtype", E, "null", "Gradient accumulation dtype; fp32 keeps 4-byte gradients on the GPU.")
          .one_of("fp32|fp16|bf16").flag(kKeyNullable).note("training dtype").bind(STRATA_BIND(data_types.grad_accum_dtype)));

  // --- optimizer ----------------------------------------------------------------
  add(section("optimizer", "The optimizer; Strata runs it on the CPU with offload_optimizer, on the device otherwise."));
  add(Key("optimizer.type", E, "\"Adam\"", "Optimizer (case-insensitive). Adam uses decoupled weight decay unless adam_w_mode is false.")
          .one_of("Adam|AdamW|Adagrad|Lion").flag(kKeyCaseless).bind(STRATA_BIND(optimizer.type)));
  add(section("optimizer.params", "Hyper-parameters of optimizer.type (gradient clipping is the top-level gradient_clipping)."));
  add(Key("optimizer.params.lr", N, "0.001", "Learning rate.").range(0, kInf).flag(kKeyAuto).bind(STRATA_BIND(optimizer.lr)));
  add(Key("optimizer.params.betas", P2, "[0.9, 0.999]", "Decay rates of the first and second moments.")
          .range(0, 1).flag(kKeyAuto).only("Adam|AdamW|Lion").bind(STRATA_BIND(optimizer.betas)));
  add(Key("optimizer.params.eps", N, "1e-08", "Added to the denominator for stability.")
          .above(0).flag(kKeyAuto).only("Adam|AdamW|Adagrad").bind(STRATA_BIND(optimizer.eps)));
  add(Key("optimizer.params.weight_decay", N, "0.0", "Weight decay.").range(0, kInf).flag(kKeyAuto).bind(STRATA_BIND(optimizer.weight_decay)));
  add(Key("optimizer.params.adam_w_mode", B, "true", "Decoupled weight decay (AdamW); false: L2 added to the gradient.")
          .only("Adam|AdamW").bind(STRATA_BIND(optimizer.adam_w_mode)));
  add(Key("optimizer.params.bias_correction", B, "true", "Correct the moment estimates for their zero start.")
          .only("Adam|AdamW").bind(STRATA_BIND(optimizer.bias_correction)));
  add(Key("optimizer.params.amsgrad", B, "false", "AMSGrad variant (not implemented: must be false).")
          .only("Adam|AdamW").bind(STRATA_BIND(optimizer.amsgrad)));
  add(Key("optimizer.params.torch_adam", B, "false", "DeepSpeed: use torch's Adam. Accepted; Strata always uses its own kernels.")
          .only("Adam|AdamW").bind(STRATA_BIND(optimizer.torch_adam)));
  add(Key("optimizer.params.initial_accumulator_value", N, "0.0", "Adagrad: starting value of the squared-gradient sum.")
          .range(0, kInf).only("Adagrad").bind(STRATA_BIND(optimizer.initial_accumulator_value)));

  // --- scheduler ----------------------------------------------------------------
  add(section("scheduler", "Learning-rate schedule; absent: constant learning rate."));
  add(Key("scheduler.type", E, "\"none\"", "Schedule.")
          .one_of("none|WarmupLR|WarmupDecayLR|WarmupCosineLR|OneCycle|LRRangeTest").bind(STRATA_BIND(scheduler.type)));
  add(section("scheduler.params", "Parameters of scheduler.type; each key belongs to the types listed."));
  add(Key("scheduler.params.warmup_min_lr", N, "0", "Learning rate at the start of warm-up.")
          .range(0, kInf).flag(kKeyAuto).only("WarmupLR|WarmupDecayLR"));
  add(Key("scheduler.params.warmup_max_lr", N, "0.001", "Learning rate at the end of warm-up.")
          .range(0, kInf).flag(kKeyAuto).only("WarmupLR|WarmupDecayLR"));
  add(Key("scheduler.params.warmup_num_steps", I, "1000", "Warm-up steps.")
          .range(0, kInf).flag(kKeyAuto).only("WarmupLR|WarmupDecayLR|WarmupCosineLR"));
  add(Key("scheduler.params.warmup_type", E, "\"log\"", "Warm-up curve.").one_of("log|linear").only("WarmupLR|WarmupDecayLR|WarmupCosineLR"));
  add(Key("scheduler.params.total_num_steps", I, "null", "Steps of the whole run (decay ends here).")
          .range(1, kInf).flag(kKeyAuto | kKeyRequired | kKeyNullable).only("WarmupDecayLR|WarmupCosineLR").note("required"));
  add(Key("scheduler.params.warmup_min_ratio", N, "0.0", "Start of warm-up as a fraction of the optimizer's lr.")
          .range(0, 1).only("WarmupCosineLR"));
  add(Key("scheduler.params.cos_min_ratio", N, "0.0001", "End of the cosine decay as a fraction of the optimizer's lr.")
          .range(0, 1).only("WarmupCosineLR"));
  add(Key("scheduler.params.cycle_min_lr", N, "null", "Lowest learning rate of the cycle.")
          .range(0, kInf).flag(kKeyRequired | kKeyNullable).only("OneCycle").note("required"));
  add(Key("scheduler.params.cycle_max_lr", N, "null", "Highest learning rate of the cycle.")
          .range(0, kInf).flag(kKeyRequired | kKeyNullable).only("OneCycle").note("required"));
  add(Key("scheduler.params.decay_lr_rate", N, "0.0", "Learning-rate decay after the cycle.").range(0, kInf).only("OneCycle"));
  add(Key("scheduler.params.cycle_first_step_size", I, "2000", "Steps of the rising half of the cycle.").range(1, kInf).only("OneCycle"));
  add(Key("scheduler.params.cycle_second_step_size", I, "null", "Steps of the falling half; unset: same as the first.")
          .range(1, kInf).flag(kKeyNullable).only("OneCycle"));
  add(Key("scheduler.params.cycle_first_stair_count", I, "0", "Stairs in the rising half (0: smooth).").range(0, kInf).only("OneCycle"));
  add(Key("scheduler.params.cycle_second_stair_count", I, "null", "Stairs in the falling half.")
          .range(0, kInf).flag(kKeyNullable).only("OneCycle"));
  add(Key("scheduler.params.decay_step_size", I, "0", "Steps between decays after the cycle.").range(0, kInf).only("OneCycle"));
  add(Key("scheduler.params.cycle_momentum", B, "true", "Cycle the momentum inversely to the learning rate.").only("OneCycle"));
  add(Key("scheduler.params.cycle_min_mom", N, "0.8", "Lowest momentum.").range(0, 1).only("OneCycle"));
  add(Key("scheduler.params.cycle_max_mom", N, "0.9", "Highest momentum.").range(0, 1).only("OneCycle"));
  add(Key("scheduler.params.decay_mom_rate", N, "0.0", "Momentum decay after the cycle.").range(0, kInf).only("OneCycle"));
  add(Key("scheduler.params.lr_range_test_min_lr", N, "0.001", "Starting learning rate.").range(0, kInf).only("LRRangeTest"));
  add(Key("scheduler.params.lr_range_test_step_size", I, "2000", "Steps per increase.").range(1, kInf).only("LRRangeTest"));
  add(Key("scheduler.params.lr_range_test_step_rate", N, "1.0", "Increase per step.").range(0, kInf).only("LRRangeTest"));
  add(Key("scheduler.params.lr_range_test_staircase", B, "false", "Increase in stairs rather than continuously.").only("LRRangeTest"));
  add(Key("scheduler.params.last_batch_iteration", I, "-1", "Step to resume the schedule from; -1: start.").range(-1, kInf));

  // --- Strata --------------------------------------------------------------------
  add(section("strata", "Strata extensions."));
  add(Key("strata.device", E, "\"auto\"", "Compute device: auto (cuda when a GPU is present), cpu or cuda.")
          .one_of("auto|cpu|cuda").bind(STRATA_BIND(strata.device)));
  add(Key("strata.device_memory", BY, "0", "Capacity of the cpu device (\"256MiB\"); 0: a quarter of host memory.")
          .bind(STRATA_BIND(strata.device_memory)));
  add(Key("strata.host_memory_budget", BY, "0", "Most host memory for offloaded state and buffers (\"64GB\"); 0: unlimited.")
          .bind(STRATA_BIND(strata.host_memory_budget)));
  add(Key("strata.verify_checksums", B, "true", "Check the checksum of every NVMe extent read back.").bind(STRATA_BIND(strata.verify_checksums)));
  add(Key("strata.optimizer_state_dtype", E, "\"fp32\"",
          "Element type of the Adam moments m and v (master weights stay fp32); int8: block-wise 8-bit codes with one "
          "fp32 scale per 256 elements, for offloaded state (offload_optimizer cpu or nvme) and Adam/AdamW.")
          .one_of("fp32|bf16|int8").bind(STRATA_BIND(strata.optimizer_state_dtype)));
  add(Key("strata.overlap_optimizer", B, "true",
          "Step the CPU optimizer layer by layer while the next forward runs (exact: same losses as false).")
          .bind(STRATA_BIND(strata.overlap_optimizer)));
  add(Key("strata.speculative_optimizer", E, "\"auto\"",
          "Start each layer's CPU optimizer step under the backward, as soon as its reduced gradient is in, and redo "
          "it at the step's end when clipping or an overflow says so (exact: same losses as off). Needs the optimizer "
          "state offloaded (cpu or nvme; with ratio < 1 the host part runs early). auto: on where the model computes "
          "on a GPU (not the cpu device) and the pending state fits strata.host_memory_budget (without one: half the "
          "machine's memory per rank).")
          .one_of("auto|on|off").bind(STRATA_BIND(strata.speculative_optimizer)));
  add(Key("strata.gradient_shards", E, "\"auto\"",
          "Where each layer's reduced gradient shard waits for the optimizer step. pinned: in pinned host memory "
          "(2-4 B per parameter). nvme: each piece is written to NVMe and read back just before its step, through "
          "max(2, buffer_count) pinned slots, so host memory no longer grows with the model; it costs one more "
          "write and read of the gradient per step (exact: same losses as pinned). The folder and buffer_count are "
          "offload_optimizer's when the optimizer state is on NVMe, else offload_param's (stage 3, the state in "
          "host memory, the parameters on NVMe); refused with neither on NVMe or with offload_optimizer.ratio < 1. "
          "auto: nvme where one of those folders exists and the plan with pinned shards does not fit "
          "strata.host_memory_budget, pinned otherwise.")
          .one_of("auto|pinned|nvme").bind(STRATA_BIND(strata.gradient_shards)));
  add(Key("strata.wait_timeout_s", N, "600",
          "Seconds the engine waits for any one thing (an NVMe I/O, a copy, a kernel, a collective, a checkpoint "
          "write) before it stops with an error naming it.")
          .range(0.001, 604800).bind(STRATA_BIND(strata.wait_timeout_s)));

  // --- accepted for compatibility, not acted upon -------------------------------------
  add(section("tensorboard", "DeepSpeed monitor; accepted, Strata does not act on it.").flag(kKeyIgnored));
  add(Key("tensorboard.enabled", B, "false", "Enable.").flag(kKeyIgnored));
  add(Key("tensorboard.output_path", S, "\"\"", "Output directory.").flag(kKeyIgnored));
  add(Key("tensorboard.job_name", S, "\"DeepSpeedJobName\"", "Job name.").flag(kKeyIgnored));
  add(section("csv_monitor", "DeepSpeed monitor; accepted, Strata does not act on it.").flag(kKeyIgnored));
  add(Key("csv_monitor.enabled", B, "false", "Enable.").flag(kKeyIgnored));
  add(Key("csv_monitor.output_path", S, "\"\"", "Output directory.").flag(kKeyIgnored));
  add(Key("csv_monitor.job_name", S, "\"DeepSpeedJobName\"", "Job name.").flag(kKeyIgnored));
  add(section("wandb", "DeepSpeed monitor; accepted, Strata does not act on it.").flag(kKeyIgnored));
  add(Key("wandb.enabled", B, "false", "Enable.").flag(kKeyIgnored));
  add(Key("wandb.group", S, "null", "Group.").flag(kKeyIgnored | kKeyNullable));
  add(Key("wandb.team", S, "null", "Team.").flag(kKeyIgnored | kKeyNullable));
  add(Key("wandb.project", S, "\"deepspeed\"", "Project.").flag(kKeyIgnored));
  add(section("flops_profiler", "DeepSpeed profiler; accepted, Strata does not act on it.").flag(kKeyIgnored));
  add(Key("flops_profiler.enabled", B, "false", "Enable.").flag(kKeyIgnored));
  add(Key("flops_profiler.recompute_fwd_factor", N, "0.0", "Recomputed forward fraction.").range(0, kInf).flag(kKeyIgnored));
  add(Key("flops_profiler.profile_step", I, "1", "Step to profile.").range(0, kInf).flag(kKeyIgnored));
  add(Key("flops_profiler.module_depth", I, "-1", "Depth of modules shown.").range(-1, kInf).flag(kKeyIgnored));
  add(Key("flops_profiler.top_modules", I, "1", "Modules shown.").range(0, kInf).flag(kKeyIgnored));
  add(Key("flops_profiler.detailed", B, "true", "Detailed output.").flag(kKeyIgnored));
  add(Key("flops_profiler.output_file", S, "null", "Output file.").flag(kKeyIgnored | kKeyNullable));
  // Acted on by strata.torch's checkpoint functions (docs/torch.md, "Activation checkpointing"), not by the
  // engine: the values pass through to the resolved config for the front end to read.
  add(section("activation_checkpointing", "DeepSpeed activation checkpointing: strata.torch's checkpoint "
              "(deepspeed.checkpointing) reads it; the strata CLI's model does not checkpoint."));
  add(Key("activation_checkpointing.partition_activations", B, "false", "Shard checkpoints across model-parallel ranks: none in Strata, so no effect.").flag(kKeyIgnored));
  add(Key("activation_checkpointing.contiguous_memory_optimization", B, "false", "Copy checkpoints into one buffer; strata.torch reuses its pinned host buffers instead.").flag(kKeyIgnored));
  add(Key("activation_checkpointing.cpu_checkpointing", B, "false", "Keep checkpointed inputs in pinned host memory, fetched back ahead of their recompute.").flag(kKeyIgnored));
  add(Key("activation_checkpointing.number_checkpoints", I, "null", "Checkpoints per model (for the contiguous buffer).").range(1, kInf).flag(kKeyIgnored | kKeyNullable));
  add(Key("activation_checkpointing.synchronize_checkpoint_boundary", B, "false", "Synchronize the GPU at each checkpoint's start and end (a debugging aid: it stalls the pipeline).").flag(kKeyIgnored));
  add(Key("activation_checkpointing.profile", B, "false", "DeepSpeed's per-checkpoint timers; strata.torch warns that it does not print them.").flag(kKeyIgnored));
  add(Key("sparse_gradients", B, "false", "DeepSpeed: sparse gradients for embeddings; accepted, Strata does not act on it.")
          .flag(kKeyIgnored));
  add(section("amp", "NVIDIA apex AMP; only enabled: false is accepted (use bf16 or fp16).").flag(kKeyIgnored));
  add(Key("amp.enabled", B, "false", "Must stay false: Strata does not use apex.").flag(kKeyIgnored));
  add(Key("amp.opt_level", S, "\"O1\"", "apex optimization level.").flag(kKeyIgnored));
  add(section("checkpoint", "DeepSpeed checkpoint options; accepted, Strata does not act on them.").flag(kKeyIgnored));
  add(Key("checkpoint.tag_validation", E, "\"Warn\"", "Check that ranks save the same tag.")
          .one_of("Ignore|Warn|Fail").flag(kKeyIgnored | kKeyCaseless));
  add(Key("checkpoint.load_universal", B, "false", "Load a universal checkpoint.").flag(kKeyIgnored));
  add(Key("checkpoint.use_node_local_storage", B, "false", "Save to node-local storage.").flag(kKeyIgnored));
  add(section("comms_logger", "DeepSpeed communication logger; accepted, Strata does not act on it.").flag(kKeyIgnored));
  add(Key("comms_logger.enabled", B, "false", "Enable.").flag(kKeyIgnored));
  add(Key("comms_logger.verbose", B, "false", "Log every operation.").flag(kKeyIgnored));
  add(Key("comms_logger.prof_all", B, "true", "Profile every operation.").flag(kKeyIgnored));
  add(Key("comms_logger.debug", B, "false", "Include caller names.").flag(kKeyIgnored));
  add(Key("comms_logger.prof_ops", SL, "[]", "Operations to profile.").flag(kKeyIgnored));
  return t;
}

}  // namespace

std::string_view key_type_name(KeyType type) {
  switch (type) {
    case KeyType::kSection: return "section";
    case KeyType::kBool: return "bool";
    case KeyType::kInteger: return "integer";
    case KeyType::kNumber: return "number";
    case KeyType::kString: return "string";
    case KeyType::kEnum: return "enum";
    case KeyType::kBytes: return "bytes";
    case KeyType::kNumberPair: return "[number, number]";
    case KeyType::kStringList: return "[string, ...]";
  }
  return "?";
}

std::string_view ConfigKey::name() const {
  const size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? path : path.substr(dot + 1);
}

std::string_view ConfigKey::parent() const {
  const size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? std::string_view{} : path.substr(0, dot);
}

nlohmann::json ConfigKey::default_value() const {
  if (type == KeyType::kSection) return json::object();
  return json::parse(default_json);
}

std::span<const ConfigKey> config_keys() {
  static const std::vector<ConfigKey> table = build_table();
  return table;
}

const ConfigKey* find_config_key(std::string_view path) {
  for (const ConfigKey& k : config_keys()) {
    if (k.path == path) return &k;
  }
  return nullptr;
}

}  // namespace strata

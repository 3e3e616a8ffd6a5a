// The DeepSpeed key table (see deepspeed_keys.h).
// Note [DeepSpeed keys]
// Taken by reading DeepSpeed 0.19.6 (commit edaa722...): runtime/config.py and
// runtime/constants.py (the top level), runtime/zero/config.py and
// zero/offload_config.py (pydantic fields and their aliases),
// runtime/precision_config.py, monitor/, comm/, profiling/, autotuning/,
// elasticity/, nebula/, datastates/, compile/, compression/,
// runtime/data_pipeline/, runtime/model_checkpointing/, runtime/pipe/,
// runtime/tensor_parallel/, module_inject/auto_ep_config.py, utils/config.py
// (timers) and zenflow/. Keys in Strata's own table are listed as kStrata so
// that the list is complete; their rules live in config_schema.cpp.
//
// How a key is classified: a key whose feature, when ignored, leaves every
// loss and every update the same (monitors, loggers, timers, profilers,
// autotuner hints, checkpoint-writer and communication knobs of DeepSpeed's
// own implementation) is accepted with a warning. A key whose feature changes
// what is computed (the model, the data, the batch, the numerics, the
// parallel layout of the math) is refused, but only when the feature is on:
// a DeepSpeed config that carries the section switched off still loads.
#include "strata/core/deepspeed_keys.h"

#include <fmt/format.h>

namespace strata {
namespace {

using C = DeepSpeedKeyClass;

constexpr DeepSpeedFeature kFeatures[] = {
    {"strata", C::kStrata, "keys Strata acts on",
     "Read by Strata with DeepSpeed's meaning, or accepted by Strata's own key table with the rule documented there.",
     "docs/config.md"},
    // --- accepted with a warning: no effect on what training computes -------------------------
    {"comet", C::kNoEffect, "Comet monitor", "A logger of training metrics; Strata prints its own per-step report.",
     "deepspeed/monitor/config.py"},
    {"timers", C::kNoEffect, "throughput timers", "Timing and logging only; Strata reports time per phase itself.",
     "deepspeed/utils/config.py"},
    {"autotuning", C::kNoEffect, "autotuner",
     "Read by DeepSpeed's autotuning launcher, not by training; the config it writes is what trains.",
     "deepspeed/autotuning/config.py, deepspeed/autotuning/constants.py"},
    {"nebula", C::kNoEffect, "Nebula checkpoint service",
     "Where and how often checkpoints are persisted by Azure's Nebula service; Strata writes its own checkpoints.",
     "deepspeed/nebula/config.py, deepspeed/nebula/constants.py"},
    {"datastates", C::kNoEffect, "DataStates checkpoint engine",
     "An asynchronous checkpoint writer; Strata writes its own checkpoints.", "deepspeed/datastates/config.py"},
    {"checkpoint_io", C::kNoEffect, "checkpoint writer options",
     "How DeepSpeed serializes and writes checkpoint files; Strata has its own checkpoint format and writer.",
     "deepspeed/runtime/model_checkpointing/constants.py, deepspeed/runtime/config.py"},
    {"graph_harvesting", C::kNoEffect, "graph harvesting",
     "Captures and replays GPU graphs of DeepSpeed's kernels: same results, Strata has no such capture.",
     "deepspeed/runtime/constants.py"},
    {"dataloader", C::kNoEffect, "DeepSpeed's data loader options",
     "Options of the loader deepspeed_io() builds; Strata's trainer reads its data itself.",
     "deepspeed/runtime/constants.py"},
    {"logging", C::kNoEffect, "log level", "Verbosity of DeepSpeed's logger.", "deepspeed/runtime/constants.py"},
    {"vocabulary_size", C::kNoEffect, "vocabulary size hint",
     "Only used by DeepSpeed to warn when the vocabulary is not a multiple of 8.", "deepspeed/runtime/config.py"},
    {"disable_allgather", C::kNoEffect, "disable_allgather",
     "Parsed by DeepSpeed but read by none of its optimizers in this release.", "deepspeed/runtime/config.py"},
    {"managed_gradient_accumulation", C::kNoEffect, "managed gradient accumulation",
     "Whether DeepSpeed's engine or the caller marks accumulation boundaries; Strata's trainer steps every "
     "gradient_accumulation_steps micro batches.",
     "deepspeed/runtime/constants.py"},
    {"legacy_fusion", C::kNoEffect, "legacy optimizer fusion", "Selects an old fused fp16 optimizer wrapper of DeepSpeed.",
     "deepspeed/runtime/constants.py"},
    {"sequence_parallel_comm", C::kNoEffect, "sequence-parallel communication dtype",
     "Element type of sequence-parallel collectives; Strata has no sequence parallelism, so there are none.",
     "deepspeed/runtime/constants.py"},
    {"expert_data_topology", C::kNoEffect, "expert/data group order",
     "Order of expert- and data-parallel process groups; Strata has no expert parallelism, so there are no expert "
     "groups to order.",
     "deepspeed/runtime/constants.py"},
    {"zero_runtime_knobs", C::kNoEffect, "ZeRO implementation knobs",
     "How DeepSpeed's ZeRO-3 fetches, traces, hooks and checks modules; Strata's engine gathers layer by layer "
     "from the recorded order and has none of these mechanisms. The math is the same.",
     "deepspeed/runtime/zero/config.py, deepspeed/runtime/zero/leaf_module_config.py"},
    {"zeropp_extra", C::kNoEffect, "ZeRO++ quantization extras",
     "Like zero_quantized_weights (see docs/config.md): quantized communication is not implemented by Strata, "
     "which communicates at full precision.",
     "deepspeed/runtime/zero/config.py"},
    {"mics", C::kNoEffect, "MiCS", "Shards within sub-groups of ranks instead of across all; Strata shards across "
     "every rank, with the same losses.", "deepspeed/runtime/zero/config.py"},
    {"superoffload", C::kNoEffect, "SuperOffload and CPU Adam core share",
     "Scheduling of DeepSpeed's CPU optimizer; Strata steps the CPU optimizer overlapped with compute "
     "(strata.overlap_optimizer) with the same results.",
     "deepspeed/runtime/zero/offload_config.py"},
    {"bf16_overflow_check", C::kNoEffect, "bf16 overflow check switch",
     "Whether DeepSpeed's bf16 optimizer checks gradients for inf/NaN; Strata has no such switch.",
     "deepspeed/runtime/precision_config.py"},
    // --- refused when on: changes what training computes ---------------------------------------------
    {"pipeline", C::kUnsupported, "pipeline parallelism",
     "Splits the model into stages that run on different ranks; Strata trains the whole model on every rank "
     "(data parallel). Refused when stages is a number above 1; the other keys alone configure a pipeline "
     "model, which Strata does not have.",
     "deepspeed/runtime/config.py (get_pipeline_config), deepspeed/runtime/pipe/engine.py"},
    {"sparse_attention", C::kUnsupported, "sparse attention",
     "Replaces dense attention by block-sparse attention: a different model. DeepSpeed turns it on by the "
     "section's presence.",
     "deepspeed/runtime/config.py, deepspeed/ops/sparse_attention/"},
    {"progressive_layer_drop", C::kUnsupported, "progressive layer drop",
     "Skips transformer layers with a scheduled probability: a different computation.", "deepspeed/runtime/constants.py"},
    {"curriculum_learning", C::kUnsupported, "curriculum learning (legacy)",
     "Changes the sequence length or data of each step by schedule.", "deepspeed/runtime/data_pipeline/config.py"},
    {"data_efficiency", C::kUnsupported, "data efficiency (curriculum sampling, random-LTD)",
     "Changes which samples and tokens each step sees.", "deepspeed/runtime/data_pipeline/constants.py"},
    {"compression_training", C::kUnsupported, "compression training",
     "Quantizes weights and activations and prunes weights, heads, rows, channels or layers while training.",
     "deepspeed/compression/constants.py, deepspeed/compression/config.py"},
    {"eigenvalue", C::kUnsupported, "eigenvalue computation (MoQ)",
     "Hessian eigenvalues that drive the quantization schedule of MoQ; in 0.19.6 DeepSpeed reads it inside "
     "quantize_training under compression_training, older releases read it at the top level.",
     "deepspeed/runtime/config.py (get_eigenvalue_config), deepspeed/runtime/constants.py"},
    {"quantize_training", C::kUnsupported, "quantization-aware training (MoQ)",
     "Trains with progressively quantized weights; 0.19.6 reads it only together with compression_training's "
     "weight quantization, older releases under its own enabled switch.",
     "deepspeed/runtime/config.py (get_eigenvalue_config)"},
    {"hybrid_engine", C::kUnsupported, "hybrid engine (RLHF)",
     "Switches the model between training and DeepSpeed's inference kernels for generation.",
     "deepspeed/runtime/config.py (HybridEngineConfig)"},
    {"torch_autocast", C::kUnsupported, "torch autocast",
     "Runs chosen modules in a lower precision under torch.autocast; Strata's precision is fp16, bf16 or fp32 for "
     "the whole model.",
     "deepspeed/runtime/config.py, deepspeed/runtime/constants.py"},
    {"compile", C::kUnsupported, "DeepCompile",
     "Compiles the model with DeepSpeed's own passes, which also decide what is offloaded and freed; refused when "
     "deepcompile is true, the other keys only act with it.",
     "deepspeed/compile/config.py"},
    {"elasticity", C::kUnsupported, "elastic training",
     "Chooses the batch size and micro batch from the elasticity section, overriding the batch keys.",
     "deepspeed/elasticity/config.py, deepspeed/elasticity/constants.py"},
    {"weight_quantization", C::kUnsupported, "weight quantization",
     "Quantizes the model's weights at initialization or after loading; on unless enabled is false.",
     "deepspeed/inference/config.py (WeightQuantConfig), deepspeed/runtime/config.py"},
    {"tensor_parallel", C::kUnsupported, "tensor parallelism (AutoTP)",
     "Shards the model's matrices across ranks; refused when autotp_size is above 0 or tp.tp_size above 1.",
     "deepspeed/runtime/tensor_parallel/config.py"},
    {"expert_parallel", C::kUnsupported, "expert parallelism (AutoEP, MoE)",
     "Shards mixture-of-experts layers across ranks.", "deepspeed/module_inject/auto_ep_config.py"},
    {"sequence_parallel", C::kUnsupported, "sequence parallelism (Ulysses)",
     "Splits each sequence across ranks and divides the data-parallel world size by sequence_parallel_size.",
     "deepspeed/runtime/config.py"},
    {"gradient_allreduce_op", C::kUnsupported, "gradient sum instead of mean",
     "\"sum\" adds gradients over ranks instead of averaging them: different updates. Strata averages (\"mean\").",
     "deepspeed/runtime/config.py, deepspeed/runtime/constants.py"},
    {"zenflow", C::kUnsupported, "ZenFlow",
     "Applies part of the gradients late (top-k now, the rest stale): different updates. Strata's CPU step is "
     "exact. DeepSpeed turns it on by the section's presence.",
     "deepspeed/runtime/zenflow/zenflow_config.py, deepspeed/runtime/zero/config.py"},
    {"bf16_master", C::kUnsupported, "bf16 master weights and gradients",
     "Keeps master weights and gradients in bf16; Strata keeps fp32 master weights.", "deepspeed/runtime/precision_config.py"},
    {"bf16_optimizer_states", C::kUnsupported, "bf16 optimizer states",
     "Keeps Adam's moments in bf16; in Strata write strata.optimizer_state_dtype: \"bf16\" instead.",
     "deepspeed/runtime/precision_config.py"},
    {"param_buffer_dtype", C::kUnsupported, "parameter / buffer dtype override",
     "Casts parameters or buffers to another dtype than the training precision.", "deepspeed/runtime/constants.py"},
};

// Every key of DeepSpeed 0.19.6's training config. Sections come before
// their keys; a key's feature decides its class.
constexpr DeepSpeedKey kKeys[] = {
    // --- top level, read by Strata (config_schema.cpp) ---
    {"train_batch_size", "strata"},
    {"train_micro_batch_size_per_gpu", "strata"},
    {"gradient_accumulation_steps", "strata"},
    {"gradient_clipping", "strata"},
    {"steps_per_print", "strata"},
    {"wall_clock_breakdown", "strata"},
    {"memory_breakdown", "strata"},
    {"dump_state", "strata"},
    {"prescale_gradients", "strata"},
    {"gradient_predivide_factor", "strata"},
    {"communication_data_type", "strata"},
    {"zero_allow_untested_optimizer", "strata"},
    {"zero_force_ds_cpu_optimizer", "strata"},
    {"sparse_gradients", "strata"},
    {"optimizer", "strata"},
    {"optimizer.type", "strata"},
    {"optimizer.params", "strata"},
    {"optimizer.legacy_fusion", "legacy_fusion"},
    {"scheduler", "strata"},
    {"scheduler.type", "strata"},
    {"scheduler.params", "strata"},
    // --- zero_optimization ---
    {"zero_optimization", "strata"},
    {"zero_optimization.stage", "strata"},
    {"zero_optimization.contiguous_gradients", "strata"},
    {"zero_optimization.reduce_scatter", "strata"},
    {"zero_optimization.reduce_bucket_size", "strata"},
    {"zero_optimization.use_multi_rank_bucket_allreduce", "strata"},
    {"zero_optimization.allgather_partitions", "strata"},
    {"zero_optimization.allgather_bucket_size", "strata"},
    {"zero_optimization.overlap_comm", "strata"},
    {"zero_optimization.load_from_fp32_weights", "strata"},
    {"zero_optimization.elastic_checkpoint", "strata"},
    {"zero_optimization.sub_group_size", "strata"},
    {"zero_optimization.cpu_offload", "strata"},
    {"zero_optimization.cpu_offload_param", "strata"},
    {"zero_optimization.cpu_offload_use_pin_memory", "strata"},
    {"zero_optimization.stage3_prefetch_bucket_size", "strata"},
    {"zero_optimization.stage3_param_persistence_threshold", "strata"},
    {"zero_optimization.stage3_model_persistence_threshold", "strata"},
    {"zero_optimization.stage3_max_live_parameters", "strata"},
    {"zero_optimization.stage3_max_reuse_distance", "strata"},
    {"zero_optimization.stage3_gather_16bit_weights_on_model_save", "strata"},
    {"zero_optimization.ignore_unused_parameters", "strata"},
    {"zero_optimization.round_robin_gradients", "strata"},
    {"zero_optimization.zero_hpz_partition_size", "strata"},
    {"zero_optimization.zero_quantized_weights", "strata"},
    {"zero_optimization.zero_quantized_gradients", "strata"},
    {"zero_optimization.memory_efficient_linear", "strata"},
    {"zero_optimization.stage3_module_granularity_threshold", "zero_runtime_knobs"},
    {"zero_optimization.module_granularity_threshold", "zero_runtime_knobs"},
    {"zero_optimization.stage3_use_all_reduce_for_fetch_params", "zero_runtime_knobs"},
    {"zero_optimization.use_all_reduce_for_fetch_params", "zero_runtime_knobs"},
    {"zero_optimization.stage3_allgather_sequential", "zero_runtime_knobs"},
    {"zero_optimization.allgather_sequential", "zero_runtime_knobs"},
    {"zero_optimization.legacy_stage1", "zero_runtime_knobs"},
    {"zero_optimization.pipeline_loading_checkpoint", "zero_runtime_knobs"},
    {"zero_optimization.override_module_apply", "zero_runtime_knobs"},
    {"zero_optimization.log_trace_cache_warnings", "zero_runtime_knobs"},
    {"zero_optimization.enable_sanity_checks", "zero_runtime_knobs"},
    {"zero_optimization.save_muon_momentum_buffer_in_memory", "zero_runtime_knobs"},
    {"zero_optimization.leaf_module", "zero_runtime_knobs"},
    {"zero_optimization.leaf_module.classes", "zero_runtime_knobs"},
    {"zero_optimization.leaf_module.names", "zero_runtime_knobs"},
    {"zero_optimization.leaf_module.name_suffixes", "zero_runtime_knobs"},
    {"zero_optimization.zero_quantized_nontrainable_weights", "zeropp_extra"},
    {"zero_optimization.zeropp_loco_param", "zeropp_extra", "", true},
    {"zero_optimization.mics_shard_size", "mics"},
    {"zero_optimization.mics_hierarchical_params_gather", "mics"},
    {"zero_optimization.zenflow", "zenflow", "*"},
    {"zero_optimization.zenflow.topk_ratio", "zenflow"},
    {"zero_optimization.zenflow.select_strategy", "zenflow"},
    {"zero_optimization.zenflow.select_interval", "zenflow"},
    {"zero_optimization.zenflow.update_interval", "zenflow"},
    {"zero_optimization.zenflow.overlap_step", "zenflow"},
    {"zero_optimization.zenflow.offload", "zenflow"},
    {"zero_optimization.zenflow.auto_ratio", "zenflow"},
    {"zero_optimization.zenflow.full_warm_up_rounds", "zenflow"},
    {"zero_optimization.zenflow.pt_reserved_cores_perc", "zenflow"},
    {"zero_optimization.zenflow.steps_per_epoch", "zenflow"},
    {"zero_optimization.offload_optimizer", "strata"},
    {"zero_optimization.offload_optimizer.device", "strata"},
    {"zero_optimization.offload_optimizer.nvme_path", "strata"},
    {"zero_optimization.offload_optimizer.buffer_count", "strata"},
    {"zero_optimization.offload_optimizer.pin_memory", "strata"},
    {"zero_optimization.offload_optimizer.pipeline_read", "strata"},
    {"zero_optimization.offload_optimizer.pipeline_write", "strata"},
    {"zero_optimization.offload_optimizer.fast_init", "strata"},
    {"zero_optimization.offload_optimizer.ratio", "strata"},
    {"zero_optimization.offload_optimizer.super_offload", "superoffload"},
    {"zero_optimization.offload_optimizer.cpuadam_cores_perc", "superoffload"},
    {"zero_optimization.offload_param", "strata"},
    {"zero_optimization.offload_param.device", "strata"},
    {"zero_optimization.offload_param.nvme_path", "strata"},
    {"zero_optimization.offload_param.buffer_count", "strata"},
    {"zero_optimization.offload_param.buffer_size", "strata"},
    {"zero_optimization.offload_param.max_in_cpu", "strata"},
    {"zero_optimization.offload_param.pin_memory", "strata"},
    // --- aio, precision ---
    {"aio", "strata"},
    {"aio.block_size", "strata"},
    {"aio.queue_depth", "strata"},
    {"aio.intra_op_parallelism", "strata"},
    {"aio.single_submit", "strata"},
    {"aio.overlap_events", "strata"},
    {"aio.use_gds", "strata"},
    {"fp16", "strata"},
    {"fp16.enabled", "strata"},
    {"fp16.auto_cast", "strata"},
    {"fp16.loss_scale", "strata"},
    {"fp16.initial_scale_power", "strata"},
    {"fp16.loss_scale_window", "strata"},
    {"fp16.hysteresis", "strata"},
    {"fp16.consecutive_hysteresis", "strata"},
    {"fp16.min_loss_scale", "strata"},
    {"fp16.fp16_master_weights_and_grads", "strata"},
    {"bf16", "strata"},
    {"bf16.enabled", "strata"},
    {"bf16.immediate_grad_update", "strata"},
    {"bf16.check_grad_overflow", "bf16_overflow_check"},
    {"bf16.bf16_master_weights_and_grads", "bf16_master", "false"},
    {"bf16.bf16_optimizer_states", "bf16_optimizer_states", "false"},
    {"data_types", "strata"},
    {"data_types.grad_accum_dtype", "strata"},
    {"data_types.param_dtype", "param_buffer_dtype", "null"},
    {"data_types.buffer_dtype", "param_buffer_dtype", "null"},
    {"amp", "strata"},
    {"amp.enabled", "strata"},
    {"torch_autocast", "torch_autocast"},
    {"torch_autocast.enabled", "torch_autocast", "false"},
    {"torch_autocast.dtype", "torch_autocast"},
    {"torch_autocast.lower_precision_safe_modules", "torch_autocast"},
    // --- monitors, profilers, loggers (Strata's table accepts the ones it lists) ---
    {"tensorboard", "strata"},
    {"tensorboard.enabled", "strata"},
    {"tensorboard.output_path", "strata"},
    {"tensorboard.job_name", "strata"},
    {"wandb", "strata"},
    {"wandb.enabled", "strata"},
    {"wandb.group", "strata"},
    {"wandb.team", "strata"},
    {"wandb.project", "strata"},
    {"csv_monitor", "strata"},
    {"csv_monitor.enabled", "strata"},
    {"csv_monitor.output_path", "strata"},
    {"csv_monitor.job_name", "strata"},
    {"comet", "comet"},
    {"comet.enabled", "comet"},
    {"comet.samples_log_interval", "comet"},
    {"comet.project", "comet"},
    {"comet.workspace", "comet"},
    {"comet.api_key", "comet"},
    {"comet.experiment_name", "comet"},
    {"comet.experiment_key", "comet"},
    {"comet.online", "comet"},
    {"comet.mode", "comet"},
    {"comms_logger", "strata"},
    {"comms_logger.enabled", "strata"},
    {"comms_logger.verbose", "strata"},
    {"comms_logger.prof_all", "strata"},
    {"comms_logger.debug", "strata"},
    {"comms_logger.prof_ops", "strata"},
    {"flops_profiler", "strata"},
    {"flops_profiler.enabled", "strata"},
    {"flops_profiler.recompute_fwd_factor", "strata"},
    {"flops_profiler.profile_step", "strata"},
    {"flops_profiler.module_depth", "strata"},
    {"flops_profiler.top_modules", "strata"},
    {"flops_profiler.detailed", "strata"},
    {"flops_profiler.output_file", "strata"},
    {"timers", "timers"},
    {"timers.throughput", "timers"},
    {"timers.throughput.enabled", "timers"},
    {"timers.throughput.synchronized", "timers"},
    {"activation_checkpointing", "strata"},
    {"activation_checkpointing.partition_activations", "strata"},
    {"activation_checkpointing.contiguous_memory_optimization", "strata"},
    {"activation_checkpointing.cpu_checkpointing", "strata"},
    {"activation_checkpointing.number_checkpoints", "strata"},
    {"activation_checkpointing.synchronize_checkpoint_boundary", "strata"},
    {"activation_checkpointing.profile", "strata"},
    // --- checkpoints ---
    {"checkpoint", "strata"},
    {"checkpoint.tag_validation", "strata"},
    {"checkpoint.load_universal", "strata"},
    {"checkpoint.use_node_local_storage", "strata"},
    {"checkpoint.checkpoint_serialization", "checkpoint_io"},
    {"checkpoint.parallel_write", "checkpoint_io"},
    {"checkpoint.parallel_write.pipeline_stage", "checkpoint_io"},
    {"checkpoint.writer", "checkpoint_io"},
    {"checkpoint.writer.type", "checkpoint_io"},
    {"checkpoint.writer.io_buffer_size", "checkpoint_io"},
    {"checkpoint.writer.io_buffer_double", "checkpoint_io"},
    {"checkpoint.writer.show_statistics", "checkpoint_io"},
    {"checkpoint.writer.data_parallel", "checkpoint_io"},
    {"checkpoint.writer.decoupled", "checkpoint_io"},
    {"checkpoint.writer.io_multiplier", "checkpoint_io"},
    {"nebula", "nebula"},
    {"nebula.enabled", "nebula"},
    {"nebula.enable_nebula_load", "nebula"},
    {"nebula.nebula_load_path", "nebula"},
    {"nebula.persistent_storage_path", "nebula"},
    {"nebula.persistent_time_interval", "nebula"},
    {"nebula.num_of_version_in_retention", "nebula"},
    {"datastates_ckpt", "datastates", "", true},
    // --- other top-level keys without effect ---
    {"graph_harvesting", "graph_harvesting"},
    {"dataloader_drop_last", "dataloader"},
    {"log_level", "logging"},
    {"vocabulary_size", "vocabulary_size"},
    {"disable_allgather", "disable_allgather"},
    {"managed_gradient_accumulation", "managed_gradient_accumulation"},
    {"seq_parallel_communication_data_type", "sequence_parallel_comm"},
    {"use_data_before_expert_parallelism", "expert_data_topology"},
    // --- autotuning ---
    {"autotuning", "autotuning"},
    {"autotuning.enabled", "autotuning"},
    {"autotuning.fast", "autotuning"},
    {"autotuning.results_dir", "autotuning"},
    {"autotuning.exps_dir", "autotuning"},
    {"autotuning.overwrite", "autotuning"},
    {"autotuning.start_profile_step", "autotuning"},
    {"autotuning.end_profile_step", "autotuning"},
    {"autotuning.metric_path", "autotuning"},
    {"autotuning.metric", "autotuning"},
    {"autotuning.tuner_type", "autotuning"},
    {"autotuning.tuner_early_stopping", "autotuning"},
    {"autotuning.tuner_num_trials", "autotuning"},
    {"autotuning.arg_mappings", "autotuning", "", true},
    {"autotuning.max_train_batch_size", "autotuning"},
    {"autotuning.min_train_batch_size", "autotuning"},
    {"autotuning.max_train_micro_batch_size_per_gpu", "autotuning"},
    {"autotuning.min_train_micro_batch_size_per_gpu", "autotuning"},
    {"autotuning.num_tuning_micro_batch_sizes", "autotuning"},
    {"autotuning.mp_size", "autotuning"},
    {"autotuning.model_info_path", "autotuning"},
    {"autotuning.model_info", "autotuning"},
    {"autotuning.model_info.profile", "autotuning"},
    {"autotuning.model_info.num_params", "autotuning"},
    {"autotuning.model_info.hidden_size", "autotuning"},
    {"autotuning.model_info.num_layers", "autotuning"},
    // --- refused when on ---
    {"pipeline", "pipeline", "", true},
    {"pipeline.stages", "pipeline", "\"auto\"|1"},
    {"pipeline.partition", "pipeline"},
    {"pipeline.seed_layers", "pipeline"},
    {"pipeline.activation_checkpoint_interval", "pipeline"},
    {"pipeline.pipe_partitioned", "pipeline"},
    {"pipeline.grad_partitioned", "pipeline"},
    {"pipeline.use_reentrant", "pipeline"},
    {"sparse_attention", "sparse_attention", "*"},
    {"sparse_attention.mode", "sparse_attention"},
    {"sparse_attention.block", "sparse_attention"},
    {"sparse_attention.different_layout_per_head", "sparse_attention"},
    {"sparse_attention.num_local_blocks", "sparse_attention"},
    {"sparse_attention.num_global_blocks", "sparse_attention"},
    {"sparse_attention.attention", "sparse_attention"},
    {"sparse_attention.horizontal_global_attention", "sparse_attention"},
    {"sparse_attention.num_different_global_patterns", "sparse_attention"},
    {"sparse_attention.num_random_blocks", "sparse_attention"},
    {"sparse_attention.local_window_blocks", "sparse_attention"},
    {"sparse_attention.global_block_indices", "sparse_attention"},
    {"sparse_attention.global_block_end_indices", "sparse_attention"},
    {"sparse_attention.num_sliding_window_blocks", "sparse_attention"},
    {"progressive_layer_drop", "progressive_layer_drop"},
    {"progressive_layer_drop.enabled", "progressive_layer_drop", "false"},
    {"progressive_layer_drop.theta", "progressive_layer_drop"},
    {"progressive_layer_drop.gamma", "progressive_layer_drop"},
    {"curriculum_learning", "curriculum_learning", "", true},
    {"curriculum_learning.enabled", "curriculum_learning", "false"},
    {"curriculum_learning.curriculum_type", "curriculum_learning"},
    {"curriculum_learning.min_difficulty", "curriculum_learning"},
    {"curriculum_learning.max_difficulty", "curriculum_learning"},
    {"curriculum_learning.schedule_type", "curriculum_learning"},
    {"curriculum_learning.schedule_config", "curriculum_learning", "", true},
    {"data_efficiency", "data_efficiency"},
    {"data_efficiency.enabled", "data_efficiency", "false"},
    {"data_efficiency.seed", "data_efficiency"},
    {"data_efficiency.data_sampling", "data_efficiency", "", true},
    {"data_efficiency.data_routing", "data_efficiency", "", true},
    {"compression_training", "compression_training"},
    {"compression_training.weight_quantization", "compression_training"},
    {"compression_training.weight_quantization.shared_parameters", "compression_training", "", true},
    {"compression_training.weight_quantization.shared_parameters.enabled", "compression_training", "false"},
    {"compression_training.weight_quantization.different_groups", "compression_training", "", true},
    {"compression_training.activation_quantization", "compression_training"},
    {"compression_training.activation_quantization.shared_parameters", "compression_training", "", true},
    {"compression_training.activation_quantization.shared_parameters.enabled", "compression_training", "false"},
    {"compression_training.activation_quantization.different_groups", "compression_training", "", true},
    {"compression_training.sparse_pruning", "compression_training"},
    {"compression_training.sparse_pruning.shared_parameters", "compression_training", "", true},
    {"compression_training.sparse_pruning.shared_parameters.enabled", "compression_training", "false"},
    {"compression_training.sparse_pruning.different_groups", "compression_training", "", true},
    {"compression_training.row_pruning", "compression_training"},
    {"compression_training.row_pruning.shared_parameters", "compression_training", "", true},
    {"compression_training.row_pruning.shared_parameters.enabled", "compression_training", "false"},
    {"compression_training.row_pruning.different_groups", "compression_training", "", true},
    {"compression_training.head_pruning", "compression_training"},
    {"compression_training.head_pruning.shared_parameters", "compression_training", "", true},
    {"compression_training.head_pruning.shared_parameters.enabled", "compression_training", "false"},
    {"compression_training.head_pruning.different_groups", "compression_training", "", true},
    {"compression_training.channel_pruning", "compression_training"},
    {"compression_training.channel_pruning.shared_parameters", "compression_training", "", true},
    {"compression_training.channel_pruning.shared_parameters.enabled", "compression_training", "false"},
    {"compression_training.channel_pruning.different_groups", "compression_training", "", true},
    {"compression_training.layer_reduction", "compression_training"},
    {"compression_training.layer_reduction.enabled", "compression_training", "false"},
    {"compression_training.layer_reduction.keep_number_layer", "compression_training"},
    {"compression_training.layer_reduction.module_name_prefix", "compression_training"},
    {"compression_training.layer_reduction.teacher_layer", "compression_training"},
    {"compression_training.layer_reduction.other_module_name", "compression_training"},
    {"eigenvalue", "eigenvalue"},
    {"eigenvalue.enabled", "eigenvalue", "false"},
    {"eigenvalue.verbose", "eigenvalue"},
    {"eigenvalue.max_iter", "eigenvalue"},
    {"eigenvalue.tol", "eigenvalue"},
    {"eigenvalue.stability", "eigenvalue"},
    {"eigenvalue.gas_boundary_resolution", "eigenvalue"},
    {"eigenvalue.layer_name", "eigenvalue"},
    {"eigenvalue.layer_num", "eigenvalue"},
    {"eigenvalue.model_name", "eigenvalue"},
    {"quantize_training", "quantize_training", "", true},
    {"quantize_training.enabled", "quantize_training", "false"},
    {"quantize_training.quantize_bits", "quantize_training", "", true},
    {"quantize_training.quantize_type", "quantize_training"},
    {"quantize_training.quantize_schedule", "quantize_training", "", true},
    {"quantize_training.quantize_groups", "quantize_training"},
    {"quantize_training.fp16_mixed_quantize", "quantize_training", "", true},
    {"quantize_training.quantize_verbose", "quantize_training"},
    {"quantize_training.quantize_eigenvalue", "quantize_training"},
    {"quantize_training.quantize_rounding", "quantize_training"},
    {"quantize_training.eigenvalue", "quantize_training", "", true},
    {"hybrid_engine", "hybrid_engine"},
    {"hybrid_engine.enabled", "hybrid_engine", "false"},
    {"hybrid_engine.max_out_tokens", "hybrid_engine"},
    {"hybrid_engine.inference_tp_size", "hybrid_engine"},
    {"hybrid_engine.release_inference_cache", "hybrid_engine"},
    {"hybrid_engine.pin_parameters", "hybrid_engine"},
    {"hybrid_engine.tp_gather_partition_size", "hybrid_engine"},
    {"hybrid_engine.enable_cuda_graph", "hybrid_engine"},
    {"compile", "compile"},
    {"compile.deepcompile", "compile", "false"},
    {"compile.free_activation", "compile"},
    {"compile.free_activation_threshold", "compile"},
    {"compile.offload_activation", "compile"},
    {"compile.offload_activation_pin_memory", "compile"},
    {"compile.offload_opt_states", "compile"},
    {"compile.double_buffer", "compile"},
    {"compile.symmetric_memory", "compile"},
    {"compile.debug_log", "compile"},
    {"compile.offload_parameters", "compile"},
    {"compile.sync_before_reduce", "compile"},
    {"compile.sync_after_reduce", "compile"},
    {"compile.sync_before_allgather", "compile"},
    {"compile.sync_after_allgather", "compile"},
    {"compile.keep_int_input_tensors", "compile"},
    {"compile.keep_all_input_tensors", "compile"},
    {"compile.passes", "compile"},
    {"elasticity", "elasticity"},
    {"elasticity.enabled", "elasticity", "false"},
    {"elasticity.max_train_batch_size", "elasticity"},
    {"elasticity.micro_batch_sizes", "elasticity"},
    {"elasticity.min_gpus", "elasticity"},
    {"elasticity.max_gpus", "elasticity"},
    {"elasticity.num_gpus_per_node", "elasticity"},
    {"elasticity.model_parallel_size", "elasticity"},
    {"elasticity.min_time", "elasticity"},
    {"elasticity.prefer_larger_batch", "elasticity"},
    {"elasticity.ignore_non_elastic_batch_info", "elasticity"},
    {"elasticity.version", "elasticity"},
    {"weight_quantization", "weight_quantization", "enabled:false", true},
    {"weight_quantization.enabled", "weight_quantization"},
    {"weight_quantization.quantized_initialization", "weight_quantization", "", true},
    {"weight_quantization.post_init_quant", "weight_quantization", "", true},
    {"tensor_parallel", "tensor_parallel"},
    {"tensor_parallel.autotp_size", "tensor_parallel", "0"},
    {"tensor_parallel.dtype", "tensor_parallel"},
    {"tensor_parallel.tp_overlap_comm", "tensor_parallel"},
    {"tensor_parallel.tp", "tensor_parallel"},
    {"tensor_parallel.tp.tp_size", "tensor_parallel", "1"},
    {"tensor_parallel.tp.tp_grain_size", "tensor_parallel"},
    {"tensor_parallel.tp.mpu", "tensor_parallel"},
    {"tensor_parallel.tp.tp_group", "tensor_parallel"},
    {"tensor_parallel.tensor_parallel", "tensor_parallel"},
    {"tensor_parallel.tensor_parallel.tp_size", "tensor_parallel", "1"},
    {"tensor_parallel.tensor_parallel.tp_grain_size", "tensor_parallel"},
    {"tensor_parallel.tensor_parallel.mpu", "tensor_parallel"},
    {"tensor_parallel.tensor_parallel.tp_group", "tensor_parallel"},
    {"tensor_parallel.injection_policy_tuple", "tensor_parallel"},
    {"tensor_parallel.partition_config", "tensor_parallel", "", true},
    {"tensor_parallel.preset_model", "tensor_parallel"},
    {"tensor_parallel.keep_module_on_host", "tensor_parallel"},
    {"tensor_parallel.replace_with_kernel_inject", "tensor_parallel"},
    {"tensor_parallel.kernel_inject", "tensor_parallel"},
    {"expert_parallel", "expert_parallel", "", true},
    {"expert_parallel.enabled", "expert_parallel", "false"},
    {"expert_parallel.autoep_size", "expert_parallel"},
    {"expert_parallel.expert_tensor_parallel_size", "expert_parallel"},
    {"expert_parallel.preset_model", "expert_parallel"},
    {"expert_parallel.top_k", "expert_parallel"},
    {"sequence_parallel_size", "sequence_parallel", "1"},
    {"gradient_allreduce_op", "gradient_allreduce_op", "\"mean\"|\"MEAN\"|\"Mean\""},
};

}  // namespace

std::string_view deepspeed_key_class_name(DeepSpeedKeyClass c) {
  switch (c) {
    case DeepSpeedKeyClass::kStrata: return "read by Strata";
    case DeepSpeedKeyClass::kNoEffect: return "accepted, no effect (warning)";
    case DeepSpeedKeyClass::kUnsupported: return "refused when on (error)";
  }
  return "?";
}

std::span<const DeepSpeedFeature> deepspeed_features() { return kFeatures; }
std::span<const DeepSpeedKey> deepspeed_keys() { return kKeys; }

const DeepSpeedFeature* find_deepspeed_feature(std::string_view id) {
  for (const DeepSpeedFeature& f : kFeatures) {
    if (f.id == id) return &f;
  }
  return nullptr;
}

const DeepSpeedKey* find_deepspeed_key(std::string_view path) {
  for (const DeepSpeedKey& k : kKeys) {
    if (k.path == path) return &k;
  }
  return nullptr;
}

std::string deepspeed_keys_markdown() {
  std::string md;
  md += "# DeepSpeed keys\n\n";
  md += "<!-- Generated from the table in core/src/deepspeed_keys.cpp by `strata config defaults --deepspeed-keys`.\n"
        "     Do not edit by hand: the test DeepSpeedKeys.MarkdownIsUpToDate fails when this file differs. -->\n\n";
  md += fmt::format(
      "Every key of DeepSpeed {}'s training config (commit `{}`),\n"
      "read from its sources, and what Strata does with it. Keys Strata reads are documented in [config.md](config.md). For the others:\n\n"
      "- **accepted, no effect (warning)**: ignoring the feature leaves every loss and update the same\n"
      "  (monitors, loggers, timers, profilers, autotuner hints, checkpoint writers, knobs of DeepSpeed's own\n"
      "  implementation). The config loads; one warning per feature says it has no effect in Strata.\n"
      "- **refused when on (error)**: the feature changes what training computes (the model, the data, the\n"
      "  batch, the numerics, the parallel layout). A config that turns it on is refused, naming the key and\n"
      "  what to remove. Switched off (`\"enabled\": false`, or its off value below), the section loads with a\n"
      "  warning that Strata does not implement it.\n"
      "- A key that no DeepSpeed release has is an error, `unknown key` with a did-you-mean, as before. Inside\n"
      "  the sections below, names are checked against DeepSpeed's names the same way, except under the\n"
      "  sections marked *open* (member names chosen by the user, or passed on by DeepSpeed unread).\n\n",
      kDeepSpeedRelease, kDeepSpeedCommit);
  size_t counts[3] = {0, 0, 0};
  for (const DeepSpeedKey& k : kKeys) {
    const DeepSpeedFeature* f = find_deepspeed_feature(k.feature);
    if (f != nullptr) ++counts[static_cast<int>(f->cls)];
  }
  md += fmt::format("{} keys: {} read by Strata, {} accepted without effect, {} refused when on.\n\n",
                    std::size(kKeys), counts[0], counts[1], counts[2]);
  for (DeepSpeedKeyClass cls : {DeepSpeedKeyClass::kNoEffect, DeepSpeedKeyClass::kUnsupported}) {
    md += fmt::format("## {}\n\n", cls == DeepSpeedKeyClass::kNoEffect ? "Accepted, no effect (warning)"
                                                                        : "Refused when on (error)");
    for (const DeepSpeedFeature& f : kFeatures) {
      if (f.cls != cls) continue;
      md += fmt::format("### {}\n\n{}\nDeepSpeed reads it in {}.\n\n", f.name, f.why, f.source);
      if (cls == DeepSpeedKeyClass::kNoEffect) {
        for (const DeepSpeedKey& k : kKeys) {
          if (k.feature == f.id) md += fmt::format("- `{}`{}\n", k.path, k.open ? " (open)" : "");
        }
        md += "\n";
        continue;
      }
      md += "| key | turns the feature on unless |\n|---|---|\n";
      for (const DeepSpeedKey& k : kKeys) {
        if (k.feature != f.id) continue;
        const std::string off = k.off.empty()          ? std::string("— (a parameter of the feature)")
                                : k.off == "*"           ? std::string("absent or null (on whenever given)")
                                : k.off == "enabled:false" ? std::string("its `enabled` is false (absent: on)")
                                                           : fmt::format("`{}`", k.off);
        md += fmt::format("| `{}`{} | {} |\n", k.path, k.open ? " (open)" : "", off);
      }
      md += "\n";
    }
  }
  md += "## Read by Strata\n\n";
  for (const DeepSpeedKey& k : kKeys) {
    if (k.feature != "strata") continue;
    md += fmt::format("- `{}`\n", k.path);
  }
  md += "\nDeepSpeed's other names of these keys are accepted as listed in config.md (`prefetch_bucket_size` for\n"
        "`stage3_prefetch_bucket_size` and the like, `bfloat16` for `bf16`).\n";
  return md;
}

}  // namespace strata

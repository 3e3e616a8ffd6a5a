// strata train: trains the reference GPT on one rank (ZeRO stage 0) on the
// cpu or cuda device, with the project's CPU optimizer. A DeepSpeed config
// (--config) supplies optimizer, precision, batch and clipping; flags given
// on the command line override it.
//
// This is where the model (model/: GptModel, GptExecutor on a Device
// stream, GptRunner with the data) meets the training loop (offload/:
// TrainingLoop with its ResidentProvider), which sees the model only
// through core's contract.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "command.h"
#include <sys/sysinfo.h>

#include "strata/core/config.h"
#include "strata/core/device_registry.h"
#include "strata/core/units.h"
#include "strata/cpu_adam/optimizer.h"
#include "strata/model/cpu_ops.h"
#include "strata/model/gpt.h"
#include "strata/model/gpt_executor.h"
#include "strata/model/gpt_runner.h"
#include "strata/model/text_data.h"
#include "strata/offload/training_loop.h"

namespace strata::cli {
namespace {

struct TrainCliOptions {
  std::string preset = "tiny";
  int layers = 0, heads = 0, embd = 0, vocab = 0, max_seq = 0;  // 0: the preset's
  std::string dtype;                                           // "": fp32 or the config's precision
  int64_t steps = 100;
  int batch = 8;
  int seq = 64;
  int grad_accum = 1;
  double lr = 1e-3;
  double weight_decay = 0.0;
  double clip = 1.0;
  uint64_t seed = 1234;
  std::string device = "cpu";
  std::string device_memory;
  std::string config_path;
  std::string json_log;
  std::string data;
  int eval_every = 50;
  int eval_batches = 8;
  bool quiet = false;
  // Which flags were given (they override the config).
  bool given_batch = false, given_accum = false, given_lr = false, given_wd = false, given_clip = false,
       given_dtype = false, given_device = false, given_device_memory = false;
};

std::string bytes_text(uint64_t b) { return b == 0 ? "0 B" : format_bytes(b, true); }

// What the run is made of, after flags and config.
struct TrainSetup {
  offload::TrainingOptions loop;
  int batch = 8;
  int seq_len = 64;
  uint64_t seed = 1234;
  int eval_batches = 8;
  DeviceKind device = DeviceKind::kCpu;  // may be kAuto until resolved
  uint64_t device_memory_bytes = 0;      // 0: cpu a quarter of host memory, cuda the whole GPU
};

// The cpu device's default capacity: a quarter of host memory.
uint64_t default_cpu_device_bytes() {
  struct sysinfo info {};
  if (sysinfo(&info) != 0) return uint64_t{4} << 30;
  return static_cast<uint64_t>(info.totalram) * info.mem_unit / 4;
}

// Applies the DeepSpeed config's optimizer, precision, batch and clipping.
Status apply_config(const Config& cfg, TrainCliOptions& o, TrainSetup& t, model::GptConfig& g) {
  if (cfg.zero_optimization.stage != 0)
    return Unsupported(fmt::format("{}: zero_optimization.stage = {}: strata train runs stage 0 on one rank for now; "
                                   "set \"stage\": 0",
                                   cfg.source, cfg.zero_optimization.stage));
  if (cfg.zero_optimization.offload_optimizer.device != OffloadDevice::kNone ||
      cfg.zero_optimization.offload_param.device != OffloadDevice::kNone)
    return Unsupported(fmt::format("{}: offload_optimizer/offload_param need the offload engine, which strata train "
                                   "does not use yet; set their \"device\" to \"none\"",
                                   cfg.source));
  if (cfg.optimizer.given) {
    switch (cfg.optimizer.type) {
      case OptimizerType::kAdam: t.loop.optimizer = cpu_adam::adam_kind(cfg.optimizer.adam_w_mode); break;
      case OptimizerType::kAdamW: t.loop.optimizer = cpu_adam::OptimizerKind::kAdamW; break;
      case OptimizerType::kAdagrad: t.loop.optimizer = cpu_adam::OptimizerKind::kAdagrad; break;
      case OptimizerType::kLion: t.loop.optimizer = cpu_adam::OptimizerKind::kLion; break;
    }
    if (!cfg.is_unresolved("optimizer.params.lr") && !o.given_lr) t.loop.hyper.lr = cfg.optimizer.lr;
    t.loop.hyper.beta1 = cfg.optimizer.betas[0];
    t.loop.hyper.beta2 = cfg.optimizer.betas[1];
    t.loop.hyper.eps = cfg.optimizer.eps;
    if (!o.given_wd) t.loop.hyper.weight_decay = cfg.optimizer.weight_decay;
    t.loop.hyper.bias_correction = cfg.optimizer.bias_correction;
  }
  if (!o.given_dtype) {
    if (cfg.precision() == TrainPrecision::kBf16) g.param_dtype = DType::kBF16;
    if (cfg.precision() == TrainPrecision::kFp16) g.param_dtype = DType::kF16;
  }
  // Narrowed to int only after a range check (4294967304 must not become 8).
  if (cfg.batch.train_micro_batch_size_per_gpu && !o.given_batch) {
    const int64_t mb = *cfg.batch.train_micro_batch_size_per_gpu;
    if (mb < 1 || mb > 65536)
      return InvalidArgument(fmt::format(
          "{}: train_micro_batch_size_per_gpu {} is out of range for strata train (1..65536)", cfg.source, mb));
    t.batch = static_cast<int>(mb);
  }
  if (cfg.batch.gradient_accumulation_steps && !o.given_accum) {
    const int64_t ga = *cfg.batch.gradient_accumulation_steps;
    if (ga < 1 || ga > 1000000)
      return InvalidArgument(fmt::format(
          "{}: gradient_accumulation_steps {} is out of range for strata train (1..1000000)", cfg.source, ga));
    t.loop.grad_accum = static_cast<int>(ga);
  }
  if (!o.given_clip) t.loop.grad_clip = cfg.gradient_clipping;
  if (!o.given_device_memory && cfg.strata.device_memory != 0) t.device_memory_bytes = cfg.strata.device_memory;
  // "strata.device" ("auto" unless given) decides unless --device was given.
  if (!o.given_device) t.device = cfg.strata.device;
  for (const ConfigIssue& w : cfg.warnings) fmt::print(stderr, "strata train: {}\n", format_issue(w, cfg.source));
  if (cfg.scheduler.type != SchedulerType::kNone)
    fmt::print(stderr, "strata train: warning: {}: scheduler {} is not applied yet; the learning rate stays {}\n",
               cfg.source, scheduler_type_name(cfg.scheduler.type), t.loop.hyper.lr);
  if (cfg.fp16.enabled)
    fmt::print(stderr, "strata train: note: fp16 parameters are stored in fp16, but compute and gradients are fp32, "
                       "so no loss scaling is applied\n");
  return Status::Ok();
}

int run_train(TrainCliOptions o) {
  auto fail = [](const Status& st) {
    fmt::print(stderr, "strata train: error: {}\n", st.to_string());
    return st.code() == StatusCode::kInvalidArgument ? 2 : 1;
  };
  Result<model::GptConfig> preset = model::preset(o.preset);
  if (!preset.ok()) return fail(preset.status());
  model::GptConfig g = *preset;
  if (o.layers) g.n_layer = o.layers;
  if (o.heads) g.n_head = o.heads;
  if (o.embd) g.n_embd = o.embd;
  if (o.vocab) g.vocab_size = o.vocab;
  if (o.max_seq) g.max_seq_len = o.max_seq;
  if (!o.dtype.empty()) {
    Result<DType> dt = parse_dtype(o.dtype);
    if (!dt.ok() || !is_state_float(*dt))
      return fail(InvalidArgument(fmt::format("--dtype '{}' is not a parameter dtype; use fp32, bf16 or fp16",
                                              printable(o.dtype, 64))));
    g.param_dtype = *dt;
  }
  TrainSetup t;
  t.batch = o.batch;
  t.seq_len = o.seq;
  t.loop.grad_accum = o.grad_accum;
  t.loop.hyper.lr = o.lr;
  t.loop.hyper.weight_decay = o.weight_decay;
  t.loop.grad_clip = o.clip;
  t.seed = o.seed;
  t.eval_batches = o.eval_batches;
  Result<DeviceKind> dev = parse_device_kind(o.device, "--device");
  if (!dev.ok()) return fail(dev.status());
  t.device = *dev;
  if (!o.device_memory.empty()) {
    Result<uint64_t> bytes = parse_bytes(o.device_memory, "--device-memory");
    if (!bytes.ok()) return fail(bytes.status());
    t.device_memory_bytes = *bytes;
  }
  if (!o.config_path.empty()) {
    Result<Config> cfg = load_config(o.config_path);
    if (!cfg.ok()) return fail(cfg.status());
    Status st = apply_config(*cfg, o, t, g);
    if (!st.ok()) return fail(st);
  }
  if (o.steps < 1) return fail(InvalidArgument(fmt::format("--steps {} must be at least 1", o.steps)));
  if (o.eval_every < 0) return fail(InvalidArgument(fmt::format("--eval-every {} must be >= 0 (0: only at the end)", o.eval_every)));
  Status valid = g.validate();
  if (!valid.ok()) return fail(valid);

  const std::string data_path = o.data.empty() ? model::default_corpus_path() : o.data;
  Result<model::TextDataset> data = model::TextDataset::load(data_path, t.seq_len);
  if (!data.ok()) return fail(data.status());

  // The device and the stream the model runs on; "auto" says what it chose.
  const DeviceChoice choice = resolve_device_kind(t.device);
  DeviceOptions dopt;
  dopt.device_memory_bytes = t.device_memory_bytes;
  dopt.cuda_memory_limit_bytes = t.device_memory_bytes;  // 0: the whole GPU
  if (choice.kind == DeviceKind::kCpu && dopt.device_memory_bytes == 0)
    dopt.device_memory_bytes = default_cpu_device_bytes();
  Result<std::unique_ptr<Device>> device_r = make_device(choice.kind, dopt);
  if (!device_r.ok())
    return fail(device_r.status().with_context(
        fmt::format("--device {}{}", device_kind_name(choice.kind),
                    choice.kind == DeviceKind::kCuda ? " (use --device cpu)" : "")));
  Device& device = **device_r;
  Result<std::unique_ptr<Stream>> stream_r = device.create_stream();
  if (!stream_r.ok()) return fail(stream_r.status().with_context("creating the model's stream"));
  Result<std::unique_ptr<model::GptModel>> model_r = model::GptModel::create(g, t.seed);
  if (!model_r.ok()) return fail(model_r.status());
  Result<std::unique_ptr<model::GptExecutor>> exec_r =
      model::GptExecutor::create(**model_r, device, **stream_r, t.batch, t.seq_len);
  if (!exec_r.ok()) return fail(exec_r.status());
  Result<std::unique_ptr<model::GptRunner>> runner_r =
      model::GptRunner::create(**model_r, **exec_r, *data, t.seed, t.eval_batches);
  if (!runner_r.ok()) return fail(runner_r.status());
  Result<std::unique_ptr<offload::TrainingLoop>> loop_r = offload::TrainingLoop::create(**runner_r, device, t.loop);
  if (!loop_r.ok()) return fail(loop_r.status());
  offload::TrainingLoop& trainer = **loop_r;

  std::unique_ptr<std::ofstream> log;
  if (!o.json_log.empty()) {
    log = std::make_unique<std::ofstream>(o.json_log, std::ios::trunc);
    if (!*log) return fail(ErrnoStatus(errno, fmt::format("open --json-log '{}'", o.json_log)));
  }

  const double baseline = data->unigram_baseline();
  const double flops_per_token = g.train_flops_per_token(t.seq_len);
  fmt::print("model    {}\n", g.describe());
  fmt::print("data     {} ({} train / {} validation bytes), unigram baseline {:.4f} nats/token\n", data->name(),
             data->train().size(), data->val().size(), baseline);
  fmt::print("train    device {}, batch {} x seq {} x accum {}, {} steps, {} lr {:g} wd {:g} clip {:g}, seed {}\n",
             device_kind_name(choice.kind), t.batch, t.seq_len, t.loop.grad_accum, o.steps,
             cpu_adam::optimizer_kind_name(t.loop.optimizer), t.loop.hyper.lr, t.loop.hyper.weight_decay,
             t.loop.grad_clip, t.seed);
  if (choice.automatic) fmt::print("device   {}\n", choice.reason);
  if (choice.kind == DeviceKind::kCpu) fmt::print("matmul   {}\n", model::cpu::gemm_backend_description());
  std::fflush(stdout);

  std::vector<double> tps;
  double last_val = NAN;
  for (int64_t s = 1; s <= o.steps; ++s) {
    Result<offload::StepResult> r = trainer.step();
    if (!r.ok()) return fail(r.status().with_context(fmt::format("step {}", s)));
    std::optional<double> val;
    if ((o.eval_every > 0 && s % o.eval_every == 0) || s == o.steps) {
      Result<double> v = trainer.evaluate();
      if (!v.ok()) return fail(v.status().with_context(fmt::format("validation at step {}", s)));
      val = *v;
      last_val = *v;
    }
    if (s > 1) tps.push_back(r->tokens_per_s);
    if (!o.quiet) {
      fmt::print("step {:>5}/{} | loss {:.4f}{} | {:>8.0f} tok/s | {:>8.1f} ms | peak device {} pinned {} host {} nvme {}{}\n",
                 s, o.steps, r->loss, val ? fmt::format(" | val {:.4f}", *val) : std::string(), r->tokens_per_s,
                 r->step_ms, bytes_text(r->peak_device_bytes), bytes_text(r->peak_pinned_bytes),
                 bytes_text(r->peak_host_bytes), bytes_text(r->peak_nvme_bytes),
                 r->skipped ? " | SKIPPED (non-finite gradient)" : "");
      std::fflush(stdout);
    }
    if (log) {
      nlohmann::ordered_json j;
      j["step"] = s;
      j["loss"] = r->loss;
      j["val_loss"] = val ? nlohmann::ordered_json(*val) : nlohmann::ordered_json(nullptr);
      j["tokens_per_s"] = r->tokens_per_s;
      j["step_ms"] = r->step_ms;
      j["peak_bytes"] = {{"device", r->peak_device_bytes},
                         {"pinned", r->peak_pinned_bytes},
                         {"host", r->peak_host_bytes},
                         {"nvme", r->peak_nvme_bytes}};
      *log << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
      log->flush();
    }
  }
  double median = 0;
  if (!tps.empty()) {
    std::sort(tps.begin(), tps.end());
    median = tps[tps.size() / 2];
  }
  fmt::print("done     val loss {:.4f} vs unigram baseline {:.4f} ({}); median {:.0f} tok/s = {:.2f} GFLOP/s "
             "(model FLOPs {:.3g}/token)\n",
             last_val, baseline, last_val < baseline ? "below" : "NOT below", median, median * flops_per_token / 1e9,
             flops_per_token);
  return 0;
}

CommandRegistration train_command("train", [](CLI::App& root) {
  auto o = std::make_shared<TrainCliOptions>();
  CLI::App* cmd = root.add_subcommand(
      "train", "Train the reference GPT on one rank (stage 0) on the cpu or cuda device");
  cmd->add_option("--preset", o->preset, "Model size: tiny | small | gpt2 | gpt2-medium | 1b")->capture_default_str();
  cmd->add_option("--layers", o->layers, "Override the number of blocks");
  cmd->add_option("--heads", o->heads, "Override the number of attention heads");
  cmd->add_option("--embd", o->embd, "Override the embedding width");
  cmd->add_option("--vocab", o->vocab, "Override the vocabulary size (>= 256)");
  cmd->add_option("--max-seq", o->max_seq, "Override the maximum sequence length");
  auto* dtype = cmd->add_option("--dtype", o->dtype, "Parameter storage: fp32 | bf16 | fp16 (compute is fp32)");
  cmd->add_option("--steps", o->steps, "Optimizer steps")->capture_default_str();
  auto* batch = cmd->add_option("--batch", o->batch, "Micro batch (sequences per forward)")->capture_default_str();
  cmd->add_option("--seq", o->seq, "Sequence length")->capture_default_str();
  auto* accum = cmd->add_option("--grad-accum", o->grad_accum, "Micro batches per optimizer step")->capture_default_str();
  // Finite, bounded ranges: a flag error names the flag (not the optimizer's field).
  auto* lr = cmd->add_option("--lr", o->lr, "Learning rate")->capture_default_str()->check(CLI::Range(0.0, 1e3));
  auto* wd = cmd->add_option("--weight-decay", o->weight_decay, "Weight decay")
                 ->capture_default_str()
                 ->check(CLI::Range(0.0, 1e3));
  auto* clip = cmd->add_option("--clip", o->clip, "Global gradient-norm clipping (0: off)")->capture_default_str();
  cmd->add_option("--seed", o->seed, "Seed of initial weights and batch order")->capture_default_str();
  auto* device = cmd->add_option("--device", o->device, "cpu | cuda | auto (cuda when a GPU is usable, else cpu)")
                     ->capture_default_str();
  auto* devmem = cmd->add_option("--device-memory", o->device_memory,
                                 "Device memory capacity, e.g. 2GiB (cpu default: a quarter of host memory)");
  cmd->add_option("--config", o->config_path, "DeepSpeed JSON config: optimizer, precision, batch, clipping");
  cmd->add_option("--json-log", o->json_log, "Write one JSON object per step to this file");
  cmd->add_option("--data", o->data, "Train on this text file (default: the shipped corpus)");
  cmd->add_option("--eval-every", o->eval_every, "Validation loss every N steps (0: only at the end)")
      ->capture_default_str();
  cmd->add_option("--eval-batches", o->eval_batches, "Validation batches per evaluation")->capture_default_str();
  cmd->add_flag("--quiet", o->quiet, "No per-step progress lines");
  cmd->callback([o, batch, accum, lr, wd, clip, dtype, device, devmem] {
    o->given_batch = batch->count() > 0;
    o->given_accum = accum->count() > 0;
    o->given_lr = lr->count() > 0;
    o->given_wd = wd->count() > 0;
    o->given_clip = clip->count() > 0;
    o->given_dtype = dtype->count() > 0;
    o->given_device = device->count() > 0;
    o->given_device_memory = devmem->count() > 0;
    exit_with(run_train(*o));
  });
});

}  // namespace
}  // namespace strata::cli

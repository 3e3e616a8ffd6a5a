// strata train: trains the reference GPT with the ZeRO engine (offload/:
// Engine) on one rank or many: `--ranks N` runs N ranks as threads of this
// process (local backend, one cpu device of --device-memory each);
// `mpirun -np N strata train --backend mpi` runs them as processes. A
// DeepSpeed config (--config) supplies stage, offload placement, optimizer,
// precision, batch, clipping, loss scaling and the lr schedule; flags given
// on the command line override it.
//
// This is where the model (model/: GptModel, GptExecutor on a Device
// stream, GptRunner with its rank's slice of the data) meets the engine,
// which sees the model only through core's contract.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "command.h"
#include "config_fit_cli.h"
#include "engine_run.h"
#include "model_shape_flags.h"
#include "train_paths.h"
#include <sys/sysinfo.h>

#include "strata/core/printable.h"
#include "strata/core/bounded_file.h"
#include "strata/core/config.h"
#include "strata/core/device_registry.h"
#include "strata/core/units.h"
#include "strata/cpu_adam/optimizer.h"
#include "strata/model/cpu_ops.h"
#include "strata/model/gpt.h"
#include "strata/model/gpt_executor.h"
#include "strata/model/gpt_runner.h"
#include "strata/model/text_data.h"
#include "strata/comm/backends.h"
#include "strata/comm/host_collective.h"
#include "strata/offload/engine.h"

namespace strata::cli {
namespace {

struct TrainCliOptions {
  std::string preset = "tiny";
  ModelShapeFlags shape;  // overrides of the preset
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
  int ranks = 1;
  std::string backend = "local";
  int stage = -1;                      // with given_stage; else the config's (0 without one)
  std::string offload_optimizer;       // "": the config's
  std::string offload_param;
  std::string overlap_optimizer;       // "": the config's (on)
  std::string speculative_optimizer;   // "": the config's (auto)
  int optimizer_threads = 0;
  int device_threads = 0;              // 0: all cores (cpu device compute)
  std::string nvme_path;               // "": the config's offload_optimizer.nvme_path
  // Checkpoints (docs/checkpoints.md).
  std::string save_dir;                // "": no saves
  int64_t save_every = 0;              // 0: only at the end (with --save-dir)
  int keep = 0;                        // 0: every tag
  bool save_sync = false;
  int save_slots = 2;
  std::string resume;                  // DIR or DIR/TAG
  int step_retries = 0;                // rolled-back steps repeated before giving up
  // --fit: the config fitted to --device-memory / --host-memory / --nvme-path at start-up.
  bool fit = false;
  std::string host_memory, nvme_size;
  std::string fit_optimizer_states;   // --optimizer-states with --fit: the storages the search may choose
  std::string fit_grad_dtypes;        // --grad-dtypes with --fit: the gradient dtypes the search may choose
  // Which flags were given (they override the config).
  bool given_batch = false, given_accum = false, given_lr = false, given_wd = false, given_clip = false,
       given_dtype = false, given_device = false, given_device_memory = false, given_stage = false,
       given_save_dir = false, given_nvme_path = false;
};

std::string bytes_text(uint64_t b) { return b == 0 ? "0 B" : format_bytes(b, true); }

// What the run is made of, after flags and config (engine, batch, ...: RankSetup, engine_run.h).
struct TrainSetup : RankSetup {
  DeviceKind device = DeviceKind::kCpu;  // may be kAuto until resolved
  bool breakdown = false;                // wall_clock_breakdown
  bool has_config = false;
};

// Applies the DeepSpeed config: engine options, precision, batch. Its
// warnings are printed when `print_warnings` (one process of mpirun prints them).
Status apply_config(const Config& cfg, TrainCliOptions& o, TrainSetup& t, model::GptConfig& g, bool print_warnings) {
  const double lr = t.engine.hyper.lr, wd = t.engine.hyper.weight_decay, clip = t.engine.grad_clip;
  const int accum = t.engine.grad_accum;
  STRATA_ASSIGN_OR_RETURN(t.engine, offload::engine_options_from_config(cfg));
  if (o.given_lr || !cfg.optimizer.given || cfg.is_unresolved("optimizer.params.lr")) t.engine.hyper.lr = lr;
  if (o.given_wd || !cfg.optimizer.given) t.engine.hyper.weight_decay = wd;
  if (o.given_clip) t.engine.grad_clip = clip;
  if (o.given_accum || !cfg.batch.gradient_accumulation_steps) t.engine.grad_accum = accum;
  if (!o.given_dtype) g.param_dtype = cfg.precision_dtype();
  // Narrowed to int only after a range check (4294967304 must not become 8).
  if (cfg.batch.train_micro_batch_size_per_gpu && !o.given_batch) {
    const int64_t mb = *cfg.batch.train_micro_batch_size_per_gpu;
    if (mb < 1 || mb > 65536)
      return InvalidArgument(fmt::format(
          "{}: train_micro_batch_size_per_gpu {} is out of range for strata train (1..65536)",
          printable(cfg.source, 256), mb));
    t.batch = static_cast<int>(mb);
  }
  if (!o.given_device_memory && cfg.strata.device_memory != 0) t.device_memory_bytes = cfg.strata.device_memory;
  // "strata.device" ("auto" unless given) decides unless --device was given.
  if (!o.given_device) t.device = cfg.strata.device;
  t.breakdown = cfg.wall_clock_breakdown;
  t.has_config = true;
  if (print_warnings)
    for (const ConfigIssue& w : cfg.warnings) fmt::print(stderr, "strata train: {}\n", format_issue(w, cfg.source));
  return Status::Ok();
}

// Flags that override the placement (applied after the config).
Status apply_placement_flags(const TrainCliOptions& o, TrainSetup& t) {
  if (o.given_stage) {
    if (o.stage < 0 || o.stage > 3)
      return InvalidArgument(fmt::format("--stage {} is not 0, 1, 2 or 3 (ZeRO stage; leave it out for the config's, "
                                         "or 0 without one)",
                                         o.stage));
    t.engine.stage = o.stage;
  }
  if (!o.offload_optimizer.empty()) {
    STRATA_ASSIGN_OR_RETURN(t.engine.offload_optimizer, parse_offload(o.offload_optimizer, "--offload-optimizer"));
  }
  if (!o.offload_param.empty()) {
    STRATA_ASSIGN_OR_RETURN(t.engine.offload_param, parse_offload(o.offload_param, "--offload-param"));
  }
  if (!o.nvme_path.empty()) t.engine.nvme.path = t.engine.nvme_param.path = o.nvme_path;
  // The placement the flags and the config make: its questions, not raw values.
  const Placement placement = t.engine.placement();
  // The config's own stage 0 + optimizer offload is refused when it is read
  // (config_resolve.cpp); here a flag made the pair, so the message names it.
  if (placement.optimizer_offloaded() && !placement.optimizer_sharded()) {
    const std::string stage_from =
        o.given_stage            ? std::string("--stage 0")
        : o.config_path.empty() ? std::string("stage 0 (the default without --stage or --config)")
                                : fmt::format("stage 0 (zero_optimization.stage of --config '{}')",
                                              printable(o.config_path, 256));
    const std::string offload_from =
        !o.offload_optimizer.empty()
            ? fmt::format("--offload-optimizer {}", offload_device_name(t.engine.offload_optimizer))
            : fmt::format("optimizer offload {} (zero_optimization.offload_optimizer.device of --config '{}')",
                          offload_device_name(t.engine.offload_optimizer), printable(o.config_path, 256));
    return InvalidArgument(fmt::format(
        "{} with {}: optimizer offload needs ZeRO stage 1, 2 or 3 (the optimizer state is partitioned, and so "
        "offloaded, only there); give --stage 1, 2 or 3, or --offload-optimizer none",
        stage_from, offload_from));
  }
  if (placement.optimizer_on_nvme() && t.engine.nvme.path.empty())
    return InvalidArgument("--offload-optimizer nvme needs a folder on the NVMe drive: give --nvme-path DIR (or "
                           "zero_optimization.offload_optimizer.nvme_path in --config)");
  if (placement.params_on_nvme() && t.engine.nvme_param.path.empty())
    return InvalidArgument("--offload-param nvme needs a folder on the NVMe drive: give --nvme-path DIR (or "
                           "zero_optimization.offload_param.nvme_path in --config)");
  if (placement.params_offloaded() && !placement.params_sharded())
    return InvalidArgument(fmt::format("--offload-param needs stage 3 (parameters are partitioned only there); "
                                       "stage is {}",
                                       t.engine.stage));
  if (placement.params_offloaded() && !placement.optimizer_offloaded())
    return InvalidArgument(fmt::format("--offload-param {} needs the optimizer off the device too: add "
                                       "--offload-optimizer cpu (or nvme)",
                                       offload_device_name(t.engine.offload_param)));
  if (!o.overlap_optimizer.empty()) {
    if (o.overlap_optimizer != "on" && o.overlap_optimizer != "off")
      return InvalidArgument(fmt::format("--overlap-optimizer '{}' is not on or off", printable(o.overlap_optimizer, 32)));
    t.engine.overlap_optimizer = o.overlap_optimizer == "on";
  }
  if (!o.speculative_optimizer.empty()) {
    STRATA_ASSIGN_OR_RETURN(t.engine.speculative_optimizer,
                            offload::parse_speculation_mode(o.speculative_optimizer, "--speculative-optimizer"));
  }
  t.engine.optimizer_threads = o.optimizer_threads;
  return Status::Ok();
}

// The NVMe folders the placement uses (--nvme-path, or the config's
// nvme_path), checked before anything is built, naming where each came from.
Status check_nvme_folders(const TrainCliOptions& o, const TrainSetup& t) {
  struct Use {
    bool used;
    const std::string& path;
    const char* key;
  };
  const Placement placement = t.engine.placement();
  for (const Use& u : {Use{placement.optimizer_on_nvme(), t.engine.nvme.path,
                           "zero_optimization.offload_optimizer.nvme_path"},
                       Use{placement.params_on_nvme(), t.engine.nvme_param.path,
                           "zero_optimization.offload_param.nvme_path"}}) {
    if (!u.used || u.path.empty()) continue;  // an empty path is refused by apply_placement_flags
    const std::string named = o.given_nvme_path
                                  ? fmt::format("--nvme-path '{}'", printable(u.path, 256))
                                  : fmt::format("{} '{}' of --config '{}' (or give --nvme-path DIR)", u.key,
                                                printable(u.path, 256), printable(o.config_path, 256));
    STRATA_RETURN_IF_ERROR(check_swap_folder(u.path, named));
  }
  return Status::Ok();
}

// One line per step and the JSON log (rank 0 only).
struct Reporter {
  const TrainCliOptions& o;
  std::ofstream* log = nullptr;
  void step(int64_t s, const offload::StepMetrics& m, std::optional<double> val,
            const std::optional<offload::CheckpointSaveInfo>& saved = std::nullopt) const {
    if (!o.quiet) {
      fmt::print("step {:>5}/{} | loss {:.4f}{} | {:>8.0f} tok/s | {:>8.1f} ms | peak device {} pinned {} host {} nvme "
                 "{} | lr {:.3g} norm {:.3f}{}{}{}\n",
                 s, o.steps, m.loss, val ? fmt::format(" | val {:.4f}", *val) : std::string(), m.tokens_per_s,
                 m.step_ms, bytes_text(m.peak_device_bytes), bytes_text(m.peak_pinned_bytes),
                 bytes_text(m.peak_host_bytes), bytes_text(m.peak_nvme_bytes), m.lr, m.grad_norm,
                 m.loss_scale != 1 ? fmt::format(" scale {:g}", m.loss_scale) : std::string(),
                 m.skipped ? " | SKIPPED (fp16 overflow)" : "",
                 saved ? fmt::format(" | save {} ({}, blocked {:.1f} ms)", saved->tag, bytes_text(saved->bytes),
                                     saved->blocked_ms)
                       : std::string());
      std::fflush(stdout);
    }
    if (log != nullptr) {
      nlohmann::ordered_json j;
      j["step"] = s;
      j["loss"] = m.loss;
      j["val_loss"] = val ? nlohmann::ordered_json(*val) : nlohmann::ordered_json(nullptr);
      j["lr"] = m.lr;
      j["loss_scale"] = m.loss_scale;
      j["grad_norm"] = m.grad_norm;
      j["skipped"] = m.skipped;
      j["tokens_per_s"] = m.tokens_per_s;
      j["step_ms"] = m.step_ms;
      j["forward_ms"] = m.forward_ms;
      j["backward_ms"] = m.backward_ms;
      j["optimizer_ms"] = m.optimizer_ms;
      // Note [Early, exact updates]: layers stepped under the backward, and redone or restored at the step's end.
      j["early_updates"] = {{"layers", m.speculated_layers}, {"redone", m.redone_layers}};
      j["exposed_ms"] = {{"reduce", m.wait_reduce_ms},
                         {"optimizer", m.wait_optimizer_ms},
                         {"gather", m.wait_gather_ms},
                         {"gather_backward", m.wait_gather_backward_ms}};
      // Which layers the passes waited for their updates (StepMetrics::optimizer_waits).
      nlohmann::ordered_json by_layer = nlohmann::ordered_json::array();
      for (const auto& w : m.optimizer_waits) by_layer.push_back({{"layer", w.layer}, {"ms", w.ms}});
      j["optimizer_waits"] = std::move(by_layer);
      j["bytes"] = {{"h2d", m.h2d_bytes},          {"d2h", m.d2h_bytes},
                    {"gather", m.gather_bytes},    {"reduce", m.reduce_bytes},
                    {"nvme_read", m.nvme_read_bytes}, {"nvme_write", m.nvme_write_bytes}};
      j["exposed_ms"]["nvme"] = m.wait_nvme_ms;
      // The time this step's save held the training loop (0: no save).
      j["save"] = saved ? nlohmann::ordered_json{{"tag", saved->tag}, {"blocked_ms", saved->blocked_ms},
                                                 {"bytes", saved->bytes}}
                        : nlohmann::ordered_json(nullptr);
      j["peak_bytes"] = {{"device", m.peak_device_bytes},
                         {"pinned", m.peak_pinned_bytes},
                         {"host", m.peak_host_bytes},
                         {"nvme", m.peak_nvme_bytes}};
      *log << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
      log->flush();
    }
  }
  // A failed `what` at step s rolled back (or dropped) on every rank: the
  // state is the one after step `back` and training repeats from there. In
  // the JSON log, the step lines after `back` written before this record are
  // superseded by the ones that follow it.
  void rollback(const char* what, int64_t s, int64_t back, int left, const Status& error) const {
    if (!o.quiet)
      fmt::print("retry    {} {} failed; every rank is at the state after step {}: repeating from {} "
                 "({} of --step-retries {} left): {}\n",
                 what, s, back, back < s ? fmt::format("step {}", back + 1) : std::string("there"), left,
                 o.step_retries, error.to_string());
    if (log != nullptr) {
      nlohmann::ordered_json j;
      j["rollback"] = {{"failed", fmt::format("{} {}", what, s)}, {"state_after_step", back},
                       {"retries_left", left}, {"error", error.to_string()}};
      *log << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << '\n';
      log->flush();
    }
  }
};

struct Summary {
  std::vector<double> tps;
  double last_val = NAN;
  std::vector<offload::StepMetrics> steps;
  offload::EngineMemory predicted, measured;  // rank 0's engine
  uint64_t device_peak = 0, device_capacity = 0;
  uint64_t model_state = 0;                   // unsharded parameters + gradients + optimizer state
  // strata.gradient_shards: on NVMe, and why (auto's decision).
  bool gradients_on_nvme = false;
  std::string gradient_folder;  // whose folder they wait in
  std::string gradient_shards_why;
};

// What a checkpoint records of the run besides the engine's state: enough
// for `strata checkpoint export` (the model's shape) and to refuse a resume
// whose batches would differ.
nlohmann::json checkpoint_app(const TrainCliOptions& o, const TrainSetup& t, const model::GptConfig& g, int world) {
  nlohmann::json j;
  j["program"] = "strata train";
  j["model"] = {{"n_layer", g.n_layer},         {"n_head", g.n_head},          {"n_embd", g.n_embd},
                {"vocab_size", g.vocab_size},   {"max_seq_len", g.max_seq_len}, {"param_dtype", dtype_name(g.param_dtype)}};
  j["global_batch"] = static_cast<int64_t>(t.batch) * world;
  j["seq_len"] = t.seq_len;
  j["seed"] = t.seed;
  j["grad_accum"] = t.engine.grad_accum;
  j["config"] = o.config_path;
  // The config itself, so the checkpoint says how it was trained even if the file changes.
  if (!o.config_path.empty()) {
    Result<std::string> text = read_regular_file(o.config_path, kMaxConfigBytes,
                                                 {.what = "config file", .flag = "--config", .hint = ""});
    if (text.ok()) {
      nlohmann::json c = nlohmann::json::parse(*text, nullptr, false, true);
      if (!c.is_discarded()) j["config_json"] = c;
    }
  }
  j["data"] = o.data;
  return j;
}

// A resume must draw the same batches: same global batch, sequence length
// and seed as the run that saved (the model's shape is checked by the engine).
Result<offload::CheckpointManifest> check_resume(const TrainCliOptions& o, const TrainSetup& t,
                                                 const model::GptConfig& g) {
  STRATA_ASSIGN_OR_RETURN(offload::CheckpointReader r, offload::CheckpointReader::open(o.resume));
  const nlohmann::json& app = r.manifest().app;
  const int world = o.ranks;  // local ranks; under mpirun each process is one rank of comm's world
  (void)g;
  if (app.is_object() && app.value("program", "") == "strata train") {
    const int64_t saved_batch = app.value("global_batch", int64_t{0});
    const int64_t saved_seq = app.value("seq_len", int64_t{0});
    const uint64_t saved_seed = app.value("seed", uint64_t{0});
    if (saved_seq != t.seq_len || saved_seed != t.seed)
      return FailedPrecondition(fmt::format("--resume '{}': saved with --seq {} --seed {}, this run has --seq {} --seed "
                                            "{}; use the saved values so the run continues on the same batches",
                                            printable(o.resume, 256), saved_seq, saved_seed, t.seq_len, t.seed));
    if (o.backend == "local" && saved_batch != static_cast<int64_t>(t.batch) * world)
      return FailedPrecondition(fmt::format(
          "--resume '{}': saved with a global batch of {} sequences, this run has --batch {} x {} rank(s) = {}; keep "
          "the global batch (e.g. --batch {} with --ranks {})",
          printable(o.resume, 256), saved_batch, t.batch, world, static_cast<int64_t>(t.batch) * world,
          saved_batch % world == 0 ? saved_batch / world : saved_batch, saved_batch % world == 0 ? world : 1));
  }
  return r.manifest();
}

// Trains on one rank. Rank 0 (printer) reports.
Status train_rank(const TrainCliOptions& o, const TrainSetup& t, const model::GptConfig& g,
                  const model::TextDataset& data, DeviceKind kind, comm::Communicator& comm, const Reporter* reporter,
                  Summary* summary) {
  RankState rs;
  Status built = build_rank(t, g, data, kind, comm, rs);
  STRATA_RETURN_IF_ERROR(vote(comm, built, "to set up"));
  if (reporter != nullptr && !o.quiet) {
    fmt::print("engine   {}\n", rs.engine->describe());
    std::fflush(stdout);
  }
  if (!o.resume.empty()) {
    Result<offload::CheckpointManifest> m = check_resume(o, t, g);
    if (m.ok()) m = rs.engine->load_checkpoint(o.resume);
    STRATA_RETURN_IF_ERROR(vote(comm, m.status(), "to load the checkpoint"));
    if (reporter != nullptr && !o.quiet) {
      fmt::print("resume   from '{}' tag {} (saved by {} rank{} at stage {}, optimizer {}, params {}): step {} of {}\n",
                 printable(o.resume, 256), m->tag, m->world_size, m->world_size == 1 ? "" : "s", m->stage,
                 m->offload_optimizer, m->offload_param, m->scalars.steps_begun, o.steps);
      std::fflush(stdout);
    }
    if (m->scalars.steps_begun >= o.steps && reporter != nullptr)
      fmt::print("resume   the checkpoint is at step {}, at or past --steps {}: nothing to train\n",
                 m->scalars.steps_begun, o.steps);
  }
  const int64_t first_step = rs.engine->steps_begun() + 1;  // the same on every rank
  int retries_left = o.step_retries;
  // After a failed step() or evaluate(): true when the engine rolled back (or
  // dropped the call) on every rank and a retry is left (Note [Atomic steps]).
  auto may_retry = [&](const Status& error, int64_t s, const char* what) {
    if (retries_left <= 0 || !rs.engine->stopped().ok()) return false;
    --retries_left;
    const int64_t back = rs.engine->steps_begun();
    if (reporter != nullptr) reporter->rollback(what, s, back, retries_left, error);
    // A save of an undone step failed with it; it is not waited for again.
    if (!o.save_dir.empty()) rs.engine->wait_checkpoint().status().ignore();
    if (summary && back < s) {
      const size_t keep = static_cast<size_t>(std::max<int64_t>(0, back - first_step + 1));
      summary->steps.resize(std::min(summary->steps.size(), keep));
      const size_t first = first_step == 1 && !summary->steps.empty() ? 1 : 0;
      summary->tps.resize(std::min(summary->tps.size(), summary->steps.size() - first));  // step 1 has no throughput
    }
    return true;
  };
  for (int64_t s = first_step; s <= o.steps; ++s) {
    Result<offload::StepMetrics> r = rs.engine->step();
    if (!r.ok() && may_retry(r.status(), s, "step")) {
      s = rs.engine->steps_begun();
      continue;
    }
    if (!r.ok()) return r.status().with_context(fmt::format("step {} on rank {}", s, comm.rank()));
    std::optional<double> val;
    if ((o.eval_every > 0 && s % o.eval_every == 0) || s == o.steps) {
      Result<double> v = rs.engine->evaluate();
      // The pending update may fail here (rolled back: repeat from there), or
      // a parameter read (nothing changed: evaluate again).
      while (!v.ok() && rs.engine->steps_begun() == s && may_retry(v.status(), s, "validation at step"))
        v = rs.engine->evaluate();
      if (!v.ok() && rs.engine->steps_begun() < s && may_retry(v.status(), s, "validation at step")) {
        s = rs.engine->steps_begun();
        continue;
      }
      if (!v.ok()) return v.status().with_context(fmt::format("validation at step {} on rank {}", s, comm.rank()));
      val = *v;
      if (summary) summary->last_val = *v;
    }
    if (summary) {
      if (s > 1) summary->tps.push_back(r->tokens_per_s);
      summary->steps.push_back(*r);
    }
    std::optional<offload::CheckpointSaveInfo> saved;
    if (!o.save_dir.empty() && ((o.save_every > 0 && s % o.save_every == 0) || s == o.steps)) {
      offload::CheckpointSaveOptions so;
      so.dir = o.save_dir;
      so.keep = o.keep;
      so.sync = o.save_sync;
      so.snapshot_slots = o.save_slots;
      so.app = checkpoint_app(o, t, g, comm.world_size());
      Result<offload::CheckpointSaveInfo> info = rs.engine->save_checkpoint(so);
      if (!info.ok()) return info.status().with_context(fmt::format("saving at step {} on rank {}", s, comm.rank()));
      saved = *info;
    }
    if (reporter != nullptr) reporter->step(s, *r, val, saved);
  }
  if (first_step > o.steps) {
    // Resumed at or past --steps: nothing trained; the checkpoint's validation loss instead.
    Result<double> v = rs.engine->evaluate();
    if (!v.ok()) return v.status().with_context(fmt::format("validation on rank {}", comm.rank()));
    if (summary) summary->last_val = *v;
  }
  STRATA_RETURN_IF_ERROR(rs.engine->synchronize());
  {
    Result<std::optional<offload::CheckpointSaveDone>> done = rs.engine->wait_checkpoint();
    if (!done.ok()) return done.status().with_context(fmt::format("the last save on rank {}", comm.rank()));
    if (reporter != nullptr && !o.quiet && done->has_value())
      fmt::print("saved    '{}' tag {}: rank 0 wrote {} in {:.2f} s ({:.2f} GB/s) and committed it\n",
                 printable(o.save_dir, 256), (*done)->tag, bytes_text((*done)->bytes), (*done)->seconds,
                 (*done)->seconds > 0 ? (*done)->bytes / (*done)->seconds / 1e9 : 0.0);
  }
  if (summary) {
    summary->predicted = rs.engine->predicted_memory();
    summary->gradients_on_nvme = rs.engine->placement().gradient_slot_count != 0;
    summary->gradient_shards_why = rs.engine->placement().gradient_shards_why;
    summary->gradient_folder =
        rs.engine->placement().gradient_folder == offload::StatePlacement::GradientFolder::kOptimizerState
            ? "the optimizer state's folder"
            : "the parameter shards' folder";
    summary->measured = rs.engine->measured_memory();
    summary->device_peak = rs.device->memory_stats().get(Tier::kDevice).peak_bytes;
    summary->device_capacity = rs.device->caps().memory_bytes;
    summary->model_state = rs.engine->model_state_bytes();
  }
  return Status::Ok();
}

void print_breakdown(const Summary& sum) {
  if (sum.steps.size() < 2) return;
  // Medians over steps 2.. (step 1 records the acquire sequence).
  auto median = [&](auto field) {
    std::vector<double> v;
    for (size_t i = 1; i < sum.steps.size(); ++i) v.push_back(field(sum.steps[i]));
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  using M = offload::StepMetrics;
  fmt::print("breakdown (median of steps 2..{}, ms)\n", sum.steps.size());
  fmt::print("  step {:>9.2f}   forward {:>9.2f}   backward {:>9.2f}   optimizer (own thread) {:>9.2f}\n",
             median([](const M& m) { return m.step_ms; }), median([](const M& m) { return m.forward_ms; }),
             median([](const M& m) { return m.backward_ms; }), median([](const M& m) { return m.optimizer_ms; }));
  fmt::print("  exposed: reduce+norm {:>9.2f}   optimizer {:>9.2f}   gather {:>9.2f}   gather in backward {:>9.2f}\n",
             median([](const M& m) { return m.wait_reduce_ms; }), median([](const M& m) { return m.wait_optimizer_ms; }),
             median([](const M& m) { return m.wait_gather_ms; }), median([](const M& m) { return m.wait_gather_backward_ms; }));
  fmt::print("  bytes/step: h2d {}  d2h {}  gather {}  reduce {}\n",
             bytes_text(static_cast<uint64_t>(median([](const M& m) { return double(m.h2d_bytes); }))),
             bytes_text(static_cast<uint64_t>(median([](const M& m) { return double(m.d2h_bytes); }))),
             bytes_text(static_cast<uint64_t>(median([](const M& m) { return double(m.gather_bytes); }))),
             bytes_text(static_cast<uint64_t>(median([](const M& m) { return double(m.reduce_bytes); }))));
}

// Note [World size of the config]
// A DeepSpeed config's batch keys are checked against the world that will
// train (train_batch_size = micro batch x accumulation x world size), so the
// world size must be known before the config is read:
// - --backend local: --ranks.
// - --backend mpi: the MPI communicator's size, created before the config
//   is read (mpirun -np N, whatever launcher variables it sets).
// - --backend nccl: the launcher's variables, in the order the nccl
//   communicator takes its world from (mpirun's, then STRATA_WORLD_SIZE),
//   then torchrun's WORLD_SIZE; once the communicator exists its size must
//   be the same, else the run stops naming both.
struct TrainWorld {
  int64_t size = 1;
  std::string origin;  // where the size came from, for messages
};

constexpr int64_t kMaxWorldSize = int64_t{1} << 24;

Result<TrainWorld> launcher_world() {
  for (const char* variable : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "STRATA_WORLD_SIZE", "WORLD_SIZE"}) {
    const char* text = std::getenv(variable);
    if (text == nullptr || *text == '\0') continue;
    char* end = nullptr;
    errno = 0;
    const long long size = std::strtoll(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || size < 1 || size > kMaxWorldSize)
      return InvalidArgument(fmt::format("the launcher's {}='{}' is not a number of ranks in 1..{}", variable,
                                         printable(text, 64), kMaxWorldSize));
    return TrainWorld{size, fmt::format("the launcher's {}={}", variable, size)};
  }
  return TrainWorld{1, "no launcher variable (OMPI_COMM_WORLD_SIZE, PMI_SIZE, STRATA_WORLD_SIZE, WORLD_SIZE) is set"};
}

Result<TrainWorld> train_world(const TrainCliOptions& o, comm::Backend backend, const comm::Communicator* mpi) {
  switch (backend) {
    case comm::Backend::kLocal:
      return TrainWorld{o.ranks, comm::launched_by_mpi()
                                     ? fmt::format("--ranks {}; mpirun started this process: add --backend mpi to "
                                                   "train as one of its ranks",
                                                   o.ranks)
                                     : fmt::format("--ranks {}", o.ranks)};
    case comm::Backend::kMpi:
      return TrainWorld{mpi->world_size(), fmt::format("the MPI communicator (mpirun -np {})", mpi->world_size())};
    default:
      return launcher_world();
  }
}

int run_train(TrainCliOptions o) {
  auto fail = [](const Status& st) {
    fmt::print(stderr, "strata train: error: {}\n", printable_message(st.to_string()));
    return st.code() == StatusCode::kInvalidArgument ? 2 : 1;
  };
  Result<model::GptConfig> preset = model::preset(o.preset);
  if (!preset.ok()) return fail(preset.status().with_context("--preset"));
  model::GptConfig g = *preset;
  o.shape.apply_to(g);
  if (!o.dtype.empty()) {
    Result<DType> dt = parse_dtype(o.dtype);
    if (!dt.ok() || !is_state_float(*dt))
      return fail(InvalidArgument(fmt::format("--dtype '{}' is not a parameter dtype; use fp32, bf16 or fp16",
                                              printable(o.dtype, 64))));
    g.param_dtype = *dt;
  }
  if (o.ranks < 1 || o.ranks > 64) return fail(InvalidArgument(fmt::format("--ranks {} is not in 1..64", o.ranks)));
  Result<comm::Backend> backend = comm::parse_backend(o.backend, "--backend");
  if (!backend.ok())
    return fail(InvalidArgument(
        fmt::format("--backend '{}' is not a backend; use local, mpi or nccl", printable(o.backend, 64))));
  if (*backend != comm::Backend::kLocal && o.ranks != 1)
    return fail(InvalidArgument(fmt::format("--ranks {} is for --backend local; with {} start one process per rank "
                                            "(mpirun -np N strata train --backend {})",
                                            o.ranks, o.backend, o.backend)));
  TrainSetup t;
  t.batch = o.batch;
  t.seq_len = o.seq;
  t.engine.grad_accum = o.grad_accum;
  t.engine.hyper.lr = o.lr;
  t.engine.hyper.weight_decay = o.weight_decay;
  t.engine.grad_clip = o.clip;
  t.seed = o.seed;
  t.eval_batches = o.eval_batches;
  Result<DeviceKind> dev = parse_device_flag(o.device, "--device");
  if (!dev.ok()) return fail(dev.status());
  t.device = *dev;
  if (!o.device_memory.empty()) {
    Result<uint64_t> bytes = parse_bytes(o.device_memory, "--device-memory");
    if (!bytes.ok()) return fail(bytes.status());
    t.device_memory_bytes = *bytes;
  }
  // Where the run writes, checked before anything is built (nothing is created here).
  if (o.given_save_dir) {
    if (Status st = check_save_dir(o.save_dir); !st.ok()) return fail(st);
  }
  // Under mpirun, this process's rank of it: created before the config is
  // read, whose batch keys are checked against its size (Note [World size of the config]).
  Result<comm::CommOptions> copts = comm::apply_comm_environment({});
  if (!copts.ok()) return fail(copts.status());
  std::unique_ptr<comm::Communicator> mpi_comm;
  if (*backend == comm::Backend::kMpi) {
    Result<std::unique_ptr<comm::Communicator>> c = comm::create_mpi_communicator(*copts);
    if (!c.ok()) return fail(c.status().with_context("--backend mpi"));
    mpi_comm = std::move(*c);
  }
  std::optional<TrainWorld> world_of_config;
  if (!o.fit && (!o.host_memory.empty() || !o.nvme_size.empty()))
    return fail(InvalidArgument("--host-memory and --nvme-size are caps for --fit (add --fit), or set "
                                "strata.host_memory_budget in --config"));
  if (!o.fit && !o.fit_grad_dtypes.empty())
    return fail(InvalidArgument("--grad-dtypes is what --fit may choose (add --fit); to train with bf16 gradients "
                                "without a fit, set data_types.grad_accum_dtype in the config"));
  if (!o.fit && !o.fit_optimizer_states.empty())
    return fail(InvalidArgument("--optimizer-states is what --fit may choose (add --fit); to train with 8-bit or bf16 "
                                "optimizer state set strata.optimizer_state_dtype in --config"));
  if (o.fit && (o.given_stage || !o.offload_optimizer.empty() || !o.offload_param.empty()))
    return fail(InvalidArgument("--fit chooses the stage and the offload placement; drop --stage, "
                                "--offload-optimizer and --offload-param"));
  if (!o.config_path.empty() || o.fit) {
    Result<TrainWorld> world = train_world(o, *backend, mpi_comm.get());
    if (!world.ok()) return fail(world.status().with_context(o.config_path.empty() ? "--fit" : "--config"));
    world_of_config = *world;
    Config cfg;
    cfg.source = "defaults";
    cfg.world_size = world_of_config->size;
    if (o.given_dtype) {
      cfg.bf16.enabled = g.param_dtype == DType::kBF16;
      cfg.fp16.enabled = g.param_dtype == DType::kF16;
    }
    if (!o.config_path.empty()) {
      ConfigOptions copt;
      copt.world_size = world_of_config->size;
      copt.world_size_origin = world_of_config->origin;
      // "auto" bucket sizes from the model, as Hugging Face's Trainer resolves them.
      copt.hidden_size = g.n_embd;
      Result<Config> loaded = load_config(o.config_path, copt);
      if (!loaded.ok()) return fail(loaded.status());
      cfg = *loaded;
    }
    const bool printer = mpi_comm == nullptr || mpi_comm->rank() == 0;
    if (o.fit) {
      const int64_t batch = o.given_batch || !cfg.batch.train_micro_batch_size_per_gpu
                                ? o.batch
                                : *cfg.batch.train_micro_batch_size_per_gpu;
      const int64_t accum = o.given_accum || !cfg.batch.gradient_accumulation_steps
                                ? o.grad_accum
                                : *cfg.batch.gradient_accumulation_steps;
      if (batch < 1 || batch > 65536 || accum < 1 || accum > 1'000'000)
        return fail(InvalidArgument(fmt::format("--fit: the micro batch {} (--batch or train_micro_batch_size_per_gpu, "
                                                "1..65536) or the accumulation {} (--grad-accum or "
                                                "gradient_accumulation_steps, 1..1000000) is out of range",
                                                batch, accum)));
      if (!o.given_dtype) g.param_dtype = cfg.precision_dtype();  // given: the only dtype the fit may use
      const uint64_t default_device =
          t.device_memory_bytes != 0 ? t.device_memory_bytes
                                     : default_cpu_device_bytes() / static_cast<uint64_t>(std::max(1, o.ranks));
      FitFlags flags{o.device_memory, o.host_memory, o.nvme_path, o.nvme_size, "", o.fit_optimizer_states,
                     o.fit_grad_dtypes};
      std::string report;
      Result<Config> fitted =
          fit_train_config(cfg, g, flags, default_device, static_cast<int>(world_of_config->size),
                           *backend == comm::Backend::kLocal ? o.ranks : 1, static_cast<int>(batch), o.seq,
                           static_cast<int>(accum), o.given_dtype, report);
      if (!fitted.ok()) return fail(fitted.status());
      if (printer) {
        fmt::print("{}", report);
        std::fflush(stdout);
      }
      cfg = *fitted;
    }
    Status st = apply_config(cfg, o, t, g, printer);
    if (!st.ok()) return fail(st);
  }
  // The host budget is for this process: each local rank gets an equal share.
  if (t.engine.host_memory_budget != 0) t.engine.host_memory_budget /= static_cast<uint64_t>(o.ranks);
  Status placement = apply_placement_flags(o, t);
  if (!placement.ok()) return fail(placement);
  if (Status st = check_nvme_folders(o, t); !st.ok()) return fail(st);
  // Gradients in the parameters' dtype unless the config says otherwise;
  // fp16 without a config gets DeepSpeed's dynamic loss scale.
  if (!t.has_config) {
    t.engine.grad_dtype = g.param_dtype;
    if (g.param_dtype == DType::kF16) t.engine.fp16.enabled = true;
  }
  if (o.steps < 1) return fail(InvalidArgument(fmt::format("--steps {} must be at least 1", o.steps)));
  if (o.step_retries < 0 || o.step_retries > 1000)
    return fail(InvalidArgument(fmt::format("--step-retries {} is out of range 0..1000", o.step_retries)));
  if (o.save_dir.empty() && (o.save_every != 0 || o.keep != 0 || o.save_sync || o.save_slots != 2))
    return fail(InvalidArgument("--save-every, --keep, --save-sync and --save-slots need --save-dir DIR (where to save)"));
  if (o.eval_every < 0) return fail(InvalidArgument(fmt::format("--eval-every {} must be >= 0 (0: only at the end)", o.eval_every)));
  Status valid = g.validate();
  if (!valid.ok()) return fail(valid);

  const std::string data_path = o.data.empty() ? model::default_corpus_path() : o.data;
  Result<model::TextDataset> data = model::TextDataset::load(data_path, t.seq_len);
  if (!data.ok()) return fail(data.status());

  // A save never overwrites a tag: refuse now a run that would reach one
  // (e.g. resumed from an older tag into the same --save-dir), not hours later.
  if (!o.save_dir.empty()) {
    int64_t first = 1;
    if (!o.resume.empty()) {
      Result<offload::CheckpointReader> r = offload::CheckpointReader::open(o.resume);
      if (!r.ok()) return fail(r.status().with_context("--resume"));
      first = r->manifest().scalars.steps_begun + 1;
    }
    std::error_code ec;
    for (const std::filesystem::directory_entry& e : std::filesystem::directory_iterator(o.save_dir, ec)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("global_step", 0) != 0 || name.size() > 30) continue;
      char* end = nullptr;
      const long long step = std::strtoll(name.c_str() + 11, &end, 10);
      if (end == nullptr || *end != '\0' || step < first || step > o.steps) continue;
      if ((o.save_every > 0 && step % o.save_every == 0) || step == o.steps)
        return fail(FailedPrecondition(fmt::format(
            "--save-dir '{}' already holds tag {}, which this run would save again (saves never overwrite); give "
            "another --save-dir, or move that tag away",
            printable(o.save_dir, 256), name)));
    }
  }

  // Communicators: N local ranks, or this process's rank of mpirun (made above).
  std::vector<std::unique_ptr<comm::Communicator>> comms;
  if (*backend == comm::Backend::kLocal) {
    Result<std::vector<std::unique_ptr<comm::Communicator>>> group = comm::create_local_group(o.ranks, *copts);
    if (!group.ok()) return fail(group.status());
    comms = std::move(*group);
  } else if (*backend == comm::Backend::kMpi) {
    comms.push_back(std::move(mpi_comm));
  } else {
    // One rank per process on its GPU 0: give each process one GPU with
    // CUDA_VISIBLE_DEVICES (rank and world from mpirun or STRATA_RANK /
    // STRATA_WORLD_SIZE). Never run here: this build machine has no GPU.
    if (t.device == DeviceKind::kCpu)
      return fail(InvalidArgument("--backend nccl needs --device cuda (NCCL reduces device memory)"));
    comm::NcclOptions nopt;
    nopt.common = *copts;
    nopt.device = 0;
    Result<std::unique_ptr<comm::Communicator>> c = comm::create_nccl_communicator(nopt);
    if (!c.ok()) return fail(c.status().with_context("--backend nccl"));
    comms.push_back(std::move(*c));
  }
  if (world_of_config && comms.front()->world_size() != world_of_config->size)
    return fail(FailedPrecondition(fmt::format(
        "--config '{}': its batch keys were checked for world size {} ({}), but the {} communicator has {} ranks; "
        "make the launcher's world size and the communicator's agree (for nccl outside mpirun: STRATA_WORLD_SIZE "
        "and STRATA_RANK)",
        printable(o.config_path, 256), world_of_config->size, world_of_config->origin, o.backend,
        comms.front()->world_size())));
  const bool printer = comms.front()->rank() == 0;
  const DeviceChoice choice = resolve_device_kind(t.device);

  std::unique_ptr<std::ofstream> log;
  if (printer && !o.json_log.empty()) {
    log = std::make_unique<std::ofstream>(o.json_log, std::ios::trunc);
    if (!*log) return fail(ErrnoStatus(errno, fmt::format("open --json-log '{}'", printable(o.json_log, 256))));
  }
  // Set before the banner, which prints the limit.
  const ComputeThreadLimit compute_threads(o.device_threads);
  const int world = comms.front()->world_size();
  const double baseline = data->unigram_baseline();
  const double flops_per_token = g.train_flops_per_token(t.seq_len);
  if (printer) {
    fmt::print("model    {}\n", g.describe());
    fmt::print("data     {} ({} train / {} validation bytes), unigram baseline {:.4f} nats/token\n", data->name(),
               data->train().size(), data->val().size(), baseline);
    fmt::print("train    device {}, batch {} x seq {} x accum {} x ranks {}, {} steps, {} lr {:g} wd {:g} clip {:g}, "
               "seed {}\n",
               device_kind_name(choice.kind), t.batch, t.seq_len, t.engine.grad_accum, world, o.steps,
               cpu_adam::optimizer_kind_name(t.engine.optimizer), t.engine.hyper.lr, t.engine.hyper.weight_decay,
               t.engine.grad_clip, t.seed);
    if (choice.automatic) fmt::print("device   {}\n", choice.reason);
    if (choice.kind == DeviceKind::kCpu) fmt::print("matmul   {}\n", model::cpu::gemm_backend_description());
    // Asked to keep the compute and the optimizer apart, on too few cores to do it: say so.
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    const int local_ranks = static_cast<int>(comms.size());  // the ranks this process runs
    if (choice.kind == DeviceKind::kCpu && o.device_threads > 0 && o.optimizer_threads > 0 && cores > 0 &&
        (o.device_threads + o.optimizer_threads) * local_ranks > cores)
      fmt::print("note     --device-threads {} + --optimizer-threads {} per rank x {} rank(s) in this process is "
                 "more than this machine's {} cores: the compute and the CPU optimizer share cores\n",
                 o.device_threads, o.optimizer_threads, local_ranks, cores);
    // The NVMe optimizer tier without both pipelines keeps its I/O on the step's path: say how to take it off.
    const std::string pipelines = offload::nvme_pipelines_note(t.engine.offload_optimizer, t.engine.nvme.pipeline_read,
                                                               t.engine.nvme.pipeline_write);
    if (!pipelines.empty()) fmt::print("note     {}\n", pipelines);
    std::fflush(stdout);
  }
  Reporter reporter{o, log.get()};
  Summary summary;
  const Status trained = run_rank_threads(comms, [&](size_t i, comm::Communicator& comm) {
    const bool first = i == 0 && printer;
    return train_rank(o, t, g, *data, choice.kind, comm, first ? &reporter : nullptr, first ? &summary : nullptr);
  });
  if (!trained.ok()) return fail(trained);
  if (!printer) return 0;
  if (t.breakdown) print_breakdown(summary);
  // The mission in one line: state larger than the device, trained anyway.
  fmt::print("memory   rank 0: model state {} (unsharded parameters, gradients, optimizer state); device cap {}, "
             "device peak {} (engine {}, predicted {}; the rest is the model's activations); pinned {} (predicted {}); "
             "nvme {} (predicted {})\n",
             bytes_text(summary.model_state), bytes_text(summary.device_capacity), bytes_text(summary.device_peak),
             bytes_text(summary.measured.device), bytes_text(summary.predicted.device),
             bytes_text(summary.measured.pinned), bytes_text(summary.predicted.pinned),
             bytes_text(summary.measured.nvme), bytes_text(summary.predicted.nvme));
  if (summary.gradients_on_nvme)
    fmt::print("memory   gradient shards on NVMe in {}: {}\n", summary.gradient_folder, summary.gradient_shards_why);
  double median = 0;
  if (!summary.tps.empty()) {
    std::sort(summary.tps.begin(), summary.tps.end());
    median = summary.tps[summary.tps.size() / 2];
  }
  fmt::print("done     val loss {:.4f} vs unigram baseline {:.4f} ({}); median {:.0f} tok/s = {:.2f} GFLOP/s "
             "(model FLOPs {:.3g}/token)\n",
             summary.last_val, baseline, summary.last_val < baseline ? "below" : "NOT below", median,
             median * flops_per_token / 1e9, flops_per_token);
  return 0;
}

CommandRegistration train_command("train", [](CLI::App& root) {
  auto o = std::make_shared<TrainCliOptions>();
  CLI::App* cmd = root.add_subcommand(
      "train", "Train the reference GPT with the ZeRO engine (stages 0-3, cpu offload) on one rank or many");
  cmd->add_option("--preset", o->preset, "Model size: tiny | small | gpt2 | gpt2-medium | 1b")->capture_default_str();
  add_model_shape_flags(*cmd, o->shape, "");
  using model::GptLimits;
  auto* dtype = cmd->add_option("--dtype", o->dtype, "Parameter storage: fp32 | bf16 | fp16 (compute is fp32)");
  cmd->add_option("--steps", o->steps, "Optimizer steps")->capture_default_str();
  auto* batch = cmd->add_option("--batch", o->batch, "Micro batch (sequences per forward)")
                    ->capture_default_str()
                    ->check(CLI::Range(1, 65536));
  cmd->add_option("--seq", o->seq, "Sequence length (at most the model's --max-seq)")
      ->capture_default_str()
      ->check(CLI::Range(1, GptLimits::kMaxSeqLen));
  // gradient_accumulation_steps' range (engine_options.cpp).
  auto* accum = cmd->add_option("--grad-accum", o->grad_accum, "Micro batches per optimizer step")
                    ->capture_default_str()
                    ->check(CLI::Range(1, 1'000'000));
  // Finite, bounded ranges: a flag error names the flag (not the optimizer's field).
  auto* lr = cmd->add_option("--lr", o->lr, "Learning rate")->capture_default_str()->check(CLI::Range(0.0, 1e3));
  auto* wd = cmd->add_option("--weight-decay", o->weight_decay, "Weight decay")
                 ->capture_default_str()
                 ->check(CLI::Range(0.0, 1e3));
  auto* clip = cmd->add_option("--clip", o->clip, "Global gradient-norm clipping (0: off)")
                   ->capture_default_str()
                   ->check(CLI::Range(0.0, 1e6));
  cmd->add_option("--seed", o->seed, "Seed of initial weights and batch order")->capture_default_str();
  // No captured default: without the flag the device is the config's strata.device (apply_config).
  auto* device = cmd->add_option("--device", o->device,
                                 "cpu | cuda | auto (cuda when a GPU is usable, else cpu); default: the config's "
                                 "strata.device (auto unless set) with --config or --fit, else cpu");
  auto* devmem = cmd->add_option("--device-memory", o->device_memory,
                                 "Device memory capacity, e.g. 2GiB (cpu default: a quarter of host memory)");
  cmd->add_option("--config", o->config_path,
                  "DeepSpeed JSON config: ZeRO stage and offload, optimizer, precision, batch, clipping, scheduler");
  cmd->add_option("--json-log", o->json_log, "Write one JSON object per step to this file");
  cmd->add_option("--data", o->data, "Train on this text file (default: the shipped corpus)");
  cmd->add_option("--eval-every", o->eval_every, "Validation loss every N steps (0: only at the end)")
      ->capture_default_str();
  cmd->add_option("--eval-batches", o->eval_batches, "Validation batches per evaluation")
      ->capture_default_str()
      ->check(CLI::Range(1, 1'000'000));
  cmd->add_flag("--quiet", o->quiet, "No per-step progress lines");
  cmd->add_option("--ranks", o->ranks, "Data-parallel ranks as threads of this process (--backend local)")
      ->capture_default_str();
  cmd->add_option("--backend", o->backend,
                  "local | mpi | nccl (mpi and nccl: one process per rank under mpirun; nccl with --device cuda)")
      ->capture_default_str();
  auto* stage = cmd->add_option("--stage", o->stage, "ZeRO stage 0-3 (overrides zero_optimization.stage)");
  cmd->add_option("--offload-optimizer", o->offload_optimizer, "none | cpu | nvme (overrides offload_optimizer.device)");
  cmd->add_option("--offload-param", o->offload_param, "none | cpu | nvme, stage 3 (overrides offload_param.device)");
  auto* nvme_path = cmd->add_option("--nvme-path", o->nvme_path,
                  "Folder on the NVMe drive for --offload-optimizer/--offload-param nvme (overrides the config's "
                  "nvme_path); the run's swap files go to DIR/strata-train-<pid>[-params]/rank<r>/, removed at exit");
  cmd->add_flag("--fit", o->fit,
                "Fit the config (or DeepSpeed's defaults) to --device-memory, --host-memory and --nvme-path at "
                "start-up (strata plan --fit's search) and log the changes");
  cmd->add_option("--host-memory", o->host_memory,
                  "With --fit: pinned host memory for the engine in this process (strata.host_memory_budget)");
  cmd->add_option("--nvme-size", o->nvme_size, "With --fit: NVMe space to plan for instead of --nvme-path's free space");
  cmd->add_option("--optimizer-states", o->fit_optimizer_states,
                  "With --fit: Adam moment storages the search may choose, comma-separated: fp32,bf16,int8 (default: "
                  "the config's strata.optimizer_state_dtype)");
  cmd->add_option("--grad-dtypes", o->fit_grad_dtypes,
                  "With --fit: gradient accumulation dtypes the search may choose, comma-separated: fp32,bf16 "
                  "(default: the config's data_types.grad_accum_dtype, or the training dtype)");
  auto* save_dir = cmd->add_option("--save-dir", o->save_dir,
                  "Save checkpoints into this folder (one tag folder per save, a 'latest' file; atomic, asynchronous)");
  cmd->add_option("--save-every", o->save_every, "Save every K steps (and after the last step); 0: only at the end")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  cmd->add_option("--keep", o->keep, "Keep only the newest N checkpoint tags in --save-dir (0: all)")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_flag("--save-sync", o->save_sync, "Block each step until its save is written and committed");
  cmd->add_option("--step-retries", o->step_retries,
                  "repeat a step that failed and was rolled back on every rank (an NVMe I/O error in the optimizer's "
                  "update) up to N times in the run before giving up (0..1000; default 0)");
  cmd->add_option("--save-slots", o->save_slots,
                  "Host slots (each one piece's fp32 state) between a save's snapshot and its writer")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd->add_option("--resume", o->resume,
                  "Resume from a checkpoint: DIR (its latest tag) or DIR/TAG; --steps stays the total step count");
  cmd->add_option("--overlap-optimizer", o->overlap_optimizer,
                  "on | off: step the optimizer under the next forward (overrides strata.overlap_optimizer)");
  cmd->add_option("--speculative-optimizer", o->speculative_optimizer,
                  "auto | on | off: start each layer's optimizer step under the backward, redone exactly when clipping "
                  "or an overflow says so (overrides strata.speculative_optimizer)");
  cmd->add_option("--optimizer-threads", o->optimizer_threads, "CPU optimizer threads per rank (0: all cores)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  cmd->add_option("--device-threads", o->device_threads,
                  "cpu device: threads for the model's compute (0: all cores); with --optimizer-threads, keeps the two "
                  "on separate cores")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  cmd->callback([o, batch, accum, lr, wd, clip, dtype, device, devmem, stage, nvme_path, save_dir] {
    o->given_batch = batch->count() > 0;
    o->given_accum = accum->count() > 0;
    o->given_lr = lr->count() > 0;
    o->given_wd = wd->count() > 0;
    o->given_clip = clip->count() > 0;
    o->given_dtype = dtype->count() > 0;
    o->given_device = device->count() > 0;
    o->given_device_memory = devmem->count() > 0;
    o->given_stage = stage->count() > 0;
    o->given_nvme_path = nvme_path->count() > 0;
    o->given_save_dir = save_dir->count() > 0;
    exit_with(run_train(*o));
  });
});

}  // namespace
}  // namespace strata::cli

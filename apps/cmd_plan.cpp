// strata plan: for each placement row, the memory per tier (the estimator,
// or the engine's own plan with --model) and the predicted step time on a
// hardware profile (strata/offload/step_time_model.h), with the fastest row
// that fits marked and what bounds each row. The offload autotuner:
//
//   strata plan --params 13B --gpus-per-node 8 --profile examples/profiles/dgx-h100.json
//   strata plan --model small --profile here.json --bench bench.json   # vs strata bench offload
//
// docs/offload-bench.md.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "command.h"
#include "model_shape_flags.h"
#include "config_fit_cli.h"
#include "placement_rows.h"
#include "plan_fit.h"
#include "strata/core/printable.h"
#include "strata/core/config.h"
#include "strata/core/estimator.h"
#include "strata/core/json_file.h"
#include "strata/core/units.h"
#include "strata/model/gpt.h"
#include "strata/offload/engine.h"
#include "strata/offload/hardware_profile.h"
#include "strata/offload/step_time_model.h"

namespace strata::cli {
namespace {

struct PlanOptions {
  std::string params, model, profile, config, configs, matrix = "default", bench, dtypes = "bf16";
  std::string optimizer_states;  // --optimizer-states (when given_optimizer_states)
  ModelShapeFlags shape;  // with --model: overrides of the preset
  int blocks = 0;  // --params: transformer blocks (reduction/gather units); 0: derived
  uint32_t gpus_per_node = 0, nodes = 1;
  int batch = 4, seq = 64, grad_accum = 1;
  bool json = false, binary = false;
  // --fit (plan_fit.h).
  bool fit = false;
  int ranks = 1;
  std::string out;
  FitFlags caps;
  bool given_batch = false, given_accum = false, given_dtype = false, given_optimizer_states = false;
};

int plan_failed(const Status& st) {
  fmt::print(stderr, "strata plan: error: {}\n", printable_message(st.to_string()));
  return st.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

struct Memory {  // per GPU (device) and per node (host, nvme), as `strata estimate` prints them
  nlohmann::ordered_json columns;
  bool fits = true;
  std::string why_not;
};

// --params: the estimator's row, exactly the columns `strata estimate --json` prints.
Result<Memory> estimator_memory(const EstimateInput& base, const PlacementRow& row) {
  EstimateInput in = base;
  const Placement pl{row.stage, row.optimizer, row.param};
  if (row.ratio < 1.0) {  // the estimator plans a partial offload as a config's own row
    in.zero.offload_optimizer.ratio = row.ratio;
    in.config_row = pl;
  } else {
    in.zero.offload_optimizer.ratio = 1.0;
  }
  STRATA_ASSIGN_OR_RETURN(EstimateRow er, estimate_row(in, pl));
  Memory m;
  m.columns = {{"gpu_model_state_bytes", er.gpu_model_state_bytes},
               {"gpu_buffer_bytes", er.gpu_buffer_bytes},
               {"cpu_bytes_per_node", er.cpu_bytes_per_node},
               {"cpu_buffer_bytes_per_node", er.cpu_buffer_bytes_per_node},
               {"nvme_bytes_per_node", er.nvme_bytes_per_node}};
  m.fits = er.fits.value_or(true);
  if (er.gpu_fits == false) m.why_not = "GPU";
  else if (er.cpu_fits == false) m.why_not = "host";
  else if (er.nvme_fits == false) m.why_not = "NVMe";
  return m;
}

// --model: the engine's own plan (plan_engine_memory) on the profile's device (shared_cores: the cpu
// device, else a GPU), the largest over ranks.
Result<Memory> engine_memory(const offload::EngineOptions& base, const PlacementRow& row,
                             std::span<const LayerSpec> layers, int world, const offload::HardwareProfile& hw,
                             int ranks_per_node) {
  const offload::EngineOptions o = row.apply(base);
  offload::EngineMemory worst;
  STRATA_ASSIGN_OR_RETURN(const offload::Partition partition,
                          offload::Partition::create(layers, world, o.sub_group_size));
  for (int r : partition.distinct_ranks()) {  // the same largest as every rank, in O(sub-groups) plans
    STRATA_ASSIGN_OR_RETURN(offload::EngineMemory p, offload::plan_engine_memory(
                                o, layers, world, r,
                                hw.shared_cores ? offload::PlannedDevice::cpu() : offload::PlannedDevice::gpu()));
    worst.device = std::max(worst.device, p.device);
    worst.pinned = std::max(worst.pinned, p.pinned);
    worst.nvme = std::max(worst.nvme, p.nvme);
  }
  Memory m;
  m.columns = {{"device_bytes", worst.device},
               {"pinned_bytes_per_node", worst.pinned * ranks_per_node},
               {"nvme_bytes_per_node", worst.nvme * ranks_per_node}};
  if (worst.device > hw.device_memory_bytes) m.why_not = "GPU";
  else if (worst.pinned * ranks_per_node > hw.host_memory_bytes) m.why_not = "host";
  else if (worst.nvme * ranks_per_node > hw.nvme_bytes) m.why_not = "NVMe";
  m.fits = m.why_not.empty();
  return m;
}

// The ranks: nodes x ranks per node, at most kMaxModeledWorld (the most any
// Strata command models: strata train's launchers, the estimator).
Result<int> plan_world(const PlanOptions& o, uint32_t gpus_per_node) {
  const uint64_t world = uint64_t{gpus_per_node} * o.nodes;
  if (world <= kMaxModeledWorld) return static_cast<int>(world);
  const std::string per_node = o.gpus_per_node ? fmt::format("--gpus-per-node {}", gpus_per_node)
                                               : fmt::format("the profile's gpus_per_node {}", gpus_per_node);
  return InvalidArgument(fmt::format("--nodes {} x {} = {} ranks is more than the {} Strata models; give fewer "
                                     "--nodes or --gpus-per-node",
                                     o.nodes, per_node, world, kMaxModeledWorld));
}

// A `strata bench offload --json` file (--bench): the median step of each
// row that ran ("status": "ok"), by label.
struct BenchMeasuredRow {
  std::string label;
  double step_ms = 0;
};

Result<BenchMeasuredRow> bench_measured_row(const nlohmann::ordered_json& row, const std::string& where) {
  if (!row.is_object() || !row.contains("label") || !row["label"].is_string() || !row.contains("status") ||
      !row["status"].is_string())
    return InvalidArgument(fmt::format("{}: a row needs a string \"label\" and \"status\"", where));
  BenchMeasuredRow m{row["label"].get<std::string>(), 0};
  if (row["status"].get<std::string>() != "ok") return m;
  const nlohmann::ordered_json* median =
      row.contains("step_ms") && row["step_ms"].is_object() && row["step_ms"].contains("median")
          ? &row["step_ms"]["median"]
          : nullptr;
  if (median == nullptr || !median->is_number() || !(median->get<double>() > 0) ||
      !std::isfinite(median->get<double>()))
    return InvalidArgument(fmt::format("{}.step_ms.median must be a positive number of milliseconds", where));
  m.step_ms = median->get<double>();
  return m;
}

Result<std::vector<BenchMeasuredRow>> load_bench_result(const std::string& path) {
  // A bench of a few hundred rows with every statistic weighs well under a megabyte.
  constexpr uint64_t kMaxBenchBytes = uint64_t{16} << 20;
  Result<nlohmann::ordered_json> read = read_json_file(
      path, {.what = "bench result", .flag = "", .hint = "give the file strata bench offload --json wrote"},
      {.max_bytes = kMaxBenchBytes});
  if (!read.ok()) return read.status().with_context("--bench");
  const nlohmann::ordered_json& doc = *read;
  const std::string where = fmt::format("--bench '{}'", printable(path, 256));
  if (!doc.is_object() || !doc.contains("bench") || doc["bench"] != "offload" || !doc.contains("rows") ||
      !doc["rows"].is_array())
    return InvalidArgument(fmt::format("{} is not the JSON of strata bench offload (it has \"bench\": \"offload\" "
                                       "and \"rows\")",
                                       where));
  std::vector<BenchMeasuredRow> rows;
  for (size_t i = 0; i < doc["rows"].size(); ++i) {
    STRATA_ASSIGN_OR_RETURN(BenchMeasuredRow m,
                            bench_measured_row(doc["rows"][i], fmt::format("{}: rows[{}]", where, i)));
    if (m.step_ms > 0) rows.push_back(std::move(m));
  }
  return rows;
}

int run_plan(const PlanOptions& o) {
  if (o.fit) {
    if (!o.configs.empty() || !o.bench.empty() || o.matrix != "default" || o.gpus_per_node != 0 || o.nodes != 1 ||
        o.binary)
      return plan_failed(
          InvalidArgument("--configs, --bench, --matrix, --gpus-per-node, --nodes and --binary do not apply "
                          "to --fit (it searches every placement on --ranks ranks of one node)"));
    PlanFitArgs a;
    a.params = o.params, a.model = o.model, a.config = o.config, a.profile = o.profile, a.out = o.out;
    a.shape = o.shape;
    a.blocks = o.blocks, a.ranks = o.ranks, a.batch = o.batch, a.seq = o.seq, a.grad_accum = o.grad_accum;
    a.given_batch = o.given_batch, a.given_accum = o.given_accum, a.given_dtype = o.given_dtype;
    a.caps = o.caps;
    a.caps.dtypes = o.dtypes;
    if (o.given_optimizer_states) a.caps.optimizer_states = o.optimizer_states;
    a.json = o.json;
    return run_plan_fit(a);
  }
  if (!o.out.empty() || !o.caps.device_memory.empty() || !o.caps.host_memory.empty() || !o.caps.nvme_path.empty() ||
      !o.caps.nvme_size.empty() || !o.caps.grad_dtypes.empty() || o.ranks != 1)
    return plan_failed(
        InvalidArgument("--out, --device-memory, --host-memory, --nvme-path, --nvme-size, --grad-dtypes and "
                        "--ranks belong to --fit (fit a config to these caps); add --fit"));
  if (o.profile.empty())
    return plan_failed(
        InvalidArgument("give --profile P.json (strata report --calibrate writes one; "
                        "examples/profiles/ has others)"));
  Result<offload::HardwareProfile> hw = offload::load_hardware_profile(o.profile);
  if (!hw.ok()) return plan_failed(hw.status().with_context("--profile"));
  if (o.params.empty() == o.model.empty())
    return plan_failed(
        InvalidArgument("give exactly one of --params (e.g. 13B) or --model (a preset, for the engine's plan)"));
  Result<std::vector<DType>> dtypes = parse_dtype_list(o.dtypes, "--dtype");
  if (!dtypes.ok()) return plan_failed(dtypes.status());
  const uint32_t gpn = o.gpus_per_node ? o.gpus_per_node : static_cast<uint32_t>(hw->gpus_per_node);
  Result<int> world_or = plan_world(o, gpn);
  if (!world_or.ok()) return plan_failed(world_or.status());
  const int world = *world_or;
  const int ranks_per_node = static_cast<int>(gpn);

  std::optional<Config> config;
  if (!o.config.empty()) {
    ConfigOptions copt;
    copt.world_size = world;
    // "auto" bucket sizes from the model's hidden size, as Hugging Face's Trainer resolves them.
    if (!o.model.empty()) {
      if (Result<model::GptConfig> p = model::preset(o.model); p.ok()) copt.hidden_size = o.shape.embd ? o.shape.embd : p->n_embd;
    }
    Result<Config> c = load_config(o.config, copt);
    if (!c.ok()) return plan_failed(c.status());
    config = *c;
  }
  // --optimizer-states: rows per storage; else the rows keep the config's (or fp32).
  Result<std::vector<cpu_adam::MomentStorage>> moments =
      o.given_optimizer_states ? parse_moment_list(o.optimizer_states, "--optimizer-states")
                               : Result<std::vector<cpu_adam::MomentStorage>>(std::vector<cpu_adam::MomentStorage>{});
  if (!moments.ok()) return plan_failed(moments.status());
  Result<std::vector<PlacementRow>> selected = select_rows(o.configs, o.matrix, *dtypes, *moments);
  if (!selected.ok()) return plan_failed(selected.status());
  std::vector<PlacementRow> rows = std::move(*selected);

  // The model: a parameter count (FLOPs 6 per parameter and token) or a preset's exact layers.
  uint64_t params = 0;
  double flops_per_token = 0;
  int units = 1;
  std::unique_ptr<model::GptModel> gpt;
  std::optional<model::GptConfig> shape;  // --model: the layers per row dtype come from it
  std::string describe;
  if (!o.params.empty()) {
    Result<uint64_t> n = parse_count(o.params, "--params");
    if (!n.ok()) return plan_failed(n.status());
    if (*n == 0) return plan_failed(InvalidArgument("--params must be > 0, e.g. 13B"));
    params = *n;
    flops_per_token = 6.0 * static_cast<double>(params);
    // Blocks of a GPT of this size (about 12 C^2 parameters per block with L ~ C / 128) unless given.
    units = o.blocks ? o.blocks : std::max(1, static_cast<int>(std::lround(std::cbrt(params / 12.0 / 128.0 / 128.0))));
    describe = fmt::format("{} parameters, {} blocks{}", format_count(params), units, o.blocks ? "" : " (derived)");
  } else {
    Result<model::GptConfig> preset = model::preset(o.model);
    if (!preset.ok()) return plan_failed(preset.status().with_context("--model"));
    model::GptConfig g = *preset;
    o.shape.apply_to(g);
    g.param_dtype = dtypes->front();
    if (Status v = g.validate(); !v.ok()) return plan_failed(v);
    if (o.seq > g.max_seq_len)
      return plan_failed(
          InvalidArgument(fmt::format("--seq {} is longer than the model's max_seq {}", o.seq, g.max_seq_len)));
    Result<std::unique_ptr<model::GptModel>> m = model::GptModel::create(g, 1);
    if (!m.ok()) return plan_failed(m.status());
    gpt = std::move(*m);
    shape = g;
    params = static_cast<uint64_t>(g.param_count());
    flops_per_token = g.train_flops_per_token(o.seq);
    units = static_cast<int>(gpt->layers().size());
    describe = g.describe();
  }

  EstimateInput est;
  est.params = params;
  est.gpus_per_node = gpn;
  est.nodes = o.nodes;
  est.gpu_memory_bytes = hw->device_memory_bytes;
  est.cpu_memory_bytes = hw->host_memory_bytes;
  est.nvme_memory_bytes = hw->nvme_bytes;
  offload::EngineOptions engine_base;
  if (config) est.from_config(*config);
  if (!gpt) {
    // What `strata estimate` refuses (byte counts past 2^64, ...): estimate_row, per row below, saturates silently.
    if (Result<Estimate> checked = estimate_memory(est); !checked.ok()) return plan_failed(checked.status());
  }
  if (config) {
    Config runnable = *config;
    runnable.zero_optimization.offload_optimizer.ratio = 1.0;
    Result<offload::EngineOptions> eo = offload::engine_options_from_config(runnable);
    if (!eo.ok()) return plan_failed(eo.status());
    engine_base = *eo;
  }
  // A row without its own moments is planned with the config's (fp32 without
  // one), so its memory, model and runnability all see the same storage.
  for (PlacementRow& row : rows)
    if (!row.moments) row.moments = engine_base.moments;
  // A config's strata.gradient_shards nvme applies to the rows that can hold
  // them on NVMe (the optimizer state there, ratio 1); the others plan them
  // as auto would.
  if (engine_base.gradient_shards == offload::GradientShardsMode::kNvme)
    for (PlacementRow& row : rows)
      if (!row.gradient_shards)
        row.gradient_shards = row.placement().optimizer_on_nvme() && row.ratio == 1.0
                                  ? offload::GradientShardsMode::kNvme
                                  : offload::GradientShardsMode::kAuto;

  nlohmann::ordered_json doc;
  doc["profile"] = hw->name;
  doc["profile_file"] = o.profile;
  doc["model"] = describe;
  doc["params"] = params;
  doc["world_size"] = world;
  doc["gpus_per_node"] = gpn;
  doc["batch"] = o.batch;
  doc["seq"] = o.seq;
  doc["grad_accum"] = o.grad_accum;
  doc["tokens_per_rank"] = static_cast<double>(o.batch) * o.seq * o.grad_accum;
  doc["flops_per_token"] = flops_per_token;
  doc["memory_source"] = gpt ? "engine plan (plan_engine_memory), per rank device, per node host and nvme; the "
                               "model's activations are not in it"
                             : "estimator (strata estimate), per GPU and per node; activations are not in it";
  doc["rows"] = nlohmann::ordered_json::array();

  std::optional<std::vector<BenchMeasuredRow>> bench;
  if (!o.bench.empty()) {
    Result<std::vector<BenchMeasuredRow>> b = load_bench_result(o.bench);
    if (!b.ok()) return plan_failed(b.status());
    bench = std::move(*b);
  }

  std::optional<size_t> fastest;
  double fastest_ms = 0;
  std::vector<double> errors;
  for (size_t i = 0; i < rows.size(); ++i) {
    const PlacementRow& row = rows[i];
    nlohmann::ordered_json j;
    j["index"] = i;
    j["label"] = row.label();
    j["stage"] = row.stage;
    j["offload_optimizer"] = std::string(offload_device_name(row.optimizer));
    j["offload_param"] = std::string(offload_device_name(row.param));
    j["ratio"] = row.ratio;
    j["dtype"] = std::string(dtype_name(row.dtype));
    j["optimizer_state_dtype"] = std::string(row.moments->name());
    j["gradient_shards"] = row.gradients_on_nvme() ? "nvme" : "pinned";
    // The memory of every placement the estimator prints, runnable here or not.
    const std::string why = row.unsupported_reason();
    if (!gpt || why.empty()) {
      std::unique_ptr<model::GptModel> typed;  // the layers in this row's dtype
      if (shape) {
        model::GptConfig g = *shape;
        g.param_dtype = row.dtype;
        Result<std::unique_ptr<model::GptModel>> m = model::GptModel::create(g, 1);
        if (!m.ok()) return plan_failed(m.status());
        typed = std::move(*m);
      }
      Result<Memory> mem = gpt ? engine_memory(engine_base, row, typed->layers(), world, *hw, ranks_per_node)
                               : estimator_memory(est, row);
      if (!mem.ok()) return plan_failed(mem.status().with_context(row.label()));
      j["memory"] = mem->columns;
      j["fits"] = mem->fits;
      if (!mem->fits) j["does_not_fit"] = mem->why_not;
      if (!mem->fits && gpt && why.empty()) {
        // Which knobs make this row fit, and to what (the --fit search for this placement).
        const Config defaults;
        Result<offload::FitRequest> req = gpt_fit_request(*shape, config ? *config : defaults, world, o.batch, o.seq,
                                                          o.grad_accum, *hw);
        if (req.ok()) {
          offload::FitCaps caps;
          caps.device_bytes = hw->device_memory_bytes;
          caps.host_bytes = hw->host_memory_bytes;
          caps.nvme_bytes = hw->nvme_bytes;
          caps.ranks_per_node = std::min(world, ranks_per_node);
          if (caps.device_bytes != 0 && caps.host_bytes != 0)
            j["to_fit"] = fit_hint(*req, caps, row.stage, row.optimizer, row.param, row.ratio, row.dtype,
                                   *row.moments);
        }
      }
    }
    j["runnable"] = why.empty();
    if (!why.empty()) {
      j["reason"] = why;
      doc["rows"].push_back(j);
      continue;
    }
    const bool fits = j["fits"].get<bool>();
    offload::StepTimeInput in;
    if (shape) {
      in = gpt_step_input(*shape, row, world, o.batch, o.seq, o.grad_accum,
                          config ? config->zero_optimization.stage3_param_persistence_threshold
                                 : offload::EngineOptions{}.persistence_threshold);
    } else {
      in.params = params;
      in.layers = units;
      in.world = world;
      in.tokens_per_rank = doc["tokens_per_rank"].get<double>();
      in.flops_per_token = flops_per_token;
      in.placement = row.placement();
      in.ratio = row.ratio;
      in.param_dtype = in.grad_dtype = row.dtype;
      in.gradients_on_nvme = row.gradients_on_nvme();
    }
    in.moments = *row.moments;
    in.nvme_pipeline = row.pipeline_read.value_or(false) && row.pipeline_write.value_or(false);
    if (config) {
      const Result<offload::SpeculationMode> mode =
          offload::parse_speculation_mode(config->strata.speculative_optimizer, "strata.speculative_optimizer");
      if (mode.ok()) in.speculation = *mode;
      in.max_live_parameters = config->zero_optimization.stage3_max_live_parameters;
      in.max_in_cpu = config->zero_optimization.offload_param.max_in_cpu;
      // A row's own pipeline keys over the config's.
      in.nvme_pipeline = row.pipeline_read.value_or(config->zero_optimization.offload_optimizer.pipeline_read) &&
                         row.pipeline_write.value_or(config->zero_optimization.offload_optimizer.pipeline_write);
    }
    Result<offload::StepTimePrediction> pr = offload::predict_step_time(in, *hw);
    if (!pr.ok()) return plan_failed(pr.status().with_context(row.label()));
    const auto& b = pr->bytes;
    j["predicted"] = {{"step_ms", pr->step_ms},
                      {"ideal_ms", pr->ideal_ms},
                      {"tokens_per_s", pr->tokens_per_s},
                      {"compute_ms", pr->compute_ms},
                      {"optimizer_ms", pr->optimizer_ms},
                      {"update_ms", pr->update_ms},
                      {"grad_ms", pr->grad_ms},
                      {"param_ms", pr->param_ms},
                      {"nvme_ms", pr->nvme_ms},
                      {"exposed_ms",
                       {{"optimizer", pr->exposed_optimizer_ms},
                        {"reduce", pr->exposed_reduce_ms},
                        {"gather", pr->exposed_gather_ms}}},
                      {"bytes_per_step",
                       {{"h2d", b.h2d},
                        {"d2h", b.d2h},
                        {"gather", b.gather},
                        {"reduce", b.reduce},
                        {"nvme_read", b.nvme_read},
                        {"nvme_write", b.nvme_write}}},
                      {"bound", pr->bound}};
    if (bench) {
      for (const BenchMeasuredRow& br : *bench)
        if (br.label == row.label()) {
          const double measured = br.step_ms;
          const double err = pr->step_ms / measured - 1.0;
          j["measured_step_ms"] = measured;
          j["error"] = err;
          errors.push_back(std::abs(err));
        }
    }
    if (fits && (!fastest || pr->step_ms < fastest_ms)) fastest = i, fastest_ms = pr->step_ms;
    doc["rows"].push_back(j);
  }
  doc["fastest_fitting_row"] = fastest ? nlohmann::ordered_json(*fastest) : nlohmann::ordered_json(nullptr);
  if (bench && !errors.empty()) {
    doc["max_abs_error"] = *std::max_element(errors.begin(), errors.end());
    doc["rows_compared"] = errors.size();
  }
  if (o.json) {
    fmt::print("{}\n", doc.dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
    return 0;
  }
  fmt::print("plan: {} on {} rank(s) ({} per node), batch {} x seq {} x accum {} per rank; profile {}\n", describe,
             world, gpn, o.batch, o.seq, o.grad_accum, printable(hw->name, 256));
  for (DType dt : *dtypes)
    if (std::string note = offload::compute_dtype_note(*hw, dt); !note.empty()) fmt::print("{}\n", note);
  fmt::print("memory: {}\n", doc["memory_source"].get<std::string>());
  auto bytes = [&](const nlohmann::ordered_json& v) { return format_bytes(v.get<uint64_t>(), o.binary); };
  fmt::print("{:<45} {:>5} {:>11} {:>11} {:>11} | {:>10} {:>12} {:>9} {:>9} {:>9} | {:<24}{}\n", "row", "fits",
             gpt ? "device" : "gpu", "host/node", "nvme/node", "step ms", "tokens/s", "exp opt", "exp red", "exp gath",
             "bound", bench ? "  measured   error" : "");
  for (const auto& j : doc["rows"]) {
    if (!j["runnable"].get<bool>()) {
      fmt::print("{:<45} {:>5}  {}\n", j["label"].get<std::string>(), "-", j["reason"].get<std::string>());
      continue;
    }
    const auto& m = j["memory"];
    const std::string dev = gpt ? bytes(m["device_bytes"])
                                : format_bytes(m["gpu_model_state_bytes"].get<uint64_t>() + m["gpu_buffer_bytes"].get<uint64_t>(), o.binary);
    const std::string host = gpt ? bytes(m["pinned_bytes_per_node"])
                                 : format_bytes(m["cpu_bytes_per_node"].get<uint64_t>() + m["cpu_buffer_bytes_per_node"].get<uint64_t>(), o.binary);
    const auto& p = j["predicted"];
    std::string cmp;
    if (j.contains("measured_step_ms"))
      cmp = fmt::format("  {:>8.2f} {:>+6.1f}%", j["measured_step_ms"].get<double>(), 100 * j["error"].get<double>());
    const bool best = fastest && *fastest == j["index"].get<size_t>();
    // Past 12 digits (worlds of millions of ranks) tokens/s goes to 4 significant digits, keeping the column.
    const double tokens_per_s = p["tokens_per_s"].get<double>();
    const std::string tokens = tokens_per_s < 1e12 ? fmt::format("{:.0f}", tokens_per_s) : fmt::format("{:.4g}", tokens_per_s);
    fmt::print("{:<45} {:>5} {:>11} {:>11} {:>11} | {:>10.2f} {:>12} {:>9.2f} {:>9.2f} {:>9.2f} | {:<24}{}{}\n",
               j["label"].get<std::string>(), j["fits"].get<bool>() ? "yes" : "NO " + j["does_not_fit"].get<std::string>(),
               dev, host, bytes(m["nvme_bytes_per_node"]), p["step_ms"].get<double>(), tokens,
               p["exposed_ms"]["optimizer"].get<double>(), p["exposed_ms"]["reduce"].get<double>(),
               p["exposed_ms"]["gather"].get<double>(), p["bound"].get<std::string>(), cmp,
               best ? "  <- fastest that fits" : "");
    if (j.contains("to_fit")) fmt::print("{:<34}   to fit: {}\n", "", printable(j["to_fit"].get<std::string>(), 1000));
  }
  if (doc.contains("max_abs_error"))
    fmt::print("vs --bench: {} rows compared, largest error {:.1f}%\n", doc["rows_compared"].get<size_t>(),
               100 * doc["max_abs_error"].get<double>());
  if (!fastest) fmt::print("no row fits this profile's memory\n");
  return 0;
}

CommandRegistration plan_command("plan", [](CLI::App& root) {
  auto o = std::make_shared<PlanOptions>();
  CLI::App* cmd = root.add_subcommand(
      "plan", "Memory per tier and predicted step time of every placement on a hardware profile; the fastest that fits");
  cmd->add_option("--params", o->params, "Parameter count: 13B, 7e9 (memory from the estimator)");
  cmd->add_option("--model", o->model, "A model preset (tiny, small, gpt2, ...): memory from the engine's own plan");
  add_model_shape_flags(*cmd, o->shape, "With --model: ");
  cmd->add_option("--blocks", o->blocks, "With --params: transformer blocks (default: derived from the size)")
      ->check(CLI::Range(1, 100000));
  cmd->add_option("--profile", o->profile, "Hardware profile JSON (strata report --calibrate, examples/profiles/)");
  cmd->add_option("--config", o->config, "DeepSpeed config: precision and buffer settings for every row");
  cmd->add_option("--gpus-per-node", o->gpus_per_node, "Ranks per node (default: the profile's)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--nodes", o->nodes, "Nodes")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  auto* batch = cmd->add_option("--batch", o->batch, "Micro batch per rank")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--seq", o->seq, "Sequence length")->capture_default_str()->check(CLI::Range(1, 1 << 24));
  auto* accum = cmd->add_option("--grad-accum", o->grad_accum, "Micro batches per step")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  auto* dtype = cmd->add_option("--dtype", o->dtypes, "Parameter dtype(s) of the rows, comma-separated")->capture_default_str();
  auto* states = cmd->add_option("--optimizer-states", o->optimizer_states,
                                 "Adam moment storage(s), comma-separated: fp32,bf16,int8: a default matrix per "
                                 "storage (int8: offloaded rows only), or with --fit the storages the search may use; "
                                 "without it the rows and the fit keep the config's strata.optimizer_state_dtype "
                                 "(fp32 without a config)");
  cmd->add_option("--matrix", o->matrix, "default: the 16 placements + stage-3 ratios 0.25/0.5/0.75")->capture_default_str();
  cmd->add_option("--configs", o->configs, "Row file (as strata bench offload --configs)");
  cmd->add_option("--bench", o->bench, "A strata bench offload --json file: add the measured step and the error per row");
  cmd->add_flag("--json", o->json, "Print JSON");
  cmd->add_flag("--binary", o->binary, "GiB instead of GB");
  cmd->add_flag("--fit", o->fit,
                "Search the placements and knobs for the configs whose engine plan fits the caps below; write the "
                "fastest to --out as a complete DeepSpeed config (docs/offload-bench.md, \"Make it fit\")");
  cmd->add_option("--device-memory", o->caps.device_memory, "With --fit: the device's capacity per rank, e.g. 2GiB");
  cmd->add_option("--host-memory", o->caps.host_memory,
                  "With --fit: pinned host memory for the engine on this node (strata.host_memory_budget), e.g. 8GiB");
  cmd->add_option("--nvme-path", o->caps.nvme_path,
                  "With --fit: a folder on the NVMe drive (its free space bounds the NVMe state); none: no NVMe");
  cmd->add_option("--nvme-size", o->caps.nvme_size, "With --fit: NVMe space to plan for instead of the free space");
  cmd->add_option("--grad-dtypes", o->caps.grad_dtypes,
                  "With --fit: gradient accumulation dtypes (data_types.grad_accum_dtype) the search may use, "
                  "comma-separated: fp32,bf16 (default: the config's, or the training dtype)");
  cmd->add_option("--ranks", o->ranks, "With --fit: data-parallel ranks (on this node)")
      ->capture_default_str()
      ->check(CLI::Range(1, 65536));
  cmd->add_option("--out", o->out, "With --fit: write the fitted DeepSpeed config here (atomically)");
  cmd->callback([o, batch, accum, dtype, states] {
    o->given_batch = batch->count() > 0;
    o->given_accum = accum->count() > 0;
    o->given_dtype = dtype->count() > 0;
    o->given_optimizer_states = states->count() > 0;
    exit_with(run_plan(*o));
  });
});

}  // namespace
}  // namespace strata::cli

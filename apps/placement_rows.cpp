// Placement rows shared by `strata bench offload` and `strata plan`: see placement_rows.h.
#include "placement_rows.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "engine_run.h"
#include "strata/core/estimator.h"
#include "strata/core/json_file.h"
#include "strata/core/printable.h"

namespace strata::cli {

namespace {

// Two decimals as the default matrix's ratios print ("r=0.25"), else the
// shortest text that reads back as the same double ("r=1e-300", "r=0.333"):
// a row file's ratio is never shown as 0.00 and no two ratios share a label
// (plan --bench matches rows by label).
std::string ratio_text(double ratio) {
  const std::string two_decimals = fmt::format("{:.2f}", ratio);
  return std::strtod(two_decimals.c_str(), nullptr) == ratio ? two_decimals : fmt::format("{}", ratio);
}

// A user's JSON value in a message: bounded, control characters escaped.
std::string row_value_text(const nlohmann::ordered_json& v) { return printable(v.dump(), 64); }

}  // namespace

std::string PlacementRow::label() const {
  std::string s = fmt::format("s{} opt={} param={}", stage, offload_device_name(optimizer), offload_device_name(param));
  if (ratio < 1.0) s += " r=" + ratio_text(ratio);
  s += " " + std::string(dtype_name(dtype));
  if (moments && *moments != cpu_adam::MomentStorage::fp32()) s += fmt::format(" m={}", moments->name());
  if (gradients_on_nvme()) s += " grads=nvme";
  if (speculation && *speculation != offload::SpeculationMode::kAuto)
    s += fmt::format(" early={}", offload::speculation_mode_name(*speculation));
  if (pipeline_read || pipeline_write) {
    const bool read = pipeline_read.value_or(false), write = pipeline_write.value_or(false);
    s += fmt::format(" pipe={}{}{}", read ? "r" : "", write ? "w" : "", !read && !write ? "off" : "");
  }
  return s;
}

std::string PlacementRow::unsupported_reason() const {
  if (stage < 0 || stage > 3) return fmt::format("stage {} is not 0-3", stage);
  const Placement choice = placement();
  if (choice.optimizer_offloaded() && !choice.optimizer_sharded())
    return "stage 0 keeps the optimizer state on the device (offload needs stage 1-3)";
  if (choice.params_offloaded() && !choice.params_sharded()) return "parameter offload needs stage 3";
  if (choice.params_offloaded() && !choice.optimizer_offloaded())
    return "the engine keeps parameters off the device only with the optimizer off it too (offload_optimizer cpu "
           "or nvme)";
  if (ratio < 1.0 && !(choice.params_sharded() && choice.optimizer_in_host_memory() && !choice.params_offloaded()))
    return "ratio < 1 needs stage 3, optimizer cpu, params none";
  if (moments && moments->blocked() && !choice.optimizer_offloaded())
    return "int8 optimizer states need the optimizer state offloaded (cpu or nvme)";
  if (moments && moments->blocked() && ratio < 1.0) return "int8 optimizer states need ratio 1 (no device part)";
  if (gradients_on_nvme()) {
    const std::string blocker = offload::gradient_shards_nvme_blocker(placement(), ratio);
    if (!blocker.empty()) return "gradient shards on NVMe: " + blocker;
  }
  if (speculation == offload::SpeculationMode::kOn &&
      !offload::early_updates_allowed(offload::SpeculationMode::kOn, placement()))
    return "speculative_optimizer on needs the optimizer state offloaded (cpu or nvme)";
  if ((pipeline_read || pipeline_write) && !choice.optimizer_on_nvme())
    return "pipeline_read and pipeline_write are the NVMe optimizer tier's (offload_optimizer nvme)";
  return "";
}

offload::EngineOptions PlacementRow::apply(offload::EngineOptions o) const {
  o.stage = stage;
  o.offload_optimizer = optimizer;
  o.offload_param = param;
  o.ratio = ratio;
  o.grad_dtype = dtype;
  o.fp16.enabled = dtype == DType::kF16;
  if (moments) o.moments = *moments;
  if (gradient_shards) o.gradient_shards = *gradient_shards;
  if (o.gradient_shards == offload::GradientShardsMode::kNvme &&
      !offload::gradient_shards_nvme_blocker(placement(), ratio).empty())
    o.gradient_shards = offload::GradientShardsMode::kAuto;
  if (speculation) o.speculative_optimizer = *speculation;
  if (pipeline_read) o.nvme.pipeline_read = *pipeline_read;
  if (pipeline_write) o.nvme.pipeline_write = *pipeline_write;
  return o;
}

std::vector<PlacementRow> default_matrix(const std::vector<DType>& dtypes,
                                         const std::vector<cpu_adam::MomentStorage>& moments) {
  std::vector<PlacementRow> rows;
  std::vector<std::optional<cpu_adam::MomentStorage>> storages(moments.begin(), moments.end());
  if (storages.empty()) storages.push_back(std::nullopt);  // the base options' moments
  for (const std::optional<cpu_adam::MomentStorage>& m : storages)
    for (DType dt : dtypes) {
      std::vector<PlacementRow> these;
      for (const Placement& p : estimate_placements())
        these.push_back({p.stage, p.optimizer, p.param, 1.0, dt, m, std::nullopt, std::nullopt, std::nullopt, std::nullopt});
      for (double r : {0.25, 0.5, 0.75})
        these.push_back({3, OffloadDevice::kCpu, OffloadDevice::kNone, r, dt, m, std::nullopt, std::nullopt, std::nullopt,
                         std::nullopt});
      // fp32 keeps every placement (plan prints the memory of those the engine
      // cannot run, too); other storages only add the rows they can run.
      for (const PlacementRow& row : these)
        if (!m || *m == cpu_adam::MomentStorage::fp32() || row.unsupported_reason().empty()) rows.push_back(row);
    }
  return rows;
}

Result<std::vector<cpu_adam::MomentStorage>> parse_moment_list(const std::string& text, const char* flag) {
  std::vector<cpu_adam::MomentStorage> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    STRATA_ASSIGN_OR_RETURN(cpu_adam::MomentStorage m, cpu_adam::MomentStorage::parse(item, flag));
    if (std::find(out.begin(), out.end(), m) != out.end())
      return InvalidArgument(fmt::format("{} lists {} twice; give each storage once (each one adds its rows)", flag,
                                         m.name()));
    out.push_back(m);
  }
  if (out.empty()) return InvalidArgument(fmt::format("{} is empty; use fp32, bf16 or int8", flag));
  return out;
}

Result<std::vector<DType>> parse_dtype_list(const std::string& text, const char* flag, const char* what) {
  std::vector<DType> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    Result<DType> dt = parse_dtype(item);
    if (!dt.ok() || !is_state_float(*dt))
      return InvalidArgument(fmt::format("{} '{}' is not a {} dtype; use fp32, bf16 or fp16 (comma-separated)", flag,
                                         printable(item, 64), what));
    if (std::find(out.begin(), out.end(), *dt) != out.end())
      return InvalidArgument(fmt::format("{} lists {} twice; give each dtype once (comma-separated)", flag,
                                         dtype_name(*dt)));
    out.push_back(*dt);
  }
  if (out.empty()) return InvalidArgument(fmt::format("{} is empty; use fp32, bf16 or fp16", flag));
  return out;
}

namespace {

Result<PlacementRow> parse_row(const nlohmann::ordered_json& j, const std::string& where, DType default_dtype) {
  if (!j.is_object()) return InvalidArgument(fmt::format("{}: a row must be an object like {{\"stage\": 3}}", where));
  PlacementRow row;
  row.dtype = default_dtype;
  bool has_stage = false;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    const std::string at = fmt::format("{}.{}", where, printable(key, 64));
    if (key == "stage") {
      if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > 3)
        return InvalidArgument(fmt::format("{}: {} is not 0, 1, 2 or 3", at, row_value_text(*it)));
      row.stage = static_cast<int>(it->get<int64_t>());
      has_stage = true;
    } else if (key == "offload_optimizer" || key == "offload_param") {
      if (!it->is_string()) return InvalidArgument(fmt::format("{}: {} is not \"none\", \"cpu\" or \"nvme\"", at, row_value_text(*it)));
      STRATA_ASSIGN_OR_RETURN(OffloadDevice d, parse_offload(it->get<std::string>(), at.c_str()));
      (key == "offload_optimizer" ? row.optimizer : row.param) = d;
    } else if (key == "ratio") {
      if (!it->is_number() || !(it->get<double>() > 0.0 && it->get<double>() <= 1.0))
        return InvalidArgument(fmt::format("{}: {} is not in (0, 1]", at, row_value_text(*it)));
      row.ratio = it->get<double>();
    } else if (key == "dtype") {
      if (!it->is_string()) return InvalidArgument(fmt::format("{}: {} is not \"fp32\", \"bf16\" or \"fp16\"", at, row_value_text(*it)));
      STRATA_ASSIGN_OR_RETURN(std::vector<DType> dts, parse_dtype_list(it->get<std::string>(), at.c_str()));
      if (dts.size() != 1) return InvalidArgument(fmt::format("{}: give one dtype per row", at));
      row.dtype = dts.front();
    } else if (key == "optimizer_state_dtype") {
      if (!it->is_string()) return InvalidArgument(fmt::format("{}: {} is not \"fp32\", \"bf16\" or \"int8\"", at, row_value_text(*it)));
      STRATA_ASSIGN_OR_RETURN(row.moments, cpu_adam::MomentStorage::parse(it->get<std::string>(), at));
    } else if (key == "gradient_shards") {
      if (!it->is_string()) return InvalidArgument(fmt::format("{}: {} is not \"auto\", \"pinned\" or \"nvme\"", at, row_value_text(*it)));
      STRATA_ASSIGN_OR_RETURN(row.gradient_shards, offload::parse_gradient_shards_mode(it->get<std::string>(), at));
    } else if (key == "speculative_optimizer") {
      if (!it->is_string()) return InvalidArgument(fmt::format("{}: {} is not \"auto\", \"on\" or \"off\"", at, row_value_text(*it)));
      STRATA_ASSIGN_OR_RETURN(row.speculation, offload::parse_speculation_mode(it->get<std::string>(), at));
    } else if (key == "pipeline_read" || key == "pipeline_write") {
      if (!it->is_boolean()) return InvalidArgument(fmt::format("{}: {} is not true or false", at, row_value_text(*it)));
      (key == "pipeline_read" ? row.pipeline_read : row.pipeline_write) = it->get<bool>();
    } else {
      return InvalidArgument(fmt::format(
          "{}: unknown key '{}' (a row has stage, offload_optimizer, offload_param, ratio, dtype, "
          "optimizer_state_dtype, gradient_shards, speculative_optimizer, pipeline_read, pipeline_write)", where,
          printable(key, 64)));
    }
  }
  if (!has_stage) return InvalidArgument(fmt::format("{}: \"stage\" is missing", where));
  const std::string why = row.unsupported_reason();
  if (!why.empty()) return InvalidArgument(fmt::format("{} ({}): {}", where, row.label(), why));
  return row;
}

}  // namespace

Result<std::vector<PlacementRow>> load_rows(const std::string& path, DType default_dtype) {
  // A row file lists a few dozen rows of a few keys each.
  constexpr uint64_t kMaxRowFileBytes = uint64_t{4} << 20;
  STRATA_ASSIGN_OR_RETURN(
      nlohmann::ordered_json doc,
      read_json_file(path,
                     {.what = "row file",
                      .flag = "",
                      .hint = R"(give a row file such as {"rows": [{"stage": 3, "offload_optimizer": "cpu"}]})"},
                     {.max_bytes = kMaxRowFileBytes}));
  const std::string source = printable(path, 256);
  const nlohmann::ordered_json* list = &doc;
  if (doc.is_object()) {
    for (auto it = doc.begin(); it != doc.end(); ++it)
      if (it.key() != "rows")
        return InvalidArgument(fmt::format("{}: unknown key '{}' (the file has one key, \"rows\")", source,
                                           printable(it.key(), 64)));
    if (!doc.contains("rows")) return InvalidArgument(fmt::format("{}: \"rows\" is missing", source));
    list = &doc["rows"];
  }
  if (!list->is_array() || list->empty())
    return InvalidArgument(fmt::format("{}: \"rows\" must be a non-empty array of rows", source));
  std::vector<PlacementRow> rows;
  for (size_t i = 0; i < list->size(); ++i) {
    STRATA_ASSIGN_OR_RETURN(PlacementRow r, parse_row((*list)[i], fmt::format("{}: rows[{}]", source, i), default_dtype));
    rows.push_back(r);
  }
  return rows;
}

offload::StepTimeInput gpt_step_input(const model::GptConfig& g, const PlacementRow& row, int world, int batch, int seq,
                                      int grad_accum, int64_t persistence_threshold) {
  offload::StepTimeInput in;
  in.params = static_cast<uint64_t>(g.param_count());
  // The GPT's layers (model/gpt.h): the embedding, the blocks, the final norm.
  const int64_t C = g.n_embd;
  const int64_t embedding = (static_cast<int64_t>(g.vocab_size) + g.max_seq_len) * C;
  const int64_t block = (g.param_count() - embedding - 2 * C) / std::max(1, g.n_layer);
  const std::pair<int64_t, int64_t> layers[] = {{embedding, 1}, {block, g.n_layer}, {2 * C, 1}};  // (elements, how many)
  for (const auto& [count, how_many] : layers)
    if (count < persistence_threshold) {
      // Gathered as the partition pads it: whole pieces of kShardAlign elements per rank.
      const uint64_t unit = offload::kShardAlign * static_cast<uint64_t>(world);
      const uint64_t padded = (static_cast<uint64_t>(count) + unit - 1) / unit * unit;
      in.persistent_params += padded * static_cast<uint64_t>(how_many);
    }
  in.layers = g.n_layer + 2;  // embedding, blocks, final norm: the engine's layers
  // The forward's first product (block 0) needs the embeddings' and the first block's updates.
  in.first_update_share = static_cast<double>(embedding + (g.n_layer > 0 ? block : 0)) / static_cast<double>(in.params);
  in.world = world;
  in.tokens_per_rank = static_cast<double>(batch) * seq * grad_accum;
  in.flops_per_token = g.train_flops_per_token(seq);
  in.placement = row.placement();
  in.ratio = row.ratio;
  in.param_dtype = in.grad_dtype = row.dtype;
  if (row.moments) in.moments = *row.moments;  // else the caller's (StepTimeInput's fp32 unless it sets one)
  in.speculation = row.speculation.value_or(offload::EngineOptions{}.speculative_optimizer);
  in.gradients_on_nvme = row.gradients_on_nvme();
  in.nvme_pipeline = row.pipeline_read.value_or(false) && row.pipeline_write.value_or(false);
  return in;
}

std::vector<size_t> interleaved_order(size_t row_count, size_t repeat) {
  std::vector<size_t> order(row_count);
  for (size_t i = 0; i < row_count; ++i) order[i] = (i + repeat) % row_count;
  return order;
}

namespace {

// What --configs FILE replaces: flags that shape the default matrix would be
// silently ignored beside it, so they are refused naming both.
Status check_configs_alone(const std::string& matrix, const std::vector<DType>& dtypes,
                           const std::vector<cpu_adam::MomentStorage>& moments) {
  if (!moments.empty())
    return InvalidArgument(
        "--optimizer-states with --configs: each row of the file sets its own moment storage "
        "(\"optimizer_state_dtype\"; without it the default), so --optimizer-states would be ignored; drop "
        "--optimizer-states, or set optimizer_state_dtype in the rows");
  if (dtypes.size() > 1) {
    std::string names;
    for (DType dt : dtypes) names += fmt::format("{}{}", names.empty() ? "" : ",", dtype_name(dt));
    return InvalidArgument(fmt::format(
        "--dtype {} with --configs: each row of the file has one dtype (its own \"dtype\", else the first --dtype), "
        "so the others would be ignored; give one --dtype, or set \"dtype\" in the rows",
        names));
  }
  if (matrix != "default")
    return InvalidArgument(fmt::format("--matrix '{}' with --configs: give one of the two (--configs FILE replaces "
                                       "the matrix)",
                                       printable(matrix, 64)));
  return Status::Ok();
}

}  // namespace

Result<std::vector<PlacementRow>> select_rows(const std::string& configs, const std::string& matrix,
                                              const std::vector<DType>& dtypes,
                                              const std::vector<cpu_adam::MomentStorage>& moments) {
  if (!configs.empty()) {
    STRATA_RETURN_IF_ERROR(check_configs_alone(matrix, dtypes, moments));
    Result<std::vector<PlacementRow>> loaded = load_rows(configs, dtypes.front());
    if (!loaded.ok()) return loaded.status().with_context("--configs");
    return loaded;
  }
  if (matrix == "default") return default_matrix(dtypes, moments);
  return InvalidArgument(fmt::format("--matrix '{}' is not 'default' (or give --configs FILE)", printable(matrix, 64)));
}

}  // namespace strata::cli

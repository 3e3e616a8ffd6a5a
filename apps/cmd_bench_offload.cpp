// strata bench offload: what each placement of the training state costs.
// Runs placement rows (stage x offload_optimizer x offload_param x ratio x
// dtype, apps/placement_rows.h) of the reference GPT with the ZeRO engine
// on --ranks local ranks, a fresh engine per row and repeat, and reports per
// row the step time (median, spread), tokens/s, the penalty against the
// fastest in-memory row, bytes and GB/s per link, exposed waits and peak
// bytes per tier (the engine's StepMetrics, rank 0). docs/offload-bench.md.
//
// Note [Interleaving]
// A shared machine drifts (other jobs, thermal, page cache). Running row A's
// repeats, then row B's, lets that drift decide the comparison. Instead each
// repeat runs every row once, in an order rotated by one per repeat
// (interleaved_order), so every row takes every position and the median
// over repeats sees the same mix of good and bad moments for every row.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "command.h"
#include "model_shape_flags.h"
#include "config_fit_cli.h"
#include "engine_run.h"
#include "placement_rows.h"
#include "sample_stats.h"
#include "strata/core/printable.h"
#include "strata/comm/backends.h"
#include "strata/core/units.h"
#include "strata/offload/hardware_profile.h"
#include "strata/offload/step_time_model.h"

namespace strata::cli {
namespace {

struct BenchOffloadOptions {
  std::string preset = "tiny";
  ModelShapeFlags shape;  // overrides of the preset
  std::string dtypes = "bf16";
  std::string optimizer_states = "fp32";
  bool given_optimizer_states = false;  // --optimizer-states was given (refused beside --configs)
  int ranks = 1;
  int steps = 3;
  int warmup = 1;
  int repeats = 3;
  int batch = 4;
  int seq = 64;
  std::string matrix = "default";
  std::string configs;
  std::string device_memory;
  std::string host_memory;
  std::string nvme_path;
  int optimizer_threads = 0;
  int device_threads = 0;
  std::string device = "cpu";  // --device: cpu, cuda or auto (resolved once in run_bench_offload)
  double clip = offload::EngineOptions{}.grad_clip;  // gradient_clipping of every row
  std::string json_out, csv_out, plot_out, plot_script;
  std::string profile;  // a hardware profile: each row also gets the step-time model's prediction
  bool quiet = false;
};

enum class RowStatus { kPending, kOk, kSkipped, kDoesNotFit, kFailed };
std::string_view status_name(RowStatus s) {
  switch (s) {
    case RowStatus::kPending: return "pending";
    case RowStatus::kOk: return "ok";
    case RowStatus::kSkipped: return "skipped";
    case RowStatus::kDoesNotFit: return "does_not_fit";
    case RowStatus::kFailed: return "failed";
  }
  return "?";
}

struct RowResult {
  PlacementRow row;
  RowStatus status = RowStatus::kPending;
  std::string reason;
  std::vector<offload::StepMetrics> steps;  // rank 0's measured steps, every repeat
  std::vector<double> repeat_median_ms;     // one per repeat that ran
  offload::EngineMemory predicted;
  std::string engine;                       // Engine::describe()
};

template <typename F>
double median_field(const std::vector<offload::StepMetrics>& steps, F field) {
  std::vector<double> v;
  v.reserve(steps.size());
  for (const auto& m : steps) v.push_back(static_cast<double>(field(m)));
  return median(std::move(v));
}

// One run of one row: fresh ranks, warm-up steps, measured steps.
Status run_row_once(const BenchOffloadOptions& o, DeviceKind device, const RankSetup& base,
                    const model::GptConfig& g, const model::TextDataset& data, RowResult& result) {
  RankSetup setup = base;
  setup.engine = result.row.apply(base.engine);
  model::GptConfig gr = g;
  gr.param_dtype = result.row.dtype;
  STRATA_ASSIGN_OR_RETURN(auto comms, comm::create_local_group(o.ranks, {}));
  std::vector<offload::StepMetrics> measured;
  std::optional<offload::EngineMemory> predicted;
  std::string described;
  Status st = run_rank_threads(comms, [&](size_t i, comm::Communicator& comm) -> Status {
    RankState rs;
    STRATA_RETURN_IF_ERROR(vote(comm, build_rank(setup, gr, data, device, comm, rs), "to set up"));
    for (int s = 0; s < o.warmup + o.steps; ++s) {
      Result<offload::StepMetrics> m = rs.engine->step();
      if (!m.ok()) return m.status().with_context(fmt::format("step {} on rank {}", s + 1, comm.rank()));
      if (i == 0 && s >= o.warmup) measured.push_back(*m);
    }
    STRATA_RETURN_IF_ERROR(rs.engine->synchronize());
    if (i == 0) {
      predicted = rs.engine->predicted_memory();
      described = rs.engine->describe();
    }
    return Status::Ok();
  });
  if (!st.ok()) return st;
  std::vector<double> ms;
  for (const auto& m : measured) ms.push_back(m.step_ms);
  result.repeat_median_ms.push_back(median(ms));
  result.steps.insert(result.steps.end(), measured.begin(), measured.end());
  if (predicted) result.predicted = *predicted;
  result.engine = described;
  return Status::Ok();
}

struct Link {
  const char* name;
  uint64_t offload::StepMetrics::*bytes;
};
constexpr Link kLinks[] = {{"h2d", &offload::StepMetrics::h2d_bytes},
                           {"d2h", &offload::StepMetrics::d2h_bytes},
                           {"gather", &offload::StepMetrics::gather_bytes},
                           {"reduce", &offload::StepMetrics::reduce_bytes},
                           {"nvme_read", &offload::StepMetrics::nvme_read_bytes},
                           {"nvme_write", &offload::StepMetrics::nvme_write_bytes}};

nlohmann::ordered_json row_json(size_t index, const RowResult& r, double baseline_ms, uint64_t tokens_per_step) {
  using M = offload::StepMetrics;
  nlohmann::ordered_json j;
  j["index"] = index;
  j["label"] = r.row.label();
  j["stage"] = r.row.stage;
  j["offload_optimizer"] = std::string(offload_device_name(r.row.optimizer));
  j["offload_param"] = std::string(offload_device_name(r.row.param));
  j["ratio"] = r.row.ratio;
  j["dtype"] = std::string(dtype_name(r.row.dtype));
  // (A row without its own moments runs with the bench's default, fp32.)
  j["optimizer_state_dtype"] = std::string(r.row.moments.value_or(cpu_adam::MomentStorage::fp32()).name());
  j["gradient_shards"] = r.row.gradients_on_nvme() ? "nvme" : "pinned";
  // The row's own strata.speculative_optimizer, or null (the base options').
  j["speculative_optimizer"] = r.row.speculation ? nlohmann::ordered_json(offload::speculation_mode_name(*r.row.speculation))
                                                 : nlohmann::ordered_json(nullptr);
  // The row's own NVMe pipelining, or null (the engine's default, DeepSpeed's false).
  auto own = [](const std::optional<bool>& b) { return b ? nlohmann::ordered_json(*b) : nlohmann::ordered_json(nullptr); };
  j["pipeline_read"] = own(r.row.pipeline_read);
  j["pipeline_write"] = own(r.row.pipeline_write);
  j["status"] = std::string(status_name(r.status));
  j["reason"] = r.reason.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(r.reason);
  if (r.status != RowStatus::kOk) return j;
  std::vector<double> ms;
  for (const M& m : r.steps) ms.push_back(m.step_ms);
  const double med = median(ms);
  const auto [lo, hi] = std::minmax_element(ms.begin(), ms.end());
  j["engine"] = r.engine;
  j["step_ms"] = {{"median", med}, {"min", *lo}, {"max", *hi}, {"spread", med > 0 ? (*hi - *lo) / med : 0.0}};
  j["repeat_median_ms"] = r.repeat_median_ms;
  j["samples_ms"] = ms;
  j["tokens_per_s"] = med > 0 ? static_cast<double>(tokens_per_step) / (med / 1e3) : 0.0;
  j["penalty"] = baseline_ms > 0 ? nlohmann::ordered_json(med / baseline_ms) : nlohmann::ordered_json(nullptr);
  j["phase_ms"] = {{"forward", median_field(r.steps, [](const M& m) { return m.forward_ms; })},
                   {"backward", median_field(r.steps, [](const M& m) { return m.backward_ms; })},
                   {"optimizer", median_field(r.steps, [](const M& m) { return m.optimizer_ms; })}};
  j["early_updates"] = {{"layers", median_field(r.steps, [](const M& m) { return static_cast<double>(m.speculated_layers); })},
                        {"redone", median_field(r.steps, [](const M& m) { return static_cast<double>(m.redone_layers); })}};
  j["exposed_ms"] = {{"reduce", median_field(r.steps, [](const M& m) { return m.wait_reduce_ms; })},
                     {"optimizer", median_field(r.steps, [](const M& m) { return m.wait_optimizer_ms; })},
                     {"gather", median_field(r.steps, [](const M& m) { return m.wait_gather_ms; })},
                     {"nvme", median_field(r.steps, [](const M& m) { return m.wait_nvme_ms; })}};
  nlohmann::ordered_json bytes, rate;
  for (const Link& l : kLinks) {
    const double b = median_field(r.steps, [&](const M& m) { return m.*(l.bytes); });
    bytes[l.name] = static_cast<uint64_t>(b);
    // Over the whole step: what the link carried on average, not its peak rate.
    rate[l.name] = med > 0 ? b / (med / 1e3) / 1e9 : 0.0;
  }
  j["bytes_per_step"] = bytes;
  j["gb_per_s_over_step"] = rate;
  uint64_t dev = 0, pin = 0, host = 0, nvme = 0;
  for (const M& m : r.steps) {
    dev = std::max(dev, m.peak_device_bytes);
    pin = std::max(pin, m.peak_pinned_bytes);
    host = std::max(host, m.peak_host_bytes);
    nvme = std::max(nvme, m.peak_nvme_bytes);
  }
  j["peak_bytes"] = {{"device", dev}, {"pinned", pin}, {"host", host}, {"nvme", nvme}};
  j["predicted_bytes"] = {{"device", r.predicted.device}, {"pinned", r.predicted.pinned}, {"nvme", r.predicted.nvme}};
  return j;
}

std::string csv_field(const nlohmann::ordered_json& v) {
  if (v.is_null()) return "";
  if (v.is_string()) {
    std::string s = v.get<std::string>(), out = "\"";
    for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
    return out + "\"";
  }
  return v.dump();
}

Status write_csv(const std::string& path, const nlohmann::ordered_json& doc) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) return ErrnoStatus(errno, fmt::format("open --csv '{}'", printable(path, 256)));
  const std::vector<std::pair<std::string, std::vector<std::string>>> cols = {
      {"index", {"index"}}, {"label", {"label"}}, {"stage", {"stage"}}, {"offload_optimizer", {"offload_optimizer"}},
      {"offload_param", {"offload_param"}}, {"ratio", {"ratio"}}, {"dtype", {"dtype"}},
      {"optimizer_state_dtype", {"optimizer_state_dtype"}}, {"status", {"status"}},
      {"step_ms_median", {"step_ms", "median"}}, {"step_ms_min", {"step_ms", "min"}},
      {"step_ms_max", {"step_ms", "max"}}, {"tokens_per_s", {"tokens_per_s"}}, {"penalty", {"penalty"}},
      {"forward_ms", {"phase_ms", "forward"}}, {"backward_ms", {"phase_ms", "backward"}},
      {"optimizer_ms", {"phase_ms", "optimizer"}}, {"exposed_reduce_ms", {"exposed_ms", "reduce"}},
      {"exposed_optimizer_ms", {"exposed_ms", "optimizer"}}, {"exposed_gather_ms", {"exposed_ms", "gather"}},
      {"exposed_nvme_ms", {"exposed_ms", "nvme"}}, {"h2d_bytes", {"bytes_per_step", "h2d"}},
      {"d2h_bytes", {"bytes_per_step", "d2h"}}, {"gather_bytes", {"bytes_per_step", "gather"}},
      {"reduce_bytes", {"bytes_per_step", "reduce"}}, {"nvme_read_bytes", {"bytes_per_step", "nvme_read"}},
      {"nvme_write_bytes", {"bytes_per_step", "nvme_write"}}, {"peak_device_bytes", {"peak_bytes", "device"}},
      {"peak_pinned_bytes", {"peak_bytes", "pinned"}}, {"peak_nvme_bytes", {"peak_bytes", "nvme"}},
      {"reason", {"reason"}}};
  for (size_t c = 0; c < cols.size(); ++c) out << (c ? "," : "") << cols[c].first;
  out << '\n';
  for (const auto& row : doc["rows"]) {
    for (size_t c = 0; c < cols.size(); ++c) {
      const nlohmann::ordered_json* v = &row;
      for (const std::string& k : cols[c].second) {
        if (!v->is_object() || !v->contains(k)) { v = nullptr; break; }
        v = &(*v)[k];
      }
      out << (c ? "," : "") << (v ? csv_field(*v) : "");
    }
    out << '\n';
  }
  out.flush();
  if (!out) return ErrnoStatus(errno, fmt::format("write --csv '{}'", printable(path, 256)));
  return Status::Ok();
}

// Where --plot looks for plot_offload.py: installed beside this binary
// (<prefix>/bin/strata -> <prefix>/share/strata, put there by cmake --install),
// then the source tree this binary was built from (scripts/).
std::vector<std::string> plot_script_candidates() {
  std::vector<std::string> out;
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) out.push_back((exe.parent_path() / STRATA_PLOT_SCRIPT_FROM_BIN).lexically_normal().string());
  out.emplace_back(STRATA_SOURCE_PLOT_SCRIPT);
  return out;
}

// Single-quoted for sh.
std::string sh_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// What --plot draws with: a python3 that imports matplotlib, and the script.
struct PlotTool {
  std::string python;
  std::string script;
};

// Found before anything is measured, so a missing piece fails the bench at
// once, naming it, not after the whole matrix has run.
Result<PlotTool> find_plot_tool(const std::string& script_flag) {
  PlotTool tool;
  std::error_code ec;
  if (!script_flag.empty()) {
    if (!std::filesystem::is_regular_file(script_flag, ec))
      return NotFound(fmt::format("--plot-script '{}' is not a file", printable(script_flag, 256)));
    tool.script = script_flag;
  } else {
    const std::vector<std::string> candidates = plot_script_candidates();
    for (const std::string& candidate : candidates) {
      if (std::filesystem::is_regular_file(candidate, ec)) {
        tool.script = candidate;
        break;
      }
    }
    if (tool.script.empty()) {
      std::string looked;
      for (const std::string& candidate : candidates)
        looked += (looked.empty() ? "" : ", ") + printable(candidate, 256);
      return NotFound(fmt::format("--plot: the plotting script plot_offload.py was not found (looked at {}); give "
                                  "--plot-script PATH (scripts/plot_offload.py in the source tree), or install "
                                  "strata with cmake --install, which puts it in share/strata",
                                  looked));
    }
  }
  // The first python3 with matplotlib: the one on PATH (a virtualenv, pyenv), then the system's (apt).
  for (const char* candidate : {"python3", "/usr/bin/python3"}) {
    const std::string probe = fmt::format("{} -c 'import matplotlib' >/dev/null 2>&1", candidate);
    if (std::system(probe.c_str()) == 0) {
      tool.python = candidate;
      return tool;
    }
  }
  return Unavailable(fmt::format("--plot needs python3 with matplotlib to run {}, and neither python3 on PATH nor "
                                 "/usr/bin/python3 imports matplotlib: apt-get install python3-matplotlib (or pip "
                                 "install matplotlib), or drop --plot (--json and --csv do not need it)",
                                 printable(tool.script, 256)));
}

Status draw_plot(const PlotTool& tool, const std::string& json_path, const std::string& png_path) {
  const std::string cmd =
      fmt::format("{} {} {} {}", tool.python, sh_quote(tool.script), sh_quote(json_path), sh_quote(png_path));
  const int rc = std::system(cmd.c_str());
  if (rc != 0) return Internal(fmt::format("--plot: '{}' failed (exit status {})", cmd, rc));
  return Status::Ok();
}

void print_table(const nlohmann::ordered_json& doc) {
  size_t width = 45;  // the label column: as wide as the longest label
  for (const auto& r : doc["rows"]) width = std::max(width, r["label"].get<std::string>().size());
  fmt::print("\n{:<{}} {:>12} {:>10} {:>9} {:>7} | {:>8} {:>8} {:>8} {:>9} | {:>8} {:>8} {:>9} | {:>10} {:>10}\n",
             "row", width, "status", "step ms", "spread", "penalty", "exp opt", "exp red", "exp gath", "nvme wait", "h2d GB/s",
             "d2h GB/s", "nvme GB/s", "peak dev", "peak pin");
  for (const auto& r : doc["rows"]) {
    const std::string label = r["label"].get<std::string>();
    const std::string status = r["status"].get<std::string>();
    if (status != "ok") {
      fmt::print("{:<{}} {:>12}  {}\n", label, width, status, r["reason"].is_null() ? "" : r["reason"].get<std::string>());
      continue;
    }
    const auto& e = r["exposed_ms"];
    const auto& g = r["gb_per_s_over_step"];
    fmt::print("{:<{}} {:>12} {:>10.2f} {:>8.0f}% {:>7} | {:>8.2f} {:>8.2f} {:>8.2f} {:>9.2f} | {:>8.3f} {:>8.3f} {:>9.3f} | "
               "{:>10} {:>10}\n",
               label, width, status, r["step_ms"]["median"].get<double>(), 100 * r["step_ms"]["spread"].get<double>(),
               r["penalty"].is_null() ? std::string("-") : fmt::format("{:.2f}x", r["penalty"].get<double>()),
               e["optimizer"].get<double>(), e["reduce"].get<double>(), e["gather"].get<double>(),
               e["nvme"].get<double>(), g["h2d"].get<double>(), g["d2h"].get<double>(),
               g["nvme_read"].get<double>() + g["nvme_write"].get<double>(),
               format_bytes(r["peak_bytes"]["device"].get<uint64_t>(), true),
               format_bytes(r["peak_bytes"]["pinned"].get<uint64_t>(), true));
  }
  if (doc.contains("profile")) {
    fmt::print("\npredicted on profile '{}' (strata plan's step-time model):\n",
               printable(doc["profile"].get<std::string>(), 256));
    for (const auto& r : doc["rows"])
      if (r.contains("predicted"))
        fmt::print("{:<{}} measured {:>10.2f} ms  predicted {:>10.2f} ms ({:>+6.1f}%)  ideal {:>10.2f} ms  bound {}\n",
                   r["label"].get<std::string>(), width, r["step_ms"]["median"].get<double>(),
                   r["predicted"]["step_ms"].get<double>(), 100 * r["predicted"]["error"].get<double>(),
                   r["predicted"]["ideal_ms"].get<double>(), r["predicted"]["bound"].get<std::string>());
    if (doc.contains("profile_note")) fmt::print("{}\n", doc["profile_note"].get<std::string>());
  }
  fmt::print("(step ms: median over repeats x steps; spread: (max - min) / median; penalty: / the fastest in-memory "
             "row; exp: exposed wait ms; nvme wait: ms the optimizer thread waited for the state's NVMe reads and "
             "writes, exposed only as far as exp opt says; GB/s: bytes per step / step time)\n");
}

int run_bench_offload(const BenchOffloadOptions& o) {
  auto fail = [](const Status& st) {
    fmt::print(stderr, "strata bench offload: error: {}\n", printable_message(st.to_string()));
    return st.code() == StatusCode::kInvalidArgument ? 2 : 1;
  };
  Result<model::GptConfig> preset = model::preset(o.preset);
  if (!preset.ok()) return fail(preset.status().with_context("--preset"));
  model::GptConfig g = *preset;
  o.shape.apply_to(g);
  Result<std::vector<DType>> dtypes = parse_dtype_list(o.dtypes, "--dtype");
  if (!dtypes.ok()) return fail(dtypes.status());
  g.param_dtype = dtypes->front();
  if (Status v = g.validate(); !v.ok()) return fail(v);
  if (o.seq > g.max_seq_len)
    return fail(InvalidArgument(fmt::format("--seq {} is longer than the model's max_seq {}", o.seq, g.max_seq_len)));
  if (!o.plot_out.empty() && !o.plot_out.ends_with(".png"))
    return fail(InvalidArgument(fmt::format("--plot '{}' must name a .png file", printable(o.plot_out, 64))));
  // Every output is checked before anything is measured.
  for (const auto& [path, flag] : {std::pair{&o.json_out, "--json"}, std::pair{&o.csv_out, "--csv"},
                                   std::pair{&o.plot_out, "--plot"}}) {
    if (path->empty()) continue;
    if (Status st = check_output_path(*path, flag); !st.ok()) return fail(st);
  }
  std::optional<PlotTool> plot_tool;
  if (!o.plot_out.empty()) {
    Result<PlotTool> tool = find_plot_tool(o.plot_script);
    if (!tool.ok()) return fail(tool.status());
    plot_tool = *tool;
  } else if (!o.plot_script.empty()) {
    return fail(InvalidArgument("--plot-script is for --plot FILE.png; give --plot too, or drop --plot-script"));
  }

  Result<DeviceKind> requested = parse_device_kind(o.device, "--device");
  if (!requested.ok()) return fail(requested.status());
  const DeviceChoice choice = resolve_device_kind(*requested);
  const DeviceKind device = choice.kind;
  if (choice.automatic && !o.quiet) fmt::print(stderr, "device   --device {}\n", choice.reason);
  if (device == DeviceKind::kCuda && o.ranks != 1)
    return fail(InvalidArgument(fmt::format(
        "--ranks {} with --device cuda: the bench runs its ranks as threads of one process, on one GPU; use "
        "--ranks 1 (or the cpu device for several ranks)",
        o.ranks)));
  if (device == DeviceKind::kCuda) {  // once here, not once per row
    Result<std::unique_ptr<Device>> gpu = make_device(device);
    if (!gpu.ok()) return fail(gpu.status().with_context("--device"));
  }
  // Not given: the default matrix in fp32 moments (the engine's default), and no conflict with --configs.
  Result<std::vector<cpu_adam::MomentStorage>> moments =
      o.given_optimizer_states ? parse_moment_list(o.optimizer_states, "--optimizer-states")
                               : Result<std::vector<cpu_adam::MomentStorage>>(std::vector<cpu_adam::MomentStorage>{});
  if (!moments.ok()) return fail(moments.status());
  Result<std::vector<PlacementRow>> selected = select_rows(o.configs, o.matrix, *dtypes, *moments);
  if (!selected.ok()) return fail(selected.status());
  std::vector<PlacementRow> rows = std::move(*selected);

  RankSetup base;
  base.batch = o.batch;
  base.seq_len = o.seq;
  base.eval_batches = 1;
  base.engine.optimizer_threads = o.optimizer_threads;
  base.engine.grad_clip = o.clip;
  if (!o.device_memory.empty()) {
    Result<uint64_t> b = parse_bytes(o.device_memory, "--device-memory");
    if (!b.ok()) return fail(b.status());
    base.device_memory_bytes = *b;
  }
  if (!o.host_memory.empty()) {
    Result<uint64_t> b = parse_bytes(o.host_memory, "--host-memory");
    if (!b.ok()) return fail(b.status());
    base.engine.host_memory_budget = *b / static_cast<uint64_t>(o.ranks);
  }
  // The NVMe rows' folder: --nvme-path, else where strata train's quickstart
  // puts swap files ($STRATA_NVME_DIR, $TMPDIR, /tmp), said below.
  std::string nvme_path = o.nvme_path;
  std::string nvme_origin = "--nvme-path";
  const bool any_nvme_row = std::any_of(rows.begin(), rows.end(), [](const PlacementRow& r) {
    return r.unsupported_reason().empty() && r.uses_nvme();
  });
  if (nvme_path.empty() && any_nvme_row) {
    const DefaultNvmeDir dir = default_nvme_dir();
    nvme_path = dir.path;
    nvme_origin = dir.origin;
  }
  if (!nvme_path.empty()) {
    std::error_code ec;
    if (!std::filesystem::is_directory(nvme_path, ec)) {
      if (!o.nvme_path.empty())
        return fail(InvalidArgument(fmt::format("--nvme-path '{}' is not a directory", printable(nvme_path, 256))));
      return fail(InvalidArgument(fmt::format(
          "the NVMe rows' folder '{}' ({}) is not a directory; give --nvme-path DIR (a folder on the NVMe drive) or "
          "set STRATA_NVME_DIR",
          printable(nvme_path, 256), nvme_origin)));
    }
    base.engine.nvme.path = base.engine.nvme_param.path = nvme_path;
  }
  std::optional<offload::HardwareProfile> profile;
  if (!o.profile.empty()) {
    Result<offload::HardwareProfile> p = offload::load_hardware_profile(o.profile);
    if (!p.ok()) return fail(p.status().with_context("--profile"));
    profile = *p;
  }
  Result<model::TextDataset> data = model::TextDataset::load(model::default_corpus_path(), o.seq);
  if (!data.ok()) return fail(data.status());

  const ComputeThreadLimit compute_threads(o.device_threads);

  std::vector<RowResult> results(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    results[i].row = rows[i];
    if (std::string why = rows[i].unsupported_reason(); !why.empty()) {
      results[i].status = RowStatus::kSkipped;
      results[i].reason = why;
    }
  }
  const uint64_t tokens_per_step = static_cast<uint64_t>(o.batch) * o.seq * o.ranks;
  if (!o.quiet) {
    fmt::print("bench offload: {} on {} rank(s), batch {} x seq {}, {} warm-up + {} measured steps x {} repeats, {} "
               "rows (interleaved)\n",
               g.describe(), o.ranks, o.batch, o.seq, o.warmup, o.steps, o.repeats, rows.size());
    if (any_nvme_row)
      fmt::print("nvme     the NVMe rows swap under {} ({}{})\n", printable(nvme_path, 256), nvme_origin,
                 o.nvme_path.empty() ? "; choose another folder with --nvme-path DIR" : "");
    if (plot_tool) fmt::print("plot     {} {} draws {}\n", plot_tool->python, plot_tool->script, o.plot_out);
    std::fflush(stdout);
  }
  nlohmann::ordered_json schedule = nlohmann::ordered_json::array();
  bool any_failed = false;
  for (int rep = 0; rep < o.repeats; ++rep) {
    nlohmann::ordered_json order = nlohmann::ordered_json::array();
    for (size_t idx : interleaved_order(rows.size(), static_cast<size_t>(rep))) {
      RowResult& r = results[idx];
      if (r.status != RowStatus::kPending && r.status != RowStatus::kOk) continue;
      order.push_back(idx);
      const auto t0 = std::chrono::steady_clock::now();
      Status st = run_row_once(o, device, base, g, *data, r);
      if (!st.ok()) {
        const bool no_fit = st.code() == StatusCode::kOutOfMemory || st.code() == StatusCode::kResourceExhausted;
        r.status = no_fit ? RowStatus::kDoesNotFit : RowStatus::kFailed;
        r.reason = st.to_string();
        r.steps.clear();
        any_failed |= !no_fit;
      } else {
        r.status = RowStatus::kOk;
      }
      if (!o.quiet) {
        fmt::print("  repeat {}/{}  {:<45} {}\n", rep + 1, o.repeats, r.row.label(),
                   r.status == RowStatus::kOk
                       ? fmt::format("{:.2f} ms/step ({:.1f} s)", r.repeat_median_ms.back(),
                                     std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count())
                       : std::string(status_name(r.status)));
        std::fflush(stdout);
      }
    }
    schedule.push_back(order);
  }
  // The baseline: the fastest row with everything on the device.
  double baseline_ms = 0;
  std::optional<size_t> baseline_row;
  for (size_t i = 0; i < results.size(); ++i) {
    if (results[i].status != RowStatus::kOk || !results[i].row.in_memory()) continue;
    std::vector<double> ms;
    for (const auto& m : results[i].steps) ms.push_back(m.step_ms);
    const double med = median(ms);
    if (!baseline_row || med < baseline_ms) baseline_ms = med, baseline_row = i;
  }
  nlohmann::ordered_json doc;
  doc["bench"] = "offload";
  doc["date"] = utc_timestamp();
  doc["model"] = {{"describe", g.describe()}, {"preset", o.preset},     {"layers", g.n_layer},
                  {"heads", g.n_head},        {"embd", g.n_embd},       {"vocab", g.vocab_size},
                  {"max_seq", g.max_seq_len}, {"params", g.param_count()},
                  {"train_flops_per_token", g.train_flops_per_token(o.seq)}};
  doc["device"] = std::string(device_kind_name(device));
  doc["matmul"] = matmul_description(device);
  doc["ranks"] = o.ranks;
  doc["batch"] = o.batch;
  doc["seq"] = o.seq;
  doc["tokens_per_step"] = tokens_per_step;
  doc["warmup"] = o.warmup;
  doc["steps"] = o.steps;
  doc["repeats"] = o.repeats;
  doc["device_memory_bytes"] = base.device_memory_bytes;
  doc["nvme_path"] = nvme_path.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(nvme_path);
  doc["optimizer_threads"] = o.optimizer_threads;
  doc["clip"] = o.clip;
  doc["device_threads"] = o.device_threads;
  doc["schedule"] = schedule;
  doc["baseline_row"] = baseline_row ? nlohmann::ordered_json(*baseline_row) : nlohmann::ordered_json(nullptr);
  doc["rows"] = nlohmann::ordered_json::array();
  for (size_t i = 0; i < results.size(); ++i)
    doc["rows"].push_back(row_json(i, results[i], baseline_ms, tokens_per_step));
  if (profile) {
    // The step-time model on the profile, beside what was measured.
    for (size_t i = 0; i < results.size(); ++i) {
      if (results[i].status != RowStatus::kOk) continue;
      model::GptConfig gr = g;
      gr.param_dtype = results[i].row.dtype;
      Result<offload::StepTimePrediction> pr =
          offload::predict_step_time(gpt_step_input(gr, results[i].row, o.ranks, o.batch, o.seq, 1), *profile);
      if (!pr.ok()) return fail(pr.status().with_context(results[i].row.label()));
      nlohmann::ordered_json& j = doc["rows"][i];
      const double measured = j["step_ms"]["median"].get<double>();
      j["predicted"] = {{"step_ms", pr->step_ms},
                        {"ideal_ms", pr->ideal_ms},
                        {"bound", pr->bound},
                        {"error", pr->step_ms / measured - 1.0}};
    }
    doc["profile"] = profile->name;
    if (device == DeviceKind::kCpu)
      if (std::string note = offload::thread_count_note(*profile, o.device_threads, o.optimizer_threads); !note.empty())
        doc["profile_note"] = note;
  }
  if (!o.quiet) print_table(doc);

  const std::string text = doc.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::string json_for_plot = o.json_out;
  if (!o.json_out.empty()) {
    std::ofstream out(o.json_out, std::ios::trunc);
    out << text;
    out.flush();
    if (!out) return fail(ErrnoStatus(errno, fmt::format("write --json '{}'", printable(o.json_out, 256))));
  }
  if (!o.csv_out.empty())
    if (Status st = write_csv(o.csv_out, doc); !st.ok()) return fail(st);
  if (!o.plot_out.empty()) {
    std::string tmp;
    if (json_for_plot.empty()) {
      tmp = o.plot_out + ".json";
      std::ofstream out(tmp, std::ios::trunc);
      out << text;
      if (!out) return fail(ErrnoStatus(errno, fmt::format("write '{}' for --plot", printable(tmp, 256))));
      json_for_plot = tmp;
    }
    Status st = draw_plot(*plot_tool, json_for_plot, o.plot_out);
    if (!tmp.empty()) std::filesystem::remove(tmp);
    if (!st.ok()) return fail(st);
    if (!o.quiet) fmt::print("plot     {}\n", o.plot_out);
  }
  if (any_failed) {
    fmt::print(stderr, "strata bench offload: error: some rows failed (status \"failed\" above)\n");
    return 1;
  }
  return 0;
}

CommandRegistration bench_offload("bench offload", [](CLI::App& root) {
  auto o = std::make_shared<BenchOffloadOptions>();
  CLI::App* bench = ensure_subcommand(root, "bench", "Benchmarks of Strata's kernels and engines");
  CLI::App* cmd = bench->add_subcommand(
      "offload", "Step time, tokens/s, bytes per link and memory per tier of each placement of the training state");
  cmd->add_option("--preset", o->preset, "Model size: tiny | small | gpt2 | gpt2-medium | 1b")->capture_default_str();
  add_model_shape_flags(*cmd, o->shape, "");
  auto* states = cmd->add_option("--optimizer-states", o->optimizer_states,
                  "Adam moment storage(s) of the default matrix, comma-separated: fp32,bf16,int8 (int8: offloaded rows "
                  "only)")
      ->capture_default_str();
  cmd->add_option("--dtype", o->dtypes, "Parameter dtype(s) of the default matrix, comma-separated: fp32,bf16,fp16")
      ->capture_default_str();
  cmd->add_option("--ranks", o->ranks, "Data-parallel ranks as threads (local backend)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  cmd->add_option("--steps", o->steps, "Measured steps per row and repeat")->capture_default_str()->check(CLI::Range(1, 100000));
  cmd->add_option("--warmup", o->warmup, "Warm-up steps per row and repeat (not measured; the first records the "
                                         "acquire order)")
      ->capture_default_str()
      ->check(CLI::Range(0, 100000));
  cmd->add_option("--repeats", o->repeats, "Repeats; each runs every row once, order rotated per repeat")
      ->capture_default_str()
      ->check(CLI::Range(1, 10000));
  cmd->add_option("--batch", o->batch, "Micro batch per rank")->capture_default_str()->check(CLI::Range(1, 65536));
  cmd->add_option("--seq", o->seq, "Sequence length")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--matrix", o->matrix, "default: the 16 placements of strata estimate + stage-3 ratios 0.25/0.5/0.75")
      ->capture_default_str();
  cmd->add_option("--configs", o->configs,
                  "Row file instead of --matrix: {\"rows\": [{\"stage\": 3, \"offload_optimizer\": \"cpu\", "
                  "\"offload_param\": \"none\", \"ratio\": 1, \"dtype\": \"bf16\"}]}");
  cmd->add_option("--device", o->device, "cpu, cuda or auto: the device the rows train on (cuda: one rank)")
      ->capture_default_str();
  cmd->add_option("--device-memory", o->device_memory, "Device capacity per rank, e.g. 64MiB (rows that do not fit are "
                                                       "reported with the engine's reason)");
  cmd->add_option("--host-memory", o->host_memory, "Host memory budget for the engines (strata.host_memory_budget)");
  cmd->add_option("--nvme-path", o->nvme_path,
                  "Folder on the NVMe drive for the nvme rows (default: $STRATA_NVME_DIR, else $TMPDIR, else /tmp)");
  cmd->add_option("--optimizer-threads", o->optimizer_threads, "CPU optimizer threads per rank (0: all cores)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  cmd->add_option("--device-threads", o->device_threads, "cpu device compute threads (0: all cores)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  cmd->add_option("--clip", o->clip,
                  "Global gradient-norm clipping of every row (gradient_clipping; 0: off, DeepSpeed's default); a step "
                  "after one that clipped starts no early updates")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1e6));
  cmd->add_option("--profile", o->profile,
                  "Hardware profile (strata report --calibrate): add each row's predicted and ideal step (strata plan)");
  cmd->add_option("--json", o->json_out, "Write the results as JSON to this file");
  cmd->add_option("--csv", o->csv_out, "Write one CSV line per row to this file");
  cmd->add_option("--plot", o->plot_out, "Draw a PNG (python3 + matplotlib, scripts/plot_offload.py)");
  cmd->add_option("--plot-script", o->plot_script,
                  "The plotting script (default: share/strata/plot_offload.py beside the installed strata, else the "
                  "source tree's scripts/plot_offload.py)");
  cmd->add_flag("--quiet", o->quiet, "Only errors and the output files");
  cmd->callback([o, states] {
    o->given_optimizer_states = states->count() > 0;
    exit_with(run_bench_offload(*o));
  });
});

}  // namespace
}  // namespace strata::cli

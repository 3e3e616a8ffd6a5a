// strata plan --fit: searches the placements and knobs of the engine's
// memory plan for the configs that fit every cap, predicts each one's step,
// and writes the fastest as a complete DeepSpeed config (Note [Config fit]
// in offload/config_fit.h):
//
//   strata plan --fit --model gpt2 --layers 16 --vocab 256 --config ds.json
//       --device-memory 226MiB --host-memory 905MiB --nvme-path /mnt/nvme --out fit.json
//   strata train --config fit.json ...        # runs under the same caps
#include <algorithm>
#include <cmath>
#include <optional>

#include <fmt/format.h>

#include "command.h"
#include "placement_rows.h"
#include "plan_fit.h"
#include "strata/core/printable.h"
#include "strata/core/units.h"
#include "strata/model/gpt_config.h"

namespace strata::cli {
namespace {

int plan_fit_failed(const Status& st) {
  fmt::print(stderr, "strata plan --fit: error: {}\n", printable_message(st.to_string()));
  return st.code() == StatusCode::kInvalidArgument ? 2 : 1;
}

// --params N: a GPT of about N parameters (L blocks of 12 C^2, C a multiple of 64, GPT-2's vocabulary).
Result<model::GptConfig> shape_for_params(const PlanFitArgs& a) {
  Result<uint64_t> n = parse_count(a.params, "--params");
  if (!n.ok()) return n.status();
  if (*n < 1'000'000 || *n > 100'000'000'000'000ull)
    return InvalidArgument(fmt::format("--params {} is out of range for --fit (1M .. 100T)", a.params));
  model::GptConfig g;
  g.preset = "derived";
  g.vocab_size = a.shape.vocab ? a.shape.vocab : 50304;
  g.max_seq_len = a.shape.max_seq ? a.shape.max_seq : std::max(1024, a.seq);
  const double N = static_cast<double>(*n);
  g.n_layer = a.blocks ? a.blocks : std::max(1, static_cast<int>(std::lround(std::cbrt(N / 12.0 / 128.0 / 128.0))));
  const double c = std::sqrt(std::max(1.0, N - static_cast<double>(g.vocab_size) * 1024) / (12.0 * g.n_layer));
  g.n_embd = std::clamp(static_cast<int>(std::lround(c / 64.0)) * 64, 64, 65536);
  g.n_head = g.n_embd / 64;
  return g;
}

}  // namespace

int run_plan_fit(const PlanFitArgs& a) {
  if (a.out.empty() && !a.json)
    return plan_fit_failed(
        InvalidArgument("--fit needs --out FILE (where to write the fitted DeepSpeed config), or --json"));
  if (a.params.empty() == a.model.empty())
    return plan_fit_failed(InvalidArgument("--fit needs exactly one of --model (a preset) or --params N (e.g. 113M)"));
  if (!a.out.empty()) {
    if (Status st = check_output_path(a.out, "--out"); !st.ok()) return plan_fit_failed(st);
  }
  if (a.ranks < 1 || a.ranks > 65536)
    return plan_fit_failed(InvalidArgument(fmt::format("--ranks {} is not in 1..65536", a.ranks)));
  offload::HardwareProfile profile = offload::builtin_cpu_profile();
  if (!a.profile.empty()) {
    Result<offload::HardwareProfile> hw = offload::load_hardware_profile(a.profile);
    if (!hw.ok()) return plan_fit_failed(hw.status().with_context("--profile"));
    profile = *hw;
  }
  model::GptConfig g;
  if (!a.model.empty()) {
    Result<model::GptConfig> preset = model::preset(a.model);
    if (!preset.ok()) return plan_fit_failed(preset.status().with_context("--model"));
    g = *preset;
    a.shape.apply_to(g);
  } else {
    Result<model::GptConfig> derived = shape_for_params(a);
    if (!derived.ok()) return plan_fit_failed(derived.status());
    g = *derived;
  }
  if (Status v = g.validate(); !v.ok()) return plan_fit_failed(v);

  // The config: the user's (with "auto" resolved from the model as Hugging Face's Trainer does), else DeepSpeed's defaults.
  Config config;
  config.source = "defaults";
  nlohmann::ordered_json user = nlohmann::ordered_json::object();  // the file as written
  if (!a.config.empty()) {
    ConfigOptions copt;
    copt.world_size = a.ranks;
    copt.world_size_origin = fmt::format("--ranks {}", a.ranks);
    copt.hidden_size = g.n_embd;
    Result<Config> c = load_config(a.config, copt);
    if (!c.ok()) return plan_fit_failed(c.status());
    config = *c;
    Result<std::string> text = read_config_file(a.config);
    if (!text.ok()) return plan_fit_failed(text.status().with_context("--config"));
    user = nlohmann::ordered_json::parse(*text, nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/true);
    if (user.is_discarded())
      return plan_fit_failed(InvalidArgument(fmt::format("--config '{}' is not JSON", printable(a.config, 256))));
    for (const ConfigIssue& w : config.warnings) fmt::print(stderr, "strata plan --fit: {}\n", format_issue(w, config.source));
  }
  g.param_dtype = config.precision_dtype();
  int batch = a.batch, accum = a.grad_accum;
  if (!a.given_batch && config.batch.train_micro_batch_size_per_gpu) {
    const int64_t mb = *config.batch.train_micro_batch_size_per_gpu;
    if (mb < 1 || mb > 65536)
      return plan_fit_failed(InvalidArgument(
          fmt::format("{}: train_micro_batch_size_per_gpu {} is out of range (1..65536)", config.source, mb)));
    batch = static_cast<int>(mb);
  }
  if (!a.given_accum && config.batch.gradient_accumulation_steps) {
    const int64_t ga = *config.batch.gradient_accumulation_steps;
    if (ga < 1 || ga > 1'000'000)
      return plan_fit_failed(InvalidArgument(
          fmt::format("{}: gradient_accumulation_steps {} is out of range (1..1000000)", config.source, ga)));
    accum = static_cast<int>(ga);
  }
  if (a.seq > g.max_seq_len)
    return plan_fit_failed(
        InvalidArgument(fmt::format("--seq {} is longer than the model's max_seq {}", a.seq, g.max_seq_len)));

  const std::string config_nvme = !config.zero_optimization.offload_optimizer.nvme_path.empty()
                                      ? config.zero_optimization.offload_optimizer.nvme_path
                                      : config.zero_optimization.offload_param.nvme_path;
  Result<offload::FitCaps> caps = fit_caps_from_flags(a.caps, config.strata.device_memory,
                                                      config.strata.host_memory_budget, config_nvme, a.ranks);
  if (!caps.ok()) return plan_fit_failed(caps.status());
  Result<offload::FitRequest> req = gpt_fit_request(g, config, a.ranks, batch, a.seq, accum, profile);
  if (!req.ok()) return plan_fit_failed(req.status());
  if (a.given_dtype) {
    Result<std::vector<DType>> dts = parse_dtype_list(a.caps.dtypes, "--dtype");
    if (!dts.ok()) return plan_fit_failed(dts.status());
    req->dtypes = *dts;
  }
  if (!a.caps.optimizer_states.empty()) {
    Result<std::vector<cpu_adam::MomentStorage>> ms = parse_moment_list(a.caps.optimizer_states, "--optimizer-states");
    if (!ms.ok()) return plan_fit_failed(ms.status());
    req->moment_storages = *ms;
  }
  if (!a.caps.grad_dtypes.empty()) {
    Result<std::vector<DType>> gs = parse_dtype_list(a.caps.grad_dtypes, "--grad-dtypes", "gradient");
    if (!gs.ok()) return plan_fit_failed(gs.status());
    req->grad_dtypes = *gs;
  }
  Result<offload::FitResult> r = offload::fit_config(*req, *caps);
  if (!r.ok()) return plan_fit_failed(r.status());
  if (a.json) {
    nlohmann::ordered_json j = fit_to_json(*r);
    j["model"] = g.describe();
    j["world_size"] = a.ranks;
    j["batch"] = batch;
    j["seq"] = a.seq;
    j["grad_accum"] = accum;
    j["profile"] = profile.name;
    if (r->ok()) j["config"] = fitted_config_json(user, r->fitting.front());
    fmt::print("{}\n", j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
  } else {
    fmt::print("plan --fit: {} on {} rank(s), batch {} x seq {} x accum {}; caps: device {} per rank, host {}, nvme "
               "{}; profile {}\n",
               g.describe(), a.ranks, batch, a.seq, accum, format_bytes(caps->device_bytes, true),
               format_bytes(caps->host_bytes, true),
               caps->nvme_bytes ? fmt::format("{} in '{}'", format_bytes(*caps->nvme_bytes, true),
                                              printable(caps->nvme_path, 256))
                                : std::string("none"),
               printable(profile.name, 200));
    for (DType dt : req->dtypes)
      if (std::string note = offload::compute_dtype_note(profile, dt); !note.empty()) fmt::print("{}\n", note);
    fmt::print("{}", format_fit(*r));
  }
  if (!r->ok()) {
    fmt::print(stderr, "strata plan --fit: error: no config fits the caps: {}\n", printable(r->missing, 2000));
    return 1;
  }
  if (!a.out.empty()) {
    const std::string text = fitted_config_json(user, r->fitting.front())
                                 .dump(2, ' ', false, nlohmann::json::error_handler_t::replace) +
                             "\n";
    Status w = write_file_atomically(a.out, text, "--out");
    if (!w.ok()) return plan_fit_failed(w);
    if (!a.json) fmt::print("wrote {}\n", printable(a.out, 256));
  }
  return 0;
}

}  // namespace strata::cli

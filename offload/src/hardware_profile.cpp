// Hardware profiles: see hardware_profile.h.
#include "strata/offload/hardware_profile.h"

#include <cmath>

#include <fmt/format.h>

#include "strata/core/json_file.h"
#include "strata/core/printable.h"

namespace strata::offload {
namespace {

constexpr const char* kKnownKeys =
    "name, gpus_per_node, shared_cores, optimizer_on_own_cores, device_memory_bytes, host_memory_bytes, nvme_bytes, compute_gflops, "
    "h2d_gb_per_s, d2h_gb_per_s, collective_bus_gb_per_s, nvme_read_gb_per_s, nvme_write_gb_per_s, "
    "cpu_adam_params_per_s, device_adam_params_per_s, notes, sources, calibration";

// Note [Physical bounds of a profile's rates]
// A rate outside these bounds is a typo or a unit mix-up, never a machine,
// and would turn every prediction into nonsense (compute_gflops 1e-300 gave a
// 160-digit step time):
//   compute: 1 MFLOP/s is below any computer of the last 40 years; 1e9
//     GFLOP/s (1 EFLOP/s per device) is ~500x an H100's dense FP8 rate.
//   links (host <-> device, collectives, NVMe): 1 KB/s is below any bus or
//     drive; 1 PB/s is ~200x the fastest HBM (~5 TB/s), which no copy beats.
//   optimizer steps: 1 parameter per second is below any CPU; a step moves at
//     least ~12 bytes per parameter, so 1e15 parameters/s would need 12 PB/s.
struct RateRange {
  double min, max;
  const char* unit;
};
constexpr RateRange kComputeRange{1e-3, 1e9, "GFLOP/s"};
constexpr RateRange kLinkRange{1e-6, 1e6, "GB/s"};
constexpr RateRange kOptimizerRange{1.0, 1e15, "parameters/s"};

Result<const nlohmann::json*> required_number(const nlohmann::json& j, const std::string& source, const char* key) {
  if (!j.contains(key))
    return InvalidArgument(fmt::format("{}: \"{}\" is missing (every rate is required; `strata report --calibrate` "
                                       "measures this machine's)",
                                       source, key));
  const nlohmann::json& v = j.at(key);
  if (!v.is_number())
    return InvalidArgument(fmt::format("{}: \"{}\" is {}, not a number", source, key, printable(v.dump(), 64)));
  return &v;
}

Status rate(const nlohmann::json& j, const std::string& source, const char* key, const RateRange& range, double& out) {
  STRATA_ASSIGN_OR_RETURN(const nlohmann::json* v, required_number(j, source, key));
  const double d = v->get<double>();
  if (!std::isfinite(d) || d <= 0)
    return InvalidArgument(fmt::format("{}: \"{}\" is {}; it must be a positive number", source, key, v->dump()));
  if (d < range.min || d > range.max)
    return InvalidArgument(fmt::format("{}: \"{}\" is {} {}; a real machine's is from {:g} to {:g} {} (a unit "
                                       "mix-up or a typo?)",
                                       source, key, v->dump(), range.unit, range.min, range.max, range.unit));
  out = d;
  return Status::Ok();
}

Status positive_bytes(const nlohmann::json& j, const std::string& source, const char* key, uint64_t& out) {
  STRATA_ASSIGN_OR_RETURN(const nlohmann::json* v, required_number(j, source, key));
  const JsonByteCount bytes = json_byte_count(*v);
  if (!bytes.bytes)
    return InvalidArgument(fmt::format("{}: \"{}\" {} {}; write a whole number of bytes such as 80e9", source, key,
                                       v->dump(), bytes.problem));
  if (*bytes.bytes == 0)
    return InvalidArgument(fmt::format("{}: \"{}\" is 0; it must be a positive number of bytes", source, key));
  out = *bytes.bytes;
  return Status::Ok();
}

}  // namespace

HardwareProfile builtin_cpu_profile() {
  HardwareProfile p;
  p.name = "built-in cpu device (no --profile: relative ranking only)";
  p.gpus_per_node = 1;
  p.shared_cores = true;
  p.device_memory_bytes = uint64_t{1} << 30;
  p.host_memory_bytes = uint64_t{1} << 30;
  p.nvme_bytes = uint64_t{1} << 30;
  p.compute_gflops = 20;
  p.h2d_gb_per_s = p.d2h_gb_per_s = 5;
  p.collective_bus_gb_per_s = 5;
  p.nvme_read_gb_per_s = 1;
  p.nvme_write_gb_per_s = 0.5;
  p.cpu_adam_params_per_s_fp32 = 4e8;
  p.cpu_adam_params_per_s_bf16 = 3e8;
  // 8-bit moments step ~0.8x as many parameters per second as bf16 ones
  // (report --calibrate on the 2-core dev VM, 2026-12-02: 1270M vs 1616M/s).
  p.cpu_adam_params_per_s_int8 = 2.4e8;
  p.device_adam_params_per_s = 4e8;
  return p;
}

Result<HardwareProfile> parse_hardware_profile(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object()) return InvalidArgument(fmt::format("{}: a hardware profile is a JSON object", source));
  static const char* const known[] = {"name", "gpus_per_node", "shared_cores", "optimizer_on_own_cores",
                                      "device_memory_bytes",
                                      "host_memory_bytes", "nvme_bytes", "compute_gflops", "h2d_gb_per_s",
                                      "d2h_gb_per_s", "collective_bus_gb_per_s", "nvme_read_gb_per_s",
                                      "nvme_write_gb_per_s", "cpu_adam_params_per_s", "device_adam_params_per_s",
                                      "notes", "sources", "calibration"};
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool ok = false;
    for (const char* k : known) ok |= it.key() == k;
    if (!ok)
      return InvalidArgument(
          fmt::format("{}: unknown key \"{}\" (known: {})", source, printable(it.key(), 64), kKnownKeys));
  }
  HardwareProfile p;
  if (j.contains("name")) {
    if (!j["name"].is_string()) return InvalidArgument(fmt::format("{}: \"name\" must be a string", source));
    p.name = j["name"].get<std::string>();
  }
  if (j.contains("gpus_per_node")) {
    const nlohmann::json& v = j["gpus_per_node"];
    if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > 4096)
      return InvalidArgument(fmt::format("{}: \"gpus_per_node\" is {}; it must be an integer in 1..4096", source,
                                         printable(v.dump(), 64)));
    p.gpus_per_node = static_cast<int>(v.get<int64_t>());
  }
  if (j.contains("shared_cores")) {
    if (!j["shared_cores"].is_boolean())
      return InvalidArgument(fmt::format("{}: \"shared_cores\" is {}; write true or false without quotes", source,
                                         printable(j["shared_cores"].dump(), 64)));
    p.shared_cores = j["shared_cores"].get<bool>();
  }
  if (j.contains("optimizer_on_own_cores")) {
    if (!j["optimizer_on_own_cores"].is_boolean())
      return InvalidArgument(fmt::format("{}: \"optimizer_on_own_cores\" is {}; write true or false without quotes",
                                         source, printable(j["optimizer_on_own_cores"].dump(), 64)));
    p.optimizer_on_own_cores = j["optimizer_on_own_cores"].get<bool>();
    if (p.optimizer_on_own_cores && !p.shared_cores)
      return InvalidArgument(fmt::format(
          "{}: \"optimizer_on_own_cores\" is true but \"shared_cores\" is not: it says which of the shared cores "
          "the CPU optimizer runs on, so it needs \"shared_cores\": true (a GPU machine's optimizer has the host's "
          "cores to itself already)",
          source));
  }
  STRATA_RETURN_IF_ERROR(positive_bytes(j, source, "device_memory_bytes", p.device_memory_bytes));
  STRATA_RETURN_IF_ERROR(positive_bytes(j, source, "host_memory_bytes", p.host_memory_bytes));
  STRATA_RETURN_IF_ERROR(positive_bytes(j, source, "nvme_bytes", p.nvme_bytes));
  STRATA_RETURN_IF_ERROR(rate(j, source, "compute_gflops", kComputeRange, p.compute_gflops));
  STRATA_RETURN_IF_ERROR(rate(j, source, "h2d_gb_per_s", kLinkRange, p.h2d_gb_per_s));
  STRATA_RETURN_IF_ERROR(rate(j, source, "d2h_gb_per_s", kLinkRange, p.d2h_gb_per_s));
  STRATA_RETURN_IF_ERROR(rate(j, source, "collective_bus_gb_per_s", kLinkRange, p.collective_bus_gb_per_s));
  STRATA_RETURN_IF_ERROR(rate(j, source, "nvme_read_gb_per_s", kLinkRange, p.nvme_read_gb_per_s));
  STRATA_RETURN_IF_ERROR(rate(j, source, "nvme_write_gb_per_s", kLinkRange, p.nvme_write_gb_per_s));
  STRATA_RETURN_IF_ERROR(rate(j, source, "device_adam_params_per_s", kOptimizerRange, p.device_adam_params_per_s));
  if (!j.contains("cpu_adam_params_per_s") || !j["cpu_adam_params_per_s"].is_object())
    return InvalidArgument(fmt::format(
        "{}: \"cpu_adam_params_per_s\" must be an object {{\"fp32\": rate, \"bf16\": rate}} (parameters per second "
        "of the node's CPU optimizer with every core)",
        source));
  const nlohmann::json& adam = j["cpu_adam_params_per_s"];
  for (auto it = adam.begin(); it != adam.end(); ++it)
    if (it.key() != "fp32" && it.key() != "bf16" && it.key() != "int8")
      return InvalidArgument(fmt::format("{}: unknown key \"cpu_adam_params_per_s.{}\" (known: fp32, bf16, int8)",
                                         source, printable(it.key(), 64)));
  const std::string adam_source = source + ": cpu_adam_params_per_s";
  STRATA_RETURN_IF_ERROR(rate(adam, adam_source, "fp32", kOptimizerRange, p.cpu_adam_params_per_s_fp32));
  STRATA_RETURN_IF_ERROR(rate(adam, adam_source, "bf16", kOptimizerRange, p.cpu_adam_params_per_s_bf16));
  if (adam.contains("int8"))  // optional: 8-bit moments (older profiles lack it)
    STRATA_RETURN_IF_ERROR(rate(adam, adam_source, "int8", kOptimizerRange, p.cpu_adam_params_per_s_int8));
  if (j.contains("notes")) p.notes = j["notes"];
  if (j.contains("sources")) p.sources = j["sources"];
  if (j.contains("calibration")) p.calibration = j["calibration"];
  return p;
}

Result<HardwareProfile> load_hardware_profile(const std::string& path) {
  // Profiles weigh a few KB, their calibration's raw measurements a few more.
  constexpr uint64_t kMaxProfileBytes = uint64_t{4} << 20;
  STRATA_ASSIGN_OR_RETURN(
      nlohmann::ordered_json j,
      read_json_file(path,
                     {.what = "hardware profile",
                      .flag = "",
                      .hint = "give a hardware profile JSON (strata report --calibrate writes one; examples/profiles/ "
                              "has others)"},
                     {.max_bytes = kMaxProfileBytes}));
  return parse_hardware_profile(nlohmann::json(j), printable(path, 256));
}

nlohmann::ordered_json hardware_profile_to_json(const HardwareProfile& p) {
  nlohmann::ordered_json j;
  j["name"] = p.name;
  j["gpus_per_node"] = p.gpus_per_node;
  j["shared_cores"] = p.shared_cores;
  if (p.optimizer_on_own_cores) j["optimizer_on_own_cores"] = true;
  j["device_memory_bytes"] = p.device_memory_bytes;
  j["host_memory_bytes"] = p.host_memory_bytes;
  j["nvme_bytes"] = p.nvme_bytes;
  j["compute_gflops"] = p.compute_gflops;
  j["h2d_gb_per_s"] = p.h2d_gb_per_s;
  j["d2h_gb_per_s"] = p.d2h_gb_per_s;
  j["collective_bus_gb_per_s"] = p.collective_bus_gb_per_s;
  j["nvme_read_gb_per_s"] = p.nvme_read_gb_per_s;
  j["nvme_write_gb_per_s"] = p.nvme_write_gb_per_s;
  j["cpu_adam_params_per_s"] = {{"fp32", p.cpu_adam_params_per_s_fp32}, {"bf16", p.cpu_adam_params_per_s_bf16}};
  if (p.cpu_adam_params_per_s_int8 > 0) j["cpu_adam_params_per_s"]["int8"] = p.cpu_adam_params_per_s_int8;
  j["device_adam_params_per_s"] = p.device_adam_params_per_s;
  if (!p.notes.is_null()) j["notes"] = p.notes;
  if (!p.sources.is_null()) j["sources"] = p.sources;
  if (!p.calibration.is_null()) j["calibration"] = p.calibration;
  return j;
}

std::string thread_count_note(const HardwareProfile& profile, int device_threads, int optimizer_threads) {
  const auto& cal = profile.calibration;
  if (!profile.shared_cores || !cal.is_object()) return "";
  // 0 = every core; a profile calibrated before these keys existed timed both on every core.
  const auto count = [&](const char* section, const char* key) {
    if (!cal.contains(section) || !cal[section].is_object() || !cal[section].contains(key) ||
        !cal[section][key].is_number_integer())
      return 0;
    return static_cast<int>(cal[section][key].get<int64_t>());
  };
  const int timed_device = count("compute", "device_threads");
  const int timed_optimizer = count("cpu_adam", "optimizer_threads");
  if (timed_device == device_threads && timed_optimizer == optimizer_threads) return "";
  const auto name = [](int threads) { return threads > 0 ? std::to_string(threads) : std::string("every core"); };
  return fmt::format("note: profile '{}' was calibrated with the compute on {} and the optimizer on {} thread(s), "
                     "these rows run {} and {}: recalibrate with strata report --calibrate "
                     "--calibrate-device-threads {} --calibrate-optimizer-threads {}",
                     printable(profile.name, 64), name(timed_device), name(timed_optimizer), name(device_threads),
                     name(optimizer_threads), device_threads, optimizer_threads);
}

std::string compute_dtype_note(const HardwareProfile& profile, DType rows) {
  const auto& cal = profile.calibration;
  if (!cal.is_object() || !cal.contains("compute") || !cal["compute"].is_object()) return "";
  const auto& compute = cal["compute"];
  if (!compute.contains("dtype") || !compute["dtype"].is_string()) return "";
  const std::string timed = compute["dtype"].get<std::string>();
  const std::string wanted(dtype_name(rows));
  if (timed == wanted) return "";
  return fmt::format("note: profile '{}' timed its compute in {}, these rows train in {}: recalibrate with strata "
                     "report --calibrate --calibrate-dtype {} for their compute rate",
                     printable(profile.name, 64), printable(timed, 16), wanted, wanted);
}

}  // namespace strata::offload

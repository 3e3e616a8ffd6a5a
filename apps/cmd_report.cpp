// strata report: what this machine and this build can do (like ds_report,
// but probed rather than assumed). Sections come from every layer through
// ReportSectionRegistration; this file owns the command and the build,
// CPU and memory sections (pinning: report_devices.cpp, through the pinned pool's probe).
#include <sys/sysinfo.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "calibrate.h"
#include "command.h"
#include "strata/core/build_info.h"

namespace strata::cli {
namespace {

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  }
  return "unknown";
}

void fill_build(nlohmann::json& s, const std::string&) {
  const BuildInfo& b = build_info();
  s["version"] = std::string(b.version);
  s["build_type"] = std::string(b.build_type);
  s["compiler"] = std::string(b.compiler);
  s["cuda"] = b.have_cuda;
  s["nccl"] = b.have_nccl;
  s["mpi"] = b.have_mpi;
  s["liburing"] = b.have_uring;
  s["libaio"] = b.have_aio;
  s["openblas"] = b.have_openblas;
  s["sanitizers"] = b.sanitized;
}

void fill_cpu(nlohmann::json& s, const std::string&) {
  __builtin_cpu_init();
  s["model"] = cpu_model_name();
  s["logical_cores"] = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  nlohmann::json isa;
  isa["avx2"] = static_cast<bool>(__builtin_cpu_supports("avx2"));
  isa["fma"] = static_cast<bool>(__builtin_cpu_supports("fma"));
  isa["f16c"] = static_cast<bool>(__builtin_cpu_supports("f16c"));
  isa["avx512f"] = static_cast<bool>(__builtin_cpu_supports("avx512f"));
  isa["avx512bw"] = static_cast<bool>(__builtin_cpu_supports("avx512bw"));
  isa["avx512bf16"] = static_cast<bool>(__builtin_cpu_supports("avx512bf16"));
  s["isa"] = isa;
}

void fill_memory(nlohmann::json& s, const std::string&) {
  struct sysinfo info {};
  if (sysinfo(&info) == 0) {
    s["total_bytes"] = static_cast<uint64_t>(info.totalram) * info.mem_unit;
    s["available_bytes"] = static_cast<uint64_t>(info.freeram + info.bufferram) * info.mem_unit;
  }
}

ReportSectionRegistration build_section(0, "build", fill_build);
ReportSectionRegistration cpu_section(10, "cpu", fill_cpu);
ReportSectionRegistration memory_section(20, "memory", fill_memory);

void print_text(const nlohmann::json& value, int indent) {
  for (auto it = value.begin(); it != value.end(); ++it) {
    if (it->is_object()) {
      fmt::print("{:{}}{}:\n", "", indent, it.key());
      print_text(*it, indent + 2);
    } else {
      std::string text = it->is_string() ? it->get<std::string>() : it->dump();
      fmt::print("{:{}}{}: {}\n", "", indent, it.key(), text);
    }
  }
}

struct ReportOptions {
  bool json = false;
  std::string path;
};

int run_report(const ReportOptions& opts) {
  auto sections = report_sections();
  std::stable_sort(sections.begin(), sections.end(),
                   [](const ReportSection& a, const ReportSection& b) { return a.order < b.order; });
  nlohmann::json report = nlohmann::json::object();
  for (const ReportSection& section : sections) {
    nlohmann::json body = nlohmann::json::object();
    try {
      section.fill(body, opts.path);
    } catch (const std::exception& e) {
      body["error"] = e.what();
    }
    report[section.name] = body;
  }
  if (opts.json) {
    fmt::print("{}\n", report.dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
  } else {
    fmt::print("Strata report\n");
    for (const ReportSection& section : sections) {
      fmt::print("\n[{}]\n", section.name);
      print_text(report[section.name], 2);
    }
  }
  return 0;
}

CommandRegistration report_command("report", [](CLI::App& root) {
  auto opts = std::make_shared<ReportOptions>();
  auto cal = std::make_shared<CalibrateOptions>();
  CLI::App* cmd = root.add_subcommand("report", "Report build options, CPU, memory, I/O engines, GPUs, NCCL and MPI");
  cmd->add_flag("--json", opts->json, "Print the report as JSON");
  cmd->add_option("--path", opts->path, "Also probe this directory (file system, O_DIRECT, block size, free space)");
  cmd->add_flag("--calibrate", cal->requested, "Measure this machine's rates and write a hardware profile for strata "
                                                "plan (report_calibrate.cpp; --path: where to measure NVMe)");
  // Every option below belongs to --calibrate: without it they are refused (the callback).
  auto* out = cmd->add_option("--out", cal->out, "With --calibrate: write the profile to this file (default: print it)");
  // The compute rate depends on the shapes: calibrate at the ones you plan for.
  cmd->add_option("--calibrate-model", cal->preset, "With --calibrate: the model preset timed for compute")
      ->capture_default_str();
  cmd->add_option("--calibrate-batch", cal->batch, "With --calibrate: micro batch per rank")
      ->capture_default_str()->check(CLI::Range(1, 65536));
  cmd->add_option("--calibrate-seq", cal->seq, "With --calibrate: sequence length")
      ->capture_default_str()->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--calibrate-ranks", cal->ranks, "With --calibrate: local ranks sharing the machine")
      ->capture_default_str()->check(CLI::Range(1, 64));
  cmd->add_option("--calibrate-config", cal->config, "With --calibrate: measure NVMe with this DeepSpeed config's aio section");
  cmd->add_option("--calibrate-dtype", cal->dtype,
                  "With --calibrate: the parameter dtype the compute is timed in (fp32, bf16, fp16): the one the rows "
                  "or the fit you plan use (on a CPU, fp32 and bf16 matmuls run at different rates)")
      ->capture_default_str();
  cmd->add_option("--calibrate-device", cal->device,
                  "With --calibrate: cpu, cuda or auto, the device the copies go to and the model computes on (cuda: "
                  "also the device optimizer's rate; one rank)")
      ->capture_default_str();
  cmd->add_option("--calibrate-device-threads", cal->device_threads,
                  "With --calibrate on the cpu device: time the compute on this many threads (strata train "
                  "--device-threads; 0: every core)")
      ->capture_default_str()->check(CLI::Range(0, 4096));
  cmd->add_option("--calibrate-optimizer-threads", cal->optimizer_threads,
                  "With --calibrate: the CPU Adam rates at this many threads (strata train --optimizer-threads; 0: every "
                  "core). With --calibrate-device-threads, when both fit the cores, the profile says the optimizer "
                  "has cores of its own (optimizer_on_own_cores)")
      ->capture_default_str()->check(CLI::Range(0, 4096));
  std::vector<CLI::Option*> calibrate_only;
  for (CLI::Option* opt : cmd->get_options())
    if (opt == out || opt->get_name().rfind("--calibrate-", 0) == 0) calibrate_only.push_back(opt);
  cmd->callback([opts, cal, out, calibrate_only] {
    cal->out_given = out->count() > 0;
    if (!cal->requested) {
      // As strata plan refuses --out without --fit: a profile option without --calibrate would do nothing.
      std::vector<std::string> given;
      for (const CLI::Option* opt : calibrate_only)
        if (opt->count() > 0) given.push_back(opt->get_name());
      if (!given.empty()) {
        fmt::print(stderr, "strata report: error: {} belong{} to --calibrate (measure this machine and write a "
                           "hardware profile); add --calibrate, or drop {}\n",
                   fmt::join(given, ", "), given.size() == 1 ? "s" : "", given.size() == 1 ? "it" : "them");
        exit_with(2);
      }
    }
    if (cal->requested) {
      cal->path = opts->path;
      exit_with(run_calibrate(*cal));
    } else {
      exit_with(run_report(*opts));
    }
  });
});

}  // namespace
}  // namespace strata::cli

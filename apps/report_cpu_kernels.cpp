// strata report [cpu_kernels]: which cpu_adam kernel path runs here and why.
#include <cstdlib>
#include <string>

#include "command.h"
#include "strata/cpu_adam/kernel_path.h"

namespace strata::cli {
namespace {

void fill_cpu_kernels(nlohmann::json& s, const std::string&) {
  using namespace strata::cpu_adam;
  s["simd_built"] = simd_paths_built();
  nlohmann::json supported = nlohmann::json::array();
  for (KernelPath p : supported_kernel_paths()) supported.push_back(std::string(kernel_path_name(p)));
  s["supported_paths"] = supported;
  auto choice = resolve_kernel_path(KernelPath::kAuto);
  if (choice.ok()) {
    s["cpu_adam_path"] = std::string(kernel_path_name(choice->path));
    s["reason"] = choice->reason;
  } else {
    s["cpu_adam_path"] = "error";
    s["reason"] = choice.status().to_string();
  }
  const char* env = std::getenv("STRATA_CPU_ADAM_PATH");
  s["override"] = env != nullptr && *env != '\0' ? std::string("STRATA_CPU_ADAM_PATH=") + env
                                                 : std::string("none (set STRATA_CPU_ADAM_PATH to force a path)");
}

ReportSectionRegistration cpu_kernels_section(15, "cpu_kernels", fill_cpu_kernels);

}  // namespace
}  // namespace strata::cli

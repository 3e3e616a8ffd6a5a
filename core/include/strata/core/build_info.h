#pragma once
// What this build of Strata contains: version and compiled-in features.

#include <string_view>

namespace strata {

struct BuildInfo {
  std::string_view version;
  std::string_view build_type;
  std::string_view compiler;
  bool have_cuda;
  bool have_nccl;
  bool have_mpi;
  bool have_uring;
  bool have_aio;
  bool have_openblas;
  bool sanitized;
};

const BuildInfo& build_info();

}  // namespace strata

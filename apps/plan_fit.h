#pragma once
// `strata plan --fit`: the fastest DeepSpeed config whose plan fits the
// caps, written as a complete config (docs/offload-bench.md, "Make it fit").
#include <string>

#include "config_fit_cli.h"
#include "model_shape_flags.h"

namespace strata::cli {

struct PlanFitArgs {
  std::string params, model, config, profile, out;
  ModelShapeFlags shape;  // with --model: overrides of the preset; --vocab and --max-seq with --params too
  int blocks = 0;
  int ranks = 1;
  int batch = 4, seq = 64, grad_accum = 1;
  bool given_batch = false, given_accum = false, given_dtype = false;
  FitFlags caps;  // caps.dtypes: --dtype when given
  bool json = false;
};

// Exit code: 0 written, 1 no fit (what is missing printed), 2 a bad input.
int run_plan_fit(const PlanFitArgs& args);

}  // namespace strata::cli

// FaultHooks (fault_hooks.h; Note [Testing seam] in engine_seam.h).
#include "fault_hooks.h"

#include <signal.h>
#include <unistd.h>

#include <cstring>

#include "strata/core/dtype_convert.h"

namespace strata::offload::engine_detail {

Status FaultHooks::gather(int64_t step, int rank, size_t layer) {
  const std::optional<testing::GatherFault>& f = faults_.gather;
  if (!f || f->step != step || f->rank != rank || f->layer != layer || gather_failed_) return Status::Ok();
  gather_failed_ = true;
  return Internal("injected gather failure (testing::GatherFault)");
}

const std::byte* FaultHooks::gradient_override(int64_t step, int rank, size_t layer, DType dtype) {
  const std::optional<testing::GradientFault>& f = faults_.gradient;
  if (!f || f->step != step || f->rank != rank || f->layer != layer) return nullptr;
  const float v = f->value;
  if (dtype == DType::kF32) std::memcpy(gradient_bytes_.data(), &v, 4);
  if (dtype == DType::kBF16) convert_fp32_to_bf16(&v, reinterpret_cast<bfloat16*>(gradient_bytes_.data()), 1);
  if (dtype == DType::kF16) convert_fp32_to_fp16(&v, reinterpret_cast<float16*>(gradient_bytes_.data()), 1);
  return gradient_bytes_.data();
}

Status FaultHooks::update(int64_t step, int rank, size_t layer, bool early) const {
  const std::optional<testing::UpdateFault>& f = faults_.update;
  if (!f || f->step != step || f->rank != rank || f->layer != layer || (!early && f->early_only)) return Status::Ok();
  return Internal("injected kernel failure (testing::UpdateFault)");
}

void FaultHooks::checkpoint_point_reached(const std::optional<testing::CheckpointCrash>& crash, const char* point,
                                          const std::string& tag) {
  if (!crash || crash->point != point) return;
  if (crash->tag.empty() || crash->tag == tag) ::kill(::getpid(), SIGKILL);
}

}  // namespace strata::offload::engine_detail

// StepNvmeBytes (step_nvme_bytes.h; Note [A step's NVMe bytes]).
#include "step_nvme_bytes.h"

#include "gradient_spill.h"

namespace strata::offload::engine_detail {

StepNvmeBytes::Bytes StepNvmeBytes::updates_now() const {
  Bytes b;
  if (!ctx_.opt_on_nvme()) return b;
  const StateTierIoStats io = updates_.tier().io_stats();
  b.read = io.bytes_read;
  b.written = io.bytes_written;
  if (ctx_.gradient_spill != nullptr) b.read += ctx_.gradient_spill->bytes_read();
  return b;
}

uint64_t StepNvmeBytes::spill_written_now() const {
  return ctx_.gradient_spill != nullptr ? ctx_.gradient_spill->bytes_written() : 0;
}

void StepNvmeBytes::step_begins(bool updates_pending) {
  if (!updates_pending) updates_from_ = updates_now();
  backward_from_ = spill_written_now();
  backward_written_ = 0;
}

void StepNvmeBytes::backward_done() { backward_written_ = spill_written_now() - backward_from_; }

void StepNvmeBytes::updates_settled() {
  const Bytes now = updates_now();
  settled_.read += now.read - updates_from_.read;
  settled_.written += now.written - updates_from_.written;
  updates_from_ = now;
}

StepNvmeBytes::Bytes StepNvmeBytes::take() {
  Bytes b = settled_;
  b.written += backward_written_;
  settled_ = Bytes{};
  backward_written_ = 0;
  return b;
}

}  // namespace strata::offload::engine_detail

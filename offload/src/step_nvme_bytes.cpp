// StepNvmeBytes (step_nvme_bytes.h; Note [A step's NVMe bytes]).
#include "step_nvme_bytes.h"

#include "gradient_spill.h"

namespace strata::offload::engine_detail {

StepNvmeBytes::Bytes StepNvmeBytes::updates_now() const {
  Bytes b;
  if (ctx_.opt_on_nvme()) {
    const StateTierIoStats io = updates_.state_io_stats();
    b.read = io.bytes_read;
    b.written = io.bytes_written;
  }
  // (With the state in host memory the gradients are the updates' only NVMe bytes.)
  if (ctx_.gradient_spill != nullptr) b.read += ctx_.gradient_spill->bytes_read();
  return b;
}

uint64_t StepNvmeBytes::spill_written_now() const {
  return ctx_.gradient_spill != nullptr ? ctx_.gradient_spill->bytes_written() : 0;
}

void StepNvmeBytes::step_begins(bool updates_pending) {
  const Bytes now = updates_now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!updates_pending) {
      updates_from_ = now;
      mark_.reset();
    }
  }
  backward_from_ = spill_written_now();
  backward_written_ = 0;
}

void StepNvmeBytes::backward_done() { backward_written_ = spill_written_now() - backward_from_; }

void StepNvmeBytes::previous_updates_done(int64_t pending_step) {
  // Blocks (the optimizer thread, before the step's first early update) for
  // the previous step's last write-backs, so they count in that step, not
  // this one. A lost one is not lost here: the tier keeps it for the commit
  // point (committable()), which rolls the step back.
  updates_.flush_state().ignore();
  const Bytes now = updates_now();
  std::lock_guard<std::mutex> lock(mu_);
  mark_ = Mark{pending_step, now};
}

void StepNvmeBytes::updates_settled(int64_t step) {
  const Bytes now = updates_now();
  std::lock_guard<std::mutex> lock(mu_);
  // The mark of this step, when its next step's early updates began before
  // this commit point (a mark left from an earlier step is stale).
  const Bytes end = mark_ && mark_->step == step ? mark_->at : now;
  settled_.read += end.read - updates_from_.read;
  settled_.written += end.written - updates_from_.written;
  updates_from_ = end;
  mark_.reset();
}

StepNvmeBytes::Bytes StepNvmeBytes::take() {
  std::lock_guard<std::mutex> lock(mu_);
  Bytes b = settled_;
  b.written += backward_written_;
  settled_ = Bytes{};
  backward_written_ = 0;
  return b;
}

}  // namespace strata::offload::engine_detail

#pragma once
// The GPT as a ModelRunner (strata/core/layered_model.h): a GptExecutor on
// its device stream plus the data it trains and evaluates on. This is what
// a training loop that knows nothing of GPTs (offload/) drives: apps/ joins
// the two.
//
// Batches are drawn exactly as the stage-0 trainer always drew them: the
// training windows from a BatchLoader seeded with `seed`, one per micro
// batch in order; evaluation batch i is the i-th non-overlapping window
// block of the validation split.
//
// Data parallelism (RankSlice): with world size W, every rank draws the same
// global micro-batch of W x batch windows (the loader's sequence does not
// depend on W's split) and keeps rows [rank x batch, (rank+1) x batch). So
// world 1 with batch 8 and world 2 with batch 4 train on the same windows;
// evaluation batches are sliced the same way.

#include <cstdint>
#include <memory>
#include <vector>

#include "strata/core/layered_model.h"
#include "strata/core/status.h"
#include "strata/model/gpt.h"
#include "strata/model/gpt_executor.h"
#include "strata/model/text_data.h"

namespace strata::model {

// This rank's slice of every global batch (see above).
struct RankSlice {
  int rank = 0;
  int world = 1;
};

class GptRunner final : public ModelRunner {
 public:
  // `model`, `executor` and `data` must outlive the runner. Fails when the
  // data is too short for the executor's sequence length or holds no
  // validation batch; evaluates at most `eval_batches` (>= 1) batches.
  static Result<std::unique_ptr<GptRunner>> create(const GptModel& model, GptExecutor& executor,
                                                   const TextDataset& data, uint64_t seed, int eval_batches,
                                                   RankSlice slice = {});

  const LayeredModel& model() const override { return model_; }
  Result<float> train_micro_batch(float loss_scale, ParameterProvider& provider) override;
  Result<float> eval_batch(size_t index, ParameterProvider& provider) override;
  size_t eval_batch_count() const override { return eval_count_; }
  Stream* model_stream() override { return &executor_.stream(); }
  uint64_t tokens_per_micro_batch() const override {
    return static_cast<uint64_t>(executor_.batch()) * static_cast<uint64_t>(executor_.seq_len());
  }

  std::optional<uint64_t> data_position() const override { return drawn_; }
  // Draws (and drops) the global batches up to `micro_batches`; FailedPrecondition when already past it.
  Status seek_data(uint64_t micro_batches) override;
  const GptModel& gpt() const { return model_; }
  GptExecutor& executor() { return executor_; }

 private:
  GptRunner(const GptModel& model, GptExecutor& executor, const TextDataset& data, uint64_t seed, RankSlice slice);
  void keep_slice();
  const GptModel& model_;
  GptExecutor& executor_;
  const TextDataset& data_;
  BatchLoader loader_;
  uint64_t seed_ = 0;
  size_t eval_count_ = 0;
  RankSlice slice_;
  uint64_t drawn_ = 0;  // global micro-batches drawn
  std::vector<int32_t> global_inputs_, global_targets_;  // W x batch windows
  std::vector<int32_t> inputs_, targets_;                // this rank's rows
};

}  // namespace strata::model

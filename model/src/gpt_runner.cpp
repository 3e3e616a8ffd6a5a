#include "strata/model/gpt_runner.h"

#include <algorithm>

#include <fmt/format.h>

namespace strata::model {

GptRunner::GptRunner(const GptModel& model, GptExecutor& executor, const TextDataset& data, uint64_t seed,
                     RankSlice slice)
    : model_(model),
      executor_(executor),
      data_(data),
      loader_(data.train(), executor.batch() * slice.world, executor.seq_len(), seed),
      seed_(seed),
      slice_(slice),
      global_inputs_(static_cast<size_t>(executor.batch()) * slice.world * executor.seq_len()),
      global_targets_(global_inputs_.size()),
      inputs_(static_cast<size_t>(executor.batch()) * executor.seq_len()),
      targets_(inputs_.size()) {}

void GptRunner::keep_slice() {
  const size_t n = inputs_.size(), at = n * static_cast<size_t>(slice_.rank);
  std::copy(global_inputs_.begin() + at, global_inputs_.begin() + at + n, inputs_.begin());
  std::copy(global_targets_.begin() + at, global_targets_.begin() + at + n, targets_.begin());
}

Result<std::unique_ptr<GptRunner>> GptRunner::create(const GptModel& model, GptExecutor& executor,
                                                     const TextDataset& data, uint64_t seed, int eval_batches,
                                                     RankSlice slice) {
  if (eval_batches < 1) return InvalidArgument(fmt::format("eval batches {} must be at least 1", eval_batches));
  if (slice.world < 1 || slice.world > 65536 || slice.rank < 0 || slice.rank >= slice.world)
    return InvalidArgument(fmt::format("rank {} of world size {} is not a valid data slice", slice.rank, slice.world));
  const int seq = executor.seq_len();
  const int batch = executor.batch() * slice.world;  // the global micro-batch
  if (data.train().size() <= static_cast<size_t>(seq) || data.val().size() <= static_cast<size_t>(seq))
    return InvalidArgument(fmt::format("data '{}' is too short for --seq {}", data.name(), seq));
  std::unique_ptr<GptRunner> r(new GptRunner(model, executor, data, seed, slice));
  r->eval_count_ =
      std::min<size_t>(static_cast<size_t>(eval_batches), BatchLoader::eval_batches(data.val(), batch, seq));
  if (r->eval_count_ == 0)
    return InvalidArgument(fmt::format("validation split of '{}' ({} bytes) holds no batch of {} x {}; use a larger "
                                       "file or a smaller --batch/--seq",
                                       data.name(), data.val().size(), batch, seq));
  return r;
}

Result<float> GptRunner::train_micro_batch(float loss_scale, ParameterProvider& provider) {
  loader_.next(global_inputs_, global_targets_);
  ++drawn_;
  keep_slice();
  STRATA_ASSIGN_OR_RETURN(float loss, executor_.forward(inputs_, targets_, provider, Pass::kForward));
  STRATA_RETURN_IF_ERROR(executor_.backward(loss_scale, provider));
  return loss;
}

Status GptRunner::seek_data(uint64_t micro_batches) {
  // The loader's windows depend only on its seed and how many were drawn:
  // going back starts a fresh loader (an engine's rollback), then the draws
  // are replayed.
  if (micro_batches < drawn_) {
    loader_ = BatchLoader(data_.train(), executor_.batch() * slice_.world, executor_.seq_len(), seed_);
    drawn_ = 0;
  }
  for (; drawn_ < micro_batches; ++drawn_) loader_.next(global_inputs_, global_targets_);
  return Status::Ok();
}

Result<float> GptRunner::eval_batch(size_t index, ParameterProvider& provider) {
  if (index >= eval_count_)
    return InvalidArgument(fmt::format("evaluation batch {} out of range ({} batches)", index, eval_count_));
  BatchLoader::eval_batch(data_.val(), executor_.batch() * slice_.world, executor_.seq_len(), index, global_inputs_,
                          global_targets_);
  keep_slice();
  return executor_.forward(inputs_, targets_, provider, Pass::kEval);
}

}  // namespace strata::model

#include "strata/model/text_data.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <fmt/format.h>

#include "strata/core/bounded_file.h"

namespace strata::model {

std::vector<int32_t> encode_bytes(std::string_view text) {
  std::vector<int32_t> out(text.size());
  for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<uint8_t>(text[i]);
  return out;
}

std::string decode_bytes(std::span<const int32_t> tokens) {
  std::string out(tokens.size(), '\0');
  for (size_t i = 0; i < tokens.size(); ++i) out[i] = static_cast<char>(static_cast<uint8_t>(tokens[i]));
  return out;
}

std::string default_corpus_path() {
  std::error_code ec;
  if (std::filesystem::exists(STRATA_SOURCE_CORPUS, ec)) return STRATA_SOURCE_CORPUS;
  if (std::filesystem::exists(STRATA_INSTALLED_CORPUS, ec)) return STRATA_INSTALLED_CORPUS;
  return "";
}

Result<TextDataset> TextDataset::from_text(std::string text, int seq_len, double val_fraction, std::string name) {
  if (seq_len < 1) return InvalidArgument(fmt::format("--seq {} must be at least 1", seq_len));
  if (!(val_fraction > 0.0 && val_fraction < 1.0))
    return InvalidArgument(fmt::format("validation fraction {} must be in (0, 1)", val_fraction));
  const size_t window = static_cast<size_t>(seq_len) + 1;
  const size_t n = text.size();
  size_t val = static_cast<size_t>(std::ceil(static_cast<double>(n) * val_fraction));
  val = std::max(val, window);
  if (n < val + window)
    return InvalidArgument(fmt::format("data '{}' has {} bytes, too few for a training and a validation window of "
                                       "{} bytes each (--seq {} + 1); use a larger file or a smaller --seq",
                                       name, n, window, seq_len));
  TextDataset d;
  d.bytes_.assign(text.begin(), text.end());
  d.train_size_ = n - val;
  d.name_ = std::move(name);
  return d;
}

Result<TextDataset> TextDataset::load(const std::string& path, int seq_len, double val_fraction) {
  if (path.empty())
    return NotFound("no data file: the shipped corpus (data/corpus.txt) was not found; pass --data FILE");
  // A FIFO must not hang us and /dev/zero must not be read without bound.
  STRATA_ASSIGN_OR_RETURN(std::string text,
                          read_regular_file(path, kMaxDataBytes,
                                            {.what = "data file",
                                             .flag = "--data",
                                             .hint = "give a text file of at most 4 GiB (the byte-level loader holds "
                                                     "it in memory; cut a larger one with head -c)"}));
  return from_text(std::move(text), seq_len, val_fraction, path);
}

double TextDataset::unigram_baseline() const {
  std::array<double, kByteVocabSize> counts{};
  counts.fill(1.0);
  double total = kByteVocabSize;
  for (uint8_t b : train()) {
    counts[b] += 1.0;
    total += 1.0;
  }
  double nll = 0;
  for (uint8_t b : val()) nll -= std::log(counts[b] / total);
  return nll / static_cast<double>(val().size());
}

BatchLoader::BatchLoader(std::span<const uint8_t> source, int batch, int seq_len, uint64_t seed)
    : source_(source), batch_(batch), seq_len_(seq_len), rng_(seed, 0x6c6f61646572ull) {
  STRATA_CHECK(source.size() > static_cast<size_t>(seq_len), "BatchLoader: source shorter than one window");
}

void BatchLoader::next(std::span<int32_t> inputs, std::span<int32_t> targets) {
  const size_t T = static_cast<size_t>(seq_len_);
  STRATA_CHECK(inputs.size() == static_cast<size_t>(batch_) * T && targets.size() == inputs.size(),
               "BatchLoader::next: span sizes != batch * seq_len");
  const uint64_t starts = source_.size() - T;  // windows of T+1 bytes
  for (int b = 0; b < batch_; ++b) {
    const size_t start = rng_.below(starts);
    for (size_t t = 0; t < T; ++t) {
      inputs[b * T + t] = source_[start + t];
      targets[b * T + t] = source_[start + t + 1];
    }
  }
}

size_t BatchLoader::eval_batches(std::span<const uint8_t> source, int batch, int seq_len) {
  if (source.size() < static_cast<size_t>(seq_len) + 1) return 0;
  const size_t windows = (source.size() - 1) / static_cast<size_t>(seq_len);
  return windows / static_cast<size_t>(batch);
}

void BatchLoader::eval_batch(std::span<const uint8_t> source, int batch, int seq_len, size_t index,
                             std::span<int32_t> inputs, std::span<int32_t> targets) {
  const size_t T = static_cast<size_t>(seq_len);
  STRATA_CHECK(index < eval_batches(source, batch, seq_len), "eval_batch: index out of range");
  for (int b = 0; b < batch; ++b) {
    const size_t start = (index * static_cast<size_t>(batch) + b) * T;
    for (size_t t = 0; t < T; ++t) {
      inputs[b * T + t] = source[start + t];
      targets[b * T + t] = source[start + t + 1];
    }
  }
}

}  // namespace strata::model

#pragma once
// Byte-level text data: the tokenizer (one token per byte, vocabulary 256),
// a train/validation split, the unigram baseline, and a deterministic,
// seeded batch loader.
//
// Split: the last `val_fraction` of the file (at least one window) is the
// validation set, the rest is training data; nothing crosses the boundary.
// Training batches start at seeded random offsets; validation batches are
// the first non-overlapping windows of the validation set, always the same.

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/status.h"
#include "strata/model/rng.h"

namespace strata::model {

inline constexpr int kByteVocabSize = 256;
// The largest --data file the loader reads (it holds the file in memory).
inline constexpr uint64_t kMaxDataBytes = uint64_t{4} << 30;

// Tokens of a string: its bytes. Decoding is the inverse.
std::vector<int32_t> encode_bytes(std::string_view text);
std::string decode_bytes(std::span<const int32_t> tokens);

// The corpus shipped with Strata (data/corpus.txt, installed to
// share/strata/corpus.txt): "" when neither copy exists.
std::string default_corpus_path();

class TextDataset {
 public:
  // Reads `path`. Fails (naming the path) if it cannot be read, is not a
  // regular file (a FIFO, /dev/zero, a folder), is larger than kMaxDataBytes,
  // or is too short to hold one training and one validation window of
  // seq_len+1 bytes.
  static Result<TextDataset> load(const std::string& path, int seq_len, double val_fraction = 0.1);
  static Result<TextDataset> from_text(std::string text, int seq_len, double val_fraction = 0.1,
                                       std::string name = "<memory>");

  std::span<const uint8_t> train() const { return {bytes_.data(), train_size_}; }
  std::span<const uint8_t> val() const { return {bytes_.data() + train_size_, bytes_.size() - train_size_}; }
  const std::string& name() const { return name_; }

  // Cross-entropy (nats/token) of the validation set under the training
  // set's unigram distribution (add-one smoothed over 256 bytes): the loss a
  // model that ignores context would reach. Training must beat it.
  double unigram_baseline() const;

 private:
  std::vector<uint8_t> bytes_;
  size_t train_size_ = 0;
  std::string name_;
};

class BatchLoader {
 public:
  // Random windows of `source` (train split), seeded.
  BatchLoader(std::span<const uint8_t> source, int batch, int seq_len, uint64_t seed);
  // inputs/targets: batch * seq_len ids; targets are inputs shifted by one.
  void next(std::span<int32_t> inputs, std::span<int32_t> targets);
  int batch() const { return batch_; }
  int seq_len() const { return seq_len_; }

  // Number of full, non-overlapping validation batches in `source`.
  static size_t eval_batches(std::span<const uint8_t> source, int batch, int seq_len);
  // Validation batch `index` (deterministic, non-overlapping windows).
  static void eval_batch(std::span<const uint8_t> source, int batch, int seq_len, size_t index,
                         std::span<int32_t> inputs, std::span<int32_t> targets);

 private:
  std::span<const uint8_t> source_;
  int batch_, seq_len_;
  Rng rng_;
};

}  // namespace strata::model

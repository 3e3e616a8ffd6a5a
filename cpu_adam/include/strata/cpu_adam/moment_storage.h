#pragma once
// MomentStorage: how Adam's two moments are kept in memory, as one value
// (strata.optimizer_state_dtype): fp32, bf16, or block-wise 8-bit codes
// with one fp32 scale per block (int8_moments.h). It knows the bytes one
// moment takes, where a range of elements lies inside a moment buffer, and
// how to convert a buffer to and from fp32 (checkpoints, state reads).
//
// Layout of one moment of a span of `count` elements (one buffer each for
// exp_avg and exp_avg_sq):
//   fp32 / bf16: count values.
//   int8: count codes, padded to a multiple of 64 bytes, then
//         moment_block_count(count, block) fp32 scales. Block b covers
//         elements [b * block, (b + 1) * block) of the span.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "strata/core/dtype.h"
#include "strata/core/status.h"
#include "strata/cpu_adam/int8_moments.h"

namespace strata::cpu_adam {

struct StateSpans;

class MomentStorage {
 public:
  enum class Kind : uint8_t { kFp32 = 0, kBf16, kInt8 };

  constexpr MomentStorage() = default;
  static constexpr MomentStorage fp32() { return MomentStorage(Kind::kFp32, 0); }
  static constexpr MomentStorage bf16() { return MomentStorage(Kind::kBf16, 0); }
  static constexpr MomentStorage int8(size_t block_elements = kDefaultMomentBlockElements) {
    return MomentStorage(Kind::kInt8, block_elements);
  }
  // "fp32" | "bf16" | "int8"; anything else is an InvalidArgument naming `field`.
  static Result<MomentStorage> parse(std::string_view name, std::string_view field);

  Kind kind() const { return kind_; }
  bool blocked() const { return kind_ == Kind::kInt8; }
  std::string_view name() const;  // "fp32", "bf16", "int8"
  // Elements per scale (int8); 0 otherwise.
  size_t block_elements() const { return block_elements_; }
  // fp32 or bf16: the element type of both moments. Checked: not for int8.
  DType element_dtype() const;

  // Bytes of one moment of `count` elements (layout above).
  uint64_t moment_bytes(size_t count) const;
  // Bytes per element of both moments together, for planners that count
  // per parameter: 8, 4, or 2 + 8 / block (the scales).
  double bytes_per_element() const;

  // Points `spans`' moments at elements [first, first + spans.count) of a
  // span of `total` elements whose moments are the buffers `exp_avg` and
  // `exp_avg_sq` (moment_bytes(total) each). For int8, `first` must be a
  // multiple of block_elements (a check).
  void point(StateSpans& spans, void* exp_avg, void* exp_avg_sq, size_t total, size_t first) const;
  // The same for an out-of-place step's sources (StateSpans::*_source).
  void point_source(StateSpans& spans, const void* exp_avg, const void* exp_avg_sq, size_t total, size_t first) const;
  // The scales of an int8 moment buffer of `total` elements.
  float* scales(void* moment, size_t total) const;
  const float* scales(const void* moment, size_t total) const;

  // Elements [first, first + count) of a moment buffer of `total` elements
  // as fp32 (`which` says whether it is exp_avg or exp_avg_sq; int8 stores
  // sqrt(v)). For int8 `first` and `count` are whole blocks (or reach the end).
  Status read_fp32(Int8Moment which, const void* moment, size_t total, size_t first, size_t count, float* out) const;
  // The reverse: encodes `in` into those elements (int8: their blocks'
  // codes and scales are recomputed; rounded, see int8_moments.h).
  Status write_fp32(Int8Moment which, const float* in, size_t total, size_t first, size_t count, void* moment) const;

  bool operator==(const MomentStorage&) const = default;

 private:
  constexpr MomentStorage(Kind kind, size_t block_elements) : kind_(kind), block_elements_(block_elements) {}
  Status check_block_range(size_t total, size_t first, size_t count) const;

  Kind kind_ = Kind::kFp32;
  size_t block_elements_ = 0;
};

}  // namespace strata::cpu_adam

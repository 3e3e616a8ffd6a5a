// MomentStorage (moment_storage.h).
#include "strata/cpu_adam/moment_storage.h"

#include <cstring>

#include <fmt/format.h>

#include "strata/core/dtype_convert.h"
#include "strata/core/printable.h"
#include "strata/cpu_adam/optimizer.h"

namespace strata::cpu_adam {
namespace {

constexpr uint64_t kCodeAlign = 64;  // the scales start on a cache line (and are 4-byte aligned)

uint64_t code_bytes(size_t count) { return (count + kCodeAlign - 1) / kCodeAlign * kCodeAlign; }

}  // namespace

Result<MomentStorage> MomentStorage::parse(std::string_view name, std::string_view field) {
  if (name == "fp32") return fp32();
  if (name == "bf16") return bf16();
  if (name == "int8") return int8();
  return InvalidArgument(fmt::format("{} '{}' is not a moment storage; use fp32, bf16 or int8", field,
                                     printable(name, 32)));
}

std::string_view MomentStorage::name() const {
  switch (kind_) {
    case Kind::kFp32: return "fp32";
    case Kind::kBf16: return "bf16";
    case Kind::kInt8: return "int8";
  }
  return "?";
}

DType MomentStorage::element_dtype() const {
  STRATA_CHECK(kind_ != Kind::kInt8, "int8 moments have no element dtype");
  return kind_ == Kind::kBf16 ? DType::kBF16 : DType::kF32;
}

uint64_t MomentStorage::moment_bytes(size_t count) const {
  switch (kind_) {
    case Kind::kFp32: return uint64_t{count} * 4;
    case Kind::kBf16: return uint64_t{count} * 2;
    case Kind::kInt8: return code_bytes(count) + 4 * uint64_t{moment_block_count(count, block_elements_)};
  }
  return 0;
}

double MomentStorage::bytes_per_element() const {
  switch (kind_) {
    case Kind::kFp32: return 8;
    case Kind::kBf16: return 4;
    case Kind::kInt8: return 2 + 8.0 / static_cast<double>(block_elements_);
  }
  return 0;
}

const float* MomentStorage::scales(const void* moment, size_t total) const {
  STRATA_CHECK(kind_ == Kind::kInt8, "scales of a moment that is not int8");
  return reinterpret_cast<const float*>(static_cast<const std::byte*>(moment) + code_bytes(total));
}
float* MomentStorage::scales(void* moment, size_t total) const {
  return const_cast<float*>(scales(static_cast<const void*>(moment), total));  // the same bytes, writable
}

void MomentStorage::point(StateSpans& spans, void* exp_avg, void* exp_avg_sq, size_t total, size_t first) const {
  STRATA_CHECK(first + spans.count <= total, "moment range past the end of its buffer");
  if (kind_ != Kind::kInt8) {
    const size_t element = dtype_size(element_dtype());
    spans.moment_format = MomentFormat::kDType;
    spans.moment_dtype = element_dtype();
    spans.exp_avg = static_cast<std::byte*>(exp_avg) + first * element;
    spans.exp_avg_sq = static_cast<std::byte*>(exp_avg_sq) + first * element;
    return;
  }
  STRATA_CHECK(first % block_elements_ == 0, "an int8 moment range must start on a block");
  spans.moment_format = MomentFormat::kBlockInt8;
  spans.moment_block_elements = block_elements_;
  spans.exp_avg = static_cast<std::byte*>(exp_avg) + first;
  spans.exp_avg_sq = static_cast<std::byte*>(exp_avg_sq) + first;
  spans.exp_avg_scale = scales(exp_avg, total) + first / block_elements_;
  spans.exp_avg_sq_scale = scales(exp_avg_sq, total) + first / block_elements_;
}

void MomentStorage::point_source(StateSpans& spans, const void* exp_avg, const void* exp_avg_sq, size_t total,
                                 size_t first) const {
  STRATA_CHECK(first + spans.count <= total, "moment range past the end of its buffer");
  if (kind_ != Kind::kInt8) {
    const size_t element = dtype_size(element_dtype());
    spans.exp_avg_source = static_cast<const std::byte*>(exp_avg) + first * element;
    spans.exp_avg_sq_source = static_cast<const std::byte*>(exp_avg_sq) + first * element;
    return;
  }
  STRATA_CHECK(first % block_elements_ == 0, "an int8 moment range must start on a block");
  spans.exp_avg_source = static_cast<const std::byte*>(exp_avg) + first;
  spans.exp_avg_sq_source = static_cast<const std::byte*>(exp_avg_sq) + first;
  spans.exp_avg_scale_source = scales(exp_avg, total) + first / block_elements_;
  spans.exp_avg_sq_scale_source = scales(exp_avg_sq, total) + first / block_elements_;
}

Status MomentStorage::check_block_range(size_t total, size_t first, size_t count) const {
  if (first + count > total)
    return InvalidArgument(fmt::format("moment range [{}, {}) is past the end of its {} elements", first,
                                       first + count, total));
  if (kind_ == Kind::kInt8 && (first % block_elements_ != 0 || (count % block_elements_ != 0 && first + count != total)))
    return InvalidArgument(fmt::format("int8 moment range [{}, {}) is not whole blocks of {} elements", first,
                                       first + count, block_elements_));
  return Status::Ok();
}

Status MomentStorage::read_fp32(Int8Moment which, const void* moment, size_t total, size_t first, size_t count,
                                float* out) const {
  STRATA_RETURN_IF_ERROR(check_block_range(total, first, count));
  switch (kind_) {
    case Kind::kFp32:
      std::memcpy(out, static_cast<const float*>(moment) + first, count * sizeof(float));
      return Status::Ok();
    case Kind::kBf16:
      convert_bf16_to_fp32(static_cast<const bfloat16*>(moment) + first, out, count);
      return Status::Ok();
    case Kind::kInt8:
      return dequantize_moments(which, static_cast<const uint8_t*>(moment) + first,
                                scales(moment, total) + first / block_elements_, count,
                                block_elements_, out);
  }
  return Status::Ok();
}

Status MomentStorage::write_fp32(Int8Moment which, const float* in, size_t total, size_t first, size_t count,
                                 void* moment) const {
  STRATA_RETURN_IF_ERROR(check_block_range(total, first, count));
  switch (kind_) {
    case Kind::kFp32:
      std::memcpy(static_cast<float*>(moment) + first, in, count * sizeof(float));
      return Status::Ok();
    case Kind::kBf16:
      convert_fp32_to_bf16(in, static_cast<bfloat16*>(moment) + first, count);
      return Status::Ok();
    case Kind::kInt8:
      return quantize_moments(which, in, count, block_elements_, static_cast<uint8_t*>(moment) + first,
                              scales(moment, total) + first / block_elements_);
  }
  return Status::Ok();
}

}  // namespace strata::cpu_adam

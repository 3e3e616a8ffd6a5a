#include "strata/comm/pattern.h"

#include <algorithm>
#include <bit>
#include <cstring>

namespace strata::comm {
namespace {

// Values for reductions: integers in [-a, a] with a = 128 / world (at least
// 1), so |sum| <= 128 < 256, exact in bf16 (8 significant bits).
float reduce_value(int rank, size_t index, int world) {
  const int64_t amplitude = std::max<int64_t>(1, 128 / std::max(1, world));
  const auto span = static_cast<uint64_t>(2 * amplitude + 1);
  const uint64_t h = (index * 7u + static_cast<uint64_t>(rank) * 3u + (index >> 7) * 5u) % span;
  return static_cast<float>(static_cast<int64_t>(h) - amplitude);
}

// Values for data movement: integers in [-125, 125], distinct between
// neighbouring ranks and elements.
float move_value(int rank, size_t index) {
  const uint64_t h = (index * 13u + static_cast<uint64_t>(rank) * 101u) % 251u;
  return static_cast<float>(static_cast<int64_t>(h) - 125);
}

// Every pattern value is a small integer, exact in every dtype.
uint64_t to_bits(DType dtype, float v) {
  switch (dtype) {
    case DType::kF32: return std::bit_cast<uint32_t>(v);
    case DType::kBF16: return fp32_to_bf16_bits(v);
    case DType::kF16: return fp32_to_fp16_bits(v);
    case DType::kF64: return std::bit_cast<uint64_t>(static_cast<double>(v));
    case DType::kI64: return static_cast<uint64_t>(static_cast<int64_t>(v));
  }
  return 0;
}

void store(DType dtype, void* host, size_t index, float v) {
  const uint64_t bits = to_bits(dtype, v);
  switch (dtype_size(dtype)) {
    case 2: static_cast<uint16_t*>(host)[index] = static_cast<uint16_t>(bits); break;
    case 4: static_cast<uint32_t*>(host)[index] = static_cast<uint32_t>(bits); break;
    case 8: static_cast<uint64_t*>(host)[index] = bits; break;
    default: break;
  }
}

bool is_move(CollectiveOp op) { return op == CollectiveOp::kAllGather || op == CollectiveOp::kBroadcast; }

}  // namespace

size_t send_count(const CollectiveDesc& d, int world) {
  return d.op == CollectiveOp::kReduceScatter ? d.count * static_cast<size_t>(world)
                                              : (d.op == CollectiveOp::kBarrier ? 0 : d.count);
}

size_t recv_count(const CollectiveDesc& d, int world) {
  return d.op == CollectiveOp::kAllGather ? d.count * static_cast<size_t>(world)
                                          : (d.op == CollectiveOp::kBarrier ? 0 : d.count);
}

void fill_send_pattern(const CollectiveDesc& d, int rank, int world, void* host) {
  const size_t n = send_count(d, world);
  for (size_t i = 0; i < n; ++i) {
    store(d.dtype, host, i, is_move(d.op) ? move_value(rank, i) : reduce_value(rank, i, world));
  }
}

void fill_sentinel(DType dtype, void* host, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    switch (dtype_size(dtype)) {
      case 2: static_cast<uint16_t*>(host)[i] = 0x7e5a; break;
      case 4: static_cast<uint32_t*>(host)[i] = 0x7fc0dead; break;
      case 8: static_cast<uint64_t*>(host)[i] = 0x7ff8deaddeadbeefull; break;  // NaN; no pattern int64 either
      default: break;
    }
  }
}

uint64_t element_bits(DType dtype, const void* host, size_t index) {
  switch (dtype_size(dtype)) {
    case 2: return static_cast<const uint16_t*>(host)[index];
    case 4: return static_cast<const uint32_t*>(host)[index];
    case 8: return static_cast<const uint64_t*>(host)[index];
    default: return 0;
  }
}

uint64_t expected_bits(const CollectiveDesc& d, int rank, int world, size_t index) {
  switch (d.op) {
    case CollectiveOp::kAllGather: {
      const size_t per_rank = std::max<size_t>(d.count, 1);
      return to_bits(d.dtype, move_value(static_cast<int>(index / per_rank), index % per_rank));
    }
    case CollectiveOp::kBroadcast: return to_bits(d.dtype, move_value(d.root, index));
    case CollectiveOp::kReduceScatter:
    case CollectiveOp::kAllReduce: {
      const size_t element = d.op == CollectiveOp::kReduceScatter ? static_cast<size_t>(rank) * d.count + index : index;
      if (d.dtype == DType::kF64 || d.dtype == DType::kI64) {
        // Accumulated in the element type; the integers are exact either way.
        double wide = reduce_value(0, element, world);
        for (int p = 1; p < world; ++p) {
          const double v = reduce_value(p, element, world);
          wide = d.reduce == ReduceOp::kMax ? std::max(wide, v) : wide + v;
        }
        if (d.dtype == DType::kI64) return static_cast<uint64_t>(static_cast<int64_t>(wide));
        if (d.reduce == ReduceOp::kAvg) wide /= static_cast<double>(world);
        return std::bit_cast<uint64_t>(wide);
      }
      float acc = reduce_value(0, element, world);
      for (int p = 1; p < world; ++p) {
        const float v = reduce_value(p, element, world);
        acc = d.reduce == ReduceOp::kMax ? std::max(acc, v) : acc + v;
      }
      if (d.reduce == ReduceOp::kAvg) acc /= static_cast<float>(world);
      return to_bits(d.dtype, acc);
    }
    case CollectiveOp::kBarrier: return 0;
  }
  return 0;
}

size_t count_wrong(const CollectiveDesc& d, int rank, int world, const void* host_recv, size_t* first_wrong) {
  const size_t n = recv_count(d, world);
  size_t wrong = 0;
  if (first_wrong != nullptr) *first_wrong = SIZE_MAX;
  for (size_t i = 0; i < n; ++i) {
    if (element_bits(d.dtype, host_recv, i) != expected_bits(d, rank, world, i)) {
      if (wrong == 0 && first_wrong != nullptr) *first_wrong = i;
      ++wrong;
    }
  }
  return wrong;
}

}  // namespace strata::comm

// strata_cpu_adam_replay: runs a multi-step trajectory written by
// torch_compare.py through CpuOptimizer and writes the final state, so the
// script can compare every element with torch.optim.
//
//   strata_cpu_adam_replay --list-paths
//   strata_cpu_adam_replay DIR KIND PATH GRAD_DTYPE MOMENT_DTYPE COPY STEPS COUNT
//                          BETA1 BETA2 EPS WEIGHT_DECAY THREADS
// DIR holds params.f32 (COUNT floats), grads.f32 (STEPS x COUNT floats,
// converted here to GRAD_DTYPE with round-to-nearest-even) and lr.f64 (STEPS
// doubles). Writes DIR/out_params.f32, out_exp_avg.f32, out_exp_avg_sq.f32
// (moments widened to fp32) and out_copy.u16 (when COPY is not none).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/cpu_adam/optimizer.h"

using namespace strata;
using namespace strata::cpu_adam;

namespace {

template <typename T>
bool read_file(const std::string& path, std::vector<T>& out, size_t count) {
  std::ifstream in(path, std::ios::binary);
  out.resize(count);
  in.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(count * sizeof(T)));
  if (!in) {
    std::fprintf(stderr, "error: could not read %zu values from %s\n", count, path.c_str());
    return false;
  }
  return true;
}

template <typename T>
bool write_file(const std::string& path, const std::vector<T>& data) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size() * sizeof(T)));
  return static_cast<bool>(out);
}

int fail(const Status& st) {
  std::fprintf(stderr, "error: %s\n", st.to_string().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--list-paths") {
    for (KernelPath p : supported_kernel_paths()) std::printf("%s\n", std::string(kernel_path_name(p)).c_str());
    return 0;
  }
  if (argc != 14) {
    std::fprintf(stderr, "usage: %s DIR KIND PATH GRAD_DTYPE MOMENT_DTYPE COPY STEPS COUNT BETA1 BETA2 EPS "
                         "WEIGHT_DECAY THREADS (or --list-paths)\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  auto kind = parse_optimizer_kind(argv[2]);
  auto path = parse_kernel_path(argv[3]);
  auto grad_dtype = parse_dtype(argv[4]);
  auto moment_dtype = parse_dtype(argv[5]);
  const std::string copy = argv[6];
  const size_t steps = std::strtoull(argv[7], nullptr, 10);
  const size_t count = std::strtoull(argv[8], nullptr, 10);
  HyperParams hyper{.beta1 = std::atof(argv[9]), .beta2 = std::atof(argv[10]), .eps = std::atof(argv[11]),
                    .weight_decay = std::atof(argv[12])};
  const int threads = std::atoi(argv[13]);
  if (!kind.ok()) return fail(kind.status());
  if (!path.ok()) return fail(path.status());
  if (!grad_dtype.ok()) return fail(grad_dtype.status());
  if (!moment_dtype.ok()) return fail(moment_dtype.status());

  std::vector<float> params, grads32;
  std::vector<double> lr;
  if (!read_file(dir + "/params.f32", params, count) || !read_file(dir + "/grads.f32", grads32, steps * count) ||
      !read_file(dir + "/lr.f64", lr, steps))
    return 1;
  const size_t mb = dtype_size(*moment_dtype);
  std::vector<uint8_t> grads(count * dtype_size(*grad_dtype)), m(count * mb, 0), v(count * mb, 0);
  std::vector<uint16_t> copy_out(count, 0);

  auto opt = CpuOptimizer::create({.kind = *kind, .threads = threads, .tile_elements = 4096, .path = *path});
  if (!opt.ok()) return fail(opt.status());
  StateSpans s{.count = count, .params = params.data(), .grads = grads.data(), .grad_dtype = *grad_dtype,
               .exp_avg = m.data(), .exp_avg_sq = v.data(), .moment_dtype = *moment_dtype};
  if (copy != "none") {
    auto copy_dtype = parse_dtype(copy);
    if (!copy_dtype.ok()) return fail(copy_dtype.status());
    s.param_copy = copy_out.data();
    s.param_copy_dtype = *copy_dtype;
  }
  for (size_t t = 0; t < steps; ++t) {
    for (size_t i = 0; i < count; ++i) {
      const float g = grads32[t * count + i];
      if (*grad_dtype == DType::kF32) reinterpret_cast<float*>(grads.data())[i] = g;
      if (*grad_dtype == DType::kBF16) reinterpret_cast<uint16_t*>(grads.data())[i] = fp32_to_bf16_bits(g);
      if (*grad_dtype == DType::kF16) reinterpret_cast<uint16_t*>(grads.data())[i] = fp32_to_fp16_bits(g);
    }
    StepArgs args{.step = static_cast<int64_t>(t + 1), .hyper = hyper};
    args.hyper.lr = lr[t];
    auto r = opt->step(args, s);
    if (!r.ok()) return fail(r.status());
    if (r->overflow) {
      std::fprintf(stderr, "error: unexpected overflow at step %zu\n", t + 1);
      return 1;
    }
  }
  auto widen = [&](const std::vector<uint8_t>& raw) {
    std::vector<float> out(count);
    for (size_t i = 0; i < count; ++i)
      out[i] = *moment_dtype == DType::kF32 ? reinterpret_cast<const float*>(raw.data())[i]
                                            : bf16_bits_to_fp32(reinterpret_cast<const uint16_t*>(raw.data())[i]);
    return out;
  };
  if (!write_file(dir + "/out_params.f32", params) || !write_file(dir + "/out_exp_avg.f32", widen(m)) ||
      !write_file(dir + "/out_exp_avg_sq.f32", widen(v)) || !write_file(dir + "/out_copy.u16", copy_out)) {
    std::fprintf(stderr, "error: could not write results to %s\n", dir.c_str());
    return 1;
  }
  return 0;
}

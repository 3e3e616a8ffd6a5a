// CPU kernels of the GPT ops. See cpu_ops.h for conventions.
#include "strata/model/cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "strata/core/status.h"

#if STRATA_HAVE_OPENBLAS
#include <cblas.h>
#include <cstdlib>
#include <atomic>
#include <mutex>
#include <string>
#include <string_view>

// Present in DYNAMIC_ARCH builds of OpenBLAS (Debian's); weak so that other
// builds still link (then they are null and nothing is re-selected).
extern "C" void gotoblas_dynamic_init(void) __attribute__((weak));
extern "C" void gotoblas_dynamic_quit(void) __attribute__((weak));
#endif

namespace strata::model::cpu {
namespace {

// Inline under TSan (STRATA_TSAN_SERIAL_LOOPS): oneTBB's scheduler is not
// instrumented, so TSan would see no ordering between the caller and the workers.
template <typename F>
void parallel_rows(int n, int grain, F&& body) {
#if STRATA_TSAN_SERIAL_LOOPS
  (void)grain;
  for (int i = 0; i < n; ++i) body(i);
#else
  tbb::parallel_for(tbb::blocked_range<int>(0, n, std::max(grain, 1)),
                    [&](const tbb::blocked_range<int>& r) {
                      for (int i = r.begin(); i != r.end(); ++i) body(i);
                    },
                    tbb::simple_partitioner());
#endif
}

constexpr double kGeluScale = 0.7978845608028654;  // sqrt(2/pi)

// Dot product with 8 independent partial sums (a fixed order, so still
// deterministic), which the compiler turns into vector lanes; a single
// running sum would serialize on the add latency.
template <typename T>
inline T dot(const T* a, const T* b, int n) {
  T acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  T tail = 0;
  for (; i < n; ++i) tail += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
}

}  // namespace

template <typename T>
void encoder_forward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int B, int Tn, int C) {
  parallel_rows(B * Tn, 16, [&](int i) {
    const int t = i % Tn;
    const T* e = wte + static_cast<size_t>(tokens[i]) * C;
    const T* p = wpe + static_cast<size_t>(t) * C;
    T* o = out + static_cast<size_t>(i) * C;
    for (int c = 0; c < C; ++c) o[c] = e[c] + p[c];
  });
}

template <typename T>
void encoder_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int B, int Tn, int C) {
  // Parallel over channel blocks; rows visited in order, so the sums of
  // repeated tokens are deterministic.
  constexpr int kBlock = 64;
  const int blocks = (C + kBlock - 1) / kBlock;
  parallel_rows(blocks, 1, [&](int blk) {
    const int c0 = blk * kBlock, c1 = std::min(C, c0 + kBlock);
    for (int i = 0; i < B * Tn; ++i) {
      const int t = i % Tn;
      const T* d = dout + static_cast<size_t>(i) * C;
      T* we = dwte + static_cast<size_t>(tokens[i]) * C;
      T* pe = dwpe + static_cast<size_t>(t) * C;
      for (int c = c0; c < c1; ++c) {
        we[c] += d[c];
        pe[c] += d[c];
      }
    }
  });
}

template <typename T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* w, const T* b, int N, int C) {
  const T eps = static_cast<T>(1e-5);
  parallel_rows(N, 8, [&](int i) {
    const T* x = inp + static_cast<size_t>(i) * C;
    T m = 0;
    for (int c = 0; c < C; ++c) m += x[c];
    m /= C;
    T v = 0;
    for (int c = 0; c < C; ++c) v += (x[c] - m) * (x[c] - m);
    v /= C;
    const T s = T(1) / std::sqrt(v + eps);
    T* o = out + static_cast<size_t>(i) * C;
    for (int c = 0; c < C; ++c) o[c] = (x[c] - m) * s * w[c] + b[c];
    mean[i] = m;
    rstd[i] = s;
  });
}

template <typename T>
void layernorm_backward(T* dinp, T* dw, T* db, const T* dout, const T* inp, const T* w, const T* mean,
                        const T* rstd, int N, int C) {
  parallel_rows(N, 8, [&](int i) {
    const T* d = dout + static_cast<size_t>(i) * C;
    const T* x = inp + static_cast<size_t>(i) * C;
    const T m = mean[i], s = rstd[i];
    T dnorm_mean = 0, dnorm_norm_mean = 0;
    for (int c = 0; c < C; ++c) {
      const T norm = (x[c] - m) * s;
      const T dnorm = w[c] * d[c];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean /= C;
    dnorm_norm_mean /= C;
    T* dx = dinp + static_cast<size_t>(i) * C;
    for (int c = 0; c < C; ++c) {
      const T norm = (x[c] - m) * s;
      const T dnorm = w[c] * d[c];
      dx[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
  });
  // Weight and bias gradients: parallel over channels, rows in order.
  constexpr int kBlock = 64;
  parallel_rows((C + kBlock - 1) / kBlock, 1, [&](int blk) {
    const int c0 = blk * kBlock, c1 = std::min(C, c0 + kBlock);
    for (int i = 0; i < N; ++i) {
      const T* d = dout + static_cast<size_t>(i) * C;
      const T* x = inp + static_cast<size_t>(i) * C;
      for (int c = c0; c < c1; ++c) {
        dw[c] += (x[c] - mean[i]) * rstd[i] * d[c];
        db[c] += d[c];
      }
    }
  });
}

template <typename T>
void gemm_reference(bool trans_a, bool trans_b, int M, int N, int K, T alpha, const T* A, int lda,
                    const T* Bm, int ldb, T beta, T* Cm, int ldc) {
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; ++j) {
      T acc = 0;
      for (int k = 0; k < K; ++k) {
        const T a = trans_a ? A[static_cast<size_t>(k) * lda + i] : A[static_cast<size_t>(i) * lda + k];
        const T b = trans_b ? Bm[static_cast<size_t>(j) * ldb + k] : Bm[static_cast<size_t>(k) * ldb + j];
        acc += a * b;
      }
      T& c = Cm[static_cast<size_t>(i) * ldc + j];
      c = alpha * acc + (beta == T(0) ? T(0) : beta * c);
    }
  }
}

#if STRATA_HAVE_OPENBLAS
namespace {

// Note [OpenBLAS kernel selection]
// OpenBLAS 0.3.21 picks its kernels by CPU model number. On CPUs it does
// not know (e.g. virtual "Intel Xeon Processor" models with AVX-512) it
// falls back to the SSE3 "Prescott" kernels: 8 GFLOP/s instead of 29 on
// our 2-core CI machine. Unless the user chose a core with
// OPENBLAS_CORETYPE, we re-select by ISA (cpuid feature bits) once, before
// the first product: SkylakeX with AVX-512 F/BW/DQ/VL, Haswell with
// AVX2+FMA. The sgemm-vs-reference test checks the result elementwise.
std::string g_blas_note;
void select_blas_kernels() {
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string before = openblas_get_corename();
    g_blas_note = "OpenBLAS core " + before;
    if (std::getenv("OPENBLAS_CORETYPE") != nullptr || gotoblas_dynamic_init == nullptr ||
        gotoblas_dynamic_quit == nullptr)
      return;
    if (before != "Prescott" && before != "prescott" && before != "Core2" && before != "Nehalem") return;
    __builtin_cpu_init();
    const char* want = nullptr;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
      want = "SkylakeX";
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
      want = "Haswell";
    if (want == nullptr) return;
    setenv("OPENBLAS_CORETYPE", want, 0);
    gotoblas_dynamic_quit();
    gotoblas_dynamic_init();
    unsetenv("OPENBLAS_CORETYPE");
    g_blas_note = "OpenBLAS core " + std::string(openblas_get_corename()) + " (re-selected by ISA; OpenBLAS chose " +
                  before + ")";
  });
}

// Note [OpenBLAS threads for small products]
// On a busy 2-core machine OpenBLAS's threads cost more than they bring for
// small products (the tiny preset ran 2.4x faster single-threaded), so
// products under 100 MFLOP run on one thread and larger ones on OpenBLAS's
// configured count. The thread count does not change results (OpenBLAS
// splits M and N, not K). Several ranks of one process (strata train
// --ranks N) call gemm concurrently, so the switch is taken under a lock.
std::atomic<int> g_gemm_thread_cap{0};  // limit_gemm_threads(); 0: none

int configured_blas_threads() {
  static const int configured = openblas_get_num_threads();
  const int cap = g_gemm_thread_cap.load();
  return cap > 0 ? std::min(cap, configured) : configured;
}

void set_blas_threads_for(double flops) {
  select_blas_kernels();
  const int configured = configured_blas_threads();
  static std::mutex mutex;
  // What OpenBLAS runs now: its own count until the first switch, which is
  // not `configured` when limit_gemm_threads capped it before the first
  // product (strata train --device-threads 1 used to compute on every core).
  static int current = openblas_get_num_threads();
  const int want = flops < 1e8 ? 1 : configured;
  std::lock_guard<std::mutex> lock(mutex);
  if (want != current) {
    openblas_set_num_threads(want);
    current = want;
  }
}
}  // namespace

void limit_gemm_threads(int threads) { g_gemm_thread_cap.store(threads > 0 ? threads : 0); }

std::string gemm_backend_description() {
  select_blas_kernels();
  return g_blas_note + ", up to " + std::to_string(configured_blas_threads()) + " threads";
}

template <>
void gemm<float>(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const float* A, int lda,
                 const float* Bm, int ldb, float beta, float* Cm, int ldc) {
  set_blas_threads_for(2.0 * M * N * K);
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M,
              N, K, alpha, A, lda, Bm, ldb, beta, Cm, ldc);
}
template <>
void gemm<double>(bool trans_a, bool trans_b, int M, int N, int K, double alpha, const double* A, int lda,
                  const double* Bm, int ldb, double beta, double* Cm, int ldc) {
  set_blas_threads_for(2.0 * M * N * K);
  cblas_dgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M,
              N, K, alpha, A, lda, Bm, ldb, beta, Cm, ldc);
}
#else
// The built-in loop runs on oneTBB, which the global limit already governs.
void limit_gemm_threads(int) {}

std::string gemm_backend_description() { return "built-in blocked loop (no OpenBLAS)"; }
// Without OpenBLAS: the reference loop, parallel over row blocks of C.
template <typename T>
void gemm(bool trans_a, bool trans_b, int M, int N, int K, T alpha, const T* A, int lda, const T* Bm,
          int ldb, T beta, T* Cm, int ldc) {
  constexpr int kRows = 16;
  parallel_rows((M + kRows - 1) / kRows, 1, [&](int blk) {
    const int i0 = blk * kRows, rows = std::min(M, i0 + kRows) - i0;
    const T* a = trans_a ? A + i0 : A + static_cast<size_t>(i0) * lda;
    gemm_reference(trans_a, trans_b, rows, N, K, alpha, a, lda, Bm, ldb, beta,
                   Cm + static_cast<size_t>(i0) * ldc, ldc);
  });
}
template void gemm<float>(bool, bool, int, int, int, float, const float*, int, const float*, int, float,
                          float*, int);
template void gemm<double>(bool, bool, int, int, int, double, const double*, int, const double*, int,
                           double, double*, int);
#endif

template <typename T>
void matmul_forward(T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC) {
  if (bias != nullptr) {
    parallel_rows(N, 64, [&](int i) { std::copy(bias, bias + OC, out + static_cast<size_t>(i) * OC); });
  }
  gemm<T>(false, true, N, OC, C, T(1), inp, C, w, C, bias != nullptr ? T(1) : T(0), out, OC);
}

template <typename T>
void matmul_backward(T* dinp, T* dw, T* dbias, const T* dout, const T* inp, const T* w, int N, int C,
                     int OC) {
  gemm<T>(false, false, N, C, OC, T(1), dout, OC, w, C, T(1), dinp, C);  // dinp += dout @ W
  gemm<T>(true, false, OC, C, N, T(1), dout, OC, inp, C, T(1), dw, C);   // dW += dout^T @ inp
  if (dbias != nullptr) {
    constexpr int kBlock = 64;
    parallel_rows((OC + kBlock - 1) / kBlock, 1, [&](int blk) {
      const int o0 = blk * kBlock, o1 = std::min(OC, o0 + kBlock);
      for (int i = 0; i < N; ++i) {
        const T* d = dout + static_cast<size_t>(i) * OC;
        for (int o = o0; o < o1; ++o) dbias[o] += d[o];
      }
    });
  }
}

template <typename T>
void attention_forward(T* out, T* att, const T* qkv, int B, int Tn, int C, int NH) {
  const int hs = C / NH;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  const size_t C3 = 3 * static_cast<size_t>(C);
  parallel_rows(B * NH * Tn, 4, [&](int idx) {
    const int t = idx % Tn, h = (idx / Tn) % NH, b = idx / (Tn * NH);
    const T* q = qkv + (static_cast<size_t>(b) * Tn + t) * C3 + h * hs;
    T* a = att + ((static_cast<size_t>(b) * NH + h) * Tn + t) * Tn;
    T maxv = -std::numeric_limits<T>::infinity();
    for (int t2 = 0; t2 <= t; ++t2) {
      const T* k = qkv + (static_cast<size_t>(b) * Tn + t2) * C3 + C + h * hs;
      const T score = dot(q, k, hs) * scale;
      a[t2] = score;
      maxv = std::max(maxv, score);
    }
    T sum = 0;
    for (int t2 = 0; t2 <= t; ++t2) {
      a[t2] = std::exp(a[t2] - maxv);
      sum += a[t2];
    }
    const T inv = T(1) / sum;
    for (int t2 = 0; t2 <= t; ++t2) a[t2] *= inv;
    for (int t2 = t + 1; t2 < Tn; ++t2) a[t2] = 0;
    T* o = out + (static_cast<size_t>(b) * Tn + t) * C + h * hs;
    for (int i = 0; i < hs; ++i) o[i] = 0;
    for (int t2 = 0; t2 <= t; ++t2) {
      const T* v = qkv + (static_cast<size_t>(b) * Tn + t2) * C3 + 2 * C + h * hs;
      const T w = a[t2];
      for (int i = 0; i < hs; ++i) o[i] += w * v[i];
    }
  });
}

template <typename T>
void attention_backward(T* dqkv, T* datt, const T* dout, const T* qkv, const T* att, int B, int Tn, int C,
                        int NH) {
  const int hs = C / NH;
  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  const size_t C3 = 3 * static_cast<size_t>(C);
  // One task per (b, h): dk and dv of a position collect contributions from
  // every later query, so they are summed inside one task in a fixed order.
  parallel_rows(B * NH, 1, [&](int bh) {
    const int h = bh % NH, b = bh / NH;
    const T* base = qkv + static_cast<size_t>(b) * Tn * C3;
    T* dbase = dqkv + static_cast<size_t>(b) * Tn * C3;
    for (int t = 0; t < Tn; ++t) {
      const T* a = att + ((static_cast<size_t>(b) * NH + h) * Tn + t) * Tn;
      T* da = datt + ((static_cast<size_t>(b) * NH + h) * Tn + t) * Tn;
      const T* d = dout + (static_cast<size_t>(b) * Tn + t) * C + h * hs;
      // out = att @ v: datt = dout . v, dv += att * dout
      for (int t2 = 0; t2 <= t; ++t2) {
        const T* v = base + static_cast<size_t>(t2) * C3 + 2 * C + h * hs;
        T* dv = dbase + static_cast<size_t>(t2) * C3 + 2 * C + h * hs;
        for (int i = 0; i < hs; ++i) dv[i] += a[t2] * d[i];
        da[t2] = dot(v, d, hs);
      }
      // softmax backward: dpre = att * (datt - sum(att * datt))
      T s = 0;
      for (int t2 = 0; t2 <= t; ++t2) s += a[t2] * da[t2];
      const T* q = base + static_cast<size_t>(t) * C3 + h * hs;
      T* dq = dbase + static_cast<size_t>(t) * C3 + h * hs;
      for (int t2 = 0; t2 <= t; ++t2) {
        const T dpre = a[t2] * (da[t2] - s) * scale;
        const T* k = base + static_cast<size_t>(t2) * C3 + C + h * hs;
        T* dk = dbase + static_cast<size_t>(t2) * C3 + C + h * hs;
        for (int i = 0; i < hs; ++i) {
          dq[i] += dpre * k[i];
          dk[i] += dpre * q[i];
        }
      }
    }
  });
}

template <typename T>
void gelu_forward(T* out, const T* inp, size_t n) {
  parallel_rows(static_cast<int>((n + 4095) / 4096), 1, [&](int blk) {
    const size_t i0 = static_cast<size_t>(blk) * 4096, i1 = std::min(n, i0 + 4096);
    for (size_t i = i0; i < i1; ++i) {
      const T x = inp[i];
      out[i] = T(0.5) * x * (T(1) + std::tanh(static_cast<T>(kGeluScale) * (x + T(0.044715) * x * x * x)));
    }
  });
}

template <typename T>
void gelu_backward(T* dinp, const T* inp, const T* dout, size_t n) {
  parallel_rows(static_cast<int>((n + 4095) / 4096), 1, [&](int blk) {
    const size_t i0 = static_cast<size_t>(blk) * 4096, i1 = std::min(n, i0 + 4096);
    for (size_t i = i0; i < i1; ++i) {
      const T x = inp[i];
      const T u = static_cast<T>(kGeluScale) * (x + T(0.044715) * x * x * x);
      const T th = std::tanh(u);
      const T sech2 = T(1) - th * th;
      const T local = T(0.5) * (T(1) + th) +
                      x * T(0.5) * sech2 * static_cast<T>(kGeluScale) * (T(1) + T(3 * 0.044715) * x * x);
      dinp[i] += local * dout[i];
    }
  });
}

template <typename T>
void residual_forward(T* out, const T* a, const T* b, size_t n) {
  parallel_rows(static_cast<int>((n + 8191) / 8192), 1, [&](int blk) {
    const size_t i0 = static_cast<size_t>(blk) * 8192, i1 = std::min(n, i0 + 8192);
    for (size_t i = i0; i < i1; ++i) out[i] = a[i] + b[i];
  });
}

template <typename T>
void residual_backward(T* da, T* db, const T* dout, size_t n) {
  parallel_rows(static_cast<int>((n + 8191) / 8192), 1, [&](int blk) {
    const size_t i0 = static_cast<size_t>(blk) * 8192, i1 = std::min(n, i0 + 8192);
    for (size_t i = i0; i < i1; ++i) {
      da[i] += dout[i];
      db[i] += dout[i];
    }
  });
}

template <typename T>
T softmax_xent_forward(T* probs, T* losses, const T* logits, const int32_t* targets, int N, int V) {
  parallel_rows(N, 4, [&](int i) {
    const T* x = logits + static_cast<size_t>(i) * V;
    T* p = probs + static_cast<size_t>(i) * V;
    T maxv = x[0];
    for (int v = 1; v < V; ++v) maxv = std::max(maxv, x[v]);
    T sum = 0;
    for (int v = 0; v < V; ++v) {
      p[v] = std::exp(x[v] - maxv);
      sum += p[v];
    }
    const T inv = T(1) / sum;
    for (int v = 0; v < V; ++v) p[v] *= inv;
    const int32_t tgt = targets[i];
    STRATA_CHECK(tgt >= 0 && tgt < V, "softmax_xent_forward: target out of range");
    // log of the normalised probability, computed from the logits for accuracy
    losses[i] = -(x[tgt] - maxv - std::log(sum));
  });
  T total = 0;
  for (int i = 0; i < N; ++i) total += losses[i];
  return total / N;
}

template <typename T>
void softmax_xent_backward(T* dlogits, const T* probs, const int32_t* targets, T dloss, int N, int V) {
  parallel_rows(N, 4, [&](int i) {
    const T* p = probs + static_cast<size_t>(i) * V;
    T* d = dlogits + static_cast<size_t>(i) * V;
    for (int v = 0; v < V; ++v) d[v] = p[v] * dloss;
    d[targets[i]] -= dloss;
  });
}

#define STRATA_INSTANTIATE_CPU_OPS(T)                                                                   \
  template void encoder_forward<T>(T*, const int32_t*, const T*, const T*, int, int, int);             \
  template void encoder_backward<T>(T*, T*, const T*, const int32_t*, int, int, int);                  \
  template void layernorm_forward<T>(T*, T*, T*, const T*, const T*, const T*, int, int);              \
  template void layernorm_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, const T*, int, \
                                      int);                                                            \
  template void gemm_reference<T>(bool, bool, int, int, int, T, const T*, int, const T*, int, T, T*, int); \
  template void matmul_forward<T>(T*, const T*, const T*, const T*, int, int, int);                    \
  template void matmul_backward<T>(T*, T*, T*, const T*, const T*, const T*, int, int, int);           \
  template void attention_forward<T>(T*, T*, const T*, int, int, int, int);                            \
  template void attention_backward<T>(T*, T*, const T*, const T*, const T*, int, int, int, int);       \
  template void gelu_forward<T>(T*, const T*, size_t);                                                 \
  template void gelu_backward<T>(T*, const T*, const T*, size_t);                                      \
  template void residual_forward<T>(T*, const T*, const T*, size_t);                                   \
  template void residual_backward<T>(T*, T*, const T*, size_t);                                        \
  template T softmax_xent_forward<T>(T*, T*, const T*, const int32_t*, int, int);                      \
  template void softmax_xent_backward<T>(T*, const T*, const int32_t*, T, int, int);

STRATA_INSTANTIATE_CPU_OPS(float)
STRATA_INSTANTIATE_CPU_OPS(double)

}  // namespace strata::model::cpu

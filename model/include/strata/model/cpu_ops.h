#pragma once
// CPU forward and backward of every GPT op, templated on the element type
// (float for training, double for gradient checks against finite
// differences). Instantiated for float and double in cpu_ops.cpp.
//
// Conventions (as in llm.c): activations are row-major [N, C] with
// N = B * T rows; weights of a linear layer are [OC, C] (out = in @ W^T + b).
// Every *_backward ACCUMULATES (+=) into its gradient outputs, so the caller
// zeroes them once per step; the one exception is softmax_xent_backward,
// which overwrites dlogits. Loops are parallel over outputs (oneTBB) and
// every reduction runs in a fixed order, so results are bit-identical run
// after run with the same thread count.

#include <cstddef>
#include <cstdint>
#include <string>

namespace strata::model::cpu {

// out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]
template <typename T>
void encoder_forward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int B, int Tn, int C);
template <typename T>
void encoder_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int B, int Tn, int C);

// out = (inp - mean) * rstd * w + b per row; mean/rstd saved for backward.
template <typename T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* w, const T* b, int N, int C);
template <typename T>
void layernorm_backward(T* dinp, T* dw, T* db, const T* dout, const T* inp, const T* w, const T* mean,
                        const T* rstd, int N, int C);

// General matrix product on row-major data, C = alpha * op(A) @ op(B) + beta * C
// (float: OpenBLAS sgemm; double: dgemm; without OpenBLAS a blocked loop).
template <typename T>
void gemm(bool trans_a, bool trans_b, int M, int N, int K, T alpha, const T* A, int lda, const T* Bm,
          int ldb, T beta, T* Cm, int ldc);
// "OpenBLAS core SkylakeX (...), 2 threads": what gemm<float> runs on.
std::string gemm_backend_description();
// At most `threads` OpenBLAS threads per product from now on (0: OpenBLAS's
// own count). With oneTBB's global limit this keeps the model's compute on
// a given number of cores (strata train --device-threads), e.g. to leave
// the others to the CPU optimizer. Results do not depend on it.
void limit_gemm_threads(int threads);
// Straightforward triple loop; the reference every gemm path is compared to.
template <typename T>
void gemm_reference(bool trans_a, bool trans_b, int M, int N, int K, T alpha, const T* A, int lda,
                    const T* Bm, int ldb, T beta, T* Cm, int ldc);

// out[N,OC] = inp[N,C] @ w[OC,C]^T + bias[OC] (bias may be null)
template <typename T>
void matmul_forward(T* out, const T* inp, const T* w, const T* bias, int N, int C, int OC);
template <typename T>
void matmul_backward(T* dinp, T* dw, T* dbias, const T* dout, const T* inp, const T* w, int N, int C,
                     int OC);

// Causal multi-head attention. qkv is [B,T,3C] (q | k | v, heads of size
// C/NH side by side); att [B,NH,T,T] keeps the softmax for backward; out [B,T,C].
template <typename T>
void attention_forward(T* out, T* att, const T* qkv, int B, int Tn, int C, int NH);
// datt_scratch: [B,NH,T,T] workspace (contents on return unspecified).
template <typename T>
void attention_backward(T* dqkv, T* datt_scratch, const T* dout, const T* qkv, const T* att, int B,
                        int Tn, int C, int NH);

// GELU, tanh approximation (GPT-2).
template <typename T>
void gelu_forward(T* out, const T* inp, size_t n);
template <typename T>
void gelu_backward(T* dinp, const T* inp, const T* dout, size_t n);

template <typename T>
void residual_forward(T* out, const T* a, const T* b, size_t n);
// da += dout; db += dout
template <typename T>
void residual_backward(T* da, T* db, const T* dout, size_t n);

// probs = softmax(logits) per row over the first V entries of rows of
// stride Vp; losses[i] = -log probs[i, targets[i]]. Returns the mean loss.
// Targets outside [0, V) are a bug in the caller (checked).
template <typename T>
T softmax_xent_forward(T* probs, T* losses, const T* logits, const int32_t* targets, int N, int V);
// dlogits = (probs - onehot(targets)) * dloss (dloss = 1/N for a mean loss).
template <typename T>
void softmax_xent_backward(T* dlogits, const T* probs, const int32_t* targets, T dloss, int N, int V);

}  // namespace strata::model::cpu

// The activations on the device, for the bf16 (cuda.cu) and fp8 (cuda_fp8.cu) CUDA experts' kernels: float32
// versions of experts.cpp's activation_value. CUDA sources only; private to src/experts/.
#pragma once

#include <epmoe/experts.hpp>

namespace epmoe::experts_cuda {

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float gelu_f(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }

/// act(g, u) of a gated activation, act(g) of a non-gated one (u unused).
template <Activation A>
__device__ __forceinline__ float act_value(float g, float u) {
  if constexpr (A == Activation::silu) return silu_f(g) * u;
  else if constexpr (A == Activation::gelu) return gelu_f(g) * u;
  else if constexpr (A == Activation::swigluoai) {
    // gpt-oss constants (vLLM's swigluoai_and_mul): alpha 1.702, limit 7.
    g = fminf(g, 7.0f);
    u = fminf(fmaxf(u, -7.0f), 7.0f);
    return (u + 1.0f) * g / (1.0f + expf(-1.702f * g));
  } else if constexpr (A == Activation::silu_no_mul) return silu_f(g);
  else if constexpr (A == Activation::gelu_no_mul) return gelu_f(g);
  else return g > 0.0f ? g * g : 0.0f;  // relu2_no_mul
}

}  // namespace epmoe::experts_cuda

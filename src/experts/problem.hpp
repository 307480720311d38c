// The argument checks of ExpertsInputs, one for every Experts implementation (CPU and CUDA, bf16 and fp8;
// defined in experts.cpp), and the checked form the CPU implementations run from (internal).
#pragma once

#include <epmoe/dtype.hpp>
#include <epmoe/experts.hpp>

#include <cmath>
#include <cstdint>
#include <string_view>
#include <vector>

namespace epmoe {

/// What the checks of ExpertsInputs establish.
struct ExpertsSizes {
  bool batched = false, reduce = true, gated = true, weight_on_input = false;
  Device device;  ///< every tensor's: the CPU, or the weights' GPU (make_cuda_experts)
  std::int64_t e_local = 0, n = 0, h = 0, r1 = 0;  ///< r1: rows of w1 per expert (2N or N)
  std::int64_t m = 0, k = 0;    ///< standard: tokens and choices per token
  std::int64_t max_tokens = 0;  ///< batched: rows per slab
  std::int64_t id_limit = 0;    ///< standard: ids lie in [-1, id_limit) (E_local, or the size of expert_map)
  /// ExpertsInputs::combine_signal, checked: the entries (null when unset), per expert (uint32) or per block.
  void* signal = nullptr;
  bool signal_per_expert = false;
  std::int64_t signal_block_m = 0, signal_block_n = 0, signal_blocks = 0;  ///< blocks: ceil(max_tokens / block_m)
  Shape out_shape;
};

/// invalid_argument unless `a` is an Activation; returns is_gated(a).
bool check_activation(Activation a);

/// One tensor of an Experts call: on `device` (the CPU, or for the CUDA experts a CUDA tensor on the weights'
/// device), contiguous, with data unless empty.
void check_experts_tensor(const TensorView& t, std::string_view name, const Device& device);

/// The CUDA experts' device, the weights': invalid_argument unless w2 (defined) is a CUDA tensor.
Device cuda_weights_device(const TensorView& w2);

/// A 16-byte-aligned data pointer (the CUDA kernels' vector loads), unless `t` is empty.
void check_aligned16(const TensorView& t, std::string_view name);

/// Checks the bf16 weights (ExpertsQuant::none) and hidden's dtype on the CPU, or with `cuda` on the weights'
/// GPU with the CUDA experts' restrictions (H % 8 == 0, N % 8 == 0, E_local <= 1024, aligned data).
ExpertsSizes check_bf16_weights(const ExpertsInputs& in, const ExpertsConfig& config, bool cuda);

/// Limits of the CUDA experts' int32 row and slot indices.
struct CudaIndexLimits {
  std::int64_t slab_align;  ///< batched: rows per slab are rounded up to a multiple of this
  std::int64_t max_slots;   ///< standard: M * K at most this
  const char* slots;        ///< topk_idx's expected text when K or M * K is too large
};

/// The routing part of every check, once the weights fixed `s`'s sizes: hidden's shape; batched:
/// expert_num_tokens int32 [E_local], no expert_map, no router weight on the input; standard: topk_idx,
/// topk_weights, expert_map and global_num_experts. Shapes and dtypes only: the caller checks the values where
/// it can read them. Sets m, k, max_tokens, weight_on_input, id_limit and out_shape. `cuda`: the CUDA experts'
/// limits (nullptr on the CPU). Errors: invalid_argument naming the argument, the expected and the actual value.
void check_experts_routing(const ExpertsInputs& in, const CudaIndexLimits* cuda, ExpertsSizes& s);

/// The checked form of ExpertsInputs the CPU implementations run from (host pointers, local ids).
struct ExpertsProblem : ExpertsSizes {
  ActivationFormat format = ActivationFormat::standard;
  Activation activation = Activation::silu;
  const void* hidden = nullptr;     ///< bf16 or fp32, see hidden_dtype
  DType hidden_dtype = DType::bf16;
  const bf16_t* w1 = nullptr;       ///< [e_local, w1_rows(), h]
  const bf16_t* w2 = nullptr;       ///< [e_local, h, n]
  const float* topk_weights = nullptr;  ///< standard: [m, k]
  std::vector<std::int32_t> local_ids;  ///< standard: [m, k] local expert id or -1 (expert_map applied)
  const std::int32_t* counts = nullptr; ///< batched: [e_local]

  std::int64_t w1_rows() const { return gated ? 2 * n : n; }
  /// Row of w1[e] holding the gate (or, non-gated, the only) value of intermediate channel j.
  std::int64_t gate_row(std::int64_t j) const {
    return activation == Activation::swigluoai ? 2 * j : j;
  }
  /// Row of w1[e] holding the up value of channel j (gated activations only).
  std::int64_t up_row(std::int64_t j) const {
    return activation == Activation::swigluoai ? 2 * j + 1 : n + j;
  }
  /// Number of output elements (the product of Experts::output_shape).
  std::int64_t output_numel() const {
    if (format == ActivationFormat::batched_experts) return e_local * max_tokens * h;
    return reduce ? m * h : m * k * h;
  }
  /// Element `i` of the flat hidden tensor, widened to float (exact).
  float hidden_at(std::int64_t i) const {
    if (hidden_dtype == DType::bf16) return bf16_to_float(static_cast<const bf16_t*>(hidden)[i]);
    return static_cast<const float*>(hidden)[i];
  }
};

/// Adds 1 (release) to entry `i` of a checked combine signal (ExpertsSizes::signal) on the host.
inline void add_host_signal(const ExpertsSizes& s, std::int64_t i) {
  if (s.signal_per_expert)
    __atomic_fetch_add(static_cast<std::uint32_t*>(s.signal) + i, 1u, __ATOMIC_RELEASE);
  else
    __atomic_fetch_add(static_cast<std::int32_t*>(s.signal) + i, 1, __ATOMIC_RELEASE);
}

/// Checks every argument of `in` (see Experts::output_shape for the errors) and resolves the routing
/// to local ids. Defined in experts.cpp.
ExpertsProblem check_experts_inputs(const ExpertsInputs& in, const ExpertsConfig& config);

/// double -> bf16 with a single round-to-nearest-even (a plain double -> float -> bf16 would round
/// twice). Round-to-odd to float keeps the sticky information the second rounding needs.
inline bf16_t double_to_bf16(double d) {
  if (std::isnan(d)) return float_to_bf16(static_cast<float>(d));
  float f = static_cast<float>(d);
  if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);  // toward zero
  if (static_cast<double>(f) != d) f = bits_float(float_bits(f) | 1u);  // inexact: make it odd
  return float_to_bf16(f);
}

}  // namespace epmoe

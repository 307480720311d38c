// The checked form of ExpertsInputs that every Experts implementation runs from (internal).
#pragma once

#include <epmoe/dtype.hpp>
#include <epmoe/experts.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

namespace epmoe {

struct ExpertsProblem {
  ActivationFormat format = ActivationFormat::standard;
  bool reduce = true;  ///< standard only
  Activation activation = Activation::silu;
  bool gated = true;
  std::int64_t e_local = 0, n = 0, h = 0;
  std::int64_t m = 0, k = 0;        ///< standard: tokens and choices per token
  std::int64_t max_tokens = 0;      ///< batched: rows per slab
  const void* hidden = nullptr;     ///< bf16 or fp32, see hidden_dtype
  DType hidden_dtype = DType::bf16;
  const bf16_t* w1 = nullptr;       ///< [e_local, w1_rows(), h]
  const bf16_t* w2 = nullptr;       ///< [e_local, h, n]
  const float* topk_weights = nullptr;  ///< standard: [m, k]
  std::vector<std::int32_t> local_ids;  ///< standard: [m, k] local expert id or -1 (expert_map applied)
  const std::int32_t* counts = nullptr; ///< batched: [e_local]
  bool weight_on_input = false;

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

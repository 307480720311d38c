// An independent, naive float64 model of the fp8 block-scaled experts (ExpertsQuant::fp8_block, DeepSeek-V3's
// format), for tests. Written from the format's definition, separately from src/experts: fp8 codes decoded
// arithmetically (ref_fp8_decode), every weight matrix dequantized element by element (value * the scale of
// its 128x128 block) before use, inputs and the activation output quantized by support/quant_reference's semantics §6
// model, activations from naive_activation. No rounding besides those quantizations.
#pragma once

#include <epmoe/experts.hpp>
#include <epmoe/tensor.hpp>

#include <vector>

namespace epmoe::test {

/// Dequantized weights: w fp8 [E, rows, cols] with float32 scales [E, ceil(rows/128), ceil(cols/128)] ->
/// doubles [E, rows, cols] (row-major).
std::vector<double> naive_dequantize_blocks(const TensorView& w, const TensorView& scales);

/// The fp8 activations the experts' GEMMs see for x [rows, H]: fp8 x dequantized with x_scales [rows,
/// ceil(H/128)], or bf16/fp32 x (times row_weights[r] in float32 when given) quantized per semantics §6 and
/// dequantized. Returns doubles [rows, H].
std::vector<double> naive_fp8_inputs(const TensorView& x, const TensorView& x_scales, const float* row_weights,
                                     std::int64_t row_weight_stride);

/// Standard format (see experts.hpp and ExpertsQuant::fp8_block): returns [M, H] (reduce) or [M, K, H].
std::vector<double> naive_fp8_experts_standard(const TensorView& x, const TensorView& x_scales, const TensorView& w1,
                                               const TensorView& w1_scales, const TensorView& w2,
                                               const TensorView& w2_scales, const TensorView& topk_weights,
                                               const TensorView& topk_idx, Activation act,
                                               const TensorView& expert_map, bool weight_on_input, bool reduce);

/// Batched format: x [E_local, T, H] (+ scales [E_local, T, ceil(H/128)] when fp8), counts int32 [E_local].
/// Returns [E_local, T, H] with rows past each count zero.
std::vector<double> naive_fp8_experts_batched(const TensorView& x, const TensorView& x_scales, const TensorView& w1,
                                              const TensorView& w1_scales, const TensorView& w2,
                                              const TensorView& w2_scales, const TensorView& counts, Activation act);

}  // namespace epmoe::test

// Internal pieces of the fp8 block-scaled experts (ExpertsQuant::fp8_block): the argument checks shared by
// the float64 reference (reference_fp8.cpp) and the CUDA path (cuda_fp8.cpp), and the reference's factory.
#pragma once

#include <epmoe/experts.hpp>

#include <cstdint>
#include <memory>
#include <vector>

#include "experts/problem.hpp"

namespace epmoe::experts_fp8 {

inline constexpr std::int64_t kBlock = 128;  ///< weight blocks are kBlock x kBlock, activation groups 1 x kBlock
constexpr std::int64_t blocks(std::int64_t n) { return (n + kBlock - 1) / kBlock; }

/// The sizes the fp8 checks establish.
struct Fp8Sizes : ExpertsSizes {
  bool hidden_fp8 = false;  ///< hidden given in fp8, with hidden_scales
};

/// Checks what ExpertsQuant::fp8_block adds to ExpertsInputs, on top of (and before) the layout checks every
/// Experts implementation makes: w1/w2 float8_e4m3fn, 3-d, with float32 w1_scales [E_local, ceil(rows/128),
/// ceil(H/128)] and w2_scales [E_local, ceil(H/128), ceil(N/128)]; H % 16 == 0 and N % 16 == 0; hidden
/// float8_e4m3fn with float32 hidden_scales [rows..., ceil(H/128)], or bfloat16/float32 without scales;
/// apply_router_weight_on_input only with a bf16/fp32 hidden. Every tensor on `device` (check_experts_tensor).
/// Errors: invalid_argument naming the argument, the expected and the actual value.
Fp8Sizes check_fp8_inputs(const ExpertsInputs& in, const ExpertsConfig& config, const Device& device);

/// `in` with w1, w2 (and an fp8 hidden) retyped as bfloat16 views of the same shapes, for the layout and
/// routing checks written for the bf16 experts (they never read those tensors' data).
ExpertsInputs as_bf16_layout(const ExpertsInputs& in);

/// The float64 reference of ExpertsQuant::fp8_block (reference_fp8.cpp); make_reference_experts and
/// reference_experts_f64 dispatch here.
std::unique_ptr<Experts> make_reference_experts_fp8(const ExpertsConfig& config);
std::vector<double> reference_experts_fp8_f64(const ExpertsInputs& in, const ExpertsConfig& config);

}  // namespace epmoe::experts_fp8

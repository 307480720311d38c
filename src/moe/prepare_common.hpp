// Steps every prepare/finalize shares (CPU).
#pragma once

#include <epmoe/moe.hpp>

namespace epmoe {

/// Checks the token-side inputs of prepare (names the argument, expected and actual).
void check_prepare_inputs(const PrepareInputs& in);

/// apply_router_weight_on_input (K == 1): hidden[t] * w[t, 0] rounded to bf16, and all-ones weights
/// (so nothing downstream weights the token again). Otherwise returns the inputs unchanged.
std::pair<Tensor, Tensor> apply_router_weight_on_input(const PrepareInputs& in);

/// The activations the experts see after an fp8 wire: quantize, then dequantize to bfloat16.
Tensor fp8_round_trip(const TensorView& hidden, const PrepareFinalizeOptions& options);

/// Copies a view into a new contiguous CPU tensor.
Tensor clone(const TensorView& v);

/// Applies a WeightAndReduce (none or contiguous) to standard-format expert output for rows with
/// `topk_idx`/`topk_weights`, giving bfloat16 [M, H].
Tensor reduce_standard(const TensorView& fused, WeightAndReduce w, const TensorView& topk_weights,
                       const TensorView& topk_idx);

}  // namespace epmoe

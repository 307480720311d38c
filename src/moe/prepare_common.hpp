// Steps every prepare/finalize shares (CPU).
#pragma once

#include <epmoe/moe.hpp>

namespace epmoe {

/// The token side of one dispatch, kept by prepare/finalize until the combine.
struct TokenSide {
  Tensor hidden;        ///< bfloat16 [T, H], scaled by the weight with apply_router_weight_on_input
  Tensor topk_idx;      ///< int64/int32 [T, K] (a view of the caller's)
  Tensor topk_weights;  ///< float32 [T, K], all ones with apply_router_weight_on_input
};

/// Checks the token-side inputs of prepare (names the argument, expected and actual) and returns
/// them. With apply_router_weight_on_input (K == 1), hidden[t] * w[t, 0] is rounded to bf16 and the
/// weights become 1, so nothing downstream weights the token again.
TokenSide prepare_token_side(const PrepareInputs& in);

/// The activations the experts see after an fp8 wire: quantize, then dequantize to bfloat16.
Tensor fp8_round_trip(const TensorView& hidden, const PrepareFinalizeOptions& options);

/// Copies a view into a new contiguous CPU tensor.
Tensor clone(const TensorView& v);

/// Applies a WeightAndReduce (none or contiguous) to standard-format expert output for rows with
/// `topk_idx`/`topk_weights`, giving bfloat16 [M, H].
Tensor reduce_standard(const TensorView& fused, WeightAndReduce w, const TensorView& topk_weights,
                       const TensorView& topk_idx);

}  // namespace epmoe

// Steps every prepare/finalize shares (private to src/moe/): on the CPU (cpu.cpp) and on CUDA tensors (cuda.cpp).
#pragma once

#include <epmoe/moe.hpp>

namespace epmoe {

/// The token side of one dispatch, kept by prepare/finalize until the combine.
struct TokenSide {
  Tensor hidden;        ///< bfloat16 [T, H], scaled by the weight with apply_router_weight_on_input
  Tensor topk_idx;      ///< int64/int32 [T, K] (a view of the caller's)
  Tensor topk_weights;  ///< float32 [T, K], all ones with apply_router_weight_on_input
};

/// Checks the token-side inputs of a CPU prepare (names the argument, expected and actual: every tensor on
/// the CPU) and returns them. With apply_router_weight_on_input (K == 1), hidden[t] * w[t, 0] is rounded to bf16 and the
/// weights become 1, so nothing downstream weights the token again.
TokenSide prepare_token_side(const PrepareInputs& in);

/// Checks the token-side inputs of a prepare on CUDA tensors: hidden contiguous bfloat16 [T, H], H % 8 == 0,
/// 16-byte aligned; topk_idx int64/int32 [T, K] and topk_weights float32 [T, K], contiguous, and the optional
/// output bfloat16 [T, H], all on hidden's device; global_num_experts > 0; apply_router_weight_on_input only with
/// K == 1. invalid_argument naming the argument, the expected and the actual value. Reads no device memory.
void check_cuda_prepare_inputs(const PrepareInputs& in);

/// The token side of a checked call on CUDA tensors, asynchronous on the current stream: views of the caller's
/// tensors, or with apply_router_weight_on_input (K == 1) x * w rounded to bf16 and weights of 1 (as
/// prepare_token_side, same rounding), written into workspaces "<prefix>.scaled" and "<prefix>.ones" of
/// micro-batch 0 (valid until the next call that uses them). unsupported in builds without CUDA.
TokenSide cuda_token_side(const PrepareInputs& in, WorkspaceCache& workspaces, std::string_view prefix);

/// apply_router_weight_on_input (K == 1) on CUDA tensors of one GPU, asynchronous on `stream`: scaled bf16 [T, H] =
/// hidden * topk_weights rounded to bf16 (as prepare_token_side), ones float32 [T, 1] = 1. CUDA builds only.
void weight_on_input_cuda(const TensorView& hidden, const TensorView& topk_weights, const TensorView& scaled,
                          const TensorView& ones, Stream stream);

/// The activations the experts see after an fp8 wire: quantize, then dequantize to bfloat16.
Tensor fp8_round_trip(const TensorView& hidden, const PrepareFinalizeOptions& options);

/// DispatchDtype::nvfp4 is a low-latency wire format only: prepare/finalize `name` refuses it (invalid_argument naming
/// dispatch_dtype).
void refuse_nvfp4(const PrepareFinalizeOptions& options, std::string_view name);

/// Copies a view into a new contiguous CPU tensor.
Tensor clone(const TensorView& v);

/// Applies a WeightAndReduce (none or contiguous) to standard-format expert output for rows with
/// `topk_idx`/`topk_weights`, giving bfloat16 [M, H].
Tensor reduce_standard(const TensorView& fused, WeightAndReduce w, const TensorView& topk_weights,
                       const TensorView& topk_idx);

}  // namespace epmoe

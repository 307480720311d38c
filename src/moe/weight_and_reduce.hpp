// TopKWeightAndReduce on CPU: the step between the experts and the combine (SPEC 8).
#pragma once

#include <epmoe/experts.hpp>
#include <epmoe/tensor.hpp>

namespace epmoe {

/// Contiguous: fused bfloat16 [M, K, H] -> out bfloat16 [M, H], out[m] = sum_k w[m,k] * fused[m,k],
/// accumulated in float32 over k ascending, rounded once. Slots with topk_idx -1 are skipped.
void weight_and_reduce_contiguous(const TensorView& fused, const TensorView& topk_weights,
                                  const TensorView& topk_idx, const TensorView& out);

/// NaiveBatched: fused bfloat16 [E_local, max_tokens, H] in which slot i of local expert e holds the
/// i-th token (token order) routed to global expert first_expert + e -> out bfloat16 [M, H],
/// out[m] = sum over the token's local experts, in k order, of w[m,k] * fused[e, slot], in float32.
void weight_and_reduce_naive_batched(const TensorView& fused, const TensorView& topk_weights,
                                     const TensorView& topk_idx, int first_expert, const TensorView& out);

}  // namespace epmoe

// TopKWeightAndReduce, the step between the experts and the combine (semantics §8), on the CPU (cpu.cpp) and on CUDA
// (cuda.cu). Private to src/moe/.
#pragma once

#include <epmoe/experts.hpp>
#include <epmoe/stream.hpp>
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

// The CUDA twins (cuda.cu, CUDA builds only), asynchronous on `stream`, every tensor on one
// device and contiguous, H % 8 == 0 with 16-byte-aligned rows (checked by the caller). Same arithmetic as the
// CPU: float32 products rounded, then added in k order (no fused multiply-add), one bf16 rounding, so the
// bits equal the CPU's. Every row of `out` is written (zeros for a row without an expert).

/// Contiguous on CUDA: as weight_and_reduce_contiguous.
void weight_and_reduce_contiguous_cuda(const TensorView& fused, const TensorView& topk_weights,
                                       const TensorView& topk_idx, const TensorView& out, Stream stream);

/// NaiveBatched on CUDA, given where each choice sits: slot_of int32 [M, K] is the flat row
/// e * max_tokens + slot of choice (m, k) in fused [E_local, max_tokens, H], or -1 (no local expert,
/// dropped). The no-EP prepare computes it in the order weight_and_reduce_naive_batched assumes.
void weight_and_reduce_naive_batched_cuda(const TensorView& fused, const TensorView& topk_weights,
                                          const TensorView& slot_of, const TensorView& out, Stream stream);

}  // namespace epmoe

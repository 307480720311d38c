// Permute / unpermute around the experts (semantics §4 and 8): group the rows a rank received by local
// expert, and reduce the experts' outputs back to one row per received token.
//
// As in SGLang's DeepEP dispatcher (deepep_run_moe_deep_preprocess, deepep_permute_triton_kernel,
// deepep_post_reorder_triton_kernel; seeds/000): a counting sort of the local top-k ids gives
// src2dst [M, K], the per-expert offsets seg_indptr [E_local + 1] and the expert of each permuted row
// (reorder_topk_ids); permute copies each received row to every local expert it goes to; unpermute sums
// the expert outputs of a row weighted by its router weights.
//
// Determinism: within an expert, rows keep the (m, k) row-major order of topk_idx, so the CPU and CUDA
// implementations produce the same bits. Segments are padded to `expert_alignment` rows (semantics §4's
// num_recv_tokens_per_expert), padding rows of the permuted tensor are zero.
//
// Sizes never depend on the data: a permuted tensor has `capacity` rows (M*K plus the worst-case
// padding), so no host synchronisation is needed on a GPU; rows at and past seg_indptr[E_local] are
// not written. Everything runs on the tensors' device; on CUDA, asynchronously on the current stream
// (stream.hpp).
#pragma once

#include <epmoe/stream.hpp>
#include <epmoe/tensor.hpp>

#include <cstdint>

namespace epmoe {

/// Where every (token, local expert) entry of a received batch goes.
struct PermuteLayout {
  Tensor seg_indptr;             ///< int64 [E_local + 1]: rows of expert e are [seg_indptr[e], seg_indptr[e+1]),
                                 ///< each segment num_tokens_per_expert[e] rounded up to expert_alignment
  Tensor num_tokens_per_expert;  ///< int32 [E_local]: entries per expert, unpadded
  Tensor src2dst;                ///< int32 [M, K]: permuted row of entry (m, k); -1 where topk_idx is -1
  Tensor dst2src;               ///< int32 [capacity]: source row m of each permuted row; -1 for padding and unused rows
  Tensor reorder_topk_ids;      ///< int32 [capacity]: local expert of each permuted row; -1 for padding and unused rows
  std::int64_t num_tokens = 0;  ///< M
  int num_topk = 0;             ///< K
  int num_local_experts = 0;    ///< E_local
  int expert_alignment = 1;
  std::int64_t capacity = 0;  ///< permute_capacity(M, K, E_local, expert_alignment)
};

/// Rows a permuted tensor needs in the worst case: M*K + min(E_local, M*K) * (expert_alignment - 1).
constexpr std::int64_t permute_capacity(std::int64_t num_tokens, int num_topk, int num_local_experts,
                                        int expert_alignment) {
  const std::int64_t n = num_tokens * num_topk;
  const std::int64_t padded_experts = n < num_local_experts ? n : num_local_experts;
  return n + padded_experts * (expert_alignment - 1);
}

/// Counting sort of the local ids topk_idx (int64 or int32 [M, K], any strides; -1 = not on this rank)
/// into per-expert segments. The result lives on topk_idx's device.
/// Errors: topk_idx not 2-d int32/int64; num_local_experts outside 1..1024 (semantics §1); expert_alignment < 1;
/// on CPU, ids outside [-1, E_local) (the message names the first one and its [m, k]). On CUDA such ids
/// are skipped (src2dst -1) and flagged: cuda::check_invalid_ids() raises the same error later.
PermuteLayout make_permute_layout(const TensorView& topk_idx, int num_local_experts, int expert_alignment = 1);
PermuteLayout make_permute_layout(const TensorView& topk_idx, int num_local_experts, int expert_alignment,
                                  Stream stream);

/// The permuted activations: x [capacity, H] with x's dtype, and scales [capacity, S] when given.
struct Permuted {
  Tensor x;
  Tensor scales;  ///< undefined when no scales were passed
};

/// Copies row m of x [M, H] (bfloat16, float32 or float8_e4m3fn; rows of a multiple of 16 bytes, unit
/// inner stride, any 16-byte-aligned row stride) to permuted row src2dst[m, k] for every local k.
/// `x_scales` [M, S] (float32 or UE8M0 int32 per-token-group scales, unit inner stride) travel with their
/// rows when given. Padding rows are zero (data and scales).
/// Errors: dtype, shape, stride, alignment or device mismatches, naming the argument.
Permuted permute(const TensorView& x, const PermuteLayout& layout, const TensorView& x_scales = {});
Permuted permute(const TensorView& x, const PermuteLayout& layout, const TensorView& x_scales, Stream stream);

/// As permute, into caller memory: out [>= capacity, H] of x's dtype, out_scales [>= capacity, S] when
/// x_scales is given (rows may be strided; 16-byte-aligned row stride for out).
void permute_into(const TensorView& x, const PermuteLayout& layout, const TensorView& out,
                  const TensorView& x_scales = {}, const TensorView& out_scales = {});
void permute_into(const TensorView& x, const PermuteLayout& layout, const TensorView& out, const TensorView& x_scales,
                  const TensorView& out_scales, Stream stream);

/// Weighted reduction of the experts' outputs y [>= capacity, H] (bfloat16 or float32, permuted order):
///   out[m] = sum over k = 0..K-1 with src2dst[m, k] >= 0 of topk_weights[m, k] * y[src2dst[m, k]]
/// accumulated in float32 in ascending k (each product rounded, then added), rounded once to y's dtype;
/// a row with no local entry is zero. topk_weights: float32 [M, K]. Returns [M, H] with y's dtype.
Tensor unpermute(const TensorView& y, const PermuteLayout& layout, const TensorView& topk_weights);
Tensor unpermute(const TensorView& y, const PermuteLayout& layout, const TensorView& topk_weights, Stream stream);

/// As unpermute, into out [M, H] of y's dtype (16-byte-aligned row stride, unit inner stride).
void unpermute_into(const TensorView& y, const PermuteLayout& layout, const TensorView& topk_weights,
                    const TensorView& out);
void unpermute_into(const TensorView& y, const PermuteLayout& layout, const TensorView& topk_weights,
                    const TensorView& out, Stream stream);

namespace cuda {
/// semantics §11 on GPUs: get_dispatch_layout and make_permute_layout skip out-of-range ids on CUDA tensors
/// and record the first one (smallest [t, k]) in a per-device flag instead of synchronising. This call
/// waits for `stream`, reads and clears the flags of the current device, and throws the error the CPU
/// would have thrown (invalid_argument naming topk_idx, the bound, the value and its [t, k]). A no-op in
/// builds without CUDA.
void check_invalid_ids(Stream stream = {});
}  // namespace cuda

}  // namespace epmoe

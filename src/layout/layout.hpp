// Module interface of the layout stage (the one header of src/layout/ that other folders include): the public
// functions (layout.cpp) check every argument on the host, then call the CPU loops (cpu.cpp) or, for tensors
// on a GPU, the CUDA entry points (cuda.cu, CUDA builds only: EPMOE_HAVE_CUDA), which other stages also run
// on their own buffers. Everything on CUDA is asynchronous on `stream`.
#pragma once

#include <epmoe/layout.hpp>
#include <epmoe/permute.hpp>
#include <epmoe/stream.hpp>
#include <epmoe/tensor.hpp>

#include <cstdint>

namespace epmoe::layout_detail {

// ---- CPU (arguments checked; ids are checked here, before anything is written) --------------------------

/// get_dispatch_layout into `out`'s tensors (num_tokens_per_rank int32 [R], num_tokens_per_expert int32 [E],
/// is_token_in_rank bool [T, R], host memory). invalid_argument naming the first id outside [-1, E).
void dispatch_layout_cpu(const TensorView& topk_idx, int num_experts, int num_ranks, DispatchLayout& out);

/// Counting sort of topk_idx [M, K] into the layout's tensors (sizes set, tensors allocated on the host).
void make_permute_layout_cpu(const TensorView& topk_idx, PermuteLayout& layout);

/// As permute_cuda and unpermute_cuda, on host memory.
void permute_cpu(const TensorView& x, const TensorView& x_scales, const PermuteLayout& layout, const TensorView& out,
                 const TensorView& out_scales);
void unpermute_cpu(const TensorView& y, const PermuteLayout& layout, const TensorView& topk_weights,
                   const TensorView& out);

// ---- CUDA -------------------------------------------------------------------------------------------------

/// Which kernel family found an out-of-range id (each has its own flag on each device).
enum class IdCheck : int { dispatch_layout = 0, permute = 1 };
inline constexpr int kNumIdChecks = 2;

/// The device word recording the first out-of-range id of `kind` on the current device (allocated on
/// first use, all ones when clear). `bound` (ids must lie in [-1, bound)) is remembered for the message.
unsigned long long* bad_id_flag(IdCheck kind, std::int64_t bound);

/// get_dispatch_layout on a CUDA topk_idx (arguments already checked): allocates the outputs on the
/// tensor's device and enqueues one memset and one kernel on the current stream.
DispatchLayout get_dispatch_layout_cuda(const TensorView& topk_idx, int num_experts, int num_ranks);

/// The same into caller memory: per_rank int32 [R] and per_expert int32 [E] (both overwritten),
/// in_rank bool [T, R] contiguous. Ids outside [-1, E) are skipped and flagged.
void dispatch_layout_cuda(const TensorView& topk_idx, int num_experts, int num_ranks, std::int32_t* per_rank,
                          std::int32_t* per_expert, bool* in_rank, Stream stream);

/// Bytes of workspace make_permute_layout_cuda needs for M*K entries and E_local experts.
std::size_t permute_layout_workspace_bytes(std::int64_t num_entries, int num_local_experts);

/// Device buffers of a permute layout (see PermuteLayout), all caller-owned.
struct PermuteLayoutBuffers {
  std::int64_t* seg_indptr;             ///< [E_local + 1]
  std::int32_t* num_tokens_per_expert;  ///< [E_local]
  std::int32_t* src2dst;                ///< [M, K] contiguous
  std::int32_t* dst2src;                ///< [capacity]
  std::int32_t* reorder_topk_ids;       ///< [capacity]
  void* workspace;                      ///< permute_layout_workspace_bytes(M*K, E_local), 16-byte aligned
};

/// Counting sort of topk_idx [M, K] (local ids, -1 = not local) by expert, stable in (m, k) order.
void make_permute_layout_cuda(const TensorView& topk_idx, int num_local_experts, int expert_alignment,
                              std::int64_t capacity, const PermuteLayoutBuffers& out, Stream stream);

/// Scatters the rows of x [M, H] (any dtype, row bytes a multiple of 16) to out[src2dst[m, k]], zeroes
/// the padding rows, and moves x_scales [M, S] (4-byte elements) alongside when given.
void permute_cuda(const TensorView& x, const TensorView& x_scales, const PermuteLayout& layout, const TensorView& out,
                  const TensorView& out_scales, Stream stream);

/// out[m] = sum over k ascending of w[m, k] * y[src2dst[m, k]] in float32, rounded once.
void unpermute_cuda(const TensorView& y, const PermuteLayout& layout, const TensorView& topk_weights,
                    const TensorView& out, Stream stream);

}  // namespace epmoe::layout_detail

// Dispatch layout (semantics §3): which rank and expert each token goes to.
#pragma once

#include <epmoe/stream.hpp>
#include <epmoe/tensor.hpp>

namespace epmoe {

struct DispatchLayout {
  Tensor num_tokens_per_rank;    ///< int32 [R]: tokens sent to each rank (a token counts once per rank)
  Tensor num_tokens_per_expert;  ///< int32 [E]
  Tensor is_token_in_rank;       ///< bool [T, R]
};

/// Computes the layout of topk_idx (int64 or int32 [T, K]; -1 entries are ignored) for `num_experts`
/// experts spread evenly over `num_ranks` ranks (expert e on rank e / (E / R)).
/// Errors: topk_idx not 2-d int32/int64; E % R != 0; E / R > 1024; on CPU, ids outside [-1, E) (the message
/// names the first bad value and its [t, k] position).
DispatchLayout get_dispatch_layout(const TensorView& topk_idx, int num_experts, int num_ranks);

/// The same on an explicit stream (stream.hpp). On CUDA the outputs are computed asynchronously on
/// `stream`, ids outside [-1, E) are skipped and flagged, and cuda::check_invalid_ids() (permute.hpp)
/// raises the CPU's error for them later.
inline DispatchLayout get_dispatch_layout(const TensorView& topk_idx, int num_experts, int num_ranks, Stream stream) {
  StreamGuard guard(stream);
  return get_dispatch_layout(topk_idx, num_experts, num_ranks);
}

}  // namespace epmoe

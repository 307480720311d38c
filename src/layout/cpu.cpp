// Dispatch layout on CPU (SPEC 3): which ranks and experts each token goes to.
#include "core/check.hpp"
#include <epmoe/layout.hpp>

#include <algorithm>
#include <cstring>

#if defined(EPMOE_HAVE_CUDA)
#include "layout/cuda.hpp"
#endif

namespace epmoe {

namespace {

/// SPEC 1 limit on experts per rank.
constexpr std::int64_t kMaxLocalExperts = 1024;

template <class Id>
void compute_layout(const TensorView& topk_idx, int num_experts, int num_ranks, DispatchLayout& out) {
  const std::int64_t T = topk_idx.size(0), K = topk_idx.size(1);
  const std::int64_t s0 = topk_idx.stride(0), s1 = topk_idx.stride(1);
  const int experts_per_rank = num_experts / num_ranks;
  const Id* idx = static_cast<const Id*>(topk_idx.data);

  // Validate every value first so a bad id leaves no partial result behind and names its position.
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t e = static_cast<std::int64_t>(idx[t * s0 + k * s1]);
      if (e < -1 || e >= num_experts)
        throw_invalid_argument("topk_idx", fmt::format("expert ids in [-1, {})", num_experts),
                               fmt::format("{} at [{}, {}]", e, t, k));
    }

  auto* per_rank = out.num_tokens_per_rank.ptr<std::int32_t>();
  auto* per_expert = out.num_tokens_per_expert.ptr<std::int32_t>();
  auto* in_rank = out.is_token_in_rank.ptr<bool>();
  std::memset(per_rank, 0, sizeof(std::int32_t) * static_cast<std::size_t>(num_ranks));
  std::memset(per_expert, 0, sizeof(std::int32_t) * static_cast<std::size_t>(num_experts));
  for (std::int64_t t = 0; t < T; ++t) {
    bool* row = in_rank + t * num_ranks;
    std::fill(row, row + num_ranks, false);
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t e = static_cast<std::int64_t>(idx[t * s0 + k * s1]);
      if (e < 0) continue;
      ++per_expert[e];  // one count per (token, expert) entry, as DeepEP counts
      row[e / experts_per_rank] = true;
    }
    for (int r = 0; r < num_ranks; ++r) per_rank[r] += row[r] ? 1 : 0;  // a token counts once per rank
  }
}

}  // namespace

DispatchLayout get_dispatch_layout(const TensorView& topk_idx, int num_experts, int num_ranks) {
  EPMOE_CHECK_ARG(topk_idx.defined(), "topk_idx", "an int64 or int32 [T, K] tensor", "None");
  EPMOE_CHECK_ARG(topk_idx.dtype == DType::int64 || topk_idx.dtype == DType::int32, "topk_idx",
                  "dtype int64 or int32", describe(topk_idx));
  EPMOE_CHECK_ARG(topk_idx.ndim() == 2, "topk_idx", "a 2-d [T, K] tensor", describe(topk_idx));
  EPMOE_CHECK_ARG(topk_idx.size(0) == 0 || topk_idx.size(1) == 0 || topk_idx.data != nullptr, "topk_idx",
                  "non-null data", "a null pointer");
#if !defined(EPMOE_HAVE_CUDA)
  if (!topk_idx.device.is_cpu())
    raise(ErrorCode::unsupported, "get_dispatch_layout: topk_idx on {} is not supported by this build (CPU only)",
          to_string(topk_idx.device));
#endif
  EPMOE_CHECK_ARG(num_ranks >= 1, "num_ranks", ">= 1", num_ranks);
  EPMOE_CHECK_ARG(num_experts >= 1, "num_experts", ">= 1", num_experts);
  EPMOE_CHECK_ARG(num_experts % num_ranks == 0, "num_experts",
                  fmt::format("a multiple of num_ranks ({})", num_ranks), num_experts);
  EPMOE_CHECK_ARG(num_experts / num_ranks <= kMaxLocalExperts, "num_experts",
                  fmt::format("at most {} experts per rank ({} ranks)", kMaxLocalExperts, num_ranks), num_experts);

#if defined(EPMOE_HAVE_CUDA)
  // layout/cuda.cu: asynchronous on the current stream; bad ids are flagged, not thrown (SPEC 11).
  if (topk_idx.device.is_cuda()) return layout_detail::get_dispatch_layout_cuda(topk_idx, num_experts, num_ranks);
#endif
  const std::int64_t T = topk_idx.size(0);
  DispatchLayout out;
  out.num_tokens_per_rank = Tensor::empty(DType::int32, {num_ranks});
  out.num_tokens_per_expert = Tensor::empty(DType::int32, {num_experts});
  out.is_token_in_rank = Tensor::empty(DType::boolean, {T, num_ranks});
  if (topk_idx.dtype == DType::int64) compute_layout<std::int64_t>(topk_idx, num_experts, num_ranks, out);
  else compute_layout<std::int32_t>(topk_idx, num_experts, num_ranks, out);
  return out;
}

}  // namespace epmoe

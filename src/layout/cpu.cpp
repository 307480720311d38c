// The layout stage on the CPU (semantics §3 and include/epmoe/permute.hpp): which ranks and experts each token goes
// to, and the permute layout, permute and unpermute loops. Arguments are checked by layout.cpp.
#include "core/check.hpp"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "layout/layout.hpp"

namespace epmoe::layout_detail {

namespace {

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

template <class Id>
void permute_layout(const TensorView& topk_idx, PermuteLayout& l) {
  const std::int64_t M = l.num_tokens, K = l.num_topk, E = l.num_local_experts;
  const std::int64_t s0 = topk_idx.stride(0), s1 = topk_idx.stride(1);
  const Id* idx = static_cast<const Id*>(topk_idx.data);
  // Validate first so a bad id leaves nothing half done and names its position.
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t k = 0; k < K; ++k) {
      const auto e = static_cast<std::int64_t>(idx[m * s0 + k * s1]);
      if (e < -1 || e >= E)
        throw_invalid_argument("topk_idx", fmt::format("expert ids in [-1, {})", E),
                               fmt::format("{} at [{}, {}]", e, m, k));
    }
  auto* count = l.num_tokens_per_expert.ptr<std::int32_t>();
  auto* seg = l.seg_indptr.ptr<std::int64_t>();
  auto* src2dst = l.src2dst.ptr<std::int32_t>();
  auto* dst2src = l.dst2src.ptr<std::int32_t>();
  auto* reorder = l.reorder_topk_ids.ptr<std::int32_t>();
  std::fill(count, count + E, 0);
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t k = 0; k < K; ++k) {
      const auto e = static_cast<std::int64_t>(idx[m * s0 + k * s1]);
      if (e >= 0) ++count[e];
    }
  const std::int64_t a = l.expert_alignment;
  seg[0] = 0;
  for (std::int64_t e = 0; e < E; ++e) seg[e + 1] = seg[e] + (count[e] + a - 1) / a * a;
  std::fill(dst2src, dst2src + l.capacity, -1);
  std::fill(reorder, reorder + l.capacity, -1);
  std::vector<std::int64_t> next(seg, seg + E);
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t k = 0; k < K; ++k) {
      const auto e = static_cast<std::int64_t>(idx[m * s0 + k * s1]);
      if (e < 0) {
        src2dst[m * K + k] = -1;
        continue;
      }
      const std::int64_t p = next[static_cast<std::size_t>(e)]++;
      src2dst[m * K + k] = static_cast<std::int32_t>(p);
      dst2src[p] = static_cast<std::int32_t>(m);
      reorder[p] = static_cast<std::int32_t>(e);
    }
}

template <class T>
float load_value(const T* p, std::int64_t i) {
  if constexpr (std::is_same_v<T, float>)
    return p[i];
  else
    return bf16_to_float(p[i]);
}
template <class T>
void store_value(T* p, std::int64_t i, float v) {
  if constexpr (std::is_same_v<T, float>)
    p[i] = v;
  else
    p[i] = float_to_bf16(v);
}

template <class T>
void unpermute_rows(const TensorView& y, const PermuteLayout& l, const TensorView& w, const TensorView& out) {
  const std::int64_t M = l.num_tokens, K = l.num_topk, H = y.size(1);
  const auto* src2dst = l.src2dst.ptr<std::int32_t>();
  std::vector<float> acc(static_cast<std::size_t>(H));
  for (std::int64_t m = 0; m < M; ++m) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    const float* wm = static_cast<const float*>(w.data) + m * w.stride(0);
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int32_t d = src2dst[m * K + k];
      if (d < 0) continue;
      const float wk = wm[k];
      const T* yr = static_cast<const T*>(y.data) + d * y.stride(0);
      for (std::int64_t h = 0; h < H; ++h) {
        const float product = wk * load_value(yr, h);  // rounded, then added: no fused multiply-add
        acc[static_cast<std::size_t>(h)] = acc[static_cast<std::size_t>(h)] + product;
      }
    }
    T* o = static_cast<T*>(out.data) + m * out.stride(0);
    for (std::int64_t h = 0; h < H; ++h) store_value(o, h, acc[static_cast<std::size_t>(h)]);
  }
}

}  // namespace

void dispatch_layout_cpu(const TensorView& topk_idx, int num_experts, int num_ranks, DispatchLayout& out) {
  if (topk_idx.dtype == DType::int64)
    compute_layout<std::int64_t>(topk_idx, num_experts, num_ranks, out);
  else
    compute_layout<std::int32_t>(topk_idx, num_experts, num_ranks, out);
}

void make_permute_layout_cpu(const TensorView& topk_idx, PermuteLayout& layout) {
  if (topk_idx.dtype == DType::int64)
    permute_layout<std::int64_t>(topk_idx, layout);
  else
    permute_layout<std::int32_t>(topk_idx, layout);
}

void permute_cpu(const TensorView& x, const TensorView& x_scales, const PermuteLayout& l, const TensorView& out,
                 const TensorView& out_scales) {
  const std::int64_t M = l.num_tokens, K = l.num_topk, E = l.num_local_experts;
  const std::size_t row_bytes = static_cast<std::size_t>(x.size(1)) * dtype_size(x.dtype);
  const std::size_t scale_bytes = x_scales.defined() ? static_cast<std::size_t>(x_scales.size(1)) * 4u : 0u;
  const auto* src2dst = l.src2dst.ptr<std::int32_t>();
  auto row_ptr = [](const TensorView& t, std::int64_t r) {
    return static_cast<char*>(t.data) + r * t.stride(0) * static_cast<std::int64_t>(dtype_size(t.dtype));
  };
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int32_t d = src2dst[m * K + k];
      if (d < 0) continue;
      std::memcpy(row_ptr(out, d), row_ptr(x, m), row_bytes);
      if (scale_bytes) std::memcpy(row_ptr(out_scales, d), row_ptr(x_scales, m), scale_bytes);
    }
  const auto* seg = l.seg_indptr.ptr<std::int64_t>();
  const auto* count = l.num_tokens_per_expert.ptr<std::int32_t>();
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t p = seg[e] + count[e]; p < seg[e + 1]; ++p) {
      std::memset(row_ptr(out, p), 0, row_bytes);
      if (scale_bytes) std::memset(row_ptr(out_scales, p), 0, scale_bytes);
    }
}

void unpermute_cpu(const TensorView& y, const PermuteLayout& layout, const TensorView& topk_weights,
                   const TensorView& out) {
  if (y.dtype == DType::bf16)
    unpermute_rows<bf16_t>(y, layout, topk_weights, out);
  else
    unpermute_rows<float>(y, layout, topk_weights, out);
}

}  // namespace epmoe::layout_detail

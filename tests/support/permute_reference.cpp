#include "support/permute_reference.hpp"

#include <algorithm>
#include <tuple>

namespace epmoe::test {

RefPermuteLayout ref_permute_layout(const std::vector<std::int64_t>& ids, std::int64_t M, int K, int E, int alignment) {
  RefPermuteLayout r;
  const std::int64_t n = M * K;
  const std::int64_t padded_experts = std::min<std::int64_t>(n, E);
  r.capacity = n + padded_experts * (alignment - 1);
  // (expert, flat index) of every local entry, stably sorted by expert: row-major order within one.
  std::vector<std::tuple<std::int64_t, std::int64_t>> entries;
  for (std::int64_t i = 0; i < n; ++i)
    if (ids[static_cast<std::size_t>(i)] >= 0) entries.emplace_back(ids[static_cast<std::size_t>(i)], i);
  std::stable_sort(entries.begin(), entries.end(),
                   [](const auto& a, const auto& b) { return std::get<0>(a) < std::get<0>(b); });
  r.counts.assign(static_cast<std::size_t>(E), 0);
  for (const auto& [e, i] : entries) ++r.counts[static_cast<std::size_t>(e)];
  r.seg_indptr.assign(static_cast<std::size_t>(E) + 1, 0);
  for (int e = 0; e < E; ++e) {
    const std::int64_t c = r.counts[static_cast<std::size_t>(e)];
    const std::int64_t padded = c % alignment == 0 ? c : c + (alignment - c % alignment);
    r.seg_indptr[static_cast<std::size_t>(e) + 1] = r.seg_indptr[static_cast<std::size_t>(e)] + padded;
  }
  r.src2dst.assign(static_cast<std::size_t>(n), -1);
  r.dst2src.assign(static_cast<std::size_t>(r.capacity), -1);
  r.reorder_topk_ids.assign(static_cast<std::size_t>(r.capacity), -1);
  std::int64_t previous_expert = -1, row = 0;
  for (const auto& [e, i] : entries) {
    if (e != previous_expert) {
      row = r.seg_indptr[static_cast<std::size_t>(e)];
      previous_expert = e;
    }
    r.src2dst[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(row);
    r.dst2src[static_cast<std::size_t>(row)] = static_cast<std::int32_t>(i / K);
    r.reorder_topk_ids[static_cast<std::size_t>(row)] = static_cast<std::int32_t>(e);
    ++row;
  }
  return r;
}

std::vector<double> ref_unpermute(const std::vector<double>& y, std::int64_t H, const RefPermuteLayout& layout,
                                  const std::vector<double>& w, std::int64_t M, int K) {
  std::vector<double> out(static_cast<std::size_t>(M * H), 0.0);
  for (std::int64_t m = 0; m < M; ++m)
    for (int k = 0; k < K; ++k) {
      const std::int32_t d = layout.src2dst[static_cast<std::size_t>(m * K + k)];
      if (d < 0) continue;
      for (std::int64_t h = 0; h < H; ++h)
        out[static_cast<std::size_t>(m * H + h)] +=
            w[static_cast<std::size_t>(m * K + k)] * y[static_cast<std::size_t>(d * H + h)];
    }
  return out;
}

}  // namespace epmoe::test

// Independent reference of permute / unpermute (include/epmoe/permute.hpp), written from its contract
// and never calling epmoe's code: entries grouped by expert with a stable sort of (expert, m, k)
// tuples; segments padded to the alignment; the weighted reduction in float64.
#pragma once

#include <cstdint>
#include <vector>

namespace epmoe::test {

struct RefPermuteLayout {
  std::vector<std::int64_t> seg_indptr;        ///< [E + 1]
  std::vector<std::int32_t> counts;            ///< [E]
  std::vector<std::int32_t> src2dst;           ///< [M * K]
  std::vector<std::int32_t> dst2src;           ///< [capacity]
  std::vector<std::int32_t> reorder_topk_ids;  ///< [capacity]
  std::int64_t capacity = 0;
};

/// ids: row-major [M, K] local expert ids, -1 = not local.
RefPermuteLayout ref_permute_layout(const std::vector<std::int64_t>& ids, std::int64_t M, int K, int E, int alignment);

/// out[m][h] = sum over k with src2dst >= 0 of w[m][k] * y[src2dst][h], in float64.
/// y: row-major [rows, H] values; w: [M, K].
std::vector<double> ref_unpermute(const std::vector<double>& y, std::int64_t H, const RefPermuteLayout& layout,
                                  const std::vector<double>& w, std::int64_t M, int K);

}  // namespace epmoe::test

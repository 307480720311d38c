#include "support/router_reference.hpp"

#include "support/quant_reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>

namespace epmoe::test {

std::vector<double> ref_logits_to_double(const TensorView& logits) {
  const std::int64_t n = logits.numel();
  std::vector<double> out(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    if (logits.dtype == DType::fp32) {
      float f;
      std::memcpy(&f, static_cast<const char*>(logits.data) + 4 * i, 4);
      out[static_cast<std::size_t>(i)] = f;
    } else if (logits.dtype == DType::bf16) {
      std::uint16_t b;
      std::memcpy(&b, static_cast<const char*>(logits.data) + 2 * i, 2);
      out[static_cast<std::size_t>(i)] = ref_bf16_decode(b);
    } else {
      throw std::invalid_argument("ref_logits_to_double: float32 or bfloat16 only");
    }
  }
  return out;
}

namespace {

// Indices [0, n) ordered by descending key; std::stable_sort keeps equal keys in ascending index order.
std::vector<int> order_desc(const std::vector<double>& key) {
  std::vector<int> idx(key.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(),
                   [&](int a, int b) { return key[static_cast<std::size_t>(a)] > key[static_cast<std::size_t>(b)]; });
  return idx;
}

bool near_tie(double a, double b, const RouterRefOptions& o) {
  const double gap = std::fabs(a - b);
  return gap > 0.0 && gap < o.tie_rel * std::max(std::fabs(a), std::fabs(b)) + o.tie_abs;
}

}  // namespace

std::vector<RouterRefRow> router_reference(const std::vector<double>& logits, std::int64_t T, std::int64_t E,
                                           const RouterRefOptions& o) {
  const auto e_count = static_cast<std::size_t>(E);
  const int G = o.num_expert_group;
  const std::size_t group_size = e_count / static_cast<std::size_t>(G);
  const bool has_bias = !o.bias.empty();
  std::vector<RouterRefRow> rows(static_cast<std::size_t>(T));
  for (std::int64_t t = 0; t < T; ++t) {
    RouterRefRow& row = rows[static_cast<std::size_t>(t)];
    const double* x = logits.data() + t * E;
    row.scores.resize(e_count);
    if (o.sigmoid) {
      for (std::size_t e = 0; e < e_count; ++e) row.scores[e] = 1.0 / (1.0 + std::exp(-x[e]));
    } else {
      const double mx = *std::max_element(x, x + E);
      double sum = 0.0;
      for (std::size_t e = 0; e < e_count; ++e) sum += std::exp(x[e] - mx);
      for (std::size_t e = 0; e < e_count; ++e) row.scores[e] = std::exp(x[e] - mx) / sum;
    }
    std::vector<double> sel = row.scores;
    if (has_bias)
      for (std::size_t e = 0; e < e_count; ++e) sel[e] += o.bias[e];

    // Which experts may be chosen: those of the best topk_group groups.
    std::vector<bool> eligible(e_count, true);
    if (G > 1 && o.topk_group < G) {
      std::vector<double> group_score(static_cast<std::size_t>(G));
      for (int g = 0; g < G; ++g) {
        std::vector<double> v(sel.begin() + static_cast<std::ptrdiff_t>(g * group_size),
                              sel.begin() + static_cast<std::ptrdiff_t>((g + 1) * group_size));
        std::sort(v.begin(), v.end(), std::greater<>());
        group_score[static_cast<std::size_t>(g)] = has_bias ? v[0] + v[1] : v[0];
      }
      const std::vector<int> gorder = order_desc(group_score);
      std::vector<bool> kept(static_cast<std::size_t>(G), false);
      for (int i = 0; i < o.topk_group; ++i) kept[static_cast<std::size_t>(gorder[static_cast<std::size_t>(i)])] = true;
      if (near_tie(group_score[static_cast<std::size_t>(gorder[static_cast<std::size_t>(o.topk_group - 1)])],
                   group_score[static_cast<std::size_t>(gorder[static_cast<std::size_t>(o.topk_group)])], o))
        row.ambiguous = true;
      for (std::size_t e = 0; e < e_count; ++e) eligible[e] = kept[e / group_size];
    }

    std::vector<double> key(e_count);
    for (std::size_t e = 0; e < e_count; ++e) key[e] = eligible[e] ? sel[e] : -INFINITY;
    const std::vector<int> order = order_desc(key);
    const auto K = static_cast<std::size_t>(o.num_topk);
    std::size_t n_eligible = static_cast<std::size_t>(std::count(eligible.begin(), eligible.end(), true));
    for (std::size_t k = 0; k + 1 < std::min(K + 1, n_eligible); ++k)
      if (near_tie(key[static_cast<std::size_t>(order[k])], key[static_cast<std::size_t>(order[k + 1])], o))
        row.ambiguous = true;
    double sum = 0.0;
    for (std::size_t k = 0; k < K; ++k) {
      row.ids.push_back(order[k]);
      row.weights.push_back(row.scores[static_cast<std::size_t>(order[k])]);
      sum += row.weights.back();
    }
    for (double& w : row.weights) w = (o.renormalize ? w / sum : w) * o.routed_scaling_factor;
  }
  return rows;
}

}  // namespace epmoe::test

// Float64 reference of the router (semantics §2), written from docs/semantics.md and vLLM's documented semantics,
// never calling epmoe's router: softmax / sigmoid scores, optional DeepSeek grouped selection with a
// correction bias, top-k with ties to the lower id (and the lower group), renormalisation, scaling.
#pragma once

#include <epmoe/tensor.hpp>

#include <cstdint>
#include <vector>

namespace epmoe::test {

struct RouterRefOptions {
  int num_topk = 1;
  bool sigmoid = false;  ///< scores: sigmoid, else softmax over the row
  bool renormalize = false;
  double routed_scaling_factor = 1.0;
  int num_expert_group = 1;
  int topk_group = 1;
  std::vector<double> bias;  ///< e_score_correction_bias [E], empty for none
  /// A decision whose deciding gap g between scores a and b is in (0, tie_rel * max(|a|, |b|) + tie_abs)
  /// is "ambiguous": float32 rounding may decide it either way. Scores of one row share their
  /// softmax divisor, so their float32 order is off only by the few ulps of expf (relative); a bias
  /// adds an absolute error of about one ulp of the biased score.
  double tie_rel = 1e-6;
  double tie_abs = 1e-9;
};

struct RouterRefRow {
  std::vector<std::int64_t> ids;  ///< [K], in descending selection-score order, ties lower id first
  std::vector<double> weights;  ///< [K]
  std::vector<double> scores;  ///< [E] unbiased scores
  bool ambiguous = false;  ///< a near-tie decided the ids or their order
};

/// Values of a float32 or bfloat16 [T, E] tensor as doubles (decoded independently of epmoe).
std::vector<double> ref_logits_to_double(const TensorView& logits);

/// Routes T rows of E logits.
std::vector<RouterRefRow> router_reference(const std::vector<double>& logits, std::int64_t T, std::int64_t E,
                                           const RouterRefOptions& options);

}  // namespace epmoe::test

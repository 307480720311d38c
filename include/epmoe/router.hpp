// Router: top-k expert selection (semantics §2).
//
// All functions take router logits [T, E] (float32 or bfloat16, on CPU or CUDA) and return
// topk_weights float32 [T, K] and topk_idx int64 [T, K] on the same device. Ties go to the lower
// expert id, so results are deterministic and identical across devices.
#pragma once

#include <epmoe/stream.hpp>
#include <epmoe/tensor.hpp>

namespace epmoe {

struct TopkResult {
  Tensor topk_weights;  ///< float32 [T, K]
  Tensor topk_idx;      ///< int64 [T, K], in descending weight order (ties: lower id first)
};

/// softmax over all E logits (float32), then the K largest. `renormalize` divides the K weights by
/// their sum. Errors: logits not 2-d float32/bfloat16; K outside 1..E.
TopkResult topk_softmax(const TensorView& logits, int num_topk, bool renormalize);

/// sigmoid of each logit, then the K largest; `renormalize` as above.
TopkResult topk_sigmoid(const TensorView& logits, int num_topk, bool renormalize);

enum class ScoringFunc { softmax, sigmoid };

/// Options of grouped_topk (DeepSeek-V2/V3 routing).
struct GroupedTopkOptions {
  int num_topk = 8;
  int num_expert_group = 1;    ///< groups the E experts are split into (E % groups == 0)
  int topk_group = 1;          ///< groups kept
  ScoringFunc scoring = ScoringFunc::softmax;
  bool renormalize = true;
  float routed_scaling_factor = 1.0f;
  TensorView e_score_correction_bias;  ///< optional float32 [E]: added to scores for selection only
};

/// DeepSeek-V2/V3 grouped top-k (semantics §2): scores = softmax or sigmoid of logits; with a correction
/// bias, selection uses score + bias and a group's score is the sum of its top-2 biased scores,
/// otherwise the group max; keep `topk_group` groups (ties: lower group), then the top K experts in
/// them (ties: lower id). Weights are the unbiased scores, renormalised if asked, times
/// routed_scaling_factor. Errors: E % num_expert_group != 0, topk_group > num_expert_group,
/// K > topk_group * E / num_expert_group, bias of the wrong shape or dtype, a bias with groups of
/// one expert (no top-2). With a bias, ids come in descending biased-score (selection) order, which
/// may differ from the order of the returned (unbiased) weights.
TopkResult grouped_topk(const TensorView& logits, const GroupedTopkOptions& options);

/// The same on an explicit stream (stream.hpp): logits on CUDA are routed asynchronously on `stream`;
/// the results are bit-identical to the CPU's on the same inputs.
inline TopkResult topk_softmax(const TensorView& logits, int num_topk, bool renormalize, Stream stream) {
  StreamGuard guard(stream);
  return topk_softmax(logits, num_topk, renormalize);
}
inline TopkResult topk_sigmoid(const TensorView& logits, int num_topk, bool renormalize, Stream stream) {
  StreamGuard guard(stream);
  return topk_sigmoid(logits, num_topk, renormalize);
}
inline TopkResult grouped_topk(const TensorView& logits, const GroupedTopkOptions& options, Stream stream) {
  StreamGuard guard(stream);
  return grouped_topk(logits, options);
}

}  // namespace epmoe

// CPU router (semantics §2): scores in float32, then a deterministic top-k with ties to the lower id.
//
// Softmax follows vLLM's topk_softmax: subtract the row max, expf, divide by the sum. grouped_topk
// follows vLLM's grouped_topk (DeepSeek-V2/V3): the group score is the group max, or with an
// e_score_correction_bias the sum of the group's two best biased scores; the experts of the kept
// groups compete on the biased score, the weights are the unbiased scores.
#include "core/check.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "router/router.hpp"
#include "router/score_math.hpp"

namespace epmoe::router_detail {

namespace {

// Keeps the best n <= k (key, id) pairs in descending key order. Candidates must arrive in
// ascending id order: a candidate only moves past a strictly smaller key, so among equal keys the
// one seen first (the lower id) ranks first. NaN keys are treated as -inf so the order stays total.
class TopK {
 public:
  void reset(float* keys, int* ids, int k) {
    keys_ = keys;
    ids_ = ids;
    k_ = k;
    n_ = 0;
  }
  void offer(float key, int id) {
    if (std::isnan(key)) key = -std::numeric_limits<float>::infinity();
    int p;
    if (n_ < k_)
      p = n_++;
    else if (key > keys_[k_ - 1])
      p = k_ - 1;
    else
      return;
    while (p > 0 && key > keys_[p - 1]) {
      keys_[p] = keys_[p - 1];
      ids_[p] = ids_[p - 1];
      --p;
    }
    keys_[p] = key;
    ids_[p] = id;
  }
  int size() const { return n_; }
  int id(int i) const { return ids_[i]; }
  float key(int i) const { return keys_[i]; }

 private:
  float* keys_ = nullptr;
  int* ids_ = nullptr;
  int k_ = 0, n_ = 0;
};

void load_row(const RoutingProblem& p, std::int64_t t, float* out) {
  const std::int64_t E = p.num_experts;
  if (p.logits.dtype == DType::fp32) {
    const float* in = static_cast<const float*>(p.logits.data) + t * E;
    for (std::int64_t e = 0; e < E; ++e) out[e] = in[e];
  } else {
    const bf16_t* in = static_cast<const bf16_t*>(p.logits.data) + t * E;
    for (std::int64_t e = 0; e < E; ++e) out[e] = bf16_to_float(in[e]);
  }
}

void softmax_inplace(float* s, std::int64_t E) {
  float m = s[0];
  for (std::int64_t e = 1; e < E; ++e) m = s[e] > m ? s[e] : m;
  float sum = 0.0f;
  for (std::int64_t e = 0; e < E; ++e) {
    s[e] = score_exp(s[e] - m);  // score_math.hpp: the same bits as the CUDA router
    sum += s[e];
  }
  for (std::int64_t e = 0; e < E; ++e) s[e] = s[e] / sum;
}

void sigmoid_inplace(float* s, std::int64_t E) {
  for (std::int64_t e = 0; e < E; ++e) s[e] = score_sigmoid(s[e]);  // 1 / (1 + exp(-s)), score_math.hpp
}

}  // namespace

void route_cpu(const RoutingProblem& p, float* topk_weights, std::int64_t* topk_idx) {
  const std::int64_t E = p.num_experts;
  const int K = p.num_topk, G = p.num_expert_group;
  const int group_size = static_cast<int>(E / G);
  const bool grouped = p.topk_group < G;  // keeping every group is plain top-k

  // Scratch for the whole call: scores, biased scores, group scores, kept-group flags, top-k slots.
  std::vector<float> score(static_cast<std::size_t>(E)), biased(p.bias ? static_cast<std::size_t>(E) : 0);
  std::vector<float> group_score(static_cast<std::size_t>(G));
  std::vector<char> group_kept(static_cast<std::size_t>(G));
  // Room for the largest of the three top-k passes: K experts, topk_group groups, a group's top 2.
  std::vector<float> keys(static_cast<std::size_t>(std::max({K, p.topk_group, 2})));
  std::vector<int> ids(keys.size());
  TopK top;

  for (std::int64_t t = 0; t < p.num_tokens; ++t) {
    float* s = score.data();
    load_row(p, t, s);
    if (p.scoring == ScoringFunc::softmax)
      softmax_inplace(s, E);
    else
      sigmoid_inplace(s, E);
    const float* sel = s;  // what experts compete on
    if (p.bias) {
      for (std::int64_t e = 0; e < E; ++e) biased[static_cast<std::size_t>(e)] = s[e] + p.bias[e];
      sel = biased.data();
    }

    if (grouped) {
      for (int g = 0; g < G; ++g) {
        const float* v = sel + static_cast<std::int64_t>(g) * group_size;
        if (p.bias) {
          // Sum of the two largest biased scores of the group.
          top.reset(keys.data(), ids.data(), 2);
          for (int i = 0; i < group_size; ++i) top.offer(v[i], i);
          group_score[static_cast<std::size_t>(g)] = v[top.id(0)] + v[top.id(1)];
        } else {
          float m = v[0];
          for (int i = 1; i < group_size; ++i) m = v[i] > m ? v[i] : m;
          group_score[static_cast<std::size_t>(g)] = m;
        }
      }
      top.reset(keys.data(), ids.data(), p.topk_group);
      for (int g = 0; g < G; ++g) top.offer(group_score[static_cast<std::size_t>(g)], g);
      std::fill(group_kept.begin(), group_kept.end(), 0);
      for (int i = 0; i < top.size(); ++i) group_kept[static_cast<std::size_t>(top.id(i))] = 1;
    }

    top.reset(keys.data(), ids.data(), K);
    for (int g = 0; g < G; ++g) {
      if (grouped && !group_kept[static_cast<std::size_t>(g)]) continue;
      const int begin = g * group_size;
      for (int e = begin; e < begin + group_size; ++e) top.offer(sel[e], e);
    }

    float* w = topk_weights + t * K;
    std::int64_t* idx = topk_idx + t * K;
    float sum = 0.0f;
    for (int k = 0; k < K; ++k) {
      idx[k] = top.id(k);
      w[k] = s[top.id(k)];
      sum += w[k];
    }
    if (p.renormalize)
      for (int k = 0; k < K; ++k) w[k] = w[k] / sum;
    if (p.routed_scaling_factor != 1.0f)
      for (int k = 0; k < K; ++k) w[k] *= p.routed_scaling_factor;
  }
}

}  // namespace epmoe::router_detail

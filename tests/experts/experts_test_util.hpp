// Random expert problems shared by the experts tests.
#pragma once

#include <epmoe/experts.hpp>

#include "support/experts_reference.hpp"
#include "support/random.hpp"

#include <algorithm>
#include <cmath>
#include <fmt/format.h>

#include <random>
#include <vector>

namespace epmoe::test {

inline const std::vector<Activation>& all_activations() {
  static const std::vector<Activation> v = {Activation::silu,        Activation::gelu,
                                            Activation::swigluoai,   Activation::silu_no_mul,
                                            Activation::gelu_no_mul, Activation::relu2_no_mul};
  return v;
}

/// bf16 tensor of any shape, uniform in [-scale, scale].
inline Tensor random_bf16_shape(std::mt19937_64& rng, Shape shape, float scale) {
  Tensor t = Tensor::empty(DType::bf16, shape);
  std::uniform_real_distribution<float> d(-scale, scale);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.ptr<bf16_t>()[i] = float_to_bf16(d(rng));
  return t;
}

/// Weights scaled so the first layer's outputs have a spread of a few units: every activation's
/// interesting region (and, with `wide`, swigluoai's clamps at +-7) is visited.
struct Weights {
  Tensor w1, w2;
};
inline Weights random_weights(std::mt19937_64& rng, std::int64_t e_local, std::int64_t n, std::int64_t h,
                              Activation act, bool wide = false) {
  const std::int64_t rows = is_gated(act) ? 2 * n : n;
  const float s1 = (wide ? 15.0f : 6.0f) / std::sqrt(static_cast<float>(h));
  const float s2 = 3.0f / std::sqrt(static_cast<float>(n));
  return {random_bf16_shape(rng, Shape{e_local, rows, h}, s1), random_bf16_shape(rng, Shape{e_local, h, n}, s2)};
}

/// A standard-format problem.
struct StandardCase {
  Tensor x, topk_idx, topk_weights, expert_map;
  Weights w;
  Activation act = Activation::silu;
  bool weight_on_input = false;

  ExpertsInputs inputs() const {
    ExpertsInputs in;
    in.hidden = x.view();
    in.w1 = w.w1.view();
    in.w2 = w.w2.view();
    in.topk_idx = topk_idx.view();
    in.topk_weights = topk_weights.view();
    in.activation = act;
    if (expert_map.defined()) in.expert_map = expert_map.view();
    in.apply_router_weight_on_input = weight_on_input;
    return in;
  }
  std::vector<double> naive(bool reduce) const {
    return naive_experts_standard(x, w.w1, w.w2, topk_weights, topk_idx, act,
                                  expert_map.defined() ? expert_map.view() : TensorView{}, weight_on_input, reduce);
  }
};

struct StandardOptions {
  std::int64_t m = 32, h = 128, n = 64;
  int k = 4, e_local = 8;
  int e_global = 0;          ///< > 0: ids are global in [0, e_global) and an expert_map is built
  double p_minus_one = 0.1;  ///< chance of a -1 id
  bool hidden_fp32 = false;
  bool idx_int32 = false;
  bool wide = false;
};

/// Random routing of m tokens, k choices: ids in [0, e_global) with an expert_map giving this rank a random set of
/// e_local experts (in shuffled local order, the rest -1) when e_global > 0, else local ids in [0, e_local);
/// a -1 id with probability p_minus_one; weights from random_topk_weights; int32 ids when idx_int32.
inline void set_routing(std::mt19937_64& rng, std::int64_t m, int k, int e_local, int e_global, double p_minus_one,
                        bool idx_int32, Tensor& topk_idx, Tensor& topk_weights, Tensor& expert_map) {
  RoutingOptions r;
  r.p_minus_one = p_minus_one;
  Tensor idx = random_topk_idx(rng, m, k, e_global > 0 ? e_global : e_local, r);
  topk_weights = random_topk_weights(rng, idx);
  if (idx_int32) {
    topk_idx = Tensor::empty(DType::int32, {m, k});
    for (std::int64_t i = 0; i < idx.numel(); ++i)
      topk_idx.ptr<std::int32_t>()[i] = static_cast<std::int32_t>(idx.ptr<std::int64_t>()[i]);
  } else {
    topk_idx = idx;
  }
  if (e_global > 0) {
    std::vector<int> ids(static_cast<std::size_t>(e_global));
    for (int i = 0; i < e_global; ++i) ids[static_cast<std::size_t>(i)] = i;
    std::shuffle(ids.begin(), ids.end(), rng);
    expert_map = Tensor::empty(DType::int32, {e_global});
    for (int i = 0; i < e_global; ++i) expert_map.ptr<std::int32_t>()[i] = -1;
    for (int l = 0; l < e_local; ++l) expert_map.ptr<std::int32_t>()[ids[static_cast<std::size_t>(l)]] = l;
  }
}

inline StandardCase make_standard(std::mt19937_64& rng, Activation act, const StandardOptions& o) {
  StandardCase c;
  c.act = act;
  c.w = random_weights(rng, o.e_local, o.n, o.h, act, o.wide);
  if (o.hidden_fp32) c.x = random_f32(rng, o.m, o.h);
  else c.x = random_bf16(rng, o.m, o.h);
  set_routing(rng, o.m, o.k, o.e_local, o.e_global, o.p_minus_one, o.idx_int32, c.topk_idx, c.topk_weights,
              c.expert_map);
  return c;
}

/// A batched-format problem with the given per-expert counts.
struct BatchedCase {
  Tensor x, counts;
  Weights w;
  Activation act = Activation::silu;

  ExpertsInputs inputs() const {
    ExpertsInputs in;
    in.hidden = x.view();
    in.w1 = w.w1.view();
    in.w2 = w.w2.view();
    in.expert_num_tokens = counts.view();
    in.activation = act;
    return in;
  }
  std::vector<double> naive() const { return naive_experts_batched(x, w.w1, w.w2, counts, act); }
};

inline BatchedCase make_batched(std::mt19937_64& rng, Activation act, const std::vector<std::int32_t>& counts,
                                std::int64_t max_tokens, std::int64_t h, std::int64_t n) {
  BatchedCase c;
  c.act = act;
  const auto e_local = static_cast<std::int64_t>(counts.size());
  c.w = random_weights(rng, e_local, n, h, act);
  c.x = random_bf16_shape(rng, Shape{e_local, max_tokens, h}, 1.0f);
  c.counts = Tensor::empty(DType::int32, {e_local});
  for (std::int64_t e = 0; e < e_local; ++e) c.counts.ptr<std::int32_t>()[e] = counts[static_cast<std::size_t>(e)];
  return c;
}

/// bf16 output tensor filled with a NaN pattern, to catch elements an implementation forgets.
inline Tensor poisoned_bf16(const Shape& shape) {
  Tensor t = Tensor::empty(DType::bf16, shape);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.ptr<bf16_t>()[i] = bf16_t{0x7fa5};
  return t;
}
inline bool is_poison(bf16_t v) { return v.bits == 0x7fa5; }

}  // namespace epmoe::test

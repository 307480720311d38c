// Random fp8 block-scaled expert problems (ExpertsQuant::fp8_block) shared by the CPU and GPU experts tests.
#pragma once

#include <epmoe/experts.hpp>
#include <epmoe/quant.hpp>

#include "experts/experts_test_util.hpp"
#include "support/experts_fp8_reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace epmoe::test {

/// fp8 weights [E, rows, cols] quantized per 128x128 block from uniform values whose range differs per block
/// (a factor in [0.25, 4] times `base`), so each block's scale matters: scale = amax / 448, q = fp8(w / scale).
inline void random_fp8_blocks(std::mt19937_64& rng, std::int64_t e_local, std::int64_t rows, std::int64_t cols,
                              float base, Tensor& q, Tensor& scales) {
  const std::int64_t rb = (rows + 127) / 128, cb = (cols + 127) / 128;
  q = Tensor::empty(DType::fp8_e4m3, {e_local, rows, cols});
  scales = Tensor::empty(DType::fp32, {e_local, rb, cb});
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f), expo(-2.0f, 2.0f);
  std::vector<float> block;
  for (std::int64_t e = 0; e < e_local; ++e)
    for (std::int64_t bi = 0; bi < rb; ++bi)
      for (std::int64_t bj = 0; bj < cb; ++bj) {
        const float range = base * std::exp2(expo(rng));
        const std::int64_t r1 = std::min(rows, (bi + 1) * 128), c1 = std::min(cols, (bj + 1) * 128);
        block.clear();
        float amax = 0.0f;
        for (std::int64_t r = bi * 128; r < r1; ++r)
          for (std::int64_t c = bj * 128; c < c1; ++c) {
            block.push_back(range * unit(rng));
            amax = std::max(amax, std::fabs(block.back()));
          }
        const float s = std::max(amax, 1e-12f) / 448.0f;
        scales.ptr<float>()[(e * rb + bi) * cb + bj] = s;
        std::size_t i = 0;
        for (std::int64_t r = bi * 128; r < r1; ++r)
          for (std::int64_t c = bj * 128; c < c1; ++c)
            q.ptr<fp8_e4m3_t>()[(e * rows + r) * cols + c] = float_to_fp8_e4m3(block[i++] / s);
      }
}

struct Fp8Weights {
  Tensor w1, w1_scales, w2, w2_scales;
};

/// Weights with the spread of random_weights (first-layer outputs of a few units).
inline Fp8Weights random_fp8_weights(std::mt19937_64& rng, std::int64_t e_local, std::int64_t n, std::int64_t h,
                                     Activation act) {
  Fp8Weights w;
  const std::int64_t rows = is_gated(act) ? 2 * n : n;
  random_fp8_blocks(rng, e_local, rows, h, 6.0f / std::sqrt(static_cast<float>(h)), w.w1, w.w1_scales);
  random_fp8_blocks(rng, e_local, h, n, 3.0f / std::sqrt(static_cast<float>(n)), w.w2, w.w2_scales);
  return w;
}

enum class Fp8Input { bf16, fp32, fp8 };

/// A host copy of `t` with another shape of the same number of elements.
inline Tensor reshaped(const Tensor& t, const Shape& shape) {
  Tensor out = Tensor::empty(t.dtype(), shape);
  if (t.nbytes() > 0) std::memcpy(out.data(), t.data(), t.nbytes());
  return out;
}

/// A hidden tensor of `shape` ([..., H]) in the requested input format; fp8 inputs are bf16 values quantized by
/// quant.hpp (1x128 groups), as a normal-mode fp8 dispatch delivers them (scales [..., ceil(H/128)]).
inline void random_fp8_hidden(std::mt19937_64& rng, const Shape& shape, Fp8Input kind, Tensor& x, Tensor& scales) {
  const std::int64_t h = shape[shape.ndim() - 1], rows = shape.numel() / h;
  Tensor flat = kind == Fp8Input::fp32 ? random_f32(rng, rows, h) : random_bf16(rng, rows, h);
  scales = Tensor();
  if (kind == Fp8Input::fp8) {
    const Fp8Tensor q = quantize_fp8(flat.view());
    flat = q.data;
    Shape s = shape;
    s[s.ndim() - 1] = q.scales.size(1);
    scales = reshaped(q.scales, s);
  }
  x = reshaped(flat, shape);
}

/// A standard-format fp8 problem.
struct Fp8StandardCase {
  Tensor x, x_scales, topk_idx, topk_weights, expert_map;
  Fp8Weights w;
  Activation act = Activation::silu;
  bool weight_on_input = false;

  ExpertsInputs inputs() const {
    ExpertsInputs in;
    in.hidden = x.view();
    if (x_scales.defined()) in.hidden_scales = x_scales.view();
    in.w1 = w.w1.view();
    in.w1_scales = w.w1_scales.view();
    in.w2 = w.w2.view();
    in.w2_scales = w.w2_scales.view();
    in.topk_idx = topk_idx.view();
    in.topk_weights = topk_weights.view();
    in.activation = act;
    if (expert_map.defined()) in.expert_map = expert_map.view();
    in.apply_router_weight_on_input = weight_on_input;
    return in;
  }
  std::vector<double> naive(bool reduce) const {
    return naive_fp8_experts_standard(x, x_scales.defined() ? x_scales.view() : TensorView{}, w.w1, w.w1_scales, w.w2,
                                      w.w2_scales, topk_weights, topk_idx, act,
                                      expert_map.defined() ? expert_map.view() : TensorView{}, weight_on_input, reduce);
  }
};

struct Fp8StandardOptions {
  std::int64_t m = 16, h = 144, n = 48;  ///< H = 144 and N = 48: partial 128-blocks and groups
  int k = 3, e_local = 4;
  int e_global = 0;  ///< > 0: global ids in [0, e_global) with an expert_map
  double p_minus_one = 0.1;
  Fp8Input input = Fp8Input::bf16;
  bool idx_int32 = false;
};

inline Fp8StandardCase make_fp8_standard(std::mt19937_64& rng, Activation act, const Fp8StandardOptions& o) {
  Fp8StandardCase c;
  c.act = act;
  c.w = random_fp8_weights(rng, o.e_local, o.n, o.h, act);
  random_fp8_hidden(rng, Shape{o.m, o.h}, o.input, c.x, c.x_scales);
  set_routing(rng, o.m, o.k, o.e_local, o.e_global, o.p_minus_one, o.idx_int32, c.topk_idx, c.topk_weights,
              c.expert_map);
  return c;
}

/// A batched-format fp8 problem with the given per-expert counts.
struct Fp8BatchedCase {
  Tensor x, x_scales, counts;
  Fp8Weights w;
  Activation act = Activation::silu;

  ExpertsInputs inputs() const {
    ExpertsInputs in;
    in.hidden = x.view();
    if (x_scales.defined()) in.hidden_scales = x_scales.view();
    in.w1 = w.w1.view();
    in.w1_scales = w.w1_scales.view();
    in.w2 = w.w2.view();
    in.w2_scales = w.w2_scales.view();
    in.expert_num_tokens = counts.view();
    in.activation = act;
    return in;
  }
  std::vector<double> naive() const {
    return naive_fp8_experts_batched(x, x_scales.defined() ? x_scales.view() : TensorView{}, w.w1, w.w1_scales, w.w2,
                                     w.w2_scales, counts, act);
  }
};

inline Fp8BatchedCase make_fp8_batched(std::mt19937_64& rng, Activation act, const std::vector<std::int32_t>& counts,
                                       std::int64_t max_tokens, std::int64_t h, std::int64_t n, Fp8Input input) {
  Fp8BatchedCase c;
  c.act = act;
  const auto e_local = static_cast<std::int64_t>(counts.size());
  c.w = random_fp8_weights(rng, e_local, n, h, act);
  random_fp8_hidden(rng, Shape{e_local, max_tokens, h}, input, c.x, c.x_scales);
  c.counts = Tensor::empty(DType::int32, {e_local});
  for (std::int64_t e = 0; e < e_local; ++e) c.counts.ptr<std::int32_t>()[e] = counts[static_cast<std::size_t>(e)];
  return c;
}

inline ExpertsConfig fp8_config(ActivationFormat format, bool reduce = true) {
  ExpertsConfig c;
  c.format = format;
  c.reduce = reduce;
  c.quant = ExpertsQuant::fp8_block;
  return c;
}

}  // namespace epmoe::test

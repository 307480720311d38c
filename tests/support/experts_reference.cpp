#include "support/experts_reference.hpp"

#include <cmath>
#include <cstdint>
#include <stdexcept>

namespace epmoe::test {

namespace {

// Element i (flat, row-major) of a contiguous tensor, as double.
double at(const TensorView& t, std::int64_t i) {
  switch (t.dtype) {
    case DType::bf16: return bf16_to_float(static_cast<const bf16_t*>(t.data)[i]);
    case DType::fp32: return static_cast<const float*>(t.data)[i];
    case DType::int32: return static_cast<const std::int32_t*>(t.data)[i];
    case DType::int64: return static_cast<double>(static_cast<const std::int64_t*>(t.data)[i]);
    default: throw std::runtime_error("naive experts reference: unexpected dtype");
  }
}

std::size_t u(std::int64_t i) { return static_cast<std::size_t>(i); }

double sigmoid(double z) { return 0.5 * (1.0 + std::tanh(0.5 * z)); }

// y[H] = w2[e] @ act(w1[e] @ x) for one expert; x has H entries.
std::vector<double> mlp(const std::vector<double>& x, const TensorView& w1, const TensorView& w2, std::int64_t e,
                        Activation act) {
  const std::int64_t rows = w1.size(1), H = w1.size(2), N = w2.size(2);
  std::vector<double> h1(u(rows), 0.0);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < H; ++c) h1[u(r)] += at(w1, (e * rows + r) * H + c) * x[u(c)];
  const bool gated = act == Activation::silu || act == Activation::gelu || act == Activation::swigluoai;
  std::vector<double> a(u(N));
  for (std::int64_t j = 0; j < N; ++j) {
    double gate, up = 0.0;
    if (act == Activation::swigluoai) {  // interleaved rows
      gate = h1[u(2 * j)];
      up = h1[u(2 * j + 1)];
    } else if (gated) {  // gate half, then up half
      gate = h1[u(j)];
      up = h1[u(N + j)];
    } else {
      gate = h1[u(j)];
    }
    a[u(j)] = naive_activation(act, gate, up);
  }
  std::vector<double> y(u(H), 0.0);
  for (std::int64_t c = 0; c < H; ++c)
    for (std::int64_t j = 0; j < N; ++j) y[u(c)] += at(w2, (e * H + c) * N + j) * a[u(j)];
  return y;
}

}  // namespace

double naive_activation(Activation act, double gate, double up) {
  const double gelu_g = 0.5 * gate * std::erfc(-gate / std::sqrt(2.0));
  switch (act) {
    case Activation::silu: return gate * sigmoid(gate) * up;
    case Activation::gelu: return gelu_g * up;
    case Activation::swigluoai: {
      const double g = gate > 7.0 ? 7.0 : gate;
      const double u = up > 7.0 ? 7.0 : (up < -7.0 ? -7.0 : up);
      return (u + 1.0) * g * sigmoid(1.702 * g);
    }
    case Activation::silu_no_mul: return gate * sigmoid(gate);
    case Activation::gelu_no_mul: return gelu_g;
    case Activation::relu2_no_mul: return gate <= 0.0 ? 0.0 : gate * gate;
  }
  throw std::runtime_error("naive experts reference: unknown activation");
}

std::vector<double> naive_experts_standard(const TensorView& x, const TensorView& w1, const TensorView& w2,
                                           const TensorView& topk_weights, const TensorView& topk_idx,
                                           Activation act, const TensorView& expert_map, bool weight_on_input,
                                           bool reduce) {
  const std::int64_t M = x.size(0), H = x.size(1), K = topk_idx.size(1);
  std::vector<double> out(u(reduce ? M * H : M * K * H), 0.0);
  for (std::int64_t m = 0; m < M; ++m) {
    for (std::int64_t k = 0; k < K; ++k) {
      std::int64_t e = static_cast<std::int64_t>(at(topk_idx, m * K + k));
      if (e >= 0 && expert_map.defined()) e = static_cast<std::int64_t>(at(expert_map, e));
      if (e < 0) continue;
      const double w = at(topk_weights, m * K + k);
      std::vector<double> xm(u(H));
      for (std::int64_t c = 0; c < H; ++c) xm[u(c)] = at(x, m * H + c) * (weight_on_input ? w : 1.0);
      const std::vector<double> y = mlp(xm, w1, w2, e, act);
      for (std::int64_t c = 0; c < H; ++c) {
        if (reduce) out[u(m * H + c)] += (weight_on_input ? 1.0 : w) * y[u(c)];
        else out[u((m * K + k) * H + c)] = y[u(c)];
      }
    }
  }
  return out;
}

std::vector<double> naive_experts_batched(const TensorView& x, const TensorView& w1, const TensorView& w2,
                                          const TensorView& counts, Activation act) {
  const std::int64_t E = x.size(0), T = x.size(1), H = x.size(2);
  std::vector<double> out(u(E * T * H), 0.0);
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(at(counts, e)); ++i) {
      std::vector<double> xi(u(H));
      for (std::int64_t c = 0; c < H; ++c) xi[u(c)] = at(x, (e * T + i) * H + c);
      const std::vector<double> y = mlp(xi, w1, w2, e, act);
      for (std::int64_t c = 0; c < H; ++c) out[u((e * T + i) * H + c)] = y[u(c)];
    }
  return out;
}

double relative_l2(const std::vector<double>& ref, const TensorView& out) {
  std::vector<double> got(ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) got[i] = at(out, static_cast<std::int64_t>(i));
  return relative_l2(ref, got);
}

double relative_l2(const std::vector<double>& ref, const std::vector<double>& got) {
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den == 0.0 ? std::sqrt(num) : std::sqrt(num / den);
}

}  // namespace epmoe::test

#include "support/moe_reference.hpp"

#include <cmath>
#include <stdexcept>

namespace epmoe::test {

namespace {
double act(const std::string& a, double g, double u) {
  const double silu = g / (1.0 + std::exp(-g));
  const double gelu = 0.5 * g * (1.0 + std::erf(g / std::sqrt(2.0)));
  if (a == "silu") return silu * u;
  if (a == "gelu") return gelu * u;
  if (a == "swigluoai") {
    const double gc = std::min(g, 7.0), uc = std::max(-7.0, std::min(u, 7.0));
    return (uc + 1.0) * gc / (1.0 + std::exp(-1.702 * gc));
  }
  if (a == "silu_no_mul") return silu;
  if (a == "gelu_no_mul") return gelu;
  if (a == "relu2_no_mul") return g > 0 ? g * g : 0.0;
  throw std::invalid_argument("unknown activation " + a);
}
double bf(const bf16_t* p, std::int64_t i) { return bf16_to_float(p[i]); }
}  // namespace

std::vector<double> moe_layer_reference(const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& topk_idx,
                                        const Tensor& topk_weights, const std::string& activation,
                                        bool weight_on_input) {
  const std::int64_t T = x.size(0), H = x.size(1), K = topk_idx.size(1), N = w2.size(2);
  const bool gated = w1.size(1) == 2 * N;
  const bool interleaved = activation == "swigluoai";
  std::vector<double> out(static_cast<std::size_t>(T * H), 0.0), xin(static_cast<std::size_t>(H)),
      a(static_cast<std::size_t>(N));
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t e = topk_idx.ptr<std::int64_t>()[t * K + k];
      if (e < 0) continue;
      const double w = topk_weights.ptr<float>()[t * K + k];
      for (std::int64_t h = 0; h < H; ++h) {
        // With the weight on the input, the token is scaled (and rounded to bf16) before the MLP.
        xin[static_cast<std::size_t>(h)] =
            weight_on_input ? bf16_to_float(float_to_bf16(static_cast<float>(w) * bf16_to_float(x.ptr<bf16_t>()[t * H + h])))
                            : bf(x.ptr<bf16_t>(), t * H + h);
      }
      const bf16_t* W1 = w1.ptr<bf16_t>() + e * w1.size(1) * H;
      const bf16_t* W2 = w2.ptr<bf16_t>() + e * H * N;
      for (std::int64_t j = 0; j < N; ++j) {
        const std::int64_t gate_row = interleaved ? 2 * j : j, up_row = interleaved ? 2 * j + 1 : N + j;
        double g = 0, u = 0;
        for (std::int64_t h = 0; h < H; ++h) g += bf(W1, gate_row * H + h) * xin[static_cast<std::size_t>(h)];
        if (gated)
          for (std::int64_t h = 0; h < H; ++h) u += bf(W1, up_row * H + h) * xin[static_cast<std::size_t>(h)];
        a[static_cast<std::size_t>(j)] = act(activation, g, u);
      }
      const double scale = weight_on_input ? 1.0 : w;
      for (std::int64_t h = 0; h < H; ++h) {
        double y = 0;
        for (std::int64_t j = 0; j < N; ++j) y += bf(W2, h * N + j) * a[static_cast<std::size_t>(j)];
        out[static_cast<std::size_t>(t * H + h)] += scale * y;
      }
    }
  return out;
}

double relative_l2(const Tensor& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double g = bf16_to_float(got.ptr<bf16_t>()[i]);
    if (!std::isfinite(g)) return INFINITY;
    num += (g - want[i]) * (g - want[i]);
    den += want[i] * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace epmoe::test

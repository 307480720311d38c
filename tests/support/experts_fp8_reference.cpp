#include "support/experts_fp8_reference.hpp"

#include "support/experts_reference.hpp"
#include "support/quant_reference.hpp"

#include <cstdint>
#include <stdexcept>

namespace epmoe::test {

namespace {

std::size_t u(std::int64_t i) { return static_cast<std::size_t>(i); }
std::int64_t cdiv(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// y[H] = W2 @ q(act(W1 @ x)) for one expert with dequantized weights (w1d [rows, H], w2d [H, N] of expert e).
std::vector<double> mlp(const std::vector<double>& x, const double* w1d, const double* w2d, std::int64_t rows,
                        std::int64_t H, std::int64_t N, Activation act) {
  std::vector<double> h1(u(rows), 0.0);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < H; ++c) h1[u(r)] += w1d[r * H + c] * x[u(c)];
  const bool gated = act == Activation::silu || act == Activation::gelu || act == Activation::swigluoai;
  std::vector<float> a(u(N));
  for (std::int64_t j = 0; j < N; ++j) {
    double gate = h1[u(j)], up = 0.0;
    if (act == Activation::swigluoai) {
      gate = h1[u(2 * j)];
      up = h1[u(2 * j + 1)];
    } else if (gated) {
      up = h1[u(N + j)];
    }
    a[u(j)] = static_cast<float>(naive_activation(act, gate, up));
  }
  // The intermediate goes through semantics §6 (from its float32 value) before the second GEMM.
  const RefFp8 q = ref_quantize_fp8(a, 1, N, false, false);
  std::vector<double> y(u(H), 0.0);
  for (std::int64_t c = 0; c < H; ++c)
    for (std::int64_t j = 0; j < N; ++j)
      y[u(c)] += w2d[c * N + j] * (ref_fp8_decode(q.q[u(j)]) * static_cast<double>(q.scales[u(j / 128)]));
  return y;
}

double float_at(const TensorView& t, std::int64_t i) {
  if (t.dtype == DType::bf16) return ref_bf16_decode(static_cast<const std::uint16_t*>(t.data)[i]);
  if (t.dtype == DType::fp32) return static_cast<const float*>(t.data)[i];
  throw std::runtime_error("naive fp8 experts: unexpected hidden dtype");
}

}  // namespace

std::vector<double> naive_dequantize_blocks(const TensorView& w, const TensorView& scales) {
  const std::int64_t E = w.size(0), rows = w.size(1), cols = w.size(2);
  const std::int64_t rb = cdiv(rows, 128), cb = cdiv(cols, 128);
  std::vector<double> out(u(E * rows * cols));
  const auto* q = static_cast<const std::uint8_t*>(w.data);
  const auto* s = static_cast<const float*>(scales.data);
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c) {
        const std::int64_t i = (e * rows + r) * cols + c;
        out[u(i)] = ref_fp8_decode(q[i]) * static_cast<double>(s[(e * rb + r / 128) * cb + c / 128]);
      }
  return out;
}

std::vector<double> naive_fp8_inputs(const TensorView& x, const TensorView& x_scales, const float* row_weights,
                                     std::int64_t row_weight_stride) {
  const std::int64_t H = x.size(-1), rows = x.numel() / H, G = cdiv(H, 128);
  std::vector<double> out(u(rows * H));
  if (x.dtype == DType::fp8_e4m3) {
    const auto* q = static_cast<const std::uint8_t*>(x.data);
    const auto* s = static_cast<const float*>(x_scales.data);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < H; ++c)
        out[u(r * H + c)] = ref_fp8_decode(q[r * H + c]) * static_cast<double>(s[r * G + c / 128]);
    return out;
  }
  std::vector<float> v(u(rows * H));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < H; ++c) {
      float f = static_cast<float>(float_at(x, r * H + c));
      if (row_weights != nullptr) f = f * row_weights[r * row_weight_stride];
      v[u(r * H + c)] = f;
    }
  const RefFp8 q = ref_quantize_fp8(v, rows, H, false, false);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < H; ++c)
      out[u(r * H + c)] = ref_fp8_decode(q.q[u(r * H + c)]) * static_cast<double>(q.scales[u(r * G + c / 128)]);
  return out;
}

std::vector<double> naive_fp8_experts_standard(const TensorView& x, const TensorView& x_scales, const TensorView& w1,
                                               const TensorView& w1_scales, const TensorView& w2,
                                               const TensorView& w2_scales, const TensorView& topk_weights,
                                               const TensorView& topk_idx, Activation act,
                                               const TensorView& expert_map, bool weight_on_input, bool reduce) {
  const std::int64_t M = x.size(0), H = x.size(1), K = topk_idx.size(1);
  const std::int64_t rows = w1.size(1), N = w2.size(2);
  const std::vector<double> w1d = naive_dequantize_blocks(w1, w1_scales);
  const std::vector<double> w2d = naive_dequantize_blocks(w2, w2_scales);
  const auto* tw = static_cast<const float*>(topk_weights.data);
  const std::vector<double> xin = naive_fp8_inputs(x, x_scales, weight_on_input ? tw : nullptr, K);
  std::vector<double> out(u(reduce ? M * H : M * K * H), 0.0);
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t i = m * K + k;
      std::int64_t id = topk_idx.dtype == DType::int64 ? static_cast<const std::int64_t*>(topk_idx.data)[i]
                                                       : static_cast<const std::int32_t*>(topk_idx.data)[i];
      if (id >= 0 && expert_map.defined()) id = static_cast<const std::int32_t*>(expert_map.data)[id];
      if (id < 0) continue;
      const std::vector<double> xm(xin.begin() + m * H, xin.begin() + (m + 1) * H);
      const std::vector<double> y = mlp(xm, w1d.data() + id * rows * H, w2d.data() + id * H * N, rows, H, N, act);
      const double wt = reduce && !weight_on_input ? static_cast<double>(tw[i]) : 1.0;
      double* o = out.data() + (reduce ? m * H : i * H);
      for (std::int64_t c = 0; c < H; ++c) o[c] += wt * y[u(c)];
    }
  return out;
}

std::vector<double> naive_fp8_experts_batched(const TensorView& x, const TensorView& x_scales, const TensorView& w1,
                                              const TensorView& w1_scales, const TensorView& w2,
                                              const TensorView& w2_scales, const TensorView& counts, Activation act) {
  const std::int64_t E = x.size(0), T = x.size(1), H = x.size(2);
  const std::int64_t rows = w1.size(1), N = w2.size(2);
  const std::vector<double> w1d = naive_dequantize_blocks(w1, w1_scales);
  const std::vector<double> w2d = naive_dequantize_blocks(w2, w2_scales);
  const std::vector<double> xin = naive_fp8_inputs(x, x_scales, nullptr, 0);
  std::vector<double> out(u(E * T * H), 0.0);
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t t = 0; t < static_cast<const std::int32_t*>(counts.data)[e]; ++t) {
      const std::int64_t r = e * T + t;
      const std::vector<double> xm(xin.begin() + r * H, xin.begin() + (r + 1) * H);
      const std::vector<double> y = mlp(xm, w1d.data() + e * rows * H, w2d.data() + e * H * N, rows, H, N, act);
      for (std::int64_t c = 0; c < H; ++c) out[u(r * H + c)] = y[u(c)];
    }
  return out;
}

}  // namespace epmoe::test

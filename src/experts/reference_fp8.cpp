// The float64 reference of the fp8 block-scaled experts (ExpertsQuant::fp8_block, DeepSeek-V3's format):
// weights dequantized exactly in double (fp8 value * the float32 scale of its 128x128 block), activations as
// the experts see them -- an fp8 hidden dequantized the same way per 1x128 group, a bf16/fp32 hidden first
// quantized by semantics §6's float32 rule --, both GEMMs and the activation in double, and the activation output
// quantized by semantics §6's rule (from its value rounded to float32) before the second GEMM, as vLLM's and
// DeepGEMM's fp8 MoE do. One bf16 rounding of the result. Also the fp8 argument checks shared with CUDA.
#include <epmoe/dtype.hpp>
#include <epmoe/experts.hpp>

#include "core/check.hpp"
#include "experts/fp8.hpp"
#include "experts/problem.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

namespace epmoe {

std::string_view experts_quant_name(ExpertsQuant q) {
  switch (q) {
    case ExpertsQuant::none: return "none";
    case ExpertsQuant::fp8_block: return "fp8_block";
  }
  return "?";
}

namespace experts_fp8 {

Fp8Sizes check_fp8_inputs(const ExpertsInputs& in, const ExpertsConfig& config, const Device& device) {
  Fp8Sizes s;
  s.batched = config.format == ActivationFormat::batched_experts;
  s.reduce = config.reduce;
  s.device = device;
  EPMOE_CHECK_ARG(config.quant == ExpertsQuant::fp8_block, "config.quant", "fp8_block",
                  experts_quant_name(config.quant));
  s.gated = check_activation(in.activation);
  auto check_tensor = [&](const TensorView& t, std::string_view name) { check_experts_tensor(t, name, device); };

  EPMOE_CHECK_ARG(in.w1.defined(), "w1", "a float8_e4m3fn [E_local, 2N or N, H] tensor (fp8_block)", "None");
  EPMOE_CHECK_ARG(in.w2.defined(), "w2", "a float8_e4m3fn [E_local, H, N] tensor (fp8_block)", "None");
  check_tensor(in.w2, "w2");
  check_tensor(in.w1, "w1");
  constexpr const char* fp8_weights = "float8_e4m3fn (experts of quant fp8_block)";
  if (in.w1.dtype != DType::fp8_e4m3) throw_wrong_dtype("w1", fp8_weights, describe(in.w1));
  if (in.w2.dtype != DType::fp8_e4m3) throw_wrong_dtype("w2", fp8_weights, describe(in.w2));
  EPMOE_CHECK_ARG(in.w2.ndim() == 3, "w2", "3 dimensions [E_local, H, N]", describe(in.w2));
  EPMOE_CHECK_ARG(in.w1.ndim() == 3, "w1", "3 dimensions [E_local, 2N or N, H]", describe(in.w1));
  s.e_local = in.w2.size(0);
  s.h = in.w2.size(1);
  s.n = in.w2.size(2);
  EPMOE_CHECK_ARG(s.e_local >= 1 && s.h >= 1 && s.n >= 1, "w2", "[E_local, H, N] with all sizes >= 1",
                  describe(in.w2));
  EPMOE_CHECK_ARG(s.h % 16 == 0 && s.n % 16 == 0, "w2", "H % 16 == 0 and N % 16 == 0 (fp8 rows, semantics §1)",
                  describe(in.w2));
  s.r1 = s.gated ? 2 * s.n : s.n;
  const Shape w1_shape{s.e_local, s.r1, s.h};
  EPMOE_CHECK_ARG(in.w1.shape == w1_shape, "w1",
                  fmt::format("shape {} ({} activation '{}', from w2 {})", w1_shape, s.gated ? "gated" : "non-gated",
                              activation_name(in.activation), describe(in.w2)),
                  describe(in.w1));

  auto check_scales = [&](const TensorView& t, std::string_view name, const Shape& want, std::string_view what) {
    EPMOE_CHECK_ARG(t.defined(), name, fmt::format("float32 {} ({})", want, what), "None");
    check_tensor(t, name);
    EPMOE_CHECK_ARG(t.dtype == DType::fp32, name, fmt::format("float32 {} ({})", want, what), describe(t));
    EPMOE_CHECK_ARG(t.shape == want, name, fmt::format("float32 {} ({})", want, what), describe(t));
  };
  check_scales(in.w1_scales, "w1_scales", Shape{s.e_local, blocks(s.r1), blocks(s.h)},
               "one per 128x128 block of w1: [E_local, ceil(rows/128), ceil(H/128)]");
  check_scales(in.w2_scales, "w2_scales", Shape{s.e_local, blocks(s.h), blocks(s.n)},
               "one per 128x128 block of w2: [E_local, ceil(H/128), ceil(N/128)]");

  EPMOE_CHECK_ARG(in.hidden.defined(), "hidden",
                  s.batched ? "a [E_local, max_tokens, H] tensor" : "an [M, H] tensor", "None");
  check_tensor(in.hidden, "hidden");
  EPMOE_CHECK_ARG(in.hidden.dtype == DType::fp8_e4m3 || in.hidden.dtype == DType::bf16 ||
                      in.hidden.dtype == DType::fp32,
                  "hidden", "float8_e4m3fn (with hidden_scales), bfloat16 or float32", describe(in.hidden));
  s.hidden_fp8 = in.hidden.dtype == DType::fp8_e4m3;
  if (s.hidden_fp8) {
    EPMOE_CHECK_ARG(in.hidden.ndim() == (s.batched ? 3 : 2) && in.hidden.size(-1) == s.h, "hidden",
                    s.batched ? fmt::format("[E_local, max_tokens, H={}]", s.h) : fmt::format("[M, H={}]", s.h),
                    describe(in.hidden));
    Shape want = in.hidden.shape;
    want[want.ndim() - 1] = blocks(s.h);
    check_scales(in.hidden_scales, "hidden_scales", want, "one per token and group of 128 channels of hidden");
    EPMOE_CHECK_ARG(!in.apply_router_weight_on_input, "apply_router_weight_on_input",
                    "false with an fp8 hidden (the weight is applied before quantization: pass bf16/fp32 hidden)",
                    "true");
  } else {
    EPMOE_CHECK_ARG(!in.hidden_scales.defined(), "hidden_scales",
                    fmt::format("None with a {} hidden (the experts quantize it)", dtype_name(in.hidden.dtype)),
                    describe(in.hidden_scales));
  }
  return s;
}

ExpertsInputs as_bf16_layout(const ExpertsInputs& in) {
  ExpertsInputs out = in;
  out.w1.dtype = DType::bf16;
  out.w2.dtype = DType::bf16;
  if (out.hidden.dtype == DType::fp8_e4m3) out.hidden.dtype = DType::bf16;
  out.hidden_scales = {};
  out.w1_scales = {};
  out.w2_scales = {};
  return out;
}

namespace {

struct Problem {
  ExpertsProblem p;  // routing, sizes, counts (the bf16 pointers in it are not used)
  Fp8Sizes s;
  const std::uint8_t* w1 = nullptr;
  const std::uint8_t* w2 = nullptr;
  const float* w1s = nullptr;
  const float* w2s = nullptr;
  const void* hidden = nullptr;
  DType hidden_dtype = DType::bf16;
  const float* hs = nullptr;  // hidden scales (fp8 hidden)
};

Problem check(const ExpertsInputs& in, const ExpertsConfig& config) {
  Problem q;
  q.s = check_fp8_inputs(in, config, Device::cpu());
  q.p = check_experts_inputs(as_bf16_layout(in), config);
  q.w1 = static_cast<const std::uint8_t*>(in.w1.data);
  q.w2 = static_cast<const std::uint8_t*>(in.w2.data);
  q.w1s = static_cast<const float*>(in.w1_scales.data);
  q.w2s = static_cast<const float*>(in.w2_scales.data);
  q.hidden = in.hidden.data;
  q.hidden_dtype = in.hidden.dtype;
  q.hs = q.s.hidden_fp8 ? static_cast<const float*>(in.hidden_scales.data) : nullptr;
  return q;
}

const std::array<double, 256>& fp8_table() {
  static const std::array<double, 256> t = [] {
    std::array<double, 256> v{};
    for (int i = 0; i < 256; ++i)
      v[static_cast<std::size_t>(i)] = fp8_e4m3_to_float(fp8_e4m3_t{static_cast<std::uint8_t>(i)});
    return v;
  }();
  return t;
}

// semantics §6 on a float32 row of `len` values: each group of 128 becomes fp8 * float32 scale; returns the
// dequantized values (exact in double).
void quantize_row(const float* v, std::int64_t len, double* out) {
  const auto& tab = fp8_table();
  for (std::int64_t g0 = 0; g0 < len; g0 += kBlock) {
    const std::int64_t g1 = std::min(len, g0 + kBlock);
    float amax = 0.0f;
    for (std::int64_t c = g0; c < g1; ++c) amax = std::fmax(amax, std::fabs(v[c]));
    const float a = std::max(amax, 1e-4f);
    const float inv = 448.0f / a, scale = a / 448.0f;
    for (std::int64_t c = g0; c < g1; ++c)
      out[c] = tab[float_to_fp8_e4m3(v[c] * inv).bits] * static_cast<double>(scale);
  }
}

// The input row `row` of hidden as the GEMMs see it (dequantized), times the router weight `w` when given.
void input_row(const Problem& q, std::int64_t row, const float* w, std::vector<float>& tmp, double* x) {
  const std::int64_t h = q.s.h;
  if (q.s.hidden_fp8) {
    const auto& tab = fp8_table();
    const auto* src = static_cast<const std::uint8_t*>(q.hidden) + row * h;
    const float* sc = q.hs + row * blocks(h);
    for (std::int64_t c = 0; c < h; ++c) x[c] = tab[src[c]] * static_cast<double>(sc[c / kBlock]);
    return;
  }
  tmp.resize(static_cast<std::size_t>(h));
  for (std::int64_t c = 0; c < h; ++c) {
    const float v = q.hidden_dtype == DType::bf16 ? bf16_to_float(static_cast<const bf16_t*>(q.hidden)[row * h + c])
                                                  : static_cast<const float*>(q.hidden)[row * h + c];
    tmp[static_cast<std::size_t>(c)] = w != nullptr ? v * *w : v;  // float32 product, as the GPU forms it
  }
  quantize_row(tmp.data(), h, x);
}

// Row r of expert e's dequantized weight matrix (rows x cols, 128x128 block scales) dotted with x.
double weight_dot(const std::uint8_t* w, const float* scales, std::int64_t e, std::int64_t rows, std::int64_t cols,
                  std::int64_t r, const double* x) {
  const auto& tab = fp8_table();
  const std::uint8_t* wr = w + (e * rows + r) * cols;
  const float* sr = scales + (e * blocks(rows) + r / kBlock) * blocks(cols);
  double s = 0.0;
  for (std::int64_t c = 0; c < cols; ++c) s += tab[wr[c]] * static_cast<double>(sr[c / kBlock]) * x[c];
  return s;
}

void expert_mlp(const Problem& q, std::int64_t e, const double* x, std::vector<float>& act, std::vector<double>& a,
                double* y) {
  const std::int64_t h = q.s.h, n = q.s.n, r1 = q.s.r1;
  act.resize(static_cast<std::size_t>(n));
  a.resize(static_cast<std::size_t>(n));
  for (std::int64_t j = 0; j < n; ++j) {
    const double g = weight_dot(q.w1, q.w1s, e, r1, h, q.p.gate_row(j), x);
    const double u = q.s.gated ? weight_dot(q.w1, q.w1s, e, r1, h, q.p.up_row(j), x) : 0.0;
    act[static_cast<std::size_t>(j)] = static_cast<float>(activation_value(q.p.activation, g, u));
  }
  quantize_row(act.data(), n, a.data());
  for (std::int64_t r = 0; r < h; ++r) y[r] = weight_dot(q.w2, q.w2s, e, h, n, r, a.data());
}

std::vector<double> compute(const Problem& q) {
  const ExpertsProblem& p = q.p;
  const std::int64_t h = q.s.h;
  std::vector<double> out(static_cast<std::size_t>(p.output_numel()), 0.0);
  std::vector<double> x(static_cast<std::size_t>(h)), y(static_cast<std::size_t>(h)), a;
  std::vector<float> tmp, act;
  if (p.format == ActivationFormat::batched_experts) {
    for (std::int64_t e = 0; e < p.e_local; ++e)
      for (std::int64_t i = 0; i < p.counts[e]; ++i) {
        const std::int64_t row = e * p.max_tokens + i;
        input_row(q, row, nullptr, tmp, x.data());
        expert_mlp(q, e, x.data(), act, a, out.data() + row * h);
      }
    return out;
  }
  for (std::int64_t t = 0; t < p.m; ++t) {
    bool any = false;
    for (std::int64_t k = 0; k < p.k; ++k) any = any || p.local_ids[static_cast<std::size_t>(t * p.k + k)] >= 0;
    if (!any) continue;
    input_row(q, t, p.weight_on_input ? p.topk_weights + t * p.k : nullptr, tmp, x.data());
    for (std::int64_t k = 0; k < p.k; ++k) {
      const std::int32_t e = p.local_ids[static_cast<std::size_t>(t * p.k + k)];
      if (e < 0) continue;
      if (!p.reduce) {
        expert_mlp(q, e, x.data(), act, a, out.data() + (t * p.k + k) * h);
        continue;
      }
      expert_mlp(q, e, x.data(), act, a, y.data());
      const double wt = p.weight_on_input ? 1.0 : static_cast<double>(p.topk_weights[t * p.k + k]);
      double* o = out.data() + t * h;
      for (std::int64_t c = 0; c < h; ++c) o[c] += wt * y[static_cast<std::size_t>(c)];
    }
  }
  return out;
}

class ReferenceFp8Experts final : public Experts {
 public:
  using Experts::Experts;
  std::string_view name() const override { return "reference"; }

  Shape output_shape(const ExpertsInputs& in) const override {
    const Problem q = check(in, config());
    if (q.s.batched) return Shape{q.p.e_local, q.p.max_tokens, q.p.h};
    return q.p.reduce ? Shape{q.p.m, q.p.h} : Shape{q.p.m, q.p.k, q.p.h};
  }

  void apply(const ExpertsInputs& in, const TensorView& out) const override {
    const Problem q = check(in, config());
    if (q.s.signal) raise(ErrorCode::unsupported, "the fp8 reference experts do not write a combine_signal");
    const Shape want = q.s.batched ? Shape{q.p.e_local, q.p.max_tokens, q.p.h}
                                   : (q.p.reduce ? Shape{q.p.m, q.p.h} : Shape{q.p.m, q.p.k, q.p.h});
    EPMOE_CHECK_ARG(out.defined(), "out", fmt::format("bfloat16{}", want), "None");
    check_experts_tensor(out, "out", Device::cpu());
    EPMOE_CHECK_ARG(out.dtype == DType::bf16 && out.shape == want, "out", fmt::format("bfloat16{}", want),
                    describe(out));
    const std::vector<double> r = compute(q);
    auto* o = static_cast<bf16_t*>(out.data);
    if (q.s.batched) {
      for (std::int64_t e = 0; e < q.p.e_local; ++e)
        for (std::int64_t i = 0; i < q.p.counts[e] * q.p.h; ++i) {
          const std::int64_t at = e * q.p.max_tokens * q.p.h + i;
          o[at] = double_to_bf16(r[static_cast<std::size_t>(at)]);
        }
      return;
    }
    for (std::size_t i = 0; i < r.size(); ++i) o[i] = double_to_bf16(r[i]);
  }

  Tensor apply(const ExpertsInputs& in) const override {
    const Shape shape = output_shape(in);
    Tensor out = Tensor::zeros(DType::bf16, shape);
    apply(in, out.view());
    return out;
  }

 protected:
  void run(const ExpertsProblem&, const TensorView&) const override {
    raise(ErrorCode::internal, "ReferenceFp8Experts::run called");
  }
};

}  // namespace

std::unique_ptr<Experts> make_reference_experts_fp8(const ExpertsConfig& config) {
  return std::make_unique<ReferenceFp8Experts>(config);
}

std::vector<double> reference_experts_fp8_f64(const ExpertsInputs& in, const ExpertsConfig& config) {
  return compute(check(in, config));
}

}  // namespace experts_fp8

}  // namespace epmoe

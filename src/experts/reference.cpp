// The float64 reference experts (semantics §7): every product and sum in double, one bf16 rounding at the end.
//
// Slow on purpose (one matrix-vector product per (token, k) slot): it defines the result the fast CPU
// and GPU paths are measured against (semantics §13), so it stays as close to the formula as possible.
#include <epmoe/experts.hpp>

#include "core/check.hpp"
#include "experts/fp8.hpp"
#include "experts/problem.hpp"

#include <algorithm>
#include <vector>

namespace epmoe {

namespace {

// y = w2[e] @ act(w1[e] @ x), all in double. `x` [h], `y` [h], `act` scratch [n].
void expert_mlp(const ExpertsProblem& p, std::int64_t e, const std::vector<double>& x, std::vector<double>& act,
                double* y) {
  const std::int64_t h = p.h, n = p.n;
  const bf16_t* w1 = p.w1 + e * p.w1_rows() * h;
  const bf16_t* w2 = p.w2 + e * h * n;
  auto row_dot = [&](std::int64_t r) {
    const bf16_t* w = w1 + r * h;
    double s = 0.0;
    for (std::int64_t c = 0; c < h; ++c)
      s += static_cast<double>(bf16_to_float(w[c])) * x[static_cast<std::size_t>(c)];
    return s;
  };
  for (std::int64_t j = 0; j < n; ++j) {
    const double g = row_dot(p.gate_row(j));
    const double u = p.gated ? row_dot(p.up_row(j)) : 0.0;
    act[static_cast<std::size_t>(j)] = activation_value(p.activation, g, u);
  }
  for (std::int64_t r = 0; r < h; ++r) {
    const bf16_t* w = w2 + r * n;
    double s = 0.0;
    for (std::int64_t j = 0; j < n; ++j)
      s += static_cast<double>(bf16_to_float(w[j])) * act[static_cast<std::size_t>(j)];
    y[r] = s;
  }
}

// The whole result in double, laid out as the output tensor (zeros where nothing is computed).
std::vector<double> compute(const ExpertsProblem& p) {
  std::vector<double> out(static_cast<std::size_t>(p.output_numel()), 0.0);
  std::vector<double> x(static_cast<std::size_t>(p.h)), act(static_cast<std::size_t>(p.n)),
      y(static_cast<std::size_t>(p.h));
  if (p.format == ActivationFormat::batched_experts) {
    for (std::int64_t e = 0; e < p.e_local; ++e)
      for (std::int64_t i = 0; i < p.counts[e]; ++i) {
        const std::int64_t row = e * p.max_tokens + i;
        for (std::int64_t c = 0; c < p.h; ++c) x[static_cast<std::size_t>(c)] = p.hidden_at(row * p.h + c);
        expert_mlp(p, e, x, act, out.data() + row * p.h);
      }
    return out;
  }
  for (std::int64_t t = 0; t < p.m; ++t) {
    // bf16/fp32 times fp32 is exact in double, so folding the weight in here loses nothing.
    const double in_scale = p.weight_on_input ? static_cast<double>(p.topk_weights[t * p.k]) : 1.0;
    for (std::int64_t c = 0; c < p.h; ++c) x[static_cast<std::size_t>(c)] = in_scale * p.hidden_at(t * p.h + c);
    for (std::int64_t k = 0; k < p.k; ++k) {
      const std::int32_t e = p.local_ids[static_cast<std::size_t>(t * p.k + k)];
      if (e < 0) continue;
      if (!p.reduce) {
        expert_mlp(p, e, x, act, out.data() + (t * p.k + k) * p.h);
        continue;
      }
      expert_mlp(p, e, x, act, y.data());
      const double wt = p.weight_on_input ? 1.0 : static_cast<double>(p.topk_weights[t * p.k + k]);
      double* o = out.data() + t * p.h;
      for (std::int64_t c = 0; c < p.h; ++c) o[c] += wt * y[static_cast<std::size_t>(c)];
    }
  }
  return out;
}

class ReferenceExperts final : public Experts {
 public:
  using Experts::Experts;
  std::string_view name() const override { return "reference"; }
  bool writes_combine_signal() const override { return true; }

 protected:
  void run(const ExpertsProblem& p, const TensorView& out) const override {
    bf16_t* o = static_cast<bf16_t*>(out.data);
    if (p.format == ActivationFormat::batched_experts) {
      run_batched(p, o);
      return;
    }
    const std::vector<double> r = compute(p);
    for (std::size_t i = 0; i < r.size(); ++i) o[i] = double_to_bf16(r[i]);
  }

 private:
  // Expert by expert, block by block (block_m rows with a per-block combine signal, else the expert's rows), the
  // block's rows stored N-tile by N-tile, so an overlapped combine can send each block while later ones compute.
  // Only the counted rows are written: the rest of `out` belongs to the caller.
  static void run_batched(const ExpertsProblem& p, bf16_t* o) {
    std::vector<double> x(static_cast<std::size_t>(p.h)), act(static_cast<std::size_t>(p.n)), y;
    const bool per_block = p.signal != nullptr && !p.signal_per_expert;
    for (std::int64_t e = 0; e < p.e_local; ++e) {
      const std::int64_t count = p.counts[e];
      const std::int64_t bm = per_block ? p.signal_block_m : std::max<std::int64_t>(count, 1);
      const std::int64_t bn = per_block ? p.signal_block_n : p.h;
      for (std::int64_t b = 0; b * bm < count; ++b) {
        const std::int64_t first = b * bm, n_rows = std::min(count, first + bm) - first;
        y.assign(static_cast<std::size_t>(n_rows * p.h), 0.0);
        for (std::int64_t i = 0; i < n_rows; ++i) {
          const std::int64_t row = e * p.max_tokens + first + i;
          for (std::int64_t c = 0; c < p.h; ++c) x[static_cast<std::size_t>(c)] = p.hidden_at(row * p.h + c);
          expert_mlp(p, e, x, act, y.data() + i * p.h);
        }
        for (std::int64_t c0 = 0; c0 < p.h; c0 += bn) {
          for (std::int64_t i = 0; i < n_rows; ++i)
            for (std::int64_t c = c0; c < std::min(p.h, c0 + bn); ++c)
              o[(e * p.max_tokens + first + i) * p.h + c] = double_to_bf16(y[static_cast<std::size_t>(i * p.h + c)]);
          if (per_block) add_host_signal(p, e * p.signal_blocks + b);
        }
      }
      if (p.signal_per_expert) add_host_signal(p, e);
    }
  }
};

}  // namespace

std::unique_ptr<Experts> make_reference_experts(const ExpertsConfig& config) {
  if (config.quant == ExpertsQuant::fp8_block) return experts_fp8::make_reference_experts_fp8(config);
  return std::make_unique<ReferenceExperts>(config);
}

std::vector<double> reference_experts_f64(const ExpertsInputs& in, const ExpertsConfig& config) {
  if (config.quant == ExpertsQuant::fp8_block) return experts_fp8::reference_experts_fp8_f64(in, config);
  return compute(check_experts_inputs(in, config));
}

}  // namespace epmoe

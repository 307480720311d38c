#include "gpu/moe_layer_test_util.hpp"

#include <epmoe/nvfp4.hpp>
#include <epmoe/quant.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>

#include "gpu/gpu_util.hpp"
#include "support/moe_reference.hpp"
#include "support/random.hpp"

namespace epmoe::gputest {

PrepareFinalizeOptions LayerCase::options() const {
  PrepareFinalizeOptions o;
  o.dispatch_dtype = nvfp4 ? DispatchDtype::nvfp4 : fp8 ? DispatchDtype::fp8 : DispatchDtype::bf16;
  o.nvfp4_global_scale = nvfp4_global_scale;
  o.round_scale = ue8m0;
  o.use_ue8m0 = ue8m0;
  return o;
}

std::int64_t LayerCase::tokens_of(int r) const { return T[static_cast<std::size_t>(r) % T.size()]; }

void LayerCase::set_k_one_weight_on_input_int32_ids() {
  K = 1;
  weight_on_input = true;
  int32_idx = true;
}

ExpertWeights make_expert_weights(std::mt19937_64& rng, std::int64_t E, std::int64_t H, std::int64_t N) {
  const Tensor a = test::random_bf16(rng, E * 2 * N, H, 1.0f / std::sqrt(static_cast<float>(H)));
  const Tensor b = test::random_bf16(rng, E * H, N, 1.0f / std::sqrt(static_cast<float>(N)));
  return {Tensor::wrap(TensorView(a.data(), DType::bf16, {E, 2 * N, H}), std::make_shared<Tensor>(a)),
          Tensor::wrap(TensorView(b.data(), DType::bf16, {E, H, N}), std::make_shared<Tensor>(b))};
}

ExpertWeights rank_weights(const ExpertWeights& m, int r, int El, bool gpu) {
  auto put = [&](const TensorView& t) { return gpu ? to_gpu(t, r) : Tensor::wrap(t, nullptr); };
  return {put(m.w1.view().slice_rows(r * El, (r + 1) * El)), put(m.w2.view().slice_rows(r * El, (r + 1) * El))};
}

Ins make_inputs(std::mt19937_64& rng, const LayerCase& c, int R, int E) {
  Ins in(static_cast<std::size_t>(R));
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < c.forwards; ++f) {
      const std::int64_t T = c.tokens_of(r);
      CallIn ci;
      ci.x = test::random_bf16(rng, T, c.H, 2.0f);
      test::RoutingOptions ro;
      ro.p_minus_one = c.p_minus_one;
      ci.idx = test::random_topk_idx(rng, T, c.K, E, ro);
      ci.w = test::random_topk_weights(rng, ci.idx);
      in[static_cast<std::size_t>(r)].push_back(std::move(ci));
    }
  return in;
}

Tensor ids_as(const Tensor& idx64, bool int32) {
  if (!int32) return idx64;
  Tensor out = Tensor::empty(DType::int32, idx64.shape());
  for (std::int64_t i = 0; i < idx64.numel(); ++i)
    out.ptr<std::int32_t>()[i] = static_cast<std::int32_t>(idx64.ptr<std::int64_t>()[i]);
  return out;
}

Tensor seen_by_experts(const LayerCase& c, const CallIn& ci) {
  Tensor x = ci.x;
  if (c.weight_on_input) {
    x = Tensor::empty(DType::bf16, ci.x.shape());
    for (std::int64_t t = 0; t < x.size(0); ++t)
      for (std::int64_t h = 0; h < c.H; ++h)
        x.ptr<bf16_t>()[t * c.H + h] =
            float_to_bf16(ci.w.ptr<float>()[t] * bf16_to_float(ci.x.ptr<bf16_t>()[t * c.H + h]));
  }
  if (c.nvfp4 && x.numel() > 0) {
    Tensor gs = Tensor::empty(DType::fp32, Shape{});
    *gs.ptr<float>() = c.nvfp4_global_scale;
    const Nvfp4Tensor q = quantize_nvfp4(x, gs, Nvfp4ScaleLayout::linear);
    return dequantize_nvfp4(q.data, q.scales, gs, Nvfp4ScaleLayout::linear, DType::bf16);
  }
  if (!c.fp8 || x.numel() == 0) return x;
  const Fp8Tensor q = quantize_fp8(x, {c.ue8m0, c.ue8m0});
  return dequantize_fp8(q.data, q.scales, DType::bf16);
}

CallIn put_call(const CallIn& ci, int r, bool gpu) {
  auto put = [&](const Tensor& t) { return gpu ? to_gpu(t.view(), r) : t; };
  return {put(ci.x), put(ci.idx), put(ci.w)};
}

MoEForwardArgs forward_args(const TensorView& hidden, const TensorView& w1, const TensorView& w2,
                            const TensorView& topk_idx, const TensorView& topk_weights, int global_num_experts) {
  return {.hidden = hidden, .w1 = w1, .w2 = w2, .topk_weights = topk_weights, .topk_idx = topk_idx,
          .global_num_experts = global_num_experts, .expert_map = {}, .output = {}};
}

PrepareInputs prepare_inputs(const TensorView& hidden, const TensorView& topk_idx, const TensorView& topk_weights,
                             int global_num_experts) {
  return {.hidden = hidden, .topk_idx = topk_idx, .topk_weights = topk_weights,
          .global_num_experts = global_num_experts, .output = {}};
}

Tensor forward_checked(MoELayer& layer, const LayerCase& c, const std::string& name, const CallIn& ci,
                       const ExpertWeights& w, int global_num_experts, int r, bool gpu, bool give_output,
                       const std::function<void(MoEForwardArgs&)>& adjust) {
  auto put = [&](const TensorView& t) { return gpu ? to_gpu(t, r) : Tensor::wrap(t, nullptr); };
  const Tensor ids = ids_as(ci.idx, c.int32_idx);  // alive for the call: the CPU path wraps it
  const Tensor x = put(ci.x), idx = put(ids), wts = put(ci.w);
  MoEForwardArgs a = forward_args(x, w.w1, w.w2, idx, wts, global_num_experts);
  a.apply_router_weight_on_input = c.weight_on_input;
  Tensor out;
  if (give_output) {
    out = gpu ? Tensor::empty(DType::bf16, {ci.x.size(0), c.H}, Device::cuda(r))
              : Tensor::empty(DType::bf16, {ci.x.size(0), c.H});
    if (gpu) poison(out);
    else if (out.nbytes()) std::memset(out.data(), 0xff, out.nbytes());
    a.output = out;
  }
  if (adjust) adjust(a);
  const MoEForwardResult res = layer.forward(a);
  EXPECT_EQ(res.output.shape(), (Shape{ci.x.size(0), c.H})) << name << " rank " << r;
  EXPECT_EQ(res.output.device().is_cuda(), gpu) << name << " rank " << r;
  if (out.defined()) {
    EXPECT_EQ(res.output.data(), out.data()) << name << ": not written into the output";
  }
  return to_cpu(res.output);
}

void check_layer_case(const LayerCase& c, const std::string& name, std::uint64_t seed,
                      const std::function<int(int R)>& experts, const RunLayer& run, int log_width) {
  const int R = thread_ranks();
  if (R < 1) GTEST_SKIP() << "no GPU";
  const int E = experts(R);
  std::mt19937_64 rng(seed);
  const ExpertWeights m = make_expert_weights(rng, E, c.H, c.N);
  const Ins in = make_inputs(rng, c, R, E);
  const Outs got = run(m, in, R, /*gpu=*/true);
  const Outs cpu = run(m, in, R, /*gpu=*/false);
  for (int r = 0; r < R; ++r)
    for (int f = 0; f < c.forwards; ++f) {
      const auto ru = static_cast<std::size_t>(r), fu = static_cast<std::size_t>(f);
      const CallIn& ci = in[ru][fu];
      const std::string what = name + " R=" + std::to_string(R) + " rank " + std::to_string(r) + " forward " +
                               std::to_string(f);
      ASSERT_EQ(got[ru].size(), static_cast<std::size_t>(c.forwards)) << what;
      if (ci.x.size(0) == 0) {
        EXPECT_EQ(got[ru][fu].numel(), 0) << what;
        continue;
      }
      // seen_by_experts has the router weight applied already (on the token side, before the wire), so the
      // reference takes weights of 1 then (and applies none on either side).
      Tensor ones;
      if (c.weight_on_input) {
        ones = Tensor::empty(DType::fp32, ci.w.shape());
        for (std::int64_t i = 0; i < ones.numel(); ++i) ones.ptr<float>()[i] = 1.0f;
      }
      const std::vector<double> ref = test::moe_layer_reference(seen_by_experts(c, ci), m.w1, m.w2, ci.idx,
                                                                c.weight_on_input ? ones : ci.w, "silu", false);
      const double err = test::relative_l2(got[ru][fu], ref);
      log_relative_l2(what + " vs float64", err, log_width);
      // also fails on NaN / poison
      EXPECT_LE(err, kLayerTolerance) << what << " (seed " << seed << "): GPU vs float64";
      const double cpu_err = test::relative_l2(cpu[ru][fu], ref);
      EXPECT_LE(cpu_err, kLayerTolerance) << what << " (seed " << seed << "): CPU ranks vs float64";
      const double diff = bf16_relative_l2(got[ru][fu], cpu[ru][fu]);
      log_relative_l2(what + " vs CPU ranks", diff, log_width);
      EXPECT_LE(diff, kLayerTolerance) << what << " (seed " << seed << "): GPU vs CPU ranks";
    }
}

void expect_forward_matches_float64(MoELayer& layer, const MoEForwardArgs& args, const CallIn& ci,
                                    const ExpertWeights& m, std::uint64_t seed, const std::string& what,
                                    int log_width) {
  const MoEForwardResult r = layer.forward(args);
  const double err = test::relative_l2(to_cpu(r.output), test::moe_layer_reference(ci.x, m.w1, m.w2, ci.idx, ci.w,
                                                                                   "silu"));
  log_relative_l2(what, err, log_width);
  EXPECT_LE(err, kLayerTolerance) << "seed " << seed;
}

double bf16_relative_l2(const Tensor& got, const Tensor& want) {
  double num = 0, den = 0;
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    const double g = bf16_to_float(got.ptr<bf16_t>()[i]), w = bf16_to_float(want.ptr<bf16_t>()[i]);
    num += (g - w) * (g - w);
    den += w * w;
  }
  if (std::isnan(num) || std::isnan(den)) return std::nan("");
  return den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0.0);
}

void log_relative_l2(const std::string& what, double err, int width) {
  std::printf("[ rel_l2   ] %-*s %.3e\n", width, what.c_str(), err);
}

}  // namespace epmoe::gputest

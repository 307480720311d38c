// The MoE stage's CPU steps, shared by the prepare/finalize implementations: the token side of a dispatch
// (prepare_common.hpp) and TopKWeightAndReduce (semantics §8, weight_and_reduce.hpp). The CUDA twins are in cuda.cpp
// and cuda.cu.
#include <epmoe/quant.hpp>

#include <cstring>
#include <vector>

#include "core/check.hpp"
#include "moe/prepare_common.hpp"
#include "moe/weight_and_reduce.hpp"

namespace epmoe {

namespace {

std::int64_t id_at(const TensorView& topk_idx, std::int64_t i) {
  return topk_idx.dtype == DType::int64 ? topk_idx.ptr<std::int64_t>()[i] : topk_idx.ptr<std::int32_t>()[i];
}

void check_prepare_inputs(const PrepareInputs& in) {
  EPMOE_CHECK_ARG(in.hidden.dtype == DType::bf16 && in.hidden.ndim() == 2 && in.hidden.is_contiguous() &&
                      in.hidden.device.is_cpu(),
                  "hidden", "contiguous bfloat16 [T, H] on cpu", describe(in.hidden));
  const std::int64_t T = in.hidden.size(0);
  // The CPU steps read the ids and weights on the host: a CUDA tensor here would be a device pointer.
  check_topk_idx_dtype(in.topk_idx);
  EPMOE_CHECK_ARG(in.topk_idx.ndim() == 2 && in.topk_idx.size(0) == T && in.topk_idx.is_contiguous() &&
                      in.topk_idx.device.is_cpu(),
                  "topk_idx", fmt::format("contiguous [{}, K] on cpu (hidden's device)", T), describe(in.topk_idx));
  EPMOE_CHECK_ARG(in.topk_weights.dtype == DType::fp32 && in.topk_weights.shape == in.topk_idx.shape &&
                      in.topk_weights.is_contiguous() && in.topk_weights.device.is_cpu(),
                  "topk_weights", fmt::format("contiguous float32 {} on cpu (hidden's device)", to_string(in.topk_idx.shape)),
                  describe(in.topk_weights));
  EPMOE_CHECK_ARG(in.global_num_experts > 0, "global_num_experts", "> 0", in.global_num_experts);
  EPMOE_CHECK_ARG(!in.apply_router_weight_on_input || in.topk_idx.size(1) == 1, "apply_router_weight_on_input",
                  "only with K == 1", fmt::format("K = {}", in.topk_idx.size(1)));
}

}  // namespace

void refuse_nvfp4(const PrepareFinalizeOptions& options, std::string_view name) {
  EPMOE_CHECK_ARG(options.dispatch_dtype != DispatchDtype::nvfp4, "dispatch_dtype",
                  fmt::format("bf16 or fp8 for the {} prepare/finalize (nvfp4: low-latency mode only)", name), "nvfp4");
}

Tensor clone(const TensorView& v) {
  Tensor t = Tensor::empty(v.dtype, v.shape);
  EPMOE_ASSERT(v.is_contiguous());
  if (t.nbytes()) std::memcpy(t.data(), v.data, t.nbytes());
  return t;
}

TokenSide prepare_token_side(const PrepareInputs& in) {
  check_prepare_inputs(in);
  const Tensor topk_idx = Tensor::wrap(in.topk_idx, nullptr);
  if (!in.apply_router_weight_on_input)
    return {Tensor::wrap(in.hidden, nullptr), topk_idx, Tensor::wrap(in.topk_weights, nullptr)};
  const std::int64_t T = in.hidden.size(0), H = in.hidden.size(1);
  Tensor x = Tensor::empty(DType::bf16, {T, H});
  Tensor ones = Tensor::empty(DType::fp32, {T, 1});
  for (std::int64_t t = 0; t < T; ++t) {
    const float w = in.topk_weights.ptr<float>()[t];
    for (std::int64_t h = 0; h < H; ++h)
      x.ptr<bf16_t>()[t * H + h] = float_to_bf16(w * bf16_to_float(in.hidden.ptr<bf16_t>()[t * H + h]));
    ones.ptr<float>()[t] = 1.0f;
  }
  return {x, topk_idx, ones};
}

Tensor fp8_round_trip(const TensorView& hidden, const PrepareFinalizeOptions& options) {
  const Fp8Tensor q = quantize_fp8(hidden, {options.round_scale, options.use_ue8m0});
  return dequantize_fp8(q.data, q.scales, DType::bf16);
}

Tensor reduce_standard(const TensorView& fused, WeightAndReduce w, const TensorView& topk_weights,
                       const TensorView& topk_idx) {
  const std::int64_t M = topk_idx.size(0);
  if (w == WeightAndReduce::none) {
    EPMOE_CHECK_ARG(fused.ndim() == 2 && fused.size(0) == M, "fused_expert_output", fmt::format("bfloat16 [{}, H]", M),
                    describe(fused));
    return clone(fused);
  }
  EPMOE_CHECK_ARG(w == WeightAndReduce::contiguous, "weight_and_reduce", "none or contiguous for the standard format",
                  weight_and_reduce_name(w));
  EPMOE_CHECK_ARG(fused.ndim() == 3, "fused_expert_output", "bfloat16 [M, K, H]", describe(fused));
  Tensor out = Tensor::empty(DType::bf16, {M, fused.size(2)});
  weight_and_reduce_contiguous(fused, topk_weights, topk_idx, out);
  return out;
}

void weight_and_reduce_contiguous(const TensorView& fused, const TensorView& topk_weights, const TensorView& topk_idx,
                                  const TensorView& out) {
  const std::int64_t M = out.size(0), H = out.size(1), K = topk_weights.size(1);
  EPMOE_CHECK_ARG(fused.ndim() == 3 && fused.size(0) == M && fused.size(1) == K && fused.size(2) == H,
                  "fused_expert_output", fmt::format("bfloat16 [{}, {}, {}]", M, K, H), describe(fused));
  const auto* f = fused.ptr<bf16_t>();
  const auto* w = topk_weights.ptr<float>();
  auto* o = out.ptr<bf16_t>();
  std::vector<float> acc(static_cast<std::size_t>(H));
  for (std::int64_t m = 0; m < M; ++m) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (std::int64_t k = 0; k < K; ++k) {
      if (id_at(topk_idx, m * K + k) < 0) continue;
      const float wk = w[m * K + k];
      const bf16_t* row = f + (m * K + k) * H;
      for (std::int64_t h = 0; h < H; ++h) acc[static_cast<std::size_t>(h)] += wk * bf16_to_float(row[h]);
    }
    for (std::int64_t h = 0; h < H; ++h) o[m * H + h] = float_to_bf16(acc[static_cast<std::size_t>(h)]);
  }
}

void weight_and_reduce_naive_batched(const TensorView& fused, const TensorView& topk_weights, const TensorView& topk_idx,
                                     int first_expert, const TensorView& out) {
  const std::int64_t M = out.size(0), H = out.size(1), K = topk_weights.size(1);
  const std::int64_t E_local = fused.size(0), max_tokens = fused.size(1);
  EPMOE_CHECK_ARG(fused.ndim() == 3 && fused.size(2) == H, "fused_expert_output",
                  fmt::format("bfloat16 [E_local, max_tokens, {}]", H), describe(fused));
  const auto* f = fused.ptr<bf16_t>();
  const auto* w = topk_weights.ptr<float>();
  auto* o = out.ptr<bf16_t>();
  std::vector<std::int64_t> next_slot(static_cast<std::size_t>(E_local), 0);
  std::vector<float> acc(static_cast<std::size_t>(H));
  for (std::int64_t m = 0; m < M; ++m) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int64_t e = id_at(topk_idx, m * K + k) - first_expert;
      if (e < 0 || e >= E_local) continue;
      const std::int64_t slot = next_slot[static_cast<std::size_t>(e)]++;
      EPMOE_CHECK_ARG(slot < max_tokens, "fused_expert_output", fmt::format("at least {} slots for expert {}", slot + 1, e),
                      max_tokens);
      const float wk = w[m * K + k];
      const bf16_t* row = f + (e * max_tokens + slot) * H;
      for (std::int64_t h = 0; h < H; ++h) acc[static_cast<std::size_t>(h)] += wk * bf16_to_float(row[h]);
    }
    for (std::int64_t h = 0; h < H; ++h) o[m * H + h] = float_to_bf16(acc[static_cast<std::size_t>(h)]);
  }
}

}  // namespace epmoe

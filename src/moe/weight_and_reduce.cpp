#include "moe/weight_and_reduce.hpp"

#include <vector>

#include "core/check.hpp"

namespace epmoe {

namespace {
std::int64_t id_at(const TensorView& topk_idx, std::int64_t i) {
  return topk_idx.dtype == DType::int64 ? topk_idx.ptr<std::int64_t>()[i] : topk_idx.ptr<std::int32_t>()[i];
}
}  // namespace

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

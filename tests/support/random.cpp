#include "support/random.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <numeric>
#include <string>

namespace epmoe::test {

std::uint64_t fresh_seed() {
  std::uint64_t seed;
  if (const char* s = std::getenv("EPMOE_TEST_SEED")) seed = std::strtoull(s, nullptr, 0);
  else seed = (static_cast<std::uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  std::printf("[ seed     ] EPMOE_TEST_SEED=%llu\n", static_cast<unsigned long long>(seed));
  if (::testing::UnitTest::GetInstance()->current_test_info())
    ::testing::Test::RecordProperty("seed", std::to_string(seed));
  return seed;
}

Tensor random_bf16(std::mt19937_64& rng, std::int64_t rows, std::int64_t cols, float scale) {
  Tensor t = Tensor::empty(DType::bf16, {rows, cols});
  std::uniform_real_distribution<float> d(-scale, scale);
  auto* p = t.ptr<bf16_t>();
  for (std::int64_t i = 0; i < rows * cols; ++i) p[i] = float_to_bf16(d(rng));
  return t;
}

Tensor random_f32(std::mt19937_64& rng, std::int64_t rows, std::int64_t cols, float lo, float hi) {
  Tensor t = Tensor::empty(DType::fp32, {rows, cols});
  std::uniform_real_distribution<float> d(lo, hi);
  auto* p = t.ptr<float>();
  for (std::int64_t i = 0; i < rows * cols; ++i) p[i] = d(rng);
  return t;
}

Tensor random_topk_idx(std::mt19937_64& rng, std::int64_t T, int K, int E, const RoutingOptions& o) {
  Tensor t = Tensor::empty(DType::int64, {T, K});
  auto* p = t.ptr<std::int64_t>();
  std::vector<std::int64_t> ids(static_cast<std::size_t>(E));
  std::iota(ids.begin(), ids.end(), 0);
  std::bernoulli_distribution minus_one(o.p_minus_one);
  for (std::int64_t i = 0; i < T; ++i) {
    // Partial Fisher-Yates: K distinct ids.
    for (int k = 0; k < K; ++k) {
      std::uniform_int_distribution<int> d(k, E - 1);
      std::swap(ids[static_cast<std::size_t>(k)], ids[static_cast<std::size_t>(d(rng))]);
      p[i * K + k] = ids[static_cast<std::size_t>(k)];
      if (o.p_minus_one > 0 && minus_one(rng)) p[i * K + k] = -1;
    }
    if (o.only_expert >= 0)
      for (int k = 0; k < K; ++k) p[i * K + k] = k == 0 ? o.only_expert : -1;
  }
  return t;
}

Tensor random_topk_weights(std::mt19937_64& rng, const Tensor& topk_idx) {
  const auto T = topk_idx.size(0), K = topk_idx.size(1);
  Tensor w = Tensor::empty(DType::fp32, {T, K});
  std::uniform_real_distribution<float> d(0.05f, 1.0f);
  for (std::int64_t i = 0; i < T * K; ++i) w.ptr<float>()[i] = topk_idx.ptr<std::int64_t>()[i] < 0 ? 0.0f : d(rng);
  return w;
}

Tensor scales_in_layout(const Tensor& row_major, ScaleLayout layout) {
  if (!row_major.defined() || layout == ScaleLayout::row_major) return row_major;
  const std::int64_t T = row_major.size(0), C = row_major.size(1);
  Tensor t = empty_fp8_scales(row_major.dtype(), {T, C}, layout);
  const std::int64_t pitch = tma_aligned_scale_rows(T);
  auto* d = static_cast<std::uint32_t*>(t.data());
  const auto* s = static_cast<const std::uint32_t*>(row_major.data());
  for (std::int64_t c = 0; c < C; ++c)
    for (std::int64_t r = 0; r < pitch; ++r) d[c * pitch + r] = r < T ? s[r * C + c] : 0x7fc0deadu;
  return t;
}

}  // namespace epmoe::test

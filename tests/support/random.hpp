// Seeded random inputs for tests. Every test draws from a fresh seed (EPMOE_TEST_SEED to replay one)
// and logs it, so a failure can be reproduced exactly.
#pragma once

#include <epmoe/quant.hpp>
#include <epmoe/tensor.hpp>

#include <cstdint>
#include <random>
#include <vector>

namespace epmoe::test {

/// A fresh seed per call (or EPMOE_TEST_SEED), printed and recorded as the test property "seed".
std::uint64_t fresh_seed();

/// bf16 [rows, cols] with values uniform in [-scale, scale] (never all zeros).
Tensor random_bf16(std::mt19937_64& rng, std::int64_t rows, std::int64_t cols, float scale = 1.0f);
/// float32 [rows, cols] uniform in [lo, hi].
Tensor random_f32(std::mt19937_64& rng, std::int64_t rows, std::int64_t cols, float lo = -1.0f, float hi = 1.0f);

/// Options for random routing.
struct RoutingOptions {
  double p_minus_one = 0.0;  ///< chance that an entry is -1
  int only_expert = -1;      ///< >= 0: every token's first choice is this expert, the rest -1
};
/// int64 [T, K] with K distinct ids in [0, E) per row (then some set to -1 as asked).
Tensor random_topk_idx(std::mt19937_64& rng, std::int64_t T, int K, int E, const RoutingOptions& options = {});
/// float32 [T, K] positive weights, 0 where topk_idx is -1.
Tensor random_topk_weights(std::mt19937_64& rng, const Tensor& topk_idx);

/// A copy of row-major 4-byte scales [T, C] (undefined stays undefined) in `layout`: column-major as
/// empty_fp8_scales lays it out (columns padded to 4 rows), the padding filled with 0x7fc0dead so a read of it shows.
Tensor scales_in_layout(const Tensor& row_major, ScaleLayout layout);

}  // namespace epmoe::test

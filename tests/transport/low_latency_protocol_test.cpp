// The low-latency byte protocol's arithmetic shared by the CPU implementation and the GPU kernels
// (transport/low_latency_protocol.hpp), checked on the host against plain integer division.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>

#include "transport/low_latency_protocol.hpp"

namespace epmoe::low_latency_protocol {
namespace {

// Every local expert count semantics §1 allows, every id below 2^24. floor(id * m / 2^40) and id / d are both
// non-decreasing in id, so they agree on [q * d, q * d + d - 1] when they agree at its two ends: checking both ends
// of every quotient's range covers every id (2 * 2^24 / d ids per d, not 2^24).
TEST(LowLatencyProtocol, ExpertRankIsTheDivisionForEveryLocalExpertCountAndId) {
  constexpr std::int64_t kIdLimit = std::int64_t{1} << 24;
  for (int d = 1; d <= 1024; ++d) {
    const std::uint64_t m = expert_rank_multiplier(d);
    for (std::int64_t first = 0; first < kIdLimit; first += d) {
      const std::int64_t last = std::min(first + d - 1, kIdLimit - 1);
      const int q = static_cast<int>(first / d);
      const int at_first = expert_rank(static_cast<std::int32_t>(first), m);
      const int at_last = expert_rank(static_cast<std::int32_t>(last), m);
      if (at_first != q || at_last != q) {
        FAIL() << "local_experts = " << d << ": expert_rank(" << first << ") = " << at_first << ", expert_rank(" << last
               << ") = " << at_last << ", expected " << q;
      }
    }
  }
}

// A hand-made case: 256 experts over 8 ranks (32 local), the DeepSeek-V3 shape.
TEST(LowLatencyProtocol, ExpertRankOfTheDeepSeekShape) {
  const std::uint64_t m = expert_rank_multiplier(32);
  EXPECT_EQ(expert_rank(0, m), 0);
  EXPECT_EQ(expert_rank(31, m), 0);
  EXPECT_EQ(expert_rank(32, m), 1);
  EXPECT_EQ(expert_rank(255, m), 7);
}

TEST(LowLatencyProtocol, LayoutCarriesTheMultiplierOfItsLocalExperts) {
  const Layout L = Layout::make(/*tmax=*/8, /*hidden=*/2048, /*R=*/4, /*E=*/48);
  EXPECT_EQ(L.local_experts, 12);
  EXPECT_EQ(L.expert_rank_multiplier, expert_rank_multiplier(12));
  EXPECT_EQ(expert_rank(47, L.expert_rank_multiplier), 3);
}

}  // namespace
}  // namespace epmoe::low_latency_protocol

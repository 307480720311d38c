// Replaying recorded OLMoE routing (SPEC 14) from the committed slice.
#include <epmoe/replay.hpp>
#include <gtest/gtest.h>

#include <set>

#include "core/npy.hpp"

namespace epmoe {
namespace {

const std::string kDir = std::string(EPMOE_TEST_DATA_DIR) + "/olmoe-routing";

TEST(Replay, LoadsBothDomainsWithTheRecordedShapes) {
  for (const char* domain : {"general", "coding"}) {
    const RoutingTrace t = load_routing_trace(kDir, domain);
    EXPECT_EQ(t.num_tokens(), 2048);
    EXPECT_EQ(t.num_layers(), 16);
    EXPECT_EQ(t.num_topk(), 8);
    // Every row: 8 distinct ids in [0, 64) (the data set's README promises no duplicates).
    const auto* idx = t.topk_idx.ptr<std::int16_t>();
    double weight_sum = 0;
    for (std::int64_t r = 0; r < t.num_tokens() * 16; ++r) {
      std::set<int> ids;
      for (int k = 0; k < 8; ++k) {
        ASSERT_GE(idx[r * 8 + k], 0);
        ASSERT_LT(idx[r * 8 + k], 64);
        ids.insert(idx[r * 8 + k]);
        weight_sum += t.topk_weights.ptr<float>()[r * 8 + k];
      }
      ASSERT_EQ(ids.size(), 8u);
    }
    // Softmax probabilities of the top 8 of 64, not renormalised: about 0.38 per row on average.
    const double mean = weight_sum / static_cast<double>(t.num_tokens() * 16);
    EXPECT_GT(mean, 0.2);
    EXPECT_LT(mean, 0.6);
  }
}

TEST(Replay, LoadsFromAFilePathToo) {
  const RoutingTrace t = load_routing_trace(kDir + "/coding.topk_idx.npy");
  EXPECT_EQ(t.domain, "coding");
  EXPECT_EQ(t.num_tokens(), 2048);
}

TEST(Replay, GivesRankRItsConsecutiveTokensAndKeepsWeights) {
  const RoutingTrace t = load_routing_trace(kDir, "general");
  const int layer = 5, T = 16;
  const auto r = replay_routing(t, layer, /*offset=*/100, /*rank=*/2, T, 64);
  for (int i = 0; i < T; ++i)
    for (int k = 0; k < 8; ++k) {
      const std::int64_t at = ((100 + 2 * T + i) * 16 + layer) * 8 + k;
      EXPECT_EQ(r.topk_idx.ptr<std::int64_t>()[i * 8 + k], t.topk_idx.ptr<std::int16_t>()[at]);
      EXPECT_EQ(r.topk_weights.ptr<float>()[i * 8 + k], t.topk_weights.ptr<float>()[at]);
    }
}

TEST(Replay, MapsIdsOntoMoreExpertsAsSpec14Says) {
  const RoutingTrace t = load_routing_trace(kDir, "coding");
  const auto r = replay_routing(t, 0, 0, 0, 8, 256);  // E/64 = 4
  for (int i = 0; i < 8; ++i)
    for (int k = 0; k < 8; ++k) {
      const int e = t.topk_idx.ptr<std::int16_t>()[(i * 16) * 8 + k];
      EXPECT_EQ(r.topk_idx.ptr<std::int64_t>()[i * 8 + k], e * 4 + i % 4);
    }
}

TEST(Replay, WrapsAroundTheEndOfTheTrace) {
  const RoutingTrace t = load_routing_trace(kDir, "general");
  const auto r = replay_routing(t, 0, 2047, 0, 2, 64);
  EXPECT_EQ(r.topk_idx.ptr<std::int64_t>()[8], t.topk_idx.ptr<std::int16_t>()[0]);  // token 2048 -> 0
}

TEST(Replay, RejectsBadArgumentsNamingThem) {
  const RoutingTrace t = load_routing_trace(kDir, "general");
  try {
    replay_routing(t, 16, 0, 0, 4, 64);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("'layer'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("16"), std::string::npos) << e.what();
  }
  EXPECT_THROW(replay_routing(t, 0, 0, 0, 4, 96), Error);
  EXPECT_THROW(load_routing_trace(kDir, "nonexistent"), Error);
  EXPECT_THROW(load_npy(kDir + "/README.md"), Error);
}

}  // namespace
}  // namespace epmoe

// Router (semantics §2) on CPU tensors: random logits against the float64 reference, constructed ties,
// hand-made DeepSeek-style grouped cases, K = 1 and K = E, and argument errors.
#include <gtest/gtest.h>

#include <epmoe/router.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "support/random.hpp"
#include "support/router_reference.hpp"

namespace epmoe {
namespace {

using test::RouterRefOptions;
using test::RouterRefRow;

Tensor f32_logits(std::int64_t T, std::int64_t E, const std::vector<float>& v) {
  Tensor t = Tensor::empty(DType::fp32, {T, E});
  EXPECT_EQ(static_cast<std::int64_t>(v.size()), T * E);
  std::memcpy(t.data(), v.data(), v.size() * sizeof(float));
  return t;
}

Tensor bf16_logits(std::int64_t T, std::int64_t E, const std::vector<float>& v) {
  Tensor t = Tensor::empty(DType::bf16, {T, E});
  for (std::size_t i = 0; i < v.size(); ++i) t.ptr<bf16_t>()[i] = float_to_bf16(v[i]);
  return t;
}

Tensor f32_vector(const std::vector<float>& v) {
  Tensor t = Tensor::empty(DType::fp32, {static_cast<std::int64_t>(v.size())});
  std::memcpy(t.data(), v.data(), v.size() * sizeof(float));
  return t;
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
// float32 softmax: a few ulps from expf plus up to about E ulps from the sum of the row.
double tol(double want) { return 1e-7 + 3e-5 * std::fabs(want); }

std::vector<std::int64_t> ids_of(const TopkResult& r, std::int64_t t) {
  const auto K = r.topk_idx.size(1);
  const std::int64_t* p = r.topk_idx.ptr<std::int64_t>() + t * K;
  return {p, p + K};
}

// Compares a result with the reference row by row. Rows the reference marks ambiguous (a deciding
// gap below its tie tolerance, where float32 rounding may legitimately decide otherwise) only need valid,
// distinct ids whose weights match the reference scores of those ids.
void expect_matches_reference(const TopkResult& r, const std::vector<RouterRefRow>& ref, const RouterRefOptions& o,
                              std::int64_t E) {
  const auto T = static_cast<std::int64_t>(ref.size());
  const int K = o.num_topk;
  ASSERT_EQ(r.topk_idx.dtype(), DType::int64);
  ASSERT_EQ(r.topk_weights.dtype(), DType::fp32);
  ASSERT_EQ(r.topk_idx.shape(), (Shape{T, K}));
  ASSERT_EQ(r.topk_weights.shape(), (Shape{T, K}));
  int ambiguous = 0;
  for (std::int64_t t = 0; t < T; ++t) {
    const RouterRefRow& row = ref[static_cast<std::size_t>(t)];
    const std::int64_t* idx = r.topk_idx.ptr<std::int64_t>() + t * K;
    const float* w = r.topk_weights.ptr<float>() + t * K;
    if (!row.ambiguous) {
      for (int k = 0; k < K; ++k) {
        ASSERT_EQ(idx[k], row.ids[static_cast<std::size_t>(k)]) << "token " << t << " slot " << k;
        ASSERT_NEAR(w[k], row.weights[static_cast<std::size_t>(k)], tol(row.weights[static_cast<std::size_t>(k)]))
            << "token " << t << " slot " << k;
      }
      continue;
    }
    ++ambiguous;
    std::set<std::int64_t> seen;
    double sum = 0.0;
    for (int k = 0; k < K; ++k) {
      ASSERT_TRUE(idx[k] >= 0 && idx[k] < E) << idx[k];
      ASSERT_TRUE(seen.insert(idx[k]).second) << "duplicate id " << idx[k] << " in token " << t;
      sum += row.scores[static_cast<std::size_t>(idx[k])];
    }
    for (int k = 0; k < K; ++k) {
      const double s = row.scores[static_cast<std::size_t>(idx[k])];
      const double want = (o.renormalize ? s / sum : s) * o.routed_scaling_factor;
      ASSERT_NEAR(w[k], want, tol(want)) << "token " << t << " slot " << k;
    }
  }
  EXPECT_LE(ambiguous, T / 10 + 1) << "too many near-ties for random logits";
}

std::vector<float> random_logits(std::mt19937_64& rng, std::int64_t T, std::int64_t E, float lo = -4.0f,
                                 float hi = 4.0f) {
  const Tensor t = test::random_f32(rng, T, E, lo, hi);
  return {t.ptr<float>(), t.ptr<float>() + T * E};
}

// ---------------------------------------------------------------- topk_softmax / topk_sigmoid

TEST(TopkSoftmax, RandomFloat32MatchesReference) {
  std::mt19937_64 rng(test::fresh_seed());
  for (std::int64_t E : {8, 60, 64, 256}) {
    for (int K : {1, 2, 6, 8}) {
      for (bool renorm : {false, true}) {
        const std::int64_t T = 37;
        const auto v = random_logits(rng, T, E);
        const Tensor logits = f32_logits(T, E, v);
        const TopkResult r = topk_softmax(logits, K, renorm);
        RouterRefOptions o;
        o.num_topk = K;
        o.renormalize = renorm;
        SCOPED_TRACE("E=" + std::to_string(E) + " K=" + std::to_string(K) + " renormalize=" + std::to_string(renorm));
        expect_matches_reference(r, test::router_reference(test::ref_logits_to_double(logits), T, E, o), o, E);
      }
    }
  }
}

TEST(TopkSoftmax, RandomBfloat16MatchesReference) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t T = 64, E = 128;
  const Tensor logits = test::random_bf16(rng, T, E, 6.0f);
  for (int K : {1, 4, 8}) {
    const TopkResult r = topk_softmax(logits, K, true);
    RouterRefOptions o;
    o.num_topk = K;
    o.renormalize = true;
    expect_matches_reference(r, test::router_reference(test::ref_logits_to_double(logits), T, E, o), o, E);
  }
}

TEST(TopkSigmoid, RandomFloat32AndBfloat16MatchReference) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t T = 50, E = 96;
  const Tensor f = f32_logits(T, E, random_logits(rng, T, E, -5.0f, 5.0f));
  const Tensor b = test::random_bf16(rng, T, E, 5.0f);
  for (const Tensor* logits : {&f, &b}) {
    for (bool renorm : {false, true}) {
      RouterRefOptions o;
      o.num_topk = 4;
      o.sigmoid = true;
      o.renormalize = renorm;
      const TopkResult r = topk_sigmoid(*logits, 4, renorm);
      expect_matches_reference(r, test::router_reference(test::ref_logits_to_double(*logits), T, E, o), o, E);
    }
  }
}

TEST(TopkSoftmax, KEqualsOneAndKEqualsE) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t T = 20, E = 32;
  const Tensor logits = f32_logits(T, E, random_logits(rng, T, E));
  for (int K : {1, 32}) {
    RouterRefOptions o;
    o.num_topk = K;
    o.renormalize = K == 32;
    const TopkResult r = topk_softmax(logits, K, o.renormalize);
    expect_matches_reference(r, test::router_reference(test::ref_logits_to_double(logits), T, E, o), o, E);
    if (K == 32) {
      // All experts, in descending order: every id once, weights sum to 1.
      for (std::int64_t t = 0; t < T; ++t) {
        auto ids = ids_of(r, t);
        EXPECT_EQ(std::set<std::int64_t>(ids.begin(), ids.end()).size(), 32u);
        double sum = 0;
        for (int k = 0; k < K; ++k) sum += r.topk_weights.ptr<float>()[t * K + k];
        EXPECT_NEAR(sum, 1.0, 1e-5);
        for (int k = 1; k < K; ++k)
          EXPECT_GE(r.topk_weights.ptr<float>()[t * K + k - 1], r.topk_weights.ptr<float>()[t * K + k]);
      }
    }
  }
  // E = 1, K = 1: the only expert with weight 1.
  const Tensor one = f32_logits(3, 1, {-2.0f, 0.0f, 9.0f});
  const TopkResult r1 = topk_softmax(one, 1, false);
  for (int t = 0; t < 3; ++t) {
    EXPECT_EQ(r1.topk_idx.ptr<std::int64_t>()[t], 0);
    EXPECT_EQ(r1.topk_weights.ptr<float>()[t], 1.0f);
  }
}

TEST(TopkSoftmax, EqualLogitsTieToLowerIds) {
  // Row 0: all equal; row 1: three-way tie for first; row 2: tie at the K boundary.
  const std::vector<float> v = {
      1, 1, 1, 1, 1, 1, 1, 1,  //
      0, 3, 3, 2, 3, 0, 0, 0,  //
      5, 2, 0, 2, 2, 0, 0, 2,  //
  };
  for (const Tensor& logits : {f32_logits(3, 8, v), bf16_logits(3, 8, v)}) {
    const TopkResult r = topk_softmax(logits, 3, false);
    EXPECT_EQ(ids_of(r, 0), (std::vector<std::int64_t>{0, 1, 2}));
    EXPECT_EQ(ids_of(r, 1), (std::vector<std::int64_t>{1, 2, 4}));
    EXPECT_EQ(ids_of(r, 2), (std::vector<std::int64_t>{0, 1, 3}));
    for (int k = 0; k < 3; ++k) EXPECT_EQ(r.topk_weights.ptr<float>()[k], 0.125f);
    const TopkResult s = topk_sigmoid(logits, 2, true);
    EXPECT_EQ(ids_of(s, 0), (std::vector<std::int64_t>{0, 1}));
    EXPECT_EQ(ids_of(s, 1), (std::vector<std::int64_t>{1, 2}));
    EXPECT_EQ(ids_of(s, 2), (std::vector<std::int64_t>{0, 1}));
    EXPECT_EQ(s.topk_weights.ptr<float>()[0], 0.5f);
    EXPECT_EQ(s.topk_weights.ptr<float>()[1], 0.5f);
  }
}

TEST(TopkSoftmax, UnderflowingProbabilitiesStillTieToLowerIds) {
  // exp(-100) is a float subnormal, exp(-200) and exp(-300) are 0: experts 1 and 2 tie in float32.
  const Tensor logits = f32_logits(1, 4, {0.0f, -200.0f, -300.0f, -100.0f});
  const TopkResult r = topk_softmax(logits, 3, false);
  EXPECT_EQ(ids_of(r, 0), (std::vector<std::int64_t>{0, 3, 1}));
  EXPECT_EQ(r.topk_weights.ptr<float>()[0], 1.0f);
  EXPECT_EQ(r.topk_weights.ptr<float>()[2], 0.0f);
}

TEST(TopkSoftmax, HandComputedWeights) {
  // softmax of {ln 1, ln 2, ln 3, ln 4} = {0.1, 0.2, 0.3, 0.4}.
  const Tensor logits = f32_logits(1, 4, {0.0f, std::log(2.0f), std::log(3.0f), std::log(4.0f)});
  const TopkResult r = topk_softmax(logits, 2, false);
  EXPECT_EQ(ids_of(r, 0), (std::vector<std::int64_t>{3, 2}));
  EXPECT_NEAR(r.topk_weights.ptr<float>()[0], 0.4, 1e-6);
  EXPECT_NEAR(r.topk_weights.ptr<float>()[1], 0.3, 1e-6);
  const TopkResult n = topk_softmax(logits, 2, true);
  EXPECT_NEAR(n.topk_weights.ptr<float>()[0], 4.0 / 7.0, 1e-6);
  EXPECT_NEAR(n.topk_weights.ptr<float>()[1], 3.0 / 7.0, 1e-6);
  // Large logits do not overflow (the max is subtracted first).
  const Tensor big = f32_logits(1, 2, {1000.0f, 1000.0f + std::log(3.0f)});
  const TopkResult b = topk_softmax(big, 1, false);
  EXPECT_EQ(ids_of(b, 0), (std::vector<std::int64_t>{1}));
  EXPECT_NEAR(b.topk_weights.ptr<float>()[0], 0.75, 1e-4);
}

TEST(TopkSoftmax, EmptyBatchAndInputUntouched) {
  const Tensor empty = Tensor::empty(DType::fp32, {0, 16});
  const TopkResult r = topk_softmax(empty, 4, true);
  EXPECT_EQ(r.topk_idx.shape(), (Shape{0, 4}));
  EXPECT_EQ(r.topk_weights.shape(), (Shape{0, 4}));
  std::mt19937_64 rng(test::fresh_seed());
  const auto v = random_logits(rng, 5, 16);
  const Tensor logits = f32_logits(5, 16, v);
  (void)topk_sigmoid(logits, 3, true);
  EXPECT_EQ(std::memcmp(logits.data(), v.data(), v.size() * 4), 0);
}

// ---------------------------------------------------------------- grouped_topk

GroupedTopkOptions deepseek_v3_options(const Tensor& bias) {
  GroupedTopkOptions o;
  o.num_topk = 8;
  o.num_expert_group = 8;
  o.topk_group = 4;
  o.scoring = ScoringFunc::sigmoid;
  o.renormalize = true;
  o.routed_scaling_factor = 2.5f;
  o.e_score_correction_bias = bias;
  return o;
}

TEST(GroupedTopk, DeepSeekV3HandCase) {
  // E = 256 in 8 groups of 32; sigmoid scores; keep 4 groups by the sum of their top-2 biased scores.
  const std::int64_t E = 256;
  std::vector<float> logits(E, -6.0f), bias(E, 0.0f);
  // group 0: the best single expert, a weak second: top-2 sum 0.998 + 0.002 = 1.0
  logits[5] = 6.0f;
  // group 1: 0.881 + 0.818 = 1.698
  logits[40] = 2.0f, logits[41] = 1.5f;
  // group 2: 0.731 + 0.731 = 1.462
  logits[70] = 1.0f, logits[71] = 1.0f;
  // group 3: (0.5 + bias 0.6) + 0.622 = 1.722
  logits[100] = 0.0f, bias[100] = 0.6f, logits[101] = 0.5f;
  // group 4: 0.953 + 0.002 = 0.955
  logits[130] = 3.0f;
  // group 5: 0.690 + 0.690 = 1.380
  logits[170] = 0.8f, logits[171] = 0.8f;
  // group 6: all -6
  // group 7: 0.769 + 0.731 = 1.500
  logits[250] = 1.2f, logits[251] = 1.0f;
  const Tensor bias_t = f32_vector(bias);
  const TopkResult r = grouped_topk(f32_logits(1, E, logits), deepseek_v3_options(bias_t));
  // Kept groups 3, 1, 7, 2 (group 0 has the best expert but the lower top-2 sum). Expert 100 wins on
  // its biased score 1.1; 70, 71 and 251 tie at sigmoid(1) and come in id order.
  const std::vector<std::int64_t> want_ids = {100, 40, 41, 250, 70, 71, 251, 101};
  EXPECT_EQ(ids_of(r, 0), want_ids);
  std::vector<double> s;
  double sum = 0;
  for (auto id : want_ids) {
    s.push_back(sigmoid(logits[static_cast<std::size_t>(id)]));
    sum += s.back();
  }
  for (int k = 0; k < 8; ++k) {
    const double want = s[static_cast<std::size_t>(k)] / sum * 2.5;  // unbiased score: 100 weighs sigmoid(0)
    EXPECT_NEAR(r.topk_weights.ptr<float>()[k], want, tol(want)) << k;
  }
  // The bias only selects: without it, group 0 and expert 5 come back, and the max rule applies.
  GroupedTopkOptions nb = deepseek_v3_options(Tensor());
  nb.e_score_correction_bias = TensorView();
  const TopkResult r2 = grouped_topk(f32_logits(1, E, logits), nb);
  // Group max: g0 0.998, g4 0.953, g1 0.881, g7 0.769 kept; then the best 8 of them.
  const std::vector<std::int64_t> ids2 = ids_of(r2, 0);
  EXPECT_EQ((std::vector<std::int64_t>(ids2.begin(), ids2.begin() + 5)),
            (std::vector<std::int64_t>{5, 130, 40, 41, 250}));
  EXPECT_EQ((std::vector<std::int64_t>(ids2.begin() + 5, ids2.end())), (std::vector<std::int64_t>{251, 0, 1}));
}

// K = 1 and topk_group = 1 with a bias: the group pass still takes each group's top 2 (a scratch of
// max(K, topk_group) entries overflowed here; the sanitizer build catches a regression).
TEST(GroupedTopk, KOneTopkGroupOneWithBiasTakesTopTwoOfEachGroup) {
  const std::int64_t E = 8;
  // 4 groups of 2. Group 1 holds the best single expert (logit 3) but group 2's pair sums higher.
  std::vector<float> logits = {-4, -4, 3, -4, 1.5f, 1.5f, -4, -4}, bias(E, 0.0f);
  const Tensor bias_t = f32_vector(bias);
  GroupedTopkOptions o;
  o.num_topk = 1;
  o.num_expert_group = 4;
  o.topk_group = 1;
  o.scoring = ScoringFunc::sigmoid;
  o.renormalize = false;
  o.e_score_correction_bias = bias_t;
  const TopkResult r = grouped_topk(f32_logits(1, E, logits), o);
  // group 1: sigmoid(3) + sigmoid(-4) = 0.9526 + 0.0180 = 0.971; group 2: 2 * sigmoid(1.5) = 1.635.
  EXPECT_EQ(ids_of(r, 0), (std::vector<std::int64_t>{4}));  // tie inside group 2 goes to the lower id
  EXPECT_NEAR(r.topk_weights.ptr<float>()[0], sigmoid(1.5), tol(sigmoid(1.5)));
}

TEST(GroupedTopk, SoftmaxWithoutBiasUsesGroupMax) {
  // E = 64 in 8 groups of 8, keep 3 groups by their max softmax score, K = 6, no renormalisation.
  const std::int64_t E = 64;
  std::vector<float> logits(E, 0.0f);
  logits[3] = 5.0f;  // group 0: max 5
  for (int e = 8; e < 16; ++e) logits[static_cast<std::size_t>(e)] = 3.9f;  // group 1: many high, max 3.9
  logits[20] = 4.0f;  // group 2: max 4
  logits[30] = 4.5f;
  logits[31] = 4.5f;  // group 3: max 4.5
  logits[33] = 4.2f;  // group 4: max 4.2
  GroupedTopkOptions o;
  o.num_topk = 6;
  o.num_expert_group = 8;
  o.topk_group = 3;
  o.scoring = ScoringFunc::softmax;
  o.renormalize = false;
  const TopkResult r = grouped_topk(f32_logits(1, E, logits), o);
  // Groups 0, 3, 4; experts 3, then the 30/31 tie in id order, 33, then the lowest zero-logit ids.
  const std::vector<std::int64_t> want = {3, 30, 31, 33, 0, 1};
  EXPECT_EQ(ids_of(r, 0), want);
  double z = 0;
  for (float l : logits) z += std::exp(static_cast<double>(l));
  for (int k = 0; k < 6; ++k) {
    const double p =
        std::exp(static_cast<double>(logits[static_cast<std::size_t>(want[static_cast<std::size_t>(k)])])) / z;
    EXPECT_NEAR(r.topk_weights.ptr<float>()[k], p, tol(p));
  }
}

TEST(GroupedTopk, EqualGroupScoresTieToLowerGroup) {
  // Groups of 4; groups 1, 2 and 3 tie at max 2, group 0 has max 1. Keep 2 groups: 1 and 2.
  std::vector<float> logits(16, 0.0f);
  logits[1] = 1.0f;
  logits[5] = 2.0f;
  logits[9] = 2.0f;
  logits[13] = 2.0f;
  GroupedTopkOptions o;
  o.num_topk = 3;
  o.num_expert_group = 4;
  o.topk_group = 2;
  o.renormalize = true;
  for (ScoringFunc f : {ScoringFunc::softmax, ScoringFunc::sigmoid}) {
    o.scoring = f;
    const TopkResult r = grouped_topk(f32_logits(1, 16, logits), o);
    EXPECT_EQ(ids_of(r, 0), (std::vector<std::int64_t>{5, 9, 4}));
  }
  // All equal, with a zero bias: groups 0..1 are kept, experts 0..2 chosen, equal weights.
  const std::vector<float> flat(16, 0.25f);
  const Tensor zero_bias = f32_vector(std::vector<float>(16, 0.0f));
  o.e_score_correction_bias = zero_bias;
  const TopkResult r = grouped_topk(f32_logits(1, 16, flat), o);
  EXPECT_EQ(ids_of(r, 0), (std::vector<std::int64_t>{0, 1, 2}));
  for (int k = 0; k < 3; ++k) EXPECT_NEAR(r.topk_weights.ptr<float>()[k], 1.0 / 3.0, 1e-7);
}

TEST(GroupedTopk, AllGroupsKeptEqualsPlainTopk) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t T = 30, E = 64;
  const Tensor logits = f32_logits(T, E, random_logits(rng, T, E));
  GroupedTopkOptions o;
  o.num_topk = 6;
  o.num_expert_group = 4;
  o.topk_group = 4;
  o.renormalize = true;
  const TopkResult g = grouped_topk(logits, o);
  const TopkResult p = topk_softmax(logits, 6, true);
  EXPECT_EQ(std::memcmp(g.topk_idx.data(), p.topk_idx.data(), g.topk_idx.nbytes()), 0);
  EXPECT_EQ(std::memcmp(g.topk_weights.data(), p.topk_weights.data(), g.topk_weights.nbytes()), 0);
  o.num_expert_group = 1;
  o.topk_group = 1;
  const TopkResult g1 = grouped_topk(logits, o);
  EXPECT_EQ(std::memcmp(g1.topk_idx.data(), p.topk_idx.data(), g1.topk_idx.nbytes()), 0);
}

struct GroupedCase {
  std::int64_t E;
  int groups, topk_group, K;
  bool sigmoid, bias, renormalize, bf16;
  float scale;
};

TEST(GroupedTopk, RandomMatchesReference) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::vector<GroupedCase> cases = {
      {256, 8, 4, 8, true, true, true, false, 2.5f},  // DeepSeek-V3
      {256, 8, 4, 8, true, true, true, true, 2.5f},  // DeepSeek-V3, bf16 logits
      {160, 8, 3, 6, false, false, true, false, 16.0f},  // DeepSeek-V2
      {64, 8, 3, 6, false, false, false, false, 1.0f},
      {64, 16, 2, 8, false, true, false, true, 1.0f},  // softmax with bias, all of the two groups
      {72, 9, 9, 5, true, false, true, false, 1.0f},  // every group kept
      {32, 16, 5, 1, true, true, false, false, 0.5f},  // groups of 2, K = 1
  };
  for (const GroupedCase& c : cases) {
    const std::int64_t T = 48;
    const Tensor logits =
        c.bf16 ? test::random_bf16(rng, T, c.E, 4.0f) : f32_logits(T, c.E, random_logits(rng, T, c.E));
    std::vector<float> bias;
    std::uniform_real_distribution<float> bd(-0.2f, 0.2f);
    if (c.bias)
      for (std::int64_t e = 0; e < c.E; ++e) bias.push_back(bd(rng));
    const Tensor bias_t = c.bias ? f32_vector(bias) : Tensor();
    GroupedTopkOptions o;
    o.num_topk = c.K;
    o.num_expert_group = c.groups;
    o.topk_group = c.topk_group;
    o.scoring = c.sigmoid ? ScoringFunc::sigmoid : ScoringFunc::softmax;
    o.renormalize = c.renormalize;
    o.routed_scaling_factor = c.scale;
    if (c.bias) o.e_score_correction_bias = bias_t;
    const TopkResult r = grouped_topk(logits, o);
    RouterRefOptions ro;
    ro.num_topk = c.K;
    ro.num_expert_group = c.groups;
    ro.topk_group = c.topk_group;
    ro.sigmoid = c.sigmoid;
    ro.renormalize = c.renormalize;
    ro.routed_scaling_factor = c.scale;
    for (float b : bias) ro.bias.push_back(b);
    if (c.bias) ro.tie_abs = 1e-6;
    SCOPED_TRACE("E=" + std::to_string(c.E) + " groups=" + std::to_string(c.groups) + " K=" + std::to_string(c.K));
    expect_matches_reference(r, test::router_reference(test::ref_logits_to_double(logits), T, c.E, ro), ro, c.E);
  }
}

TEST(GroupedTopk, KEqualsAllExpertsOfTheKeptGroups) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t T = 16, E = 32;
  const Tensor logits = f32_logits(T, E, random_logits(rng, T, E));
  GroupedTopkOptions o;
  o.num_topk = 16;  // 2 groups of 8 kept: every expert of both
  o.num_expert_group = 4;
  o.topk_group = 2;
  o.renormalize = true;
  const TopkResult r = grouped_topk(logits, o);
  RouterRefOptions ro;
  ro.num_topk = 16;
  ro.num_expert_group = 4;
  ro.topk_group = 2;
  ro.renormalize = true;
  expect_matches_reference(r, test::router_reference(test::ref_logits_to_double(logits), T, E, ro), ro, E);
  for (std::int64_t t = 0; t < T; ++t) {
    std::set<std::int64_t> groups;
    for (auto id : ids_of(r, t)) groups.insert(id / 8);
    EXPECT_EQ(groups.size(), 2u);
  }
}

// ---------------------------------------------------------------- errors

// Runs f, expects an epmoe::Error of `code` whose message contains every part.
template <class F>
void expect_error(F&& f, ErrorCode code, std::vector<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming " << parts.front();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const auto& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << " lacks " << p;
  }
}

TEST(RouterErrors, BadLogits) {
  const Tensor ok = Tensor::zeros(DType::fp32, {4, 8});
  const Tensor i32 = Tensor::zeros(DType::int32, {4, 8});
  const Tensor three_d = Tensor::zeros(DType::fp32, {2, 4, 8});
  const Tensor no_experts = Tensor::zeros(DType::fp32, {4, 0});
  expect_error([&] { topk_softmax(i32, 2, false); }, ErrorCode::invalid_argument,
               {"'logits'", "float32 or bfloat16", "int32[4, 8]"});
  expect_error([&] { topk_softmax(three_d, 2, false); }, ErrorCode::invalid_argument,
               {"'logits'", "2-d", "float32[2, 4, 8]"});
  expect_error([&] { topk_sigmoid(TensorView(), 2, false); }, ErrorCode::invalid_argument, {"'logits'", "None"});
  expect_error([&] { topk_sigmoid(no_experts, 1, false); }, ErrorCode::invalid_argument, {"'logits'", "E >= 1"});
  const TensorView strided(ok.data(), DType::fp32, {2, 8}, {16, 1}, Device::cpu());
  expect_error([&] { topk_softmax(strided, 2, false); }, ErrorCode::invalid_argument,
               {"'logits'", "contiguous", "[16, 1]"});
  EXPECT_NO_THROW(topk_softmax(ok, 8, false));
}

TEST(RouterErrors, BadTopk) {
  const Tensor ok = Tensor::zeros(DType::fp32, {4, 8});
  expect_error([&] { topk_softmax(ok, 0, false); }, ErrorCode::invalid_argument, {"'num_topk'", "[1, 8]", "got 0"});
  expect_error([&] { topk_sigmoid(ok, 9, false); }, ErrorCode::invalid_argument, {"'num_topk'", "[1, 8]", "got 9"});
}

TEST(RouterErrors, BadGroupedOptions) {
  const Tensor logits = Tensor::zeros(DType::fp32, {2, 64});
  GroupedTopkOptions o;
  o.num_topk = 4;
  o.num_expert_group = 6;
  o.topk_group = 2;
  expect_error([&] { grouped_topk(logits, o); }, ErrorCode::invalid_argument,
               {"'options.num_expert_group'", "divisor of E = 64", "got 6"});
  o.num_expert_group = 0;
  expect_error([&] { grouped_topk(logits, o); }, ErrorCode::invalid_argument, {"'options.num_expert_group'"});
  o.num_expert_group = 8;
  o.topk_group = 9;
  expect_error([&] { grouped_topk(logits, o); }, ErrorCode::invalid_argument,
               {"'options.topk_group'", "[1, num_expert_group = 8]", "got 9"});
  o.topk_group = 0;
  expect_error([&] { grouped_topk(logits, o); }, ErrorCode::invalid_argument, {"'options.topk_group'"});
  o.topk_group = 2;
  o.num_topk = 17;  // 2 groups of 8 experts
  expect_error([&] { grouped_topk(logits, o); }, ErrorCode::invalid_argument,
               {"'options.num_topk'", "[1, 16]", "got 17"});
  o.num_topk = 4;
  o.routed_scaling_factor = NAN;
  expect_error([&] { grouped_topk(logits, o); }, ErrorCode::invalid_argument,
               {"'options.routed_scaling_factor'", "finite"});
  o.routed_scaling_factor = 1.0f;
  const Tensor short_bias = Tensor::zeros(DType::fp32, {32});
  o.e_score_correction_bias = short_bias;
  expect_error([&] { grouped_topk(logits, o); }, ErrorCode::invalid_argument,
               {"'options.e_score_correction_bias'", "float32[64]", "float32[32]"});
  const Tensor bf16_bias = Tensor::zeros(DType::bf16, {64});
  o.e_score_correction_bias = bf16_bias;
  expect_error([&] { grouped_topk(logits, o); }, ErrorCode::invalid_argument,
               {"'options.e_score_correction_bias'", "bfloat16[64]"});
  const Tensor bias = Tensor::zeros(DType::fp32, {64});
  o.e_score_correction_bias = bias;
  o.num_expert_group = 64;  // groups of one expert have no top-2
  o.topk_group = 4;
  expect_error([&] { grouped_topk(logits, o); }, ErrorCode::invalid_argument,
               {"'options.num_expert_group'", "E / 2 = 32", "got 64"});
  o.num_expert_group = 32;
  EXPECT_NO_THROW(grouped_topk(logits, o));
}

#if !defined(EPMOE_HAVE_CUDA)
// CPU-only builds: logits on a GPU are a clear error (CUDA builds route them on the GPU).
TEST(RouterErrors, CudaLogitsInACpuOnlyBuildAreUnsupported) {
  float dummy[8] = {};
  const TensorView on_gpu(dummy, DType::fp32, {1, 8}, {8, 1}, Device::cuda(0));
  expect_error([&] { topk_softmax(on_gpu, 2, false); }, ErrorCode::unsupported,
               {"cuda:0", "built without CUDA", "'logits'"});
  expect_error([&] { grouped_topk(on_gpu, GroupedTopkOptions{.num_topk = 2}); }, ErrorCode::unsupported,
               {"cuda:0", "built without CUDA"});
}
#endif

}  // namespace
}  // namespace epmoe

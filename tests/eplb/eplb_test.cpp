// EPLB planner, routing step and load recorder (semantics §9): hand-made cases worked out in the comments,
// properties on fresh random loads, and argument errors.
#include <epmoe/eplb.hpp>

#include "support/random.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace epmoe {
namespace {

using i64 = std::int64_t;
using V = std::vector<i64>;

// E=4, P=6, one node, 2 GPUs, loads [10, 20, 40, 30].
// Replicate: slots 0..3 hold experts 0..3; slot 4 -> expert 2 (40 is the largest load per replica);
// then loads per replica are 10, 20, 20, 30, so slot 5 -> expert 3. Counts [1, 1, 2, 2].
// Pack the 6 slots (loads per replica 10, 20, 20, 15, 20, 15) onto 2 GPUs of 3: descending order with
// ties by index is 1, 2, 4, 3, 5, 0: 1 -> gpu0 (20), 2 -> gpu1 (20), 4 -> gpu0 (tie: lower gpu; 40),
// 3 -> gpu1 (35), 5 -> gpu1 (50), 0 -> gpu0 (full rooms elsewhere; 50).
// GPU 0 = slots [1, 4, 0] -> experts [1, 2, 0]; GPU 1 = slots [2, 3, 5] -> experts [2, 3, 3].
// Replica numbers: expert 2's slot 2 is replica 0 (physical 3), slot 4 is replica 1 (physical 1).
TEST(EplbPlanner, HandCaseOneNodeTwoGpus) {
  const std::vector<double> w = {10, 20, 40, 30};
  const EplbPlan plan = rebalance_experts(w, 1, 4, 6, 1, 1, 2);
  EXPECT_EQ(plan.max_replicas, 2);
  EXPECT_EQ(plan.physical_to_logical, (V{1, 2, 0, 2, 3, 3}));
  EXPECT_EQ(plan.logical_replica_count, (V{1, 1, 2, 2}));
  EXPECT_EQ(plan.logical_to_physical, (V{2, -1, 0, -1, 3, 1, 4, 5}));
}

// E=4 in G=4 groups of one, N=2 nodes of one GPU each, P=6, loads [10, 20, 40, 30].
// Groups onto nodes (2 each): order 2, 3, 1, 0: 2 -> node0 (40), 3 -> node1 (30), 1 -> node1 (50),
// 0 -> node0 (50). Node 0 holds experts [2, 0] (loads 40, 10), node 1 holds [3, 1] (30, 20).
// Node 0's 3 slots: the extra one replicates expert 2; loads per replica [20, 10, 20] packed on its one
// GPU in order 0, 2, 1 -> experts [2, 2, 0]. Node 1: extra -> expert 3; loads [15, 20, 15], order 1, 0, 2
// -> experts [1, 3, 3].
TEST(EplbPlanner, HandCaseHierarchicalTwoNodes) {
  const std::vector<double> w = {10, 20, 40, 30};
  const EplbPlan plan = rebalance_experts(w, 1, 4, 6, 4, 2, 2);
  EXPECT_EQ(plan.physical_to_logical, (V{2, 2, 0, 1, 3, 3}));
  EXPECT_EQ(plan.logical_replica_count, (V{1, 1, 2, 2}));
  EXPECT_EQ(plan.logical_to_physical, (V{2, -1, 3, -1, 0, 1, 4, 5}));
}

// Equal loads: every tie goes to the lower index. E=2, P=4, one GPU: slot 2 -> expert 0 (tie), then
// loads per replica 0.5, 1 -> slot 3 -> expert 1. One GPU of 4: order (loads 0.5, 0.5, 0.5, 0.5) is the
// identity, so the slots stay as made.
TEST(EplbPlanner, TiesGoToLowerIndex) {
  const std::vector<double> w = {1, 1};
  const EplbPlan plan = rebalance_experts(w, 1, 2, 4, 1, 1, 1);
  EXPECT_EQ(plan.physical_to_logical, (V{0, 1, 0, 1}));
  EXPECT_EQ(plan.logical_to_physical, (V{0, 2, 1, 3}));
}

struct Config {
  i64 L, E, P, G, N, M;
};

std::vector<double> skewed_loads(std::mt19937_64& rng, i64 n) {
  // Token counts with a heavy tail (log-normal), some experts idle.
  std::lognormal_distribution<double> d(4.0, 1.5);
  std::uniform_int_distribution<int> idle(0, 9);
  std::vector<double> w(static_cast<size_t>(n));
  for (auto& x : w) x = idle(rng) == 0 ? 0.0 : std::floor(d(rng));
  w[0] += 1;  // never all zeros
  return w;
}

// Max over GPUs of the summed load per replica of its slots.
double max_gpu_load(const std::vector<double>& w, const i64* p2l, const std::vector<i64>& count, i64 P, i64 M) {
  double most = 0;
  for (i64 g = 0; g < M; ++g) {
    double s = 0;
    for (i64 p = g * (P / M); p < (g + 1) * (P / M); ++p) s += w[p2l[p]] / static_cast<double>(count[p2l[p]]);
    most = std::max(most, s);
  }
  return most;
}

TEST(EplbPlanner, PropertiesOnRandomLoads) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::vector<Config> configs = {
      {3, 16, 24, 4, 2, 4}, {2, 64, 80, 8, 4, 8}, {2, 32, 48, 8, 1, 4}, {2, 24, 32, 3, 2, 4},  // last: global
      {2, 8, 8, 2, 2, 8},   {2, 12, 16, 4, 2, 2}, {4, 256, 288, 8, 4, 32}};
  std::vector<double> sum_eplb(configs.size(), 0.0), sum_naive(configs.size(), 0.0);
  for (int round = 0; round < 20; ++round) {
    for (size_t ci = 0; ci < configs.size(); ++ci) {
      const Config& c = configs[ci];
      SCOPED_TRACE(::testing::Message() << "round " << round << " L=" << c.L << " E=" << c.E << " P=" << c.P
                                        << " G=" << c.G << " N=" << c.N << " M=" << c.M);
      const std::vector<double> w = skewed_loads(rng, c.L * c.E);
      const EplbPlan plan = rebalance_experts(w, c.L, c.E, c.P, c.G, c.N, c.M);
      const i64 X = plan.max_replicas;
      ASSERT_EQ(X, *std::max_element(plan.logical_replica_count.begin(), plan.logical_replica_count.end()));
      const bool hierarchical = c.G % c.N == 0;
      for (i64 l = 0; l < c.L; ++l) {
        const i64* p2l = plan.physical_to_logical.data() + l * c.P;
        const i64* cnt = plan.logical_replica_count.data() + l * c.E;
        const i64* l2p = plan.logical_to_physical.data() + l * c.E * X;
        // Counts: >= 1 each, sum P, and equal to the slots holding the expert.
        std::vector<i64> seen(static_cast<size_t>(c.E), 0);
        for (i64 p = 0; p < c.P; ++p) {
          ASSERT_GE(p2l[p], 0);
          ASSERT_LT(p2l[p], c.E);
          ++seen[p2l[p]];
        }
        i64 total = 0;
        for (i64 e = 0; e < c.E; ++e) {
          EXPECT_GE(cnt[e], 1);
          EXPECT_EQ(cnt[e], seen[e]);
          total += cnt[e];
          // logical_to_physical lists exactly the expert's slots, then -1.
          for (i64 r = 0; r < X; ++r) {
            const i64 p = l2p[e * X + r];
            if (r < cnt[e]) {
              ASSERT_GE(p, 0);
              EXPECT_EQ(p2l[p], e);
            } else {
              EXPECT_EQ(p, -1);
            }
          }
        }
        EXPECT_EQ(total, c.P);
        // Each slot appears once in logical_to_physical (so the two maps are inverse).
        std::vector<int> hits(static_cast<size_t>(c.P), 0);
        for (i64 i = 0; i < c.E * X; ++i)
          if (l2p[i] >= 0) ++hits[l2p[i]];
        for (i64 p = 0; p < c.P; ++p) EXPECT_EQ(hits[p], 1) << "slot " << p;
        // Hierarchical: each group's replicas on one node.
        if (hierarchical) {
          const i64 gs = c.E / c.G, pn = c.P / c.N;
          std::vector<i64> node_of_group(static_cast<size_t>(c.G), -1);
          for (i64 p = 0; p < c.P; ++p) {
            const i64 g = p2l[p] / gs;
            if (node_of_group[g] < 0) node_of_group[g] = p / pn;
            EXPECT_EQ(node_of_group[g], p / pn) << "group " << g << " slot " << p;
          }
        }
        // Against round-robin placement within the plan's nodes: node n's P/N slots hold its experts (ascending
        // ids) in turn, slot j -> j mod (E/N); with one node, plain round-robin (slot p holds expert p mod E).
        // Both policies are greedy heuristics, so the sum over the draws is asserted: they win on average. The
        // global one also loses on a few draws (measured: a few draws in 10^4 of the 3-groups-on-2-nodes config,
        // by at most 5.5% over 80,000 draws), so per draw it is held to 1.25x round-robin, a bound a broken planner
        // passes only by chance. The hierarchical one, on few slots per node, loses on ~20% of draws with 4
        // groups on 2 nodes, by up to ~15% (more often against plain round-robin, as it keeps each group on one
        // node): no per-draw bound.
        const i64 nodes = hierarchical ? c.N : 1, pn = c.P / nodes, en = c.E / nodes;
        std::vector<i64> rr(static_cast<size_t>(c.P)), rr_cnt(static_cast<size_t>(c.E), 0);
        for (i64 n = 0; n < nodes; ++n) {
          std::vector<i64> experts;
          for (i64 p = n * pn; p < (n + 1) * pn; ++p) experts.push_back(p2l[p]);
          std::sort(experts.begin(), experts.end());
          experts.erase(std::unique(experts.begin(), experts.end()), experts.end());
          ASSERT_EQ(static_cast<i64>(experts.size()), en);
          for (i64 j = 0; j < pn; ++j) ++rr_cnt[rr[n * pn + j] = experts[j % en]];
        }
        const std::vector<double> wl(w.begin() + l * c.E, w.begin() + (l + 1) * c.E);
        const std::vector<i64> cv(cnt, cnt + c.E);
        const double mine = max_gpu_load(wl, p2l, cv, c.P, c.M);
        const double naive = max_gpu_load(wl, rr.data(), rr_cnt, c.P, c.M);
        sum_eplb[ci] += mine;
        sum_naive[ci] += naive;
        if (!hierarchical || c.N == 1) EXPECT_LE(mine, naive * 1.25);
      }
      if (!hierarchical) {  // global policy == one group on one node
        const EplbPlan flat = rebalance_experts(w, c.L, c.E, c.P, 1, 1, c.M);
        EXPECT_EQ(plan.physical_to_logical, flat.physical_to_logical);
        EXPECT_EQ(plan.logical_to_physical, flat.logical_to_physical);
      }
    }
  }
  for (size_t ci = 0; ci < configs.size(); ++ci) EXPECT_LE(sum_eplb[ci], sum_naive[ci]) << "config " << ci;
}

TEST(EplbPlanner, EmptyLayersGiveEmptyPlan) {
  const EplbPlan plan = rebalance_experts({}, 0, 4, 4, 1, 1, 1);
  EXPECT_TRUE(plan.physical_to_logical.empty());
  EXPECT_TRUE(plan.logical_replica_count.empty());
}

void expect_names(const std::function<void()>& f, const std::string& name) {
  try {
    f();
    ADD_FAILURE() << "no error for '" << name << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("'" + name + "'"), std::string::npos) << e.what();
  }
}

TEST(EplbPlanner, BadArgumentsNameThemselves) {
  const std::vector<double> w(8, 1.0);  // L=2, E=4
  expect_names([&] { rebalance_experts(w, 2, 4, 8, 1, 1, 3); }, "num_replicas");   // 8 % 3
  expect_names([&] { rebalance_experts(w, 2, 4, 3, 1, 1, 1); }, "num_replicas");   // P < E
  for (long long huge : {1ll << 31, 1ll << 40})  // not a bad_alloc: named before any table is made
    expect_names([&] { rebalance_experts(w, 2, 4, huge, 1, 1, 2); }, "num_replicas");
  expect_names([&] { rebalance_experts(w, 2, 4, 8, 3, 1, 2); }, "num_groups");     // 4 % 3
  expect_names([&] { rebalance_experts(w, 2, 4, 8, 0, 1, 2); }, "num_groups");
  expect_names([&] { rebalance_experts(w, 2, 4, 8, 2, 2, 3); }, "num_gpus");       // 3 % 2
  expect_names([&] { rebalance_experts(w, 2, 4, 8, 2, 0, 2); }, "num_nodes");
  expect_names([&] { rebalance_experts(w, 2, 4, 8, 2, 1, 0); }, "num_gpus");
  expect_names([&] { rebalance_experts(w, 3, 4, 8, 2, 1, 2); }, "weight");         // size 8 != 12
  expect_names([&] { rebalance_experts(w, -1, 4, 8, 2, 1, 2); }, "num_layers");
  expect_names([&] { rebalance_experts(w, 2, 0, 8, 1, 1, 2); }, "num_logical_experts");
  std::vector<double> bad = w;
  bad[5] = -1;
  expect_names([&] { rebalance_experts(bad, 2, 4, 8, 2, 1, 2); }, "weight");
  bad[5] = std::nan("");
  expect_names([&] { rebalance_experts(bad, 2, 4, 8, 2, 1, 2); }, "weight");
}

// The hand plan of HandCaseOneNodeTwoGpus: expert 0 -> [2], 1 -> [0], 2 -> [3, 1], 3 -> [4, 5].
// Token t takes replica t mod count: token 0: [2, 3, -1] -> [3, 4, -1]; token 1: [2, 0, 3] -> [1, 2, 5];
// token 2: [-1, 1, 2] -> [-1, 0, 3].
TEST(EplbRouting, HandCaseReplicaByTokenIndex) {
  const std::vector<double> w = {10, 20, 40, 30};
  const EplbPlan plan = rebalance_experts(w, 1, 4, 6, 1, 1, 2);
  for (DType dt : {DType::int64, DType::int32}) {
    Tensor idx = Tensor::empty(dt, {3, 3});
    const i64 in[9] = {2, 3, -1, 2, 0, 3, -1, 1, 2};
    for (int i = 0; i < 9; ++i) {
      if (dt == DType::int64) idx.ptr<std::int64_t>()[i] = in[i];
      else idx.ptr<std::int32_t>()[i] = static_cast<std::int32_t>(in[i]);
    }
    const Tensor out = map_to_physical(idx, plan, 0);
    ASSERT_EQ(out.dtype(), dt);
    const i64 want[9] = {3, 4, -1, 1, 2, 5, -1, 0, 3};
    for (int i = 0; i < 9; ++i)
      EXPECT_EQ(dt == DType::int64 ? out.ptr<std::int64_t>()[i] : out.ptr<std::int32_t>()[i], want[i]) << i;
  }
}

TEST(EplbLogicalLoads, HandCaseSumsEachExpertsReplicas) {
  const std::vector<double> w = {10, 20, 40, 30};
  const EplbPlan plan = rebalance_experts(w, 1, 4, 6, 1, 1, 2);
  ASSERT_EQ(plan.physical_to_logical, (std::vector<i64>{1, 2, 0, 2, 3, 3}));  // as the routing hand case implies
  const std::vector<i64> physical = {5, 7, 11, 13, 17, 19};
  EXPECT_EQ(logical_loads(plan, physical), (std::vector<i64>{11, 5, 20, 36}));
}

TEST(EplbLogicalLoads, CountsOfMappedIdsFoldBackToTheLogicalCounts) {
  const std::uint64_t seed = test::fresh_seed();
  std::mt19937_64 rng(seed);
  constexpr i64 L = 3, E = 16, P = 24, T = 257, K = 4;
  std::vector<double> w(L * E);
  for (double& v : w) v = static_cast<double>(rng() % 1000);
  const EplbPlan plan = rebalance_experts(w, L, E, P, 4, 1, 4);
  std::vector<i64> physical(L * P, 0), want(L * E, 0);
  for (i64 l = 0; l < L; ++l) {
    const Tensor idx = test::random_topk_idx(rng, T, K, E);
    const Tensor phy = map_to_physical(idx, plan, l);
    for (i64 i = 0; i < T * K; ++i) {
      const i64 e = idx.ptr<std::int64_t>()[i], p = phy.ptr<std::int64_t>()[i];
      if (e < 0) continue;
      ++want[static_cast<std::size_t>(l * E + e)];
      ++physical[static_cast<std::size_t>(l * P + p)];
    }
  }
  EXPECT_EQ(logical_loads(plan, physical), want) << "seed " << seed;
}

TEST(EplbLogicalLoads, BadArgumentsNameThemselves) {
  const std::vector<double> w = {10, 20, 40, 30};
  const EplbPlan plan = rebalance_experts(w, 1, 4, 6, 1, 1, 2);
  const auto message = [&](const std::vector<i64>& loads) {
    try {
      (void)logical_loads(plan, loads);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const std::string size = message({1, 2, 3});
  EXPECT_NE(size.find("physical_loads"), std::string::npos) << size;
  EXPECT_NE(size.find("6 entries"), std::string::npos) << size;
  const std::string negative = message({1, 2, 3, -4, 5, 6});
  EXPECT_NE(negative.find("-4 at [0, 3]"), std::string::npos) << negative;
}

TEST(EplbRouting, RandomIdsMapIntoTheirExpertsReplicas) {
  std::mt19937_64 rng(test::fresh_seed());
  const i64 L = 2, E = 16, P = 24;
  const std::vector<double> w = skewed_loads(rng, L * E);
  const EplbPlan plan = rebalance_experts(w, L, E, P, 4, 2, 4);
  test::RoutingOptions o;
  o.p_minus_one = 0.2;
  const Tensor idx = test::random_topk_idx(rng, 50, 4, static_cast<int>(E), o);
  for (i64 layer = 0; layer < L; ++layer) {
    const Tensor out = map_to_physical(idx, plan, layer);
    std::vector<std::vector<i64>> used(static_cast<size_t>(E));
    for (i64 i = 0; i < idx.numel(); ++i) {
      const i64 e = idx.ptr<std::int64_t>()[i], p = out.ptr<std::int64_t>()[i];
      if (e < 0) {
        EXPECT_EQ(p, -1);
        continue;
      }
      ASSERT_GE(p, 0);
      ASSERT_LT(p, P);
      EXPECT_EQ(plan.physical_to_logical[layer * P + p], e);
      const i64 t = i / 4, r = t % plan.logical_replica_count[layer * E + e];
      EXPECT_EQ(p, plan.logical_to_physical[(layer * E + e) * plan.max_replicas + r]);
    }
  }
}

TEST(EplbRouting, BadArgumentsNameThemselves) {
  const std::vector<double> w = {10, 20, 40, 30};
  const EplbPlan plan = rebalance_experts(w, 1, 4, 6, 1, 1, 2);
  Tensor idx = Tensor::zeros(DType::int64, {2, 2});
  expect_names([&] { map_to_physical(idx, plan, 1); }, "layer");
  expect_names([&] { map_to_physical(Tensor::zeros(DType::fp32, {2, 2}), plan, 0); }, "topk_idx");
  expect_names([&] { map_to_physical(Tensor::zeros(DType::int64, {4}), plan, 0); }, "topk_idx");
  idx.ptr<std::int64_t>()[3] = 4;
  expect_names([&] { map_to_physical(idx, plan, 0); }, "topk_idx");
  idx.ptr<std::int64_t>()[3] = -2;
  expect_names([&] { map_to_physical(idx, plan, 0); }, "topk_idx");
  idx.ptr<std::int64_t>()[3] = 0;
  std::vector<i64> l2p = plan.logical_to_physical, cnt = plan.logical_replica_count;
  expect_names([&] { map_to_physical(idx, std::span(l2p).first(5), cnt, 1, 4, 2, 0); }, "logical_to_physical");
  expect_names([&] { map_to_physical(idx, l2p, std::span(cnt).first(3), 1, 4, 2, 0); }, "logical_replica_count");
  cnt[1] = 0;
  expect_names([&] { map_to_physical(idx, l2p, cnt, 1, 4, 2, 0); }, "logical_replica_count");
  cnt[1] = 2;  // replica 1 of expert 1 is -1
  expect_names([&] { map_to_physical(idx, l2p, cnt, 1, 4, 2, 0); }, "logical_to_physical");
}

Tensor counts(std::vector<std::int32_t> v) {
  Tensor t = Tensor::empty(DType::int32, {static_cast<i64>(v.size())});
  std::copy(v.begin(), v.end(), t.ptr<std::int32_t>());
  return t;
}

// L=3, E=4, R=2 ranks (experts 0-1 on rank 0, 2-3 on rank 1), window 2.
// Layer 0 records [1,2,3,4], [5,0,0,1], [2,2,2,2]: the window keeps the last two -> [7, 2, 2, 3];
// ranks 9 and 5: balancedness mean 7 / max 9. Layer 1 records [0,0,0,8]: ranks 0 and 8 -> 4 / 8 = 0.5.
// Layer 2 has no records: loads 0, balancedness 1.
TEST(ExpertLoadRecorder, WindowedSumsAndBalancedness) {
  ExpertLoadRecorder rec(3, 4, 2, 2);
  rec.record(0, counts({1, 2, 3, 4}));
  EXPECT_EQ(rec.loads(), (V{1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0}));
  rec.record(0, counts({5, 0, 0, 1}));
  rec.record(1, counts({0, 0, 0, 8}));
  rec.record(0, counts({2, 2, 2, 2}));
  EXPECT_EQ(rec.loads(), (V{7, 2, 2, 3, 0, 0, 0, 8, 0, 0, 0, 0}));
  EXPECT_EQ(rec.num_records(), (V{2, 1, 0}));
  const std::vector<double> b = rec.balancedness();
  ASSERT_EQ(b.size(), 3u);
  EXPECT_DOUBLE_EQ(b[0], 7.0 / 9.0);
  EXPECT_DOUBLE_EQ(b[1], 0.5);
  EXPECT_DOUBLE_EQ(b[2], 1.0);
  const std::string j = rec.to_json();
  EXPECT_NE(j.find("\"loads\":[[7,2,2,3],[0,0,0,8],[0,0,0,0]]"), std::string::npos) << j;
  EXPECT_NE(j.find("\"num_records\":[2,1,0]"), std::string::npos) << j;
  rec.reset();
  EXPECT_EQ(rec.loads(), V(12, 0));
}

TEST(ExpertLoadRecorder, RandomRecordsMatchSumOfLastWindow) {
  std::mt19937_64 rng(test::fresh_seed());
  const i64 E = 8, W = 3;
  ExpertLoadRecorder rec(1, E, 4, W);
  std::vector<std::vector<std::int32_t>> all;
  std::uniform_int_distribution<std::int32_t> d(0, 1000);
  for (int step = 0; step < 10; ++step) {
    std::vector<std::int32_t> v(static_cast<size_t>(E));
    for (auto& x : v) x = d(rng);
    all.push_back(v);
    rec.record(0, counts(v));
    V want(static_cast<size_t>(E), 0);
    for (size_t s = all.size() > W ? all.size() - W : 0; s < all.size(); ++s)
      for (i64 e = 0; e < E; ++e) want[e] += all[s][e];
    EXPECT_EQ(rec.loads(), want) << "step " << step;
  }
}

TEST(ExpertLoadRecorder, BadArgumentsNameThemselves) {
  expect_names([] { ExpertLoadRecorder(0, 4, 2, 1); }, "num_layers");
  expect_names([] { ExpertLoadRecorder(1, 0, 1, 1); }, "num_experts");
  expect_names([] { ExpertLoadRecorder(1, 4, 3, 1); }, "num_ranks");
  expect_names([] { ExpertLoadRecorder(1, 4, 2, 0); }, "window");
  ExpertLoadRecorder rec(2, 4, 2, 2);
  expect_names([&] { rec.record(2, counts({1, 1, 1, 1})); }, "layer");
  expect_names([&] { rec.record(0, counts({1, 1, 1})); }, "num_tokens_per_expert");
  expect_names([&] { rec.record(0, Tensor::zeros(DType::fp32, {4})); }, "num_tokens_per_expert");
  expect_names([&] { rec.record(0, counts({1, -1, 1, 1})); }, "num_tokens_per_expert");
  EXPECT_EQ(rec.loads(), V(8, 0));  // rejected records leave no trace
}

}  // namespace
}  // namespace epmoe

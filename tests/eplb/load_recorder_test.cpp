// ExpertLoadRecorder's per-rank records (record_local), global loads over thread ranks, load_balancedness and the
// JSON of the global loads (semantics §9): hand-made cases and random records against sums made here.
#include <epmoe/eplb.hpp>
#include <epmoe/error.hpp>
#include <epmoe/group.hpp>

#include "support/random.hpp"

#include <gtest/gtest.h>

#include <functional>
#include <random>
#include <string>
#include <vector>

namespace epmoe {
namespace {

using i64 = std::int64_t;
using V = std::vector<i64>;

Tensor counts32(const std::vector<std::int32_t>& v) {
  Tensor t = Tensor::empty(DType::int32, {static_cast<i64>(v.size())});
  std::copy(v.begin(), v.end(), t.ptr<std::int32_t>());
  return t;
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

// E=6, R=3 (2 experts per rank), window 2. record_local(0, [3, 1], 2) is the record [0, 0, 3, 1, 0, 0].
TEST(ExpertLoadRecorderLocal, OffsetsPlaceTheCountsAndTheWindowDropsTheOldest) {
  ExpertLoadRecorder rec(1, 6, 3, 2);
  rec.record_local(0, counts32({3, 1}), 2);
  EXPECT_EQ(rec.loads(), (V{0, 0, 3, 1, 0, 0}));
  rec.record_local(0, counts32({5, 0}), 4);
  EXPECT_EQ(rec.loads(), (V{0, 0, 3, 1, 5, 0}));
  rec.record_local(0, counts32({7, 7}), 0);  // the first record drops out
  EXPECT_EQ(rec.loads(), (V{7, 7, 0, 0, 5, 0}));
  EXPECT_EQ(rec.num_records(), (V{2}));
  // int64 counts with a stride (every other element of [4, 9, 2, 9]): [4, 2] at experts 1, 2.
  Tensor strided = Tensor::empty(DType::int64, {4});
  const i64 vals[] = {4, 9, 2, 9};
  std::copy(vals, vals + 4, strided.ptr<i64>());
  TensorView v = strided.view();
  v.shape = Shape{2};
  v.strides[0] = 2;
  rec.record_local(0, v, 1);
  EXPECT_EQ(rec.loads(), (V{7, 11, 2, 0, 0, 0}));
  // A rank with no local experts to report: an empty record still counts as one (and drops one out).
  rec.record_local(0, counts32({}), 0);
  EXPECT_EQ(rec.loads(), (V{0, 4, 2, 0, 0, 0}));
}

TEST(ExpertLoadRecorderLocal, BadArgumentsNameThemselvesAndLeaveNoTrace) {
  ExpertLoadRecorder rec(2, 4, 2, 2);
  expect_names([&] { rec.record_local(0, counts32({1, 1}), 3); }, "expert_offset");   // 3 + 2 > 4
  expect_names([&] { rec.record_local(0, counts32({1, 1}), -1); }, "expert_offset");
  expect_names([&] { rec.record_local(0, counts32({1, 1, 1, 1, 1}), 0); }, "num_recv_tokens_per_expert");
  expect_names([&] { rec.record_local(0, counts32({1, -2}), 0); }, "num_recv_tokens_per_expert");
  expect_names([&] { rec.record_local(0, Tensor::zeros(DType::fp32, {2}), 0); }, "num_recv_tokens_per_expert");
  expect_names([&] { rec.record_local(2, counts32({1, 1}), 0); }, "layer");
  EXPECT_EQ(rec.loads(), V(8, 0));
  EXPECT_EQ(rec.num_records(), V(2, 0));
  expect_names([] { load_balancedness(V(7, 0), 2, 4, 2); }, "loads");
  expect_names([] { load_balancedness(V(8, 0), 2, 4, 3); }, "num_ranks");
  EXPECT_EQ(ExpertLoadRecorder(1, 4, 2, 1).device(), Device::cpu());
}

// Loads [[1, 2, 3, 4], [0, 0, 0, 0]] over R=2: ranks 3 and 7 -> mean 5 / max 7; a layer with no tokens -> 1.
TEST(ExpertLoadRecorderLocal, LoadBalancednessHandCase) {
  const std::vector<double> b = load_balancedness(V{1, 2, 3, 4, 0, 0, 0, 0}, 2, 4, 2);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_DOUBLE_EQ(b[0], 5.0 / 7.0);
  EXPECT_DOUBLE_EQ(b[1], 1.0);
}

// Thread ranks each record their own experts' random counts; global_loads sums them all (as written here), and
// to_json(group) dumps the global loads and their balancedness.
TEST(ExpertLoadRecorderLocal, GlobalLoadsSumEveryRanksRecordsOverThreadRanks) {
  for (int R : {1, 2, 4}) {
    const std::uint64_t seed = test::fresh_seed();
    const i64 L = 2, e_local = 3, E = e_local * R, W = 2;
    constexpr int kSteps = 4;
    // counts[step][layer][rank]: e_local values in [0, 50].
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<std::int32_t> d(0, 50);
    std::vector<std::vector<std::vector<std::vector<std::int32_t>>>> counts(kSteps);
    for (auto& s : counts) {
      s.resize(L);
      for (auto& l : s) {
        l.resize(R);
        for (auto& r : l)
          for (int e = 0; e < e_local; ++e) r.push_back(d(rng));
      }
    }
    V want(L * E, 0);
    for (int s = kSteps - W; s < kSteps; ++s)
      for (i64 l = 0; l < L; ++l)
        for (int r = 0; r < R; ++r)
          for (int e = 0; e < e_local; ++e) want[l * E + r * e_local + e] += counts[s][l][r][e];
    std::vector<V> got(R);
    std::vector<std::string> json(R);
    run_thread_ranks(R, [&](Group& g) {
      const int r = g.rank();
      ExpertLoadRecorder rec(L, E, R, W);
      for (int s = 0; s < kSteps; ++s)
        for (i64 l = 0; l < L; ++l) rec.record_local(l, counts32(counts[s][l][r]), r * e_local);
      got[r] = rec.global_loads(g);
      json[r] = rec.to_json(g);
    });
    for (int r = 0; r < R; ++r) {
      EXPECT_EQ(got[r], want) << "R " << R << " rank " << r << " seed " << seed;
      std::string rows = "\"loads\":[";
      for (i64 l = 0; l < L; ++l) {
        rows += l ? ",[" : "[";
        for (i64 e = 0; e < E; ++e) rows += (e ? "," : "") + std::to_string(want[l * E + e]);
        rows += "]";
      }
      EXPECT_NE(json[r].find(rows + "]"), std::string::npos) << json[r];
      EXPECT_NE(json[r].find("\"num_records\":[2,2]"), std::string::npos) << json[r];
    }
  }
}

TEST(ExpertLoadRecorderLocal, GlobalLoadsRefuseRanksOfDifferentShapes) {
  std::vector<ErrorCode> codes(2, ErrorCode::internal);
  run_thread_ranks_collect(2, [&](Group& g) {
    ExpertLoadRecorder rec(1, g.rank() == 0 ? 4 : 6, 2, 1);
    try {
      rec.global_loads(g);
    } catch (const Error& e) {
      codes[g.rank()] = e.code();
    }
  });
  EXPECT_EQ(codes[0], ErrorCode::rank_mismatch);
  EXPECT_EQ(codes[1], ErrorCode::rank_mismatch);
}

}  // namespace
}  // namespace epmoe

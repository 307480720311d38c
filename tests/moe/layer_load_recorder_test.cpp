// MoELayer feeding an ExpertLoadRecorder (semantics §9) on CPU thread ranks (R = 1, 2, 4), in every mode: the
// recorded loads against counts made by hand from every rank's topk_idx (-1 skipped), over a window, with a rank
// of zero tokens, automatic mode alternating the two halves, and rebalance_experts on the result.
#include <epmoe/eplb.hpp>
#include <epmoe/moe.hpp>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "support/random.hpp"

namespace epmoe {
namespace {

using test::fresh_seed;
using i64 = std::int64_t;
using V = std::vector<i64>;

constexpr int kE = 8, kK = 3;
constexpr i64 kH = 128, kN = 32;

struct Weights {
  Tensor w1, w2;  // all experts: [E, 2N, H], [E, H, N]
};

Weights make_weights(std::mt19937_64& rng) {
  Weights w;
  Tensor w1 = test::random_bf16(rng, kE * 2 * kN, kH, 1.0f / std::sqrt(static_cast<float>(kH)));
  Tensor w2 = test::random_bf16(rng, kE * kH, kN, 1.0f / std::sqrt(static_cast<float>(kN)));
  w.w1 = Tensor::wrap(TensorView(w1.data(), DType::bf16, {kE, 2 * kN, kH}), std::make_shared<Tensor>(w1));
  w.w2 = Tensor::wrap(TensorView(w2.data(), DType::bf16, {kE, kH, kN}), std::make_shared<Tensor>(w2));
  return w;
}

struct Batch {
  Tensor x, topk_idx, topk_weights;
};

Batch make_batch(std::mt19937_64& rng, i64 T) {
  test::RoutingOptions o;
  o.p_minus_one = 0.25;  // -1 choices are not counted
  Batch b{test::random_bf16(rng, T, kH), test::random_topk_idx(rng, T, kK, kE, o), {}};
  b.topk_weights = test::random_topk_weights(rng, b.topk_idx);
  return b;
}

// The hand count: tokens choosing each expert, -1 skipped.
V hand_count(const Tensor& topk_idx) {
  V c(kE, 0);
  for (i64 i = 0; i < topk_idx.numel(); ++i)
    if (const i64 e = topk_idx.ptr<i64>()[i]; e >= 0) ++c[static_cast<size_t>(e)];
  return c;
}

MoEForwardArgs forward_args(const Batch& b, const Weights& w, int rank, int R) {
  const int e_local = kE / R;
  MoEForwardArgs a;
  a.hidden = b.x;
  a.w1 = w.w1.view().slice_rows(rank * e_local, (rank + 1) * e_local);
  a.w2 = w.w2.view().slice_rows(rank * e_local, (rank + 1) * e_local);
  a.topk_idx = b.topk_idx;
  a.topk_weights = b.topk_weights;
  a.global_num_experts = kE;
  return a;
}

std::shared_ptr<Experts> experts_of(ActivationFormat f) {
  ExpertsConfig c;
  c.format = f;
  return std::shared_ptr<Experts>(make_reference_experts(c));
}

constexpr int kTmax = 24;
constexpr i64 kLayers = 2, kWindow = 3;
constexpr int kSteps = 5;

// Each step's batches: [step][layer][rank]. The last rank has no tokens on step 1 (when R > 1).
std::vector<std::vector<std::vector<Batch>>> make_steps(std::mt19937_64& rng, int R) {
  std::vector<std::vector<std::vector<Batch>>> steps(kSteps);
  for (int s = 0; s < kSteps; ++s) {
    steps[s].resize(kLayers);
    for (i64 l = 0; l < kLayers; ++l)
      for (int r = 0; r < R; ++r) {
        const i64 T = R > 1 && r == R - 1 && s == 1 ? 0 : 1 + static_cast<i64>(rng() % kTmax);
        steps[s][l].push_back(make_batch(rng, T));
      }
  }
  return steps;
}

// Global loads [L, E] of the window after `done` steps, by hand: every rank's hand counts of the last kWindow steps.
V expected_global(const std::vector<std::vector<std::vector<Batch>>>& steps, int done, int R) {
  V want(kLayers * kE, 0);
  for (int s = std::max(0, done - static_cast<int>(kWindow)); s < done; ++s)
    for (i64 l = 0; l < kLayers; ++l)
      for (int r = 0; r < R; ++r) {
        const V c = hand_count(steps[s][l][r].topk_idx);
        for (int e = 0; e < kE; ++e) want[l * kE + e] += c[e];
      }
  return want;
}

// Rank r's record: its own experts' slice of the global loads, zeros elsewhere.
V rank_slice(const V& global, int r, int R) {
  V out(global.size(), 0);
  const int e_local = kE / R;
  for (i64 l = 0; l < kLayers; ++l)
    for (int e = r * e_local; e < (r + 1) * e_local; ++e) out[l * kE + e] = global[l * kE + e];
  return out;
}

// Runs kSteps forwards of two layers (one recorder, layer indices 0 and 1) on R thread ranks in `mode` and checks
// after every step: each rank's loads() = its slice of the hand count, global_loads = the hand count.
// all_gather: the layers run make_all_gather_prepare_finalize instead (mode normal), whose received counts cover the
// rank's experts over every rank's tokens.
void run_mode(int R, DispatchMode mode, bool all_gather = false) {
  const std::uint64_t seed = fresh_seed();
  std::mt19937_64 rng(seed);
  const Weights w = make_weights(rng);
  const auto steps = make_steps(rng, R);
  std::vector<V> final_global(R);
  run_thread_ranks(R, [&](Group& g) {
    const int r = g.rank();
    std::shared_ptr<Group> group(std::shared_ptr<Group>{}, &g);
    auto buffer = std::make_shared<Buffer>(group);
    auto recorder = std::make_shared<ExpertLoadRecorder>(kLayers, kE, R, kWindow);
    std::vector<std::unique_ptr<MoELayer>> layers;
    for (i64 l = 0; l < kLayers; ++l) {
      if (all_gather)
        layers.push_back(std::make_unique<MoELayer>(make_all_gather_prepare_finalize(group),
                                                    experts_of(ActivationFormat::standard)));
      else
        layers.push_back(std::make_unique<MoELayer>(buffer, mode, kTmax, experts_of(ActivationFormat::standard),
                                                    experts_of(ActivationFormat::batched_experts)));
      layers.back()->set_load_recorder(recorder, l);
      EXPECT_EQ(layers.back()->load_recorder_layer(), l);
    }
    for (int s = 0; s < kSteps; ++s) {
      for (i64 l = 0; l < kLayers; ++l) {
        MoEForwardArgs a = forward_args(steps[s][l][r], w, r, R);
        // Automatic: prefill (normal) on even steps, decode (low_latency) on odd ones.
        if (mode == DispatchMode::automatic) a.is_extend_in_batch = s % 2 == 0;
        layers[l]->forward(a);
        if (mode == DispatchMode::automatic)
          EXPECT_EQ(layers[l]->last_resolved_mode(), s % 2 == 0 ? DispatchMode::normal : DispatchMode::low_latency);
      }
      const V want = expected_global(steps, s + 1, R);
      EXPECT_EQ(recorder->loads(), rank_slice(want, r, R)) << "rank " << r << " step " << s << " seed " << seed;
      EXPECT_EQ(recorder->num_records(), V(kLayers, std::min<i64>(s + 1, kWindow)));
      EXPECT_EQ(recorder->global_loads(g), want) << "rank " << r << " step " << s << " seed " << seed;
    }
    final_global[r] = recorder->global_loads(g);
    // Detached: forwards record nothing more.
    layers[0]->set_load_recorder(nullptr, 0);
    EXPECT_EQ(layers[0]->load_recorder(), nullptr);
    MoEForwardArgs a = forward_args(steps[0][0][r], w, r, R);
    a.is_extend_in_batch = true;
    layers[0]->forward(a);
    EXPECT_EQ(recorder->global_loads(g), final_global[r]);
  });
  // The planner on the recorded loads: the plan made from the hand count, and every slot filled.
  const V want = expected_global(steps, kSteps, R);
  for (int r = 0; r < R; ++r) EXPECT_EQ(final_global[r], want);
  const std::vector<double> weight(want.begin(), want.end());
  const std::vector<double> recorded(final_global[0].begin(), final_global[0].end());
  const i64 P = kE + 2 * R;  // two spare slots per rank
  const EplbPlan plan = rebalance_experts(recorded, kLayers, kE, P, 1, 1, R);
  const EplbPlan from_hand = rebalance_experts(weight, kLayers, kE, P, 1, 1, R);
  EXPECT_EQ(plan.physical_to_logical, from_hand.physical_to_logical);
  EXPECT_EQ(plan.logical_replica_count, from_hand.logical_replica_count);
  for (i64 l = 0; l < kLayers; ++l) {
    i64 slots = 0;
    for (int e = 0; e < kE; ++e) slots += plan.logical_replica_count[l * kE + e];
    EXPECT_EQ(slots, P);
  }
  // Balancedness of the global loads, by hand.
  const std::vector<double> b = load_balancedness(final_global[0], kLayers, kE, R);
  for (i64 l = 0; l < kLayers; ++l) {
    double total = 0, most = 0;
    for (int r = 0; r < R; ++r) {
      double s = 0;
      for (int e = r * (kE / R); e < (r + 1) * (kE / R); ++e) s += static_cast<double>(want[l * kE + e]);
      total += s;
      most = std::max(most, s);
    }
    EXPECT_DOUBLE_EQ(b[l], most > 0 ? total / R / most : 1.0);
  }
}

TEST(MoELayerLoadRecorder, NormalModeRecordsEachRanksReceivedCounts) {
  for (int R : {1, 2, 4}) {
    SCOPED_TRACE("R = " + std::to_string(R));
    run_mode(R, DispatchMode::normal);
  }
}

TEST(MoELayerLoadRecorder, AllGatherBaselineRecordsEachRanksOwnExperts) {
  for (int R : {1, 2, 4}) {
    SCOPED_TRACE("R = " + std::to_string(R));
    run_mode(R, DispatchMode::normal, /*all_gather=*/true);
  }
}

TEST(MoELayerLoadRecorder, LowLatencyModeRecordsMaskedM) {
  for (int R : {1, 2, 4}) {
    SCOPED_TRACE("R = " + std::to_string(R));
    run_mode(R, DispatchMode::low_latency);
  }
}

TEST(MoELayerLoadRecorder, AutomaticModeRecordsWhicheverHalfRan) {
  for (int R : {1, 2, 4}) {
    SCOPED_TRACE("R = " + std::to_string(R));
    run_mode(R, DispatchMode::automatic);
  }
}

// No expert parallelism: the no-EP prepare/finalize (standard and batched formats) records all E experts.
TEST(MoELayerLoadRecorder, NoEpLayerRecordsEveryExpert) {
  std::mt19937_64 rng(fresh_seed());
  const Weights w = make_weights(rng);
  for (ActivationFormat f : {ActivationFormat::standard, ActivationFormat::batched_experts}) {
    NoEpOptions no_ep;
    no_ep.format = f;
    MoELayer layer(make_no_ep_prepare_finalize({}, no_ep), experts_of(f));
    auto recorder = std::make_shared<ExpertLoadRecorder>(3, kE, 2, 2);
    layer.set_load_recorder(recorder, 2);
    std::vector<V> counts;
    for (int s = 0; s < 4; ++s) {
      const Batch b = make_batch(rng, s == 2 ? 0 : 1 + static_cast<i64>(rng() % 30));  // step 2: no tokens
      layer.forward(forward_args(b, w, 0, 1));
      counts.push_back(hand_count(b.topk_idx));
      V want(3 * kE, 0);
      for (size_t k = counts.size() > 2 ? counts.size() - 2 : 0; k < counts.size(); ++k)
        for (int e = 0; e < kE; ++e) want[2 * kE + e] += counts[k][e];
      EXPECT_EQ(recorder->loads(), want) << "format " << activation_format_name(f) << " step " << s;
    }
    EXPECT_EQ(recorder->num_records(), (V{0, 0, 2}));
  }
}

TEST(MoELayerLoadRecorder, BadRecorderIsRefusedBeforeTheDispatchAndTheLayerStaysUsable) {
  std::mt19937_64 rng(fresh_seed());
  const Weights w = make_weights(rng);
  MoELayer layer(make_no_ep_prepare_finalize(), experts_of(ActivationFormat::standard));
  auto recorder = std::make_shared<ExpertLoadRecorder>(2, kE, 1, 1);
  try {
    layer.set_load_recorder(recorder, 2);
    ADD_FAILURE() << "layer 2 of a 2-layer recorder accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'layer'"), std::string::npos) << e.what();
  }
  layer.set_load_recorder(std::make_shared<ExpertLoadRecorder>(1, 2 * kE, 1, 1), 0);  // num_experts 16 != 8
  const Batch b = make_batch(rng, 10);
  try {
    layer.forward(forward_args(b, w, 0, 1));
    ADD_FAILURE() << "a recorder of 16 experts accepted for 8";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'load_recorder'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(layer.prepare_finalize().stage(), Stage::initial);
  layer.set_load_recorder(recorder, 1);
  layer.forward(forward_args(b, w, 0, 1));
  V want(2 * kE, 0);
  const V c = hand_count(b.topk_idx);
  std::copy(c.begin(), c.end(), want.begin() + kE);
  EXPECT_EQ(recorder->loads(), want);
}

}  // namespace
}  // namespace epmoe

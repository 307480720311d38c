// MoEForwardArgs::expert_map and the EPLB mapping inside MoELayer (semantics §8, §9) on CPU thread ranks, against
// the float64 layer reference of the unbalanced (logical) layer.
#include <epmoe/eplb.hpp>
#include <epmoe/moe.hpp>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "support/moe_reference.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

using test::fresh_seed;

Tensor weights3(const Tensor& flat, std::int64_t a, std::int64_t b, std::int64_t c) {
  return Tensor::wrap(TensorView(flat.data(), DType::bf16, {a, b, c}), std::make_shared<Tensor>(flat));
}

// Rows `rows` of w (bf16 [E, ...]) stacked in that order.
Tensor gather_experts(const Tensor& w, const std::vector<std::int64_t>& rows) {
  const std::int64_t per = w.numel() / w.size(0);
  Tensor out = Tensor::empty(DType::bf16, {static_cast<std::int64_t>(rows.size()), w.size(1), w.size(2)});
  for (std::size_t i = 0; i < rows.size(); ++i)
    std::memcpy(out.ptr<bf16_t>() + static_cast<std::int64_t>(i) * per, w.ptr<bf16_t>() + rows[i] * per,
                static_cast<std::size_t>(per) * sizeof(bf16_t));
  return out;
}

Tensor concat_rows(const std::vector<Tensor>& parts) {
  std::int64_t rows = 0;
  for (const auto& t : parts) rows += t.size(0);
  Tensor out = Tensor::empty(parts[0].dtype(), {rows, parts[0].size(1)});
  std::size_t off = 0;
  for (const auto& t : parts) {
    if (t.nbytes()) std::memcpy(static_cast<char*>(out.data()) + off, t.data(), t.nbytes());
    off += t.nbytes();
  }
  return out;
}

// K distinct experts per token, expert e drawn with weight hot[e] (a skewed routing: the first experts are hot, so
// the first rank is overloaded without EPLB).
Tensor skewed_topk_idx(std::mt19937_64& rng, std::int64_t T, int K, int E) {
  std::vector<double> w(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e) w[static_cast<std::size_t>(e)] = 1.0 / std::pow(1.0 + e, 1.3);
  Tensor idx = Tensor::empty(DType::int64, {T, K});
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<double> left = w;
    for (int k = 0; k < K; ++k) {
      std::discrete_distribution<int> pick(left.begin(), left.end());
      const int e = pick(rng);
      idx.ptr<std::int64_t>()[t * K + k] = e;
      left[static_cast<std::size_t>(e)] = 0.0;
    }
  }
  return idx;
}

struct Problem {
  int R, E, K;
  std::int64_t T, H, N;
  Tensor w1, w2;  // logical experts [E, 2N, H], [E, H, N]
  std::vector<Tensor> x, topk_idx, topk_weights;
};

Problem make_problem(std::mt19937_64& rng, int R, int E, int K, std::int64_t T, std::int64_t H, std::int64_t N) {
  Problem p{R, E, K, T, H, N, {}, {}, {}, {}, {}};
  p.w1 = weights3(test::random_bf16(rng, E * 2 * N, H, 1.0f / std::sqrt(static_cast<float>(H))), E, 2 * N, H);
  p.w2 = weights3(test::random_bf16(rng, E * H, N, 1.0f / std::sqrt(static_cast<float>(N))), E, H, N);
  for (int r = 0; r < R; ++r) {
    p.x.push_back(test::random_bf16(rng, T, H));
    p.topk_idx.push_back(skewed_topk_idx(rng, T, K, E));
    p.topk_weights.push_back(test::random_topk_weights(rng, p.topk_idx.back()));
  }
  return p;
}

enum class Mode { no_ep, normal, low_latency };
const char* mode_name(Mode m) { return m == Mode::no_ep ? "no_ep" : m == Mode::normal ? "normal" : "low_latency"; }

// Runs the layer on R thread ranks; with `plan`, the layer maps topk_idx with it (layer 0) and every rank holds
// its P / R physical experts' copies of the logical weights.
std::vector<Tensor> run_layer(const Problem& p, Mode mode, const EplbPlan* plan) {
  std::vector<Tensor> out(static_cast<std::size_t>(p.R));
  Tensor w1 = p.w1, w2 = p.w2;
  if (plan) {
    const std::vector<std::int64_t> phy2log(plan->physical_to_logical.begin(),
                                            plan->physical_to_logical.begin() + plan->num_physical_experts);
    w1 = gather_experts(p.w1, phy2log);
    w2 = gather_experts(p.w2, phy2log);
  }
  const std::int64_t slots = plan ? plan->num_physical_experts : p.E;
  run_thread_ranks(p.R, [&](Group& g) {
    const int r = g.rank();
    const std::int64_t e_local = slots / p.R;
    std::shared_ptr<Group> group(std::shared_ptr<Group>{}, &g);
    std::shared_ptr<PrepareFinalize> pf;
    ExpertsConfig ec;
    if (mode == Mode::no_ep) {
      pf = make_no_ep_prepare_finalize();
    } else if (mode == Mode::normal) {
      pf = make_normal_prepare_finalize(std::make_shared<Buffer>(group));
    } else {
      pf = make_low_latency_prepare_finalize(std::make_shared<Buffer>(group), static_cast<int>(p.T));
      ec.format = ActivationFormat::batched_experts;
    }
    MoELayer layer(pf, make_reference_experts(ec));
    if (plan) layer.set_eplb_plan(*plan, 0);
    MoEForwardArgs a;
    a.hidden = p.x[static_cast<std::size_t>(r)];
    a.w1 = w1.view().slice_rows(r * e_local, (r + 1) * e_local);
    a.w2 = w2.view().slice_rows(r * e_local, (r + 1) * e_local);
    a.topk_idx = p.topk_idx[static_cast<std::size_t>(r)];
    a.topk_weights = p.topk_weights[static_cast<std::size_t>(r)];
    a.global_num_experts = p.E;  // logical, also with a plan
    out[static_cast<std::size_t>(r)] = layer.forward(a).output;
  });
  return out;
}

// max / mean over ranks of the (token, k) choices a rank's experts receive: ids / (slots / R) is the rank.
double imbalance(const std::vector<Tensor>& ids, std::int64_t slots, int R) {
  std::vector<double> load(static_cast<std::size_t>(R), 0.0);
  for (const Tensor& t : ids)
    for (std::int64_t i = 0; i < t.numel(); ++i) {
      const std::int64_t e = t.ptr<std::int64_t>()[i];
      if (e >= 0) load[static_cast<std::size_t>(e / (slots / R))] += 1.0;
    }
  const double mean = std::accumulate(load.begin(), load.end(), 0.0) / R;
  return *std::max_element(load.begin(), load.end()) / mean;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// The rebalanced layer (plan from the routing's own counts, P = E + 2R slots) gives the unbalanced layer's output
// within semantics §13's tolerance of the float64 reference, and the ranks' loads are more balanced. Bits: the
// reference experts round each (token, expert) product once, so a physical copy gives the logical expert's bits;
// with no-EP and low-latency (the combine weights every choice of a token in k order) the whole output is
// bit-identical; the normal combine sums per-rank partial sums rounded to bf16, so grouping the choices by other
// ranks may change the last bits (within tolerance, not asserted bit-identical).
TEST(MoELayerEplb, RebalancedLayerEqualsUnbalancedAndReference) {
  std::mt19937_64 rng(fresh_seed());
  for (Mode mode : {Mode::no_ep, Mode::normal, Mode::low_latency}) {
    for (int R : {1, 2, 4}) {
      if ((mode == Mode::no_ep) != (R == 1)) continue;
      const int E = 16, K = 4;
      const Problem p = make_problem(rng, R, E, K, 48, 64, 32);
      std::vector<double> counts(static_cast<std::size_t>(E), 0.0);
      for (const Tensor& t : p.topk_idx)
        for (std::int64_t i = 0; i < t.numel(); ++i) counts[static_cast<std::size_t>(t.ptr<std::int64_t>()[i])] += 1;
      const std::int64_t P = E + 2 * R;
      const EplbPlan plan = rebalance_experts(counts, 1, E, P, 1, 1, R);

      const std::vector<Tensor> plain = run_layer(p, mode, nullptr);
      const std::vector<Tensor> balanced = run_layer(p, mode, &plan);
      const auto want = test::moe_layer_reference(concat_rows(p.x), p.w1, p.w2, concat_rows(p.topk_idx),
                                                  concat_rows(p.topk_weights), "silu");
      const Tensor got = concat_rows(balanced), got_plain = concat_rows(plain);
      const double err = test::relative_l2(got, want), err_plain = test::relative_l2(got_plain, want);
      EXPECT_LE(err, 1e-2) << mode_name(mode) << " R=" << R;
      EXPECT_LE(err_plain, 1e-2) << mode_name(mode) << " R=" << R;
      const bool bits = same_bits(got, got_plain);
      if (mode != Mode::normal) EXPECT_TRUE(bits) << mode_name(mode) << " R=" << R;
      std::vector<double> diff(static_cast<std::size_t>(got_plain.numel()));
      for (std::int64_t i = 0; i < got_plain.numel(); ++i)
        diff[static_cast<std::size_t>(i)] = bf16_to_float(got_plain.ptr<bf16_t>()[i]);
      EXPECT_LE(test::relative_l2(got, diff), 1e-2) << mode_name(mode) << " R=" << R;

      if (R > 1) {
        std::vector<Tensor> physical;
        for (const Tensor& t : p.topk_idx) physical.push_back(map_to_physical(t, plan, 0));
        const double before = imbalance(p.topk_idx, E, R), after = imbalance(physical, P, R);
        EXPECT_LT(after, before) << mode_name(mode) << " R=" << R;
        std::printf("%s R=%d: imbalance %.3f -> %.3f, rel. L2 %.2e (unbalanced %.2e), bit-identical %s\n",
                    mode_name(mode), R, before, after, err, err_plain, bits ? "yes" : "no");
      }
    }
  }
}

void expect_invalid(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
    for (const auto& s : parts) EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << e.what() << " / " << s;
  }
}

TEST(MoELayerEplb, SetPlanAndForwardRefuseBadArguments) {
  std::mt19937_64 rng(fresh_seed());
  const Problem p = make_problem(rng, 1, 8, 2, 6, 32, 16);
  std::vector<double> counts(16, 1.0);
  const EplbPlan plan = rebalance_experts(counts, 2, 8, 10, 1, 1, 1);
  MoELayer layer(make_no_ep_prepare_finalize(), make_reference_experts());
  expect_invalid([&] { layer.set_eplb_plan(plan, 2); }, {"'layer'", "[0, 2)", "2"});
  EplbPlan broken = plan;
  broken.logical_replica_count[3] = 0;
  expect_invalid([&] { layer.set_eplb_plan(broken, 0); }, {"'plan'", "logical_replica_count", "0 at [0, 3]"});
  layer.set_eplb_plan(plan, 1);
  EXPECT_EQ(layer.eplb_layer(), 1);
  MoEForwardArgs a;
  a.hidden = p.x[0];
  const Tensor w1 = gather_experts(p.w1, {0, 1, 2, 3, 4, 5, 6, 7, 0, 1});
  const Tensor w2 = gather_experts(p.w2, {0, 1, 2, 3, 4, 5, 6, 7, 0, 1});
  a.w1 = w1;
  a.w2 = w2;
  a.topk_idx = p.topk_idx[0];
  a.topk_weights = p.topk_weights[0];
  a.global_num_experts = 10;  // P, not the logical E the plan maps from
  expect_invalid([&] { layer.forward(a); }, {"'global_num_experts'", "8", "10"});
  a.global_num_experts = 8;
  a.w1 = p.w1;  // 8 experts, the plan has 10 slots
  expect_invalid([&] { layer.forward(a); }, {"'w1'", "[10,"});
  layer.clear_eplb_plan();
  EXPECT_EQ(layer.eplb_plan(), nullptr);
}

// No-EP with an expert_map: this rank holds a permuted subset of the experts; the output equals the float64
// reference of the same tokens with every non-local choice dropped (vLLM: they contribute nothing from this rank).
TEST(MoELayerExpertMap, NoEpMapSelectsLocalExpertsInTheirSlots) {
  std::mt19937_64 rng(fresh_seed());
  const int E = 8, K = 3;
  const Problem p = make_problem(rng, 1, E, K, 20, 64, 32);
  // Local slot of each global expert: experts 5, 2, 7 held in slots 0, 1, 2.
  const std::vector<std::int32_t> map_host{-1, -1, 1, -1, -1, 0, -1, 2};
  Tensor map = Tensor::empty(DType::int32, {E});
  std::memcpy(map.data(), map_host.data(), sizeof(std::int32_t) * E);
  const Tensor w1 = gather_experts(p.w1, {5, 2, 7}), w2 = gather_experts(p.w2, {5, 2, 7});
  Tensor local_idx = Tensor::empty(DType::int64, {p.T, K});
  for (std::int64_t i = 0; i < p.T * K; ++i) {
    const std::int64_t g = p.topk_idx[0].ptr<std::int64_t>()[i];
    local_idx.ptr<std::int64_t>()[i] = map_host[static_cast<std::size_t>(g)] < 0 ? -1 : g;
  }
  const auto want = test::moe_layer_reference(p.x[0], p.w1, p.w2, local_idx, p.topk_weights[0], "silu");
  for (bool batched : {false, true}) {
    NoEpOptions no_ep;
    ExpertsConfig ec;
    if (batched) no_ep.format = ec.format = ActivationFormat::batched_experts;
    MoELayer layer(make_no_ep_prepare_finalize({}, no_ep), make_reference_experts(ec));
    MoEForwardArgs a;
    a.hidden = p.x[0];
    a.w1 = w1;
    a.w2 = w2;
    a.topk_idx = p.topk_idx[0];
    a.topk_weights = p.topk_weights[0];
    a.global_num_experts = E;
    a.expert_map = map;
    const Tensor got = layer.forward(a).output;
    EXPECT_LE(test::relative_l2(got, want), 1e-2) << "batched=" << batched;
  }
}

TEST(MoELayerExpertMap, NoEpRefusesBadMapsNamingExpertMap) {
  std::mt19937_64 rng(fresh_seed());
  const int E = 8;
  const Problem p = make_problem(rng, 1, E, 2, 6, 32, 16);
  const Tensor w1 = gather_experts(p.w1, {0, 1, 2}), w2 = gather_experts(p.w2, {0, 1, 2});
  MoELayer layer(make_no_ep_prepare_finalize(), make_reference_experts());
  const auto args_with = [&](const Tensor& map) {
    MoEForwardArgs a;
    a.hidden = p.x[0];
    a.w1 = w1;
    a.w2 = w2;
    a.topk_idx = p.topk_idx[0];
    a.topk_weights = p.topk_weights[0];
    a.global_num_experts = E;
    a.expert_map = map;
    return a;
  };
  const auto int32_map = [&](std::vector<std::int32_t> v) {
    Tensor t = Tensor::empty(DType::int32, {static_cast<std::int64_t>(v.size())});
    std::memcpy(t.data(), v.data(), v.size() * sizeof(std::int32_t));
    return t;
  };
  expect_invalid([&] { layer.forward(args_with(Tensor::zeros(DType::int64, {E}))); }, {"'expert_map'", "int32 [8]"});
  expect_invalid([&] { layer.forward(args_with(int32_map({0, 1, 2}))); }, {"'expert_map'", "int32 [8]", "[3]"});
  expect_invalid([&] { layer.forward(args_with(int32_map({0, 1, 2, 3, -1, -1, -1, -1}))); },
                 {"'expert_map'", "[-1, 3)", "3 at [3]"});
  expect_invalid([&] { layer.forward(args_with(int32_map({0, 1, 2, -1, 1, -1, -1, -1}))); },
                 {"'expert_map'", "at most once", "local id 1 at [1] and at [4]"});
  // The layer stays usable: a valid map runs.
  EXPECT_NO_THROW(layer.forward(args_with(int32_map({0, 1, 2, -1, -1, -1, -1, -1}))));
}

// With expert parallelism the map is the one the rank implies; any other map is refused on every rank before the
// dispatch (naming expert_map, the expected and the actual entry), and the layers stay usable.
TEST(MoELayerExpertMap, ExpertParallelMapMustBeTheRanksOwn) {
  std::mt19937_64 rng(fresh_seed());
  const int R = 2, E = 8;
  const Problem p = make_problem(rng, R, E, 2, 10, 32, 16);
  for (Mode mode : {Mode::normal, Mode::low_latency}) {
    std::vector<Tensor> out(R);
    run_thread_ranks(R, [&](Group& g) {
      const int r = g.rank(), e_local = E / R;
      std::shared_ptr<Group> group(std::shared_ptr<Group>{}, &g);
      ExpertsConfig ec;
      std::shared_ptr<PrepareFinalize> pf;
      if (mode == Mode::normal) {
        pf = make_normal_prepare_finalize(std::make_shared<Buffer>(group));
      } else {
        pf = make_low_latency_prepare_finalize(std::make_shared<Buffer>(group), static_cast<int>(p.T));
        ec.format = ActivationFormat::batched_experts;
      }
      MoELayer layer(pf, make_reference_experts(ec));
      Tensor map = Tensor::empty(DType::int32, {E});
      for (int e = 0; e < E; ++e) map.ptr<std::int32_t>()[e] = e / e_local == r ? e % e_local : -1;
      MoEForwardArgs a;
      a.hidden = p.x[static_cast<std::size_t>(r)];
      a.w1 = p.w1.view().slice_rows(r * e_local, (r + 1) * e_local);
      a.w2 = p.w2.view().slice_rows(r * e_local, (r + 1) * e_local);
      a.topk_idx = p.topk_idx[static_cast<std::size_t>(r)];
      a.topk_weights = p.topk_weights[static_cast<std::size_t>(r)];
      a.global_num_experts = E;
      Tensor wrong = Tensor::empty(DType::int32, {E});
      for (int e = 0; e < E; ++e) wrong.ptr<std::int32_t>()[e] = e < e_local ? e : -1;  // rank 0's map
      wrong.ptr<std::int32_t>()[0] = 1;
      wrong.ptr<std::int32_t>()[1] = 0;  // a permutation of rank 0's slots: valid alone, not the implied map
      a.expert_map = wrong;
      expect_invalid([&] { layer.forward(a); },
                     {"'expert_map'", fmt::format("rank {}", r), r == 0 ? "0 at [0]" : "-1 at [0]",
                      r == 0 ? "1 at [0]" : "1 at [0]"});
      a.expert_map = map;
      out[static_cast<std::size_t>(r)] = layer.forward(a).output;
    });
    const auto want = test::moe_layer_reference(concat_rows(p.x), p.w1, p.w2, concat_rows(p.topk_idx),
                                                concat_rows(p.topk_weights), "silu");
    EXPECT_LE(test::relative_l2(concat_rows(out), want), 1e-2) << mode_name(mode);
  }
}

}  // namespace
}  // namespace epmoe

// The EPLB stage's CUDA id mappings (src/eplb/cuda.cu) against their host versions, bit for bit: map_to_physical of
// plans from rebalance_experts (E in {64, 256}, several layers, skewed loads so experts get several replicas) over
// T in {0, 1, 7, 128, 4096}, int64 and int32 ids with -1 entries; the no-EP expert_map. Then a no-EP layer on one
// GPU with an EPLB plan and with an expert_map (on the GPU and on the CPU, changed between forwards of one layer)
// against the float64 reference of the logical layer (semantics §13).
#include <gtest/gtest.h>

#include <epmoe/eplb.hpp>
#include <epmoe/experts.hpp>
#include <epmoe/moe.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <cuda_runtime.h>

#include "eplb/eplb.hpp"
#include "gpu/gpu_util.hpp"
#include "support/moe_reference.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

using gputest::same_bits;
using gputest::to_device;
using gputest::to_host;

Tensor random_ids(std::mt19937_64& rng, std::int64_t T, int K, int E, DType dtype) {
  const Tensor idx = test::random_topk_idx(rng, T, K, E, {.p_minus_one = 0.1});
  if (dtype == DType::int64) return idx;
  Tensor out = Tensor::empty(DType::int32, {T, K});
  for (std::int64_t i = 0; i < T * K; ++i) out.ptr<std::int32_t>()[i] = static_cast<std::int32_t>(idx.ptr<std::int64_t>()[i]);
  return out;
}

EplbPlan skewed_plan(std::mt19937_64& rng, std::int64_t L, std::int64_t E, std::int64_t P, std::int64_t gpus) {
  std::vector<double> w(static_cast<std::size_t>(L * E));
  std::exponential_distribution<double> d(1.0);
  for (auto& x : w) x = std::pow(d(rng), 3.0) * 100.0;  // heavy tail: a few experts get many replicas
  return rebalance_experts(w, L, E, P, 1, 1, gpus);
}

TEST(GpuEplb, MapToPhysicalMatchesHostBitForBit) {
  std::mt19937_64 rng(test::fresh_seed());
  struct Shape {
    std::int64_t L, E, P, gpus;
  };
  for (const Shape s : {Shape{2, 64, 80, 8}, Shape{3, 256, 288, 8}}) {
    const EplbPlan plan = skewed_plan(rng, s.L, s.E, s.P, s.gpus);
    ASSERT_GT(plan.max_replicas, 1);
    for (std::int64_t layer = 0; layer < s.L; ++layer) {
      const std::int64_t E = s.E, X = plan.max_replicas;
      const Tensor l2p = to_device(TensorView(const_cast<std::int64_t*>(plan.logical_to_physical.data()) + layer * E * X,
                                              DType::int64, {E, X}));
      const Tensor cnt = to_device(TensorView(const_cast<std::int64_t*>(plan.logical_replica_count.data()) + layer * E,
                                              DType::int64, {E}));
      for (std::int64_t T : gputest::token_counts())
        for (DType dt : {DType::int64, DType::int32}) {
          const Tensor ids = random_ids(rng, T, 8, static_cast<int>(E), dt);
          const Tensor want = map_to_physical(ids, plan, layer);
          const Tensor d_ids = to_device(ids);
          Tensor d_out = Tensor::empty(dt, {T, 8}, gputest::gpu());
          gputest::poison(d_out);
          eplb_cuda::map_to_physical(d_ids, l2p.ptr<std::int64_t>(), cnt.ptr<std::int64_t>(), E, X, s.P, d_out, {});
          gputest::sync_ok();
          EXPECT_TRUE(same_bits(want, to_host(d_out))) << "E=" << E << " layer=" << layer << " T=" << T
                                                       << " int32=" << (dt == DType::int32);
        }
    }
  }
}

TEST(GpuEplb, ExpertMapKernelMatchesHostLoop) {
  std::mt19937_64 rng(test::fresh_seed());
  const int E = 64, E_local = 16;
  std::vector<std::int32_t> map(E, -1);
  std::vector<int> perm(E);
  for (int e = 0; e < E; ++e) perm[e] = e;
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int i = 0; i < E_local; ++i) map[static_cast<std::size_t>(perm[static_cast<std::size_t>(i)])] = i;
  const Tensor d_map = to_device(TensorView(map.data(), DType::int32, {E}));
  for (std::int64_t T : gputest::token_counts())
    for (DType dt : {DType::int64, DType::int32}) {
      const Tensor ids = random_ids(rng, T, 8, E, dt);
      Tensor want = Tensor::empty(dt, {T, 8});
      for (std::int64_t i = 0; i < T * 8; ++i) {
        const std::int64_t g = dt == DType::int64 ? ids.ptr<std::int64_t>()[i] : ids.ptr<std::int32_t>()[i];
        const std::int64_t v = g < 0 ? -1 : map[static_cast<std::size_t>(g)];
        if (dt == DType::int64)
          want.ptr<std::int64_t>()[i] = v;
        else
          want.ptr<std::int32_t>()[i] = static_cast<std::int32_t>(v);
      }
      Tensor d_out = Tensor::empty(dt, {T, 8}, gputest::gpu());
      gputest::poison(d_out);
      eplb_cuda::apply_expert_map(to_device(ids), d_map.ptr<std::int32_t>(), E, E_local, d_out, {});
      gputest::sync_ok();
      EXPECT_TRUE(same_bits(want, to_host(d_out))) << "T=" << T << " int32=" << (dt == DType::int32);
    }
}

Tensor gather_experts(const Tensor& w, const std::vector<std::int64_t>& rows) {
  const std::int64_t per = w.numel() / w.size(0);
  Tensor out = Tensor::empty(DType::bf16, {static_cast<std::int64_t>(rows.size()), w.size(1), w.size(2)});
  for (std::size_t i = 0; i < rows.size(); ++i)
    std::memcpy(out.ptr<bf16_t>() + static_cast<std::int64_t>(i) * per, w.ptr<bf16_t>() + rows[i] * per,
                static_cast<std::size_t>(per) * sizeof(bf16_t));
  return out;
}

TEST(GpuEplb, NoEpLayerWithPlanOrExpertMapMatchesReference) {
  std::mt19937_64 rng(test::fresh_seed());
  const int E = 32, K = 4;
  const std::int64_t T = 256, H = 256, N = 128;
  Tensor w1 = test::random_bf16(rng, E * 2 * N, H, 1.0f / std::sqrt(static_cast<float>(H)));
  Tensor w2 = test::random_bf16(rng, E * H, N, 1.0f / std::sqrt(static_cast<float>(N)));
  w1 = Tensor::wrap(TensorView(w1.data(), DType::bf16, {E, 2 * N, H}), std::make_shared<Tensor>(w1));
  w2 = Tensor::wrap(TensorView(w2.data(), DType::bf16, {E, H, N}), std::make_shared<Tensor>(w2));
  const Tensor x = test::random_bf16(rng, T, H), idx = test::random_topk_idx(rng, T, K, E);
  const Tensor wts = test::random_topk_weights(rng, idx);
  const Tensor d_x = to_device(x), d_idx = to_device(idx), d_wts = to_device(wts);
  const auto want = test::moe_layer_reference(x, w1, w2, idx, wts, "silu");

  // EPLB: P = 40 slots, the copies of the logical weights.
  std::vector<double> counts(E, 0.0);
  for (std::int64_t i = 0; i < idx.numel(); ++i) counts[static_cast<std::size_t>(idx.ptr<std::int64_t>()[i])] += 1;
  counts[3] *= 8;
  const EplbPlan plan = rebalance_experts(counts, 1, E, 40, 1, 1, 1);
  const std::vector<std::int64_t> phy(plan.physical_to_logical.begin(), plan.physical_to_logical.end());
  const Tensor d_w1p = to_device(gather_experts(w1, phy)), d_w2p = to_device(gather_experts(w2, phy));
  MoELayer layer(make_no_ep_prepare_finalize(), make_cuda_experts());
  layer.set_eplb_plan(plan, 0);
  MoEForwardArgs a;
  a.hidden = d_x;
  a.w1 = d_w1p;
  a.w2 = d_w2p;
  a.topk_idx = d_idx;
  a.topk_weights = d_wts;
  a.global_num_experts = E;
  const Tensor got = to_host(layer.forward(a).output);
  EXPECT_LE(test::relative_l2(got, want), 1e-2) << "EPLB";

  // expert_map: the even (or odd) experts, in reverse order; the reference drops the other choices.
  struct Mapped {
    Tensor h_map, d_map, d_w1, d_w2;
    std::vector<double> want;
  };
  const auto mapped_case = [&](int parity) {
    std::vector<std::int32_t> map(E, -1);
    std::vector<std::int64_t> held;
    for (int e = E - 2 + parity; e >= 0; e -= 2) {
      map[static_cast<std::size_t>(e)] = static_cast<std::int32_t>(held.size());
      held.push_back(e);
    }
    Tensor local = Tensor::empty(DType::int64, {T, K});
    for (std::int64_t i = 0; i < T * K; ++i) {
      const std::int64_t g = idx.ptr<std::int64_t>()[i];
      local.ptr<std::int64_t>()[i] = g < 0 || map[static_cast<std::size_t>(g)] < 0 ? -1 : g;
    }
    Mapped m;
    m.want = test::moe_layer_reference(x, w1, w2, local, wts, "silu");
    m.d_w1 = to_device(gather_experts(w1, held));
    m.d_w2 = to_device(gather_experts(w2, held));
    m.h_map = Tensor::empty(DType::int32, {E});
    std::memcpy(m.h_map.data(), map.data(), sizeof(std::int32_t) * E);
    m.d_map = to_device(m.h_map);
    return m;
  };
  const Mapped even = mapped_case(0), odd = mapped_case(1);
  const auto forward_mapped = [&](MoELayer& layer, const Mapped& m, bool on_gpu) {
    MoEForwardArgs b = a;
    b.w1 = m.d_w1;
    b.w2 = m.d_w2;
    b.expert_map = on_gpu ? m.d_map.view() : m.h_map.view();
    return to_host(layer.forward(b).output);
  };
  for (bool on_gpu : {true, false}) {
    // One layer, the map changed between forwards (a host map is re-uploaded only when its contents change).
    MoELayer mapped(make_no_ep_prepare_finalize(), make_cuda_experts());
    const char* where = on_gpu ? "GPU" : "CPU";
    int i = 0;
    for (const Mapped* m : {&even, &even, &odd, &even}) {
      const Tensor out = forward_mapped(mapped, *m, on_gpu);
      EXPECT_LE(test::relative_l2(out, m->want), 1e-2) << "expert_map on " << where << ", forward " << i++;
    }
  }
}

}  // namespace
}  // namespace epmoe

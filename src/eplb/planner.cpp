// DeepSeek's EPLB planner (deepseek-ai/EPLB eplb.py), written from its description in float64.
#include <epmoe/eplb.hpp>

#include "core/check.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <type_traits>

namespace epmoe {

namespace {

using i64 = std::int64_t;

// Balanced packing of n items into num_packs packs of n / num_packs items each: items in descending
// weight order (ties: lower index first) go to the lightest pack with room (ties: lower pack index).
// With one item per pack, item i goes to pack i (DeepSeek does the same).
void balanced_packing(const double* w, i64 n, i64 num_packs, i64* pack, i64* rank_in_pack) {
  const i64 per_pack = n / num_packs;
  if (per_pack == 1) {
    for (i64 i = 0; i < n; ++i) {
      pack[i] = i;
      rank_in_pack[i] = 0;
    }
    return;
  }
  std::vector<i64> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), i64{0});
  std::stable_sort(order.begin(), order.end(), [&](i64 a, i64 b) { return w[a] > w[b]; });
  std::vector<double> load(static_cast<size_t>(num_packs), 0.0);
  std::vector<i64> items(static_cast<size_t>(num_packs), 0);
  for (i64 item : order) {
    i64 best = -1;
    for (i64 p = 0; p < num_packs; ++p) {
      if (items[p] == per_pack) continue;
      if (best < 0 || load[p] < load[best]) best = p;
    }
    pack[item] = best;
    rank_in_pack[item] = items[best]++;
    load[best] += w[item];
  }
}

// Gives num_log experts num_phy slots: slot i < num_log holds expert i; each further slot replicates the
// expert with the largest weight / count (ties: lower index). rank: replica number of the slot.
void replicate(const double* w, i64 num_log, i64 num_phy, i64* phy2log, i64* rank, i64* count) {
  for (i64 i = 0; i < num_log; ++i) {
    phy2log[i] = i;
    rank[i] = 0;
    count[i] = 1;
  }
  for (i64 i = num_log; i < num_phy; ++i) {
    i64 best = 0;
    double best_load = w[0] / static_cast<double>(count[0]);
    for (i64 e = 1; e < num_log; ++e) {
      const double l = w[e] / static_cast<double>(count[e]);
      if (l > best_load) {
        best = e;
        best_load = l;
      }
    }
    phy2log[i] = best;
    rank[i] = count[best]++;
  }
}

// One layer of the hierarchical algorithm; writes phy2log [P], phyrank [P], logcnt [E].
void plan_layer(const double* w, i64 E, i64 P, i64 G, i64 N, i64 M, i64* phy2log, i64* phyrank, i64* logcnt) {
  const i64 group_size = E / G, groups_per_node = G / N, E_node = E / N, P_node = P / N;
  const i64 gpus_per_node = M / N, slots_per_gpu = P / M;

  // Step 1: groups onto nodes by their summed loads.
  std::vector<double> group_load(static_cast<size_t>(G), 0.0);
  for (i64 g = 0; g < G; ++g)
    for (i64 j = 0; j < group_size; ++j) group_load[g] += w[g * group_size + j];
  std::vector<i64> gpack(static_cast<size_t>(G)), grank(static_cast<size_t>(G));
  balanced_packing(group_load.data(), G, N, gpack.data(), grank.data());
  // "Node-major" logical ids: node n holds node-major ids n*E/N .. (n+1)*E/N-1.
  std::vector<i64> log2mlog(static_cast<size_t>(E)), mlog2log(static_cast<size_t>(E));
  for (i64 g = 0; g < G; ++g)
    for (i64 j = 0; j < group_size; ++j) {
      const i64 m = (gpack[g] * groups_per_node + grank[g]) * group_size + j;
      log2mlog[g * group_size + j] = m;
      mlog2log[m] = g * group_size + j;
    }

  std::vector<double> wn(static_cast<size_t>(E_node)), per_slot(static_cast<size_t>(P_node));
  std::vector<i64> p2m(static_cast<size_t>(P_node)), prank(static_cast<size_t>(P_node)),
      mcnt(static_cast<size_t>(E_node)), gpu(static_cast<size_t>(P_node)), rank_in_gpu(static_cast<size_t>(P_node)),
      slot_of(static_cast<size_t>(P_node));
  for (i64 n = 0; n < N; ++n) {
    // Step 2: replicate within the node.
    for (i64 k = 0; k < E_node; ++k) wn[k] = w[mlog2log[n * E_node + k]];
    replicate(wn.data(), E_node, P_node, p2m.data(), prank.data(), mcnt.data());
    // Step 3: the node's physical experts onto its GPUs by load per replica.
    for (i64 p = 0; p < P_node; ++p) per_slot[p] = wn[p2m[p]] / static_cast<double>(mcnt[p2m[p]]);
    balanced_packing(per_slot.data(), P_node, gpus_per_node, gpu.data(), rank_in_gpu.data());
    for (i64 p = 0; p < P_node; ++p) slot_of[gpu[p] * slots_per_gpu + rank_in_gpu[p]] = p;
    for (i64 s = 0; s < P_node; ++s) {
      const i64 p = slot_of[s];
      phy2log[n * P_node + s] = mlog2log[n * E_node + p2m[p]];
      phyrank[n * P_node + s] = prank[p];
    }
    for (i64 k = 0; k < E_node; ++k) logcnt[mlog2log[n * E_node + k]] = mcnt[k];
  }
}

}  // namespace

EplbPlan rebalance_experts(std::span<const double> weight, i64 num_layers, i64 num_logical_experts, i64 num_replicas,
                           i64 num_groups, i64 num_nodes, i64 num_gpus) {
  const i64 L = num_layers, E = num_logical_experts, P = num_replicas;
  EPMOE_CHECK_ARG(L >= 0, "num_layers", ">= 0", L);
  EPMOE_CHECK_ARG(E >= 1, "num_logical_experts", ">= 1", E);
  EPMOE_CHECK_ARG(num_groups >= 1 && E % num_groups == 0, "num_groups",
                  fmt::format(">= 1 and dividing num_logical_experts ({})", E), num_groups);
  EPMOE_CHECK_ARG(num_nodes >= 1, "num_nodes", ">= 1", num_nodes);
  EPMOE_CHECK_ARG(num_gpus >= 1 && num_gpus % num_nodes == 0, "num_gpus",
                  fmt::format(">= 1 and a multiple of num_nodes ({})", num_nodes), num_gpus);
  // Bounds far above any model's (DeepSeek-V3: 256 logical, 288 physical experts) keep the plan's [L, P] tables
  // allocatable, so a huge count is named rather than failing as bad_alloc.
  constexpr i64 kMaxExperts = i64{1} << 20;
  EPMOE_CHECK_ARG(E <= kMaxExperts, "num_logical_experts", "<= 2^20", E);
  EPMOE_CHECK_ARG(num_gpus <= kMaxExperts, "num_gpus", "<= 2^20", num_gpus);
  EPMOE_CHECK_ARG(P >= E && P <= kMaxExperts, "num_replicas",
                  fmt::format(">= num_logical_experts ({}) and <= 2^20", E), P);
  EPMOE_CHECK_ARG(P % num_gpus == 0, "num_replicas", fmt::format("a multiple of num_gpus ({})", num_gpus), P);
  EPMOE_CHECK_ARG(static_cast<i64>(weight.size()) == L * E, "weight",
                  fmt::format("{} loads ([num_layers={}, num_logical_experts={}])", L * E, L, E), weight.size());
  for (size_t i = 0; i < weight.size(); ++i)
    EPMOE_CHECK_ARG(std::isfinite(weight[i]) && weight[i] >= 0, "weight", "finite loads >= 0",
                    fmt::format("{} at [{}, {}]", weight[i], static_cast<i64>(i) / E, static_cast<i64>(i) % E));

  // Hierarchical when nodes divide groups; else one group on one node (DeepSeek's global policy).
  const bool hierarchical = num_groups % num_nodes == 0;
  const i64 G = hierarchical ? num_groups : 1, N = hierarchical ? num_nodes : 1;
  // With N nodes, E % N == 0 follows from E % G == 0 and G % N == 0, and P % N == 0 from P % M, M % N.

  EplbPlan plan;
  plan.num_layers = L;
  plan.num_logical_experts = E;
  plan.num_physical_experts = P;
  plan.physical_to_logical.assign(static_cast<size_t>(L * P), -1);
  plan.logical_replica_count.assign(static_cast<size_t>(L * E), 0);
  std::vector<i64> phyrank(static_cast<size_t>(L * P));
  for (i64 l = 0; l < L; ++l)
    plan_layer(weight.data() + l * E, E, P, G, N, num_gpus, plan.physical_to_logical.data() + l * P,
               phyrank.data() + l * P, plan.logical_replica_count.data() + l * E);
  // X: the most replicas of any expert in any layer (DeepSeek's logcnt.max()); 1 when there are no layers.
  i64 X = 1;
  for (i64 c : plan.logical_replica_count) X = std::max(X, c);
  plan.max_replicas = X;
  plan.logical_to_physical.assign(static_cast<size_t>(L * E * X), -1);
  for (i64 l = 0; l < L; ++l)
    for (i64 p = 0; p < P; ++p)
      plan.logical_to_physical[(l * E + plan.physical_to_logical[l * P + p]) * X + phyrank[l * P + p]] = p;
  return plan;
}

Tensor map_to_physical(const TensorView& topk_idx, std::span<const i64> logical_to_physical,
                       std::span<const i64> logical_replica_count, i64 num_layers, i64 num_logical_experts,
                       i64 max_replicas, i64 layer) {
  const i64 L = num_layers, E = num_logical_experts, X = max_replicas;
  check_topk_idx_dtype(topk_idx);
  EPMOE_CHECK_ARG(topk_idx.ndim() == 2 && topk_idx.device.is_cpu(), "topk_idx", "a 2-d [T, K] tensor on the CPU",
                  describe(topk_idx));
  EPMOE_CHECK_ARG(L >= 1 && E >= 1 && X >= 1, "logical_to_physical", "a shape [L, E, X] with L, E, X >= 1",
                  fmt::format("[{}, {}, {}]", L, E, X));
  EPMOE_CHECK_ARG(static_cast<i64>(logical_to_physical.size()) == L * E * X, "logical_to_physical",
                  fmt::format("{} entries [{}, {}, {}]", L * E * X, L, E, X), logical_to_physical.size());
  EPMOE_CHECK_ARG(static_cast<i64>(logical_replica_count.size()) == L * E, "logical_replica_count",
                  fmt::format("{} entries [{}, {}]", L * E, L, E), logical_replica_count.size());
  EPMOE_CHECK_ARG(layer >= 0 && layer < L, "layer", fmt::format("in [0, {})", L), layer);
  const i64* cnt = logical_replica_count.data() + layer * E;
  const i64* l2p = logical_to_physical.data() + layer * E * X;
  for (i64 e = 0; e < E; ++e) {
    EPMOE_CHECK_ARG(cnt[e] >= 1 && cnt[e] <= X, "logical_replica_count", fmt::format("in [1, {}]", X),
                    fmt::format("{} at [{}, {}]", cnt[e], layer, e));
    for (i64 r = 0; r < cnt[e]; ++r)
      EPMOE_CHECK_ARG(l2p[e * X + r] >= 0, "logical_to_physical", "a slot >= 0 for every counted replica",
                      fmt::format("{} at [{}, {}, {}]", l2p[e * X + r], layer, e, r));
  }
  const i64 T = topk_idx.size(0), K = topk_idx.size(1);
  Tensor out = Tensor::empty(topk_idx.dtype, {T, K});
  auto run = [&](auto* in_base, auto* out_base) {
    for (i64 t = 0; t < T; ++t)
      for (i64 k = 0; k < K; ++k) {
        const i64 e = static_cast<i64>(in_base[t * topk_idx.stride(0) + k * topk_idx.stride(1)]);
        EPMOE_CHECK_ARG(e >= -1 && e < E, "topk_idx", fmt::format("ids in [-1, {})", E),
                        fmt::format("{} at [{}, {}]", e, t, k));
        using O = std::remove_pointer_t<decltype(out_base)>;
        out_base[t * K + k] = e < 0 ? O{-1} : static_cast<O>(l2p[e * X + t % cnt[e]]);
      }
  };
  if (topk_idx.dtype == DType::int64)
    run(static_cast<const std::int64_t*>(topk_idx.data), out.ptr<std::int64_t>());
  else
    run(static_cast<const std::int32_t*>(topk_idx.data), out.ptr<std::int32_t>());
  return out;
}

Tensor map_to_physical(const TensorView& topk_idx, const EplbPlan& plan, i64 layer) {
  return map_to_physical(topk_idx, plan.logical_to_physical, plan.logical_replica_count, plan.num_layers,
                         plan.num_logical_experts, plan.max_replicas, layer);
}

std::vector<i64> logical_loads(const EplbPlan& plan, std::span<const i64> physical_loads) {
  const i64 L = plan.num_layers, P = plan.num_physical_experts, E = plan.num_logical_experts;
  EPMOE_CHECK_ARG(static_cast<i64>(physical_loads.size()) == L * P, "physical_loads",
                  fmt::format("{} entries (num_layers {} x num_physical_experts {})", L * P, L, P),
                  physical_loads.size());
  EPMOE_CHECK_ARG(static_cast<i64>(plan.physical_to_logical.size()) == L * P, "plan",
                  fmt::format("physical_to_logical of {} entries", L * P), plan.physical_to_logical.size());
  std::vector<i64> out(static_cast<std::size_t>(L * E), 0);
  for (i64 l = 0; l < L; ++l)
    for (i64 p = 0; p < P; ++p) {
      const auto i = static_cast<std::size_t>(l * P + p);
      const i64 e = plan.physical_to_logical[i], n = physical_loads[i];
      EPMOE_CHECK_ARG(n >= 0, "physical_loads", "counts >= 0", fmt::format("{} at [{}, {}]", n, l, p));
      EPMOE_CHECK_ARG(e >= 0 && e < E, "plan", fmt::format("physical_to_logical entries in [0, {})", E),
                      fmt::format("{} at [{}, {}]", e, l, p));
      out[static_cast<std::size_t>(l * E + e)] += n;
    }
  return out;
}

}  // namespace epmoe

// `epmoe run --eplb`: how much EPLB (semantics §9) would balance a recorded routing (semantics §14). Each layer is
// planned on the first half of the trace's tokens and measured on both halves: the second half says how well a plan
// made from past traffic holds on new traffic.
#include <epmoe/eplb.hpp>
#include <epmoe/layout.hpp>
#include <epmoe/replay.hpp>
#include <epmoe/version.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <numeric>
#include <vector>

#include "commands.hpp"
#include "common.hpp"

namespace epmoe::cli {

namespace {

// (token, k) choices per rank: the layout's tokens per expert summed over each rank's experts.
std::vector<std::int64_t> choices_per_rank(const Tensor& topk_idx, int num_slots, int R) {
  const DispatchLayout layout = get_dispatch_layout(topk_idx, num_slots, R);
  std::vector<std::int64_t> load(static_cast<std::size_t>(R), 0);
  for (int e = 0; e < num_slots; ++e)
    load[static_cast<std::size_t>(e / (num_slots / R))] += layout.num_tokens_per_expert.ptr<std::int32_t>()[e];
  return load;
}

double max_over_mean(const std::vector<std::int64_t>& load) {
  const double sum = static_cast<double>(std::accumulate(load.begin(), load.end(), std::int64_t{0}));
  if (sum == 0) return 1.0;
  return static_cast<double>(*std::max_element(load.begin(), load.end())) * static_cast<double>(load.size()) / sum;
}

}  // namespace

int run_eplb_report(const RoutingTrace& trace, int E, int R, int redundant, const std::string& json,
                    const std::string& routing_flag) {
  const int L = trace.num_layers();
  const std::int64_t N = trace.num_tokens(), half = N / 2, T = half / R;
  if (T < 1)
    bad("--routing", fmt::format("a trace of at least {} tokens (2 halves of --ranks {} x 1 token) with --eplb", 2 * R, R),
        plural(N, "token"));
  const int P = E + redundant;
  // The halves' rank batches: rank r of half h gets tokens [h*half + r*T, h*half + (r+1)*T).
  std::vector<std::vector<Tensor>> ids(static_cast<std::size_t>(L));  // [layer][half * R + r]
  ExpertLoadRecorder recorder(L, E, R, R);
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r) {
        ids[static_cast<std::size_t>(l)].push_back(replay_routing(trace, l, h * half, r, T, E).topk_idx);
        if (h == 0) recorder.record(l, get_dispatch_layout(ids[static_cast<std::size_t>(l)].back(), E, R).num_tokens_per_expert);
      }
  const std::vector<std::int64_t> loads = recorder.loads();
  const std::vector<double> weight(loads.begin(), loads.end());
  const EplbPlan plan = rebalance_experts(weight, L, E, P, 1, 1, R);

  fmt::print("eplb: '{}' ({}, {}), {} experts + {} redundant = {} slots on {} ({} per rank)\n", trace.domain,
             plural(L, "layer"), plural(N, "token"), E, redundant, P, plural(R, "rank"), P / R);
  fmt::print("      plan from tokens [0, {}), measured on [0, {}) and [{}, {}); max / mean (token, k) choices per rank\n",
             R * T, R * T, half, half + R * T);
  fmt::print("{:>5}  {:>12} {:>12}  {:>12} {:>12}  {:>12}\n", "layer", "plan before", "plan after", "test before",
             "test after", "max replicas");
  nlohmann::json jlayers = nlohmann::json::array();
  double sums[4] = {0, 0, 0, 0};
  for (int l = 0; l < L; ++l) {
    double fig[4];
    nlohmann::json jl = {{"layer", l}};
    for (int h = 0; h < 2; ++h) {
      std::vector<std::int64_t> before(static_cast<std::size_t>(R), 0), after(static_cast<std::size_t>(R), 0);
      for (int r = 0; r < R; ++r) {
        const Tensor& logical = ids[static_cast<std::size_t>(l)][static_cast<std::size_t>(h * R + r)];
        const Tensor physical = map_to_physical(logical, plan, l);
        const auto b = choices_per_rank(logical, E, R), a = choices_per_rank(physical, P, R);
        for (int q = 0; q < R; ++q) {
          before[static_cast<std::size_t>(q)] += b[static_cast<std::size_t>(q)];
          after[static_cast<std::size_t>(q)] += a[static_cast<std::size_t>(q)];
        }
      }
      fig[2 * h] = max_over_mean(before);
      fig[2 * h + 1] = max_over_mean(after);
      const char* name = h == 0 ? "plan_half" : "test_half";
      jl[name] = {{"tokens", {h * half, h * half + R * T}},
                  {"rank_choices_before", before},
                  {"rank_choices_after", after},
                  {"imbalance_before", fig[2 * h]},
                  {"imbalance_after", fig[2 * h + 1]}};
    }
    std::int64_t x = 1;
    for (int e = 0; e < E; ++e) x = std::max(x, plan.logical_replica_count[static_cast<std::size_t>(l * E + e)]);
    jl["physical_to_logical"] = std::vector<std::int64_t>(plan.physical_to_logical.begin() + l * P,
                                                          plan.physical_to_logical.begin() + (l + 1) * P);
    nlohmann::json slots = nlohmann::json::array();  // per logical expert, its slots in replica order
    for (int e = 0; e < E; ++e) {
      const std::int64_t c = plan.logical_replica_count[static_cast<std::size_t>(l * E + e)];
      const auto* row = plan.logical_to_physical.data() + (static_cast<std::int64_t>(l) * E + e) * plan.max_replicas;
      slots.push_back(std::vector<std::int64_t>(row, row + c));
    }
    jl["replica_slots"] = slots;
    jlayers.push_back(jl);
    for (int i = 0; i < 4; ++i) sums[i] += fig[i];
    fmt::print("{:>5}  {:>12.3f} {:>12.3f}  {:>12.3f} {:>12.3f}  {:>12}\n", l, fig[0], fig[1], fig[2], fig[3], x);
  }
  fmt::print("{:>5}  {:>12.3f} {:>12.3f}  {:>12.3f} {:>12.3f}\n", "mean", sums[0] / L, sums[1] / L, sums[2] / L,
             sums[3] / L);
  if (!json.empty()) {
    nlohmann::json j = {{"command", "run"},
                        {"mode", "eplb"},
                        {"version", std::string(version())},
                        {"routing", routing_flag},
                        {"domain", trace.domain},
                        {"num_layers", L},
                        {"num_tokens", N},
                        {"tokens_per_rank", T},
                        {"num_ranks", R},
                        {"num_logical_experts", E},
                        {"redundant_experts", redundant},
                        {"num_physical_experts", P},
                        {"replica_rule", "token t of a rank's batch takes replica t mod count (map_to_physical)"},
                        {"mean_imbalance",
                         {{"plan_before", sums[0] / L}, {"plan_after", sums[1] / L}, {"test_before", sums[2] / L},
                          {"test_after", sums[3] / L}}},
                        {"layers", jlayers}};
    write_text_file("--json", json, j.dump(2) + "\n");
    fmt::print("wrote {}\n", json);
  }
  return 0;
}

}  // namespace epmoe::cli

// `epmoe run --eplb` on the committed OLMoE routing slice (semantics §9, §14): the reported loads per rank against
// a count written here from the trace (rank r of half h takes tokens [h*N/2 + r*T, ...), T = N/2 / R; before: expert
// e on rank e / (E/R); after: token t of a batch takes replica t mod count of the reported plan), the plan against
// rebalance_experts of the first half's counts, and the refused flag combinations.
#include <epmoe/eplb.hpp>
#include <epmoe/replay.hpp>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "support/temp_path.hpp"

namespace {

struct CliResult {
  int code = -1;
  std::string out, err;
};

std::string temp_path(const std::string& leaf) { return epmoe::test::temp_path("epmoe_cli_eplb", leaf); }

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

CliResult run_cli(const std::string& args) {
  const char* env = std::getenv("EPMOE_CLI");
  const std::string cli = env && *env ? env : EPMOE_CLI_PATH;
  const std::string o = temp_path("stdout.txt"), e = temp_path("stderr.txt");
  const int status = std::system(("'" + cli + "' " + args + " >'" + o + "' 2>'" + e + "'").c_str());
  CliResult r{WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(o), slurp(e)};
  std::remove(o.c_str());
  std::remove(e.c_str());
  return r;
}

const std::string kTrace = std::string(EPMOE_TEST_DATA_DIR) + "/olmoe-routing";

double max_over_mean(const std::vector<std::int64_t>& v) {
  const double sum = static_cast<double>(std::accumulate(v.begin(), v.end(), std::int64_t{0}));
  return static_cast<double>(*std::max_element(v.begin(), v.end())) * static_cast<double>(v.size()) / sum;
}

TEST(CliEplb, ReportedLoadsMatchAnIndependentCountOfTheTrace) {
  for (const auto& [R, redundant] : {std::pair{4, -1}, std::pair{2, 6}}) {
    const std::string json = temp_path("eplb.json");
    std::string args = "run --eplb --routing '" + kTrace + "' --domain coding --ranks " + std::to_string(R) +
                       " --json '" + json + "'";
    if (redundant >= 0) args += " --redundant-experts " + std::to_string(redundant);
    const CliResult r = run_cli(args);
    ASSERT_EQ(r.code, 0) << r.out << r.err;
    EXPECT_NE(r.out.find("test after"), std::string::npos) << r.out;
    const nlohmann::json j = nlohmann::json::parse(slurp(json));
    const epmoe::RoutingTrace trace = epmoe::load_routing_trace(kTrace, "coding");
    const int E = 64, K = trace.num_topk(), L = trace.num_layers();
    const int want_redundant = redundant >= 0 ? redundant : 16;  // 64 / 4 = 16, a multiple of 4
    const int P = E + want_redundant;
    ASSERT_EQ(j["num_physical_experts"].get<int>(), P);
    ASSERT_EQ(j["num_ranks"].get<int>(), R);
    const std::int64_t N = trace.num_tokens(), half = N / 2, T = half / R;
    ASSERT_EQ(j["tokens_per_rank"].get<std::int64_t>(), T);
    const auto id = [&](std::int64_t t, int l, int k) {
      return static_cast<std::int64_t>(trace.topk_idx.ptr<std::int16_t>()[(t * L + l) * K + k]);
    };
    std::vector<double> first_half(static_cast<std::size_t>(L * E), 0.0);
    for (int l = 0; l < L; ++l)
      for (std::int64_t t = 0; t < R * T; ++t)
        for (int k = 0; k < K; ++k)
          if (id(t, l, k) >= 0) first_half[static_cast<std::size_t>(l * E + id(t, l, k))] += 1;
    const epmoe::EplbPlan plan = epmoe::rebalance_experts(first_half, L, E, P, 1, 1, R);
    double mean_test_before = 0, mean_test_after = 0;
    for (int l = 0; l < L; ++l) {
      const nlohmann::json& jl = j["layers"][static_cast<std::size_t>(l)];
      const auto slots = jl["replica_slots"].get<std::vector<std::vector<std::int64_t>>>();
      const auto p2l = jl["physical_to_logical"].get<std::vector<std::int64_t>>();
      ASSERT_EQ(p2l, std::vector<std::int64_t>(plan.physical_to_logical.begin() + l * P,
                                               plan.physical_to_logical.begin() + (l + 1) * P))
          << "layer " << l;
      for (int e = 0; e < E; ++e)
        for (std::int64_t s : slots[static_cast<std::size_t>(e)]) ASSERT_EQ(p2l[static_cast<std::size_t>(s)], e);
      for (int h = 0; h < 2; ++h) {
        std::vector<std::int64_t> before(static_cast<std::size_t>(R), 0), after(static_cast<std::size_t>(R), 0);
        for (int rank = 0; rank < R; ++rank)
          for (std::int64_t t = 0; t < T; ++t)
            for (int k = 0; k < K; ++k) {
              const std::int64_t e = id(h * half + rank * T + t, l, k);
              if (e < 0) continue;
              ++before[static_cast<std::size_t>(e / (E / R))];
              const auto& s = slots[static_cast<std::size_t>(e)];
              ++after[static_cast<std::size_t>(s[static_cast<std::size_t>(t % static_cast<std::int64_t>(s.size()))] /
                                              (P / R))];
            }
        const nlohmann::json& jh = jl[h == 0 ? "plan_half" : "test_half"];
        EXPECT_EQ(jh["rank_choices_before"].get<std::vector<std::int64_t>>(), before) << "layer " << l << " half " << h;
        EXPECT_EQ(jh["rank_choices_after"].get<std::vector<std::int64_t>>(), after) << "layer " << l << " half " << h;
        EXPECT_NEAR(jh["imbalance_before"].get<double>(), max_over_mean(before), 1e-12);
        EXPECT_NEAR(jh["imbalance_after"].get<double>(), max_over_mean(after), 1e-12);
        // On the tokens it was planned from, the plan balances every layer.
        if (h == 0) EXPECT_LE(max_over_mean(after), max_over_mean(before)) << "layer " << l;
        if (h == 1) {
          mean_test_before += max_over_mean(before) / L;
          mean_test_after += max_over_mean(after) / L;
        }
      }
    }
    // On new tokens it still helps on average.
    EXPECT_LT(mean_test_after, mean_test_before);
    EXPECT_NEAR(j["mean_imbalance"]["test_after"].get<double>(), mean_test_after, 1e-9);
  }
}

TEST(CliEplb, BadFlagCombinationsAreNamed) {
  const std::string routing = " --routing '" + kTrace + "'";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"run --eplb --mode low-latency" + routing, "'--mode'"},
      {"run --eplb --redundant-experts -4" + routing, "'--redundant-experts': expected >= 0 and a multiple of --ranks (4), got -4"},
      {"run --eplb --redundant-experts 6" + routing, "'--redundant-experts': expected >= 0 and a multiple of --ranks (4), got 6"},
      {"run --redundant-experts 8" + routing, "'--redundant-experts': expected --eplb beside it"},
      {"run --eplb", "'--eplb': expected --routing"},
  };
  for (const auto& [args, want] : cases) {
    const CliResult r = run_cli(args);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find(want), std::string::npos) << args << "\n" << r.err;
  }
}

}  // namespace

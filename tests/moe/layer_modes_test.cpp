// MoELayer dispatch hooks and DispatchMode (normal / low_latency / auto on one Buffer) on CPU thread ranks,
// against the independent float64 layer reference.
#include <epmoe/moe.hpp>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/moe_reference.hpp"
#include "support/random.hpp"

namespace epmoe {
namespace {

using test::fresh_seed;

constexpr int kE = 8, kK = 2;
constexpr std::int64_t kH = 128, kN = 64;

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

/// One rank's batch: its tokens and routing.
struct Batch {
  Tensor x, topk_idx, topk_weights;
};

Batch make_batch(std::mt19937_64& rng, std::int64_t T) {
  Batch b{test::random_bf16(rng, T, kH), test::random_topk_idx(rng, T, kK, kE), {}};
  b.topk_weights = test::random_topk_weights(rng, b.topk_idx);
  return b;
}

// Each token's output depends only on the token, so one rank's rows are checked against its own reference.
double error_vs_reference(const Tensor& got, const Batch& b, const Weights& w) {
  const auto want = test::moe_layer_reference(b.x, w.w1, w.w2, b.topk_idx, b.topk_weights, "silu", false);
  return test::relative_l2(got, want);
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

std::unique_ptr<MoELayer> make_layer(Group& g, DispatchMode mode, int tmax, std::int64_t chunk_size = 0) {
  std::shared_ptr<Group> group(std::shared_ptr<Group>{}, &g);
  MoELayerOptions lo;
  lo.chunk_size = chunk_size;
  return std::make_unique<MoELayer>(std::make_shared<Buffer>(group), mode, tmax,
                                    experts_of(ActivationFormat::standard),
                                    experts_of(ActivationFormat::batched_experts), PrepareFinalizeOptions{},
                                    SharedExperts{}, lo);
}

TEST(MoELayerDispatchHooks, RunOncePerForwardBetweenTheHalvesInOrderAndRemovalWorks) {
  constexpr int R = 2;
  std::mt19937_64 rng(fresh_seed());
  const Weights w = make_weights(rng);
  std::vector<std::vector<Batch>> batches(R);
  for (auto& per_rank : batches)
    for (int i = 0; i < 4; ++i) per_rank.push_back(make_batch(rng, 20));
  for (DispatchMode mode : {DispatchMode::normal, DispatchMode::low_latency}) {
    std::vector<std::vector<double>> errors(R);
    std::vector<std::vector<std::string>> calls(R);
    run_thread_ranks(R, [&](Group& g) {
      const int r = g.rank();
      // Chunks of 7 rows: the hooks still run once per forward (chunking splits only the experts).
      auto layer = make_layer(g, mode, 20, 7);
      auto& log = calls[static_cast<std::size_t>(r)];
      const auto hook = [&](std::string name) {
        return [&log, name](PrepareFinalize& pf) { log.push_back(name + ":" + std::string(stage_name(pf.stage()))); };
      };
      auto& per_rank = batches[static_cast<std::size_t>(r)];
      const auto run = [&](const Batch& b) {
        log.push_back("forward");
        const Tensor out = layer->forward(forward_args(b, w, r, R)).output;
        errors[static_cast<std::size_t>(r)].push_back(error_vs_reference(out, b, w));
      };
      run(per_rank[0]);  // no hooks
      DispatchHookHandle first = layer->register_dispatch_hook(hook("first"));
      {
        DispatchHookHandle second = layer->register_dispatch_hook(hook("second"));
        EXPECT_EQ(layer->num_dispatch_hooks(), 2u);
        run(per_rank[1]);
      }  // `second` destroyed: unregistered
      run(per_rank[2]);
      first.remove();
      EXPECT_FALSE(first.active());
      first.remove();  // a second remove is a no-op
      EXPECT_EQ(layer->num_dispatch_hooks(), 0u);
      run(per_rank[3]);
    });
    for (int r = 0; r < R; ++r) {
      const std::vector<std::string> want{"forward",
                                          "forward", "first:AFTER_DISPATCH_A", "second:AFTER_DISPATCH_A",
                                          "forward", "first:AFTER_DISPATCH_A",
                                          "forward"};
      EXPECT_EQ(calls[static_cast<std::size_t>(r)], want) << dispatch_mode_name(mode) << " rank " << r;
      for (double e : errors[static_cast<std::size_t>(r)]) EXPECT_LE(e, 1e-2) << dispatch_mode_name(mode);
    }
  }
}

TEST(MoELayerDispatchHooks, AThrowingHookPropagatesItsErrorAndTheLayerStaysUsable) {
  constexpr int R = 2;
  std::mt19937_64 rng(fresh_seed());
  const Weights w = make_weights(rng);
  std::vector<Batch> b1, b2;
  for (int r = 0; r < R; ++r) b1.push_back(make_batch(rng, 16)), b2.push_back(make_batch(rng, 16));
  for (DispatchMode mode : {DispatchMode::normal, DispatchMode::low_latency}) {
    for (int throwing_ranks : {1, 2}) {  // rank 0 only, then both
      std::vector<std::string> errors(R);
      std::vector<double> first_error(R, -1), second_error(R, -1);
      std::vector<int> after_hook(R, 0);
      run_thread_ranks(R, [&](Group& g) {
        const int r = g.rank();
        auto layer = make_layer(g, mode, 16);
        auto& later = after_hook[static_cast<std::size_t>(r)];
        DispatchHookHandle h = layer->register_dispatch_hook([&, r](PrepareFinalize&) {
          if (r < throwing_ranks) throw std::runtime_error("hook failed on purpose on rank " + std::to_string(r));
        });
        DispatchHookHandle after = layer->register_dispatch_hook([&](PrepareFinalize&) { ++later; });
        try {
          const Tensor out = layer->forward(forward_args(b1[static_cast<std::size_t>(r)], w, r, R)).output;
          first_error[static_cast<std::size_t>(r)] = error_vs_reference(out, b1[static_cast<std::size_t>(r)], w);
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(r)] = e.what();
        }
        EXPECT_EQ(layer->prepare_finalize().stage(), Stage::initial);
        h.remove();
        const Tensor out = layer->forward(forward_args(b2[static_cast<std::size_t>(r)], w, r, R)).output;
        second_error[static_cast<std::size_t>(r)] = error_vs_reference(out, b2[static_cast<std::size_t>(r)], w);
      });
      for (int r = 0; r < R; ++r) {
        const auto i = static_cast<std::size_t>(r);
        const std::string ctx = std::string(dispatch_mode_name(mode)) + " rank " + std::to_string(r);
        if (r < throwing_ranks) {
          EXPECT_EQ(errors[i], "hook failed on purpose on rank " + std::to_string(r)) << ctx;
          EXPECT_EQ(after_hook[i], 1) << ctx << ": the later hook runs only in the second forward";
        } else {
          EXPECT_TRUE(errors[i].empty()) << ctx << ": " << errors[i];
          EXPECT_LE(first_error[i], 1e-2) << ctx;
          EXPECT_EQ(after_hook[i], 2) << ctx;
        }
        EXPECT_LE(second_error[i], 1e-2) << ctx;
        EXPECT_GE(second_error[i], 0) << ctx;
      }
    }
  }
}

TEST(MoELayerDispatchHooks, RefusesAnEmptyHookNamingIt) {
  MoELayer layer(make_no_ep_prepare_finalize(), experts_of(ActivationFormat::standard));
  try {
    (void)layer.register_dispatch_hook({});
    FAIL() << "empty hook accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("hook"), std::string::npos) << e.what();
  }
}

TEST(DispatchMode, ResolvesAsDeepEPMode) {
  EXPECT_EQ(resolve_dispatch_mode(DispatchMode::automatic, true), DispatchMode::normal);
  EXPECT_EQ(resolve_dispatch_mode(DispatchMode::automatic, false), DispatchMode::low_latency);
  for (bool extend : {false, true}) {
    EXPECT_EQ(resolve_dispatch_mode(DispatchMode::normal, extend), DispatchMode::normal);
    EXPECT_EQ(resolve_dispatch_mode(DispatchMode::low_latency, extend), DispatchMode::low_latency);
  }
  EXPECT_EQ(dispatch_mode_name(DispatchMode::automatic), "auto");
}

TEST(DispatchMode, AutoAlternatesPrefillAndDecodeOnOneBufferAgainstFloat64) {
  constexpr int R = 2, kTmax = 12;
  std::mt19937_64 rng(fresh_seed());
  const Weights w = make_weights(rng);
  // prefill, decode (switch: clean), decode, prefill, decode (clean), prefill, decode (clean): the last four are
  // two switches in a row each way. Decode batches of T = Tmax and smaller; prefill batches larger than Tmax.
  const std::vector<std::pair<bool, std::int64_t>> steps{{true, 40}, {false, kTmax}, {false, 5},    {true, 33},
                                                         {false, kTmax}, {true, 7},  {false, kTmax}};
  std::vector<std::vector<Batch>> batches(R);
  for (auto& per_rank : batches)
    for (const auto& [extend, T] : steps) per_rank.push_back(make_batch(rng, T));
  std::vector<std::vector<double>> errors(R);
  std::vector<std::vector<std::string>> modes(R), pf_names(R);
  std::vector<std::int64_t> cleans(R);
  run_thread_ranks(R, [&](Group& g) {
    const int r = g.rank();
    auto layer = make_layer(g, DispatchMode::automatic, kTmax);
    auto& names = pf_names[static_cast<std::size_t>(r)];
    DispatchHookHandle h =
        layer->register_dispatch_hook([&names](PrepareFinalize& pf) { names.emplace_back(pf.name()); });
    for (std::size_t i = 0; i < steps.size(); ++i) {
      const Batch& b = batches[static_cast<std::size_t>(r)][i];
      MoEForwardArgs a = forward_args(b, w, r, R);
      a.is_extend_in_batch = steps[i].first;
      const Tensor out = layer->forward(a).output;
      errors[static_cast<std::size_t>(r)].push_back(error_vs_reference(out, b, w));
      modes[static_cast<std::size_t>(r)].emplace_back(dispatch_mode_name(layer->last_resolved_mode()));
    }
    cleans[static_cast<std::size_t>(r)] = layer->num_low_latency_cleans();
  });
  const std::vector<std::string> want_modes{"normal", "low_latency", "low_latency", "normal",
                                            "low_latency", "normal", "low_latency"};
  for (int r = 0; r < R; ++r) {
    const auto i = static_cast<std::size_t>(r);
    EXPECT_EQ(modes[i], want_modes) << "rank " << r;
    EXPECT_EQ(pf_names[i], want_modes) << "rank " << r << ": the hooks see the chosen prepare/finalize";
    EXPECT_EQ(cleans[i], 3) << "rank " << r;
    for (std::size_t s = 0; s < steps.size(); ++s) EXPECT_LE(errors[i][s], 1e-2) << "rank " << r << " step " << s;
  }
}

TEST(DispatchMode, AutoRefusesAMissingBatchKindAndAnOversizedDecodeBeforeCommunicating) {
  constexpr int kTmax = 8;
  std::mt19937_64 rng(fresh_seed());
  const Weights w = make_weights(rng);
  const Batch big = make_batch(rng, kTmax + 1), ok = make_batch(rng, kTmax);
  std::vector<std::string> messages;
  double error = -1;
  run_thread_ranks(1, [&](Group& g) {
    auto layer = make_layer(g, DispatchMode::automatic, kTmax);
    const auto expect_error = [&](MoEForwardArgs a) {
      try {
        layer->forward(a);
        messages.emplace_back("accepted");
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::invalid_argument) << e.what();
        messages.emplace_back(e.what());
      }
    };
    expect_error(forward_args(ok, w, 0, 1));  // is_extend_in_batch unset
    MoEForwardArgs a = forward_args(big, w, 0, 1);
    a.is_extend_in_batch = false;
    expect_error(a);
    MoEForwardArgs good = forward_args(ok, w, 0, 1);
    good.is_extend_in_batch = false;
    error = error_vs_reference(layer->forward(good).output, ok, w);
  });
  ASSERT_EQ(messages.size(), 2u);
  EXPECT_NE(messages[0].find("is_extend_in_batch"), std::string::npos) << messages[0];
  EXPECT_NE(messages[1].find("hidden"), std::string::npos) << messages[1];
  EXPECT_NE(messages[1].find("num_max_dispatch_tokens_per_rank = 8"), std::string::npos) << messages[1];
  EXPECT_NE(messages[1].find("9"), std::string::npos) << messages[1];
  EXPECT_LE(error, 1e-2);
  EXPECT_GE(error, 0);
}

TEST(DispatchMode, ConstructionNamesMissingOrMismatchedExperts) {
  std::string message;
  run_thread_ranks(1, [&](Group& g) {
    std::shared_ptr<Group> group(std::shared_ptr<Group>{}, &g);
    try {
      MoELayer layer(std::make_shared<Buffer>(group), DispatchMode::automatic, 8,
                     experts_of(ActivationFormat::standard), experts_of(ActivationFormat::standard));
    } catch (const Error& e) {
      message = e.what();
    }
  });
  EXPECT_NE(message.find("low_latency_experts"), std::string::npos) << message;
  EXPECT_NE(message.find("batched_experts"), std::string::npos) << message;
}

}  // namespace
}  // namespace epmoe
